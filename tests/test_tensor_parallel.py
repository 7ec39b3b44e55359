"""Tensor parallelism (plain shards, explicit collectives) against one process: the same losses and
weights at TP2, TP2 with sequence parallelism, TP2 x DP2, TP2 x ZeRO-3, TP4 and TP2 + SP x DP2 with
overlapped reduction (fp32, tiny model, no dropout; TP2 x PP2 + SP in test_pipeline_parallel.py); each
block compiles as one graph with no DTensor inside; Megatron's per-rank parameter counts, built and planned
(seeds/004's figures for the 345M model); a checkpoint saved at TP2 resumed by one process."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from distributed import TINY, _env, losses, single, spawn, torchrun
from gptrain.config import parse_megatron_args
from gptrain.model.gpt import GPT
from gptrain.train.checkpoint import load_checkpoint

STEPS = ["--train-iters", "5"]


def _weights(ckpt_dir) -> dict[str, torch.Tensor]:
    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1"], world_size=1)
    model = GPT(cfg.model)
    load_checkpoint(ckpt_dir, dict(model.named_parameters()), None, cfg.model.vocab_size)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    path = tmp_path_factory.mktemp("single")
    return losses(single(TINY + STEPS + ["--save", str(path)])), _weights(path)


@pytest.mark.slow
@pytest.mark.parametrize("nproc, tp, flags", [
    (2, 2, []), (2, 2, ["--sequence-parallel"]), (4, 2, []), (4, 2, ["--zero-stage", "3"]), (4, 4, []),
    (4, 2, ["--sequence-parallel", "--overlap-grad-reduce", "--ddp-bucket-size", "5000"])],
    ids=["tp2", "tp2+sp", "tp2xdp2", "tp2xzero3", "tp4", "tp2+spxdp2-overlap"])  # TP2 x PP2 + SP: test_pipeline_parallel
def test_tensor_parallel_equals_one_process(nproc, tp, flags, one_process, tmp_path):
    out = torchrun(nproc, TINY + STEPS + ["--tensor-model-parallel-size", str(tp), "--save", str(tmp_path),
                                          "--verbose"] + flags)
    got = losses(out)
    for it, loss in one_process[0].items():
        assert got[it] == pytest.approx(loss, rel=1e-5), it
    assert f"data-parallel-size: {nproc // tp}, tensor-model-parallel size: {tp}" in out
    # saved with the vocabulary rows split over 2 ranks, read whole. Adam turns the rounding of near-zero
    # gradients (the key bias's is zero in exact arithmetic) into differences of about 2e-6 after 5 steps
    weights = _weights(tmp_path)
    for name, ref in one_process[1].items():
        torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
def test_checkpoint_saved_at_tp2_resumes_in_one_process(one_process, tmp_path):
    flags = TINY + ["--train-iters", "5"]
    torchrun(2, flags + ["--tensor-model-parallel-size", "2", "--exit-interval", "3", "--save", str(tmp_path)])
    resumed = losses(single(flags + ["--load", str(tmp_path)]))
    assert sorted(resumed) == [4, 5]
    for it in (4, 5):
        assert resumed[it] == pytest.approx(one_process[0][it], rel=1e-5)


def _built_counts(rank: int, out_path: str) -> None:
    from gptrain.parallel.dims import init_distributed
    from gptrain.parallel.layout import parameter_counts
    from gptrain.train.build import build_training, parallel_dims, parameter_count

    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1", "--tensor-model-parallel-size", "2"], world_size=2)
    cfg.model.vocab_size = 50257
    dims = parallel_dims(cfg, 2)
    device = init_distributed(torch.device("cpu"))
    parts = build_training(cfg, device, dims, dims.build_mesh("cpu"), log=lambda s: None)
    local = {n: p.shape for n, p in parts.model.named_parameters()}
    if rank == 0:
        torch.save({"built": parameter_count(parts.model), "planned": parameter_counts(cfg.model, dims)[(0, 0)],
                    "qkv": tuple(local["layers.0.attn.qkv.weight"]), "emb": tuple(local["word_embeddings.weight"])},
                   out_path)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_built_shards_match_megatrons_counts(tmp_path):
    spawn(2, _built_counts, str(tmp_path / "counts.pt"))
    got = torch.load(tmp_path / "counts.pt")
    assert got["built"] == got["planned"]
    assert got["qkv"] == (48, 32)  # 2 of 4 heads x (q, k, v) x head dim 8
    assert got["emb"] == (50432 // 2, 32)  # the vocabulary padded to a multiple of 128 x 2, split in two


M345 = ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024 "
        "--micro-batch-size 1 --global-batch-size 8 --train-iters 10 --data-path unused_text_document").split()


@pytest.mark.slow  # the fast loop (-m "not slow") stays under 3 minutes; CI runs it
@pytest.mark.parametrize("tp, pp, expected", [
    (2, 2, {(0, 0): 102_483_968, (1, 0): 102_483_968, (0, 1): 101_437_440, (1, 1): 101_437_440}),
    (4, 1, {(t, 0): 89_714_688 for t in range(4)}),
    (1, 4, {(0, 0): 128_137_216, (0, 1): 75_577_344, (0, 2): 75_577_344, (0, 3): 127_090_688}),
])
def test_dry_run_prints_the_seeds_per_rank_counts(tp, pp, expected):
    """seeds/004's lines for the 345M model on 4 GPUs, from the dry run (nothing built)."""
    done = subprocess.run([sys.executable, "-m", "gptrain", "train", *M345, "--dry-run", "--world-size", "4",
                           "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert done.returncode == 0, done.stderr
    for (t, p), n in expected.items():
        assert f" > number of parameters on (tensor, pipeline) model parallel rank ({t}, {p}): {n}\n" in done.stdout
    assert f"new size: {50304 if tp == 1 else 50432 if tp == 2 else 50688})" in done.stdout


def _compiled_block(rank: int, sequence_parallel: bool, out_path: str) -> None:
    from torch.distributed.tensor import DTensor

    from gptrain.parallel.dims import init_distributed
    from gptrain.train.build import build_training, parallel_dims

    argv = TINY + ["--train-iters", "1", "--tensor-model-parallel-size", "2"]
    cfg, _ = parse_megatron_args(argv + (["--sequence-parallel"] if sequence_parallel else []), world_size=2)
    cfg.model.vocab_size = 50257
    dims = parallel_dims(cfg, 2)
    device = init_distributed(torch.device("cpu"))
    parts = build_training(cfg, device, dims, dims.build_mesh("cpu"), log=lambda s: None)
    dtensors = [n for n, p in parts.model.named_parameters() if isinstance(p, DTensor)]
    torch._dynamo.reset()
    block = parts.model.layers["0"]
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    tokens = 2 * 32 // (2 if sequence_parallel else 1)
    x = torch.randn(1 if sequence_parallel else 2, tokens if sequence_parallel else 32, 32, requires_grad=True)
    y = compiled(x)
    y.sum().backward()  # fullgraph=True raises on any graph break, forward or backward
    eager = block(x.detach())
    if rank == 0:
        torch.save({"dtensors": dtensors, "equal": torch.allclose(y.detach(), eager, atol=1e-6),
                    "grad": x.grad is not None}, out_path)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2+sp"])
def test_block_compiles_as_one_graph_on_plain_tensors(sequence_parallel, tmp_path):
    spawn(2, _compiled_block, sequence_parallel, str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt")
    assert got["dtensors"] == []  # no DTensor parameter, so no DTensor operation in the step
    assert got["equal"] and got["grad"]
