"""The fused decode step (inference/rows.py) on a model split over two gloo ranks by tensor
parallelism, as ``gptrain generate`` and the TP server run it: each rank's share of the heads and the
MLP, the row-parallel products summed by an all-reduce inside the step, rank 0's ids broadcast. In
fp32 it gives one process's fused decode: the same greedy and seeded tokens, logits within float
rounding, the same ids on both ranks."""
from __future__ import annotations

import dataclasses
import json
from datetime import timedelta

import pytest
import torch

from distributed import spawn
from gptrain.inference.generate import SamplingParams
from gptrain.inference.rows import fused_generate
from gptrain.model.gpt import GPT
from tiny import tiny_config

PROMPTS = [[5, 17, 300, 2], [9], [40, 41, 42, 43, 44, 45, 46]]
PARAMS = [SamplingParams(max_new_tokens=7, temperature=0.0), SamplingParams(max_new_tokens=9, seed=3, top_p=0.9),
          SamplingParams(max_new_tokens=5, seed=11, top_k=20, temperature=0.7)]
# row 1 runs well past the others (more steps than the loop queues ahead) after the hook cuts it
LONG = [SamplingParams(max_new_tokens=3, temperature=0.0), SamplingParams(max_new_tokens=16, seed=3, top_p=0.9),
        SamplingParams(max_new_tokens=3, seed=11, top_k=20, temperature=0.7)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from gptrain.train.checkpoint import save_checkpoint

    model = GPT(tiny_config(vocab_size=50257))
    model.init_weights(9)
    params = dict(model.named_parameters())
    state = {"config": {"model": dataclasses.asdict(model.cfg), "data": {"vocab_file": None}}}
    root = tmp_path_factory.mktemp("ck")
    save_checkpoint(root, 1, params, torch.optim.AdamW(params.values()), state, model.cfg.vocab_size)
    return root


def _decode(rank: int, root: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from gptrain.inference.load import load_for_inference
    from gptrain.inference.rows import row_decoder_for
    from gptrain.inference.steps import fused_decodable

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # out of step: a timeout, not a hang
    model = load_for_inference(root, "cpu", torch.float32, tp_mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))).model
    assert fused_decodable(model)
    rows = [g.tokens for g in fused_generate(model, PROMPTS, PARAMS, use_graph=False)]
    logits = row_decoder_for(model, len(PROMPTS), use_graph=False).logits.clone()
    # rank 0's stream hook ends row 1 after its second new token (as the server's does for a stop string
    # or a client gone); the other rank has no hook: both run the same steps and stay in step
    seen = []

    def hook(row: int, token: int) -> bool:
        seen.append(row)
        return row == 1 and seen.count(1) == 2

    cut = fused_generate(model, PROMPTS, LONG, use_graph=False, on_token=hook if rank == 0 else None)
    again = [g.tokens for g in fused_generate(model, PROMPTS, PARAMS, use_graph=False)]
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"rows": rows, "logits": logits.tolist(), "cut": [g.tokens for g in cut],
                   "reasons": [g.finish_reason for g in cut], "again": again}, f)
    dist.destroy_process_group()


def test_two_ranks_decode_as_one_process(checkpoint, tmp_path):
    from gptrain.inference.load import load_for_inference
    from gptrain.inference.rows import row_decoder_for

    spawn(2, _decode, str(checkpoint), str(tmp_path / "out"))
    ranks = [json.loads((tmp_path / f"out.{r}").read_text()) for r in (0, 1)]
    model = load_for_inference(checkpoint, "cpu", torch.float32).model
    alone = [g.tokens for g in fused_generate(model, PROMPTS, PARAMS, use_graph=False)]
    assert ranks[0]["rows"] == ranks[1]["rows"] == alone
    last = row_decoder_for(model, len(PROMPTS), use_graph=False).logits
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["logits"]), last, rtol=1e-4, atol=1e-4)
    # the hook cut rank 0's row 1 only; the ranks stayed in step (the next request matches)
    long = [g.tokens for g in fused_generate(model, PROMPTS, LONG, use_graph=False)]
    assert ranks[0]["cut"][1] == long[1][:len(PROMPTS[1]) + 2] and ranks[0]["reasons"][1] == "stop"
    for row in (0, 2):
        assert ranks[0]["cut"][row] == ranks[1]["cut"][row] == long[row]
    assert ranks[1]["cut"][1] == long[1]
    assert ranks[0]["again"] == ranks[1]["again"] == alone
