"""The rank simulator (one rank of a larger world alone, through the fake process group) on the CPU:
`gptrain bench` and `gptrain train` run a TP2, TP2 x PP2 and TP8 rank; a simulated rank's initial
weights are its slice of one process's, bitwise, and it draws only the elements it holds."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from distributed import TINY, _env
from gptrain.config import parse_megatron_args

SMALL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 8 --seq-length 32 --max-position-embeddings 32 "
         "--micro-batch-size 2 --device cpu --hidden-dropout 0 --attention-dropout 0").split()


def _run(args: list[str]) -> str:
    done = subprocess.run([sys.executable, "-m", "gptrain", *args], capture_output=True, text=True, timeout=240,
                          env=_env())
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("world, layout", [
    (2, ["--tensor-model-parallel-size", "2"]),
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]),
    (8, ["--tensor-model-parallel-size", "8"])], ids=["tp2", "tp2xpp2+sp", "tp8"])
def test_bench_runs_one_simulated_rank(world, layout):
    out = _run(["bench", *SMALL, "--global-batch-size", "4", "--warmup", "1", "--iters", "2",
                "--simulate-world-size", str(world), "--simulate-rank", "1", *layout])
    assert f"| gptrain, simulated rank 1 of {world} |" in out
    assert "operators per micro-batch" in out  # launches are counted on a GPU; operators here
    tp = int(layout[1])
    assert f"tp {tp} pp {2 if '--pipeline-model-parallel-size' in layout else 1}" in out


@pytest.mark.slow
def test_train_runs_one_simulated_rank_of_a_tp8_x_pp2_world():
    out = _run(["train", *SMALL, "--global-batch-size", "4", "--mock-data", "--train-iters", "2", "--log-interval", "1",
                "--eval-iters", "1", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "2",
                "--simulate-world-size", "16", "--simulate-rank", "9"])
    assert "using world size: 16, data-parallel-size: 1, tensor-model-parallel size: 8" in out
    assert " > number of parameters on (tensor, pipeline) model parallel rank (1, 1): " in out
    assert " iteration        2/       2 |" in out


def test_a_simulated_rank_draws_only_its_shard_and_equals_one_process(monkeypatch):
    import gptrain.model.init_draw as init_draw
    from gptrain.model.gpt import GPT
    from gptrain.parallel import simulate
    from gptrain.parallel.tensor_parallel import split_dim_of
    from gptrain.train.build import build_training, parallel_dims

    drawn = []
    real = init_draw.normal_region

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        drawn.append(out.numel())
        return out

    monkeypatch.setattr(init_draw, "normal_region", counting)
    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1", "--tensor-model-parallel-size", "4"], world_size=4)
    with simulate.simulated_world(4, 2):
        parts = build_training(cfg, torch.device("cpu"), parallel_dims(cfg, 4),
                               parallel_dims(cfg, 4).build_mesh("cpu"), log=lambda s: None)
        shard = {n: p.detach().clone() for n, p in parts.model.named_parameters()}
    held = sum(p.numel() for n, p in shard.items() if p.dim() > 1)  # every matrix is drawn, nothing else
    assert sum(drawn) <= held  # the padded vocabulary rows are zeros, not draws
    assert sum(drawn) >= held - shard["word_embeddings.weight"].numel()
    whole = GPT(cfg.model)  # the same padded vocabulary (128 x 4)
    whole.init_weights(cfg.data.seed)
    for name, full in whole.named_parameters():
        dim = split_dim_of(name)
        expected = full.detach() if dim is None else full.detach().chunk(4, dim=dim)[2]
        assert torch.equal(shard[name], expected), name
