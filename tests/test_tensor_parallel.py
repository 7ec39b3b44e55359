"""Tensor parallelism (plain shards, explicit collectives) against one process: the same losses and
weights at TP2, TP2 with sequence parallelism, TP2 x DP2, TP2 x ZeRO-3, TP4 and TP2 + SP x DP2 with
overlapped reduction (fp32, tiny model, no dropout; TP2 x PP2 + SP in test_pipeline_parallel.py); each
block compiles as one graph with no DTensor inside; --tp-comm-overlap's rewrite into torch's async-TP kernels; Megatron's per-rank parameter counts, built and planned
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
    (4, 2, ["--sequence-parallel", "--overlap-grad-reduce", "--ddp-bucket-size", "5000"]),
    (4, 2, ["--sequence-parallel", "--use-distributed-optimizer"])],
    ids=["tp2", "tp2+sp", "tp2xdp2", "tp2xzero3", "tp4", "tp2+spxdp2-overlap", "tp2+spxdp2-distributed-optimizer"])  # TP2 x PP2 + SP: test_pipeline_parallel
def test_tensor_parallel_equals_one_process(nproc, tp, flags, one_process, tmp_path):
    out = torchrun(nproc, TINY + STEPS + ["--tensor-model-parallel-size", str(tp), "--save", str(tmp_path),
                                          "--verbose"] + flags)
    got = losses(out)
    for it, loss in one_process[0].items():
        assert got[it] == pytest.approx(loss, rel=1e-5), it
    assert f"data-parallel-size: {nproc // tp}, tensor-model-parallel size: {tp}" in out
    if nproc == tp == 2:  # the copy engines are a lone TP2 pair's default, on GPUs of one host
        assert ("tensor parallel: NCCL's collectives: the copy engines need two GPUs' memory mapped, and this cpu run "
                "has none (--no-tp-comm-copy-engine: always)") in out
    elif tp == 2 and "--tp-comm-overlap" not in flags:
        assert "tensor parallel: NCCL's collectives (the copy engines are the default of a lone pair only" in out
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
    overlap_form = _async_tp_form_matches(block.attn.qkv, x.detach()) if sequence_parallel else True
    if rank == 0:
        torch.save({"dtensors": dtensors, "equal": torch.allclose(y.detach(), eager, atol=1e-6),
                    "grad": x.grad is not None, "overlap_form": overlap_form}, out_path)
    torch.distributed.destroy_process_group()


def _async_tp_form_matches(column, x) -> bool:
    """--tp-comm-overlap's column-parallel form (the bias added after the matmul) gives the same
    output and gradients as the fused form, on the same parameters."""
    import copy
    import dataclasses

    twin = copy.copy(column)
    twin.tp = dataclasses.replace(column.tp, comm_overlap=True)
    got = []
    for layer in (column, twin):
        layer.zero_grad()
        y = layer(x)
        y.square().sum().backward()
        got.append((y.detach(), layer.weight.grad.clone(), layer.bias.grad.clone()))
    return all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*got))


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2+sp"])
def test_block_compiles_as_one_graph_on_plain_tensors(sequence_parallel, tmp_path):
    spawn(2, _compiled_block, sequence_parallel, str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt")
    assert got["dtensors"] == []  # no DTensor parameter, so no DTensor operation in the step
    assert got["equal"] and got["grad"] and got["overlap_form"]


def test_async_tensor_parallelism_refuses_what_it_cannot_rewrite():
    from gptrain.parallel.async_tp import check_async_tp

    cuda = torch.device("cuda")
    for args, message in [((1, True, True, cuda), "--tensor-model-parallel-size above 1"),
                          ((2, False, True, cuda), "needs --sequence-parallel"),
                          ((2, True, False, cuda), "needs --compile"),
                          ((2, True, True, torch.device("cpu")), "needs NVIDIA GPUs with NCCL"),
                          ((2, True, True, cuda, False, "reduce-overhead"), "does not run under CUDA graphs")]:
        with pytest.raises(ValueError, match=message):
            check_async_tp(*args)


@pytest.mark.slow
def test_async_tensor_parallelism_rewrites_the_sequence_parallel_matmuls():
    """Inductor's micro-pipeline pass finds every sequence-parallel all-gather -> matmul and matmul ->
    reduce-scatter of a compiled TP2 + SP block, in --tp-comm-overlap's form (and not the all-gathers
    in the default form, whose column-parallel bias sits in an addmm). Rank 0 of a fake group on the
    CPU, symmetric memory mocked and NCCL claimed: only the rewrite is checked (the fused kernels are
    CUDA's, so running the rewritten forward fails after its code is generated)."""
    from unittest import mock

    import torch._inductor.config as inductor_config
    import torch.distributed as dist
    from torch._inductor.graph import GraphLowering
    from torch.distributed import _symmetric_memory as symm_mem
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from gptrain.parallel.tensor_parallel import apply_tensor_parallel

    def fused_calls(comm_overlap: bool) -> tuple[int, int]:
        with torch.device("meta"):
            model = GPT(cfg.model)
        apply_tensor_parallel(model, mesh, sequence_parallel=True, comm_overlap=comm_overlap)
        block = model.layers["0"].to_empty(device="cpu")
        x = torch.randn(1, cfg.model.seq_length, 1024, requires_grad=True)  # 2 x seq tokens / 2 ranks
        torch._dynamo.reset()
        codes: list[str] = []
        with symm_mem._test_mode(), inductor_config.patch(_micro_pipeline_tp=True), \
                mock.patch.object(GraphLowering, "save_output_code", codes.append), \
                mock.patch.object(dist, "is_nccl_available", lambda: True), pytest.raises(NotImplementedError):
            torch.compile(block, fullgraph=True)(x)
        code = "\n".join(codes)
        return (code.count("torch.ops.symm_mem.fused_all_gather_matmul.default("),
                code.count("torch.ops.symm_mem.fused_matmul_reduce_scatter.default("))

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        cfg, _ = parse_megatron_args(TINY + ["--hidden-size", "1024", "--num-attention-heads", "8",
                                             "--train-iters", "1"], world_size=1)
        # QKV and fc1 after their all-gathers, proj and fc2 before their reduce-scatters
        assert fused_calls(comm_overlap=True) == (2, 2)
        assert fused_calls(comm_overlap=False) == (0, 2)
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_cuda_graphs_are_the_default_for_tensor_parallelism_on_gpus():
    """Where the whole step compiles as one graph, a TP rank on GPUs runs CUDA graphs unless told
    otherwise; one GPU, the CPU, pipelines, ZeRO, overlapped reduction and async TP keep torch's default."""
    from gptrain.train.build import parallel_dims, step_compile_mode

    base = "--mock-data --train-iters 1 --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 " \
           "--max-position-embeddings 32 --micro-batch-size 2 --bf16"

    def mode(flags: str, world: int, cuda: bool = True):
        cfg, _ = parse_megatron_args(f"{base} {flags}".split(), world_size=world)
        return step_compile_mode(cfg, parallel_dims(cfg, world), cuda)

    tp2 = "--compile --tensor-model-parallel-size 2"
    assert mode(tp2, 2) == "reduce-overhead"
    assert mode(f"{tp2} --sequence-parallel", 2) == "reduce-overhead"
    assert mode(f"{tp2} --compile-mode default", 2) == "default"
    assert mode(tp2, 2, cuda=False) is None
    assert mode("--compile", 1) is None and mode("--tensor-model-parallel-size 2", 2) is None  # not compiled
    assert mode(f"{tp2} --pipeline-model-parallel-size 2 --global-batch-size 4", 4) is None
    assert mode(f"{tp2} --zero-stage 3", 4) is None
    assert mode(f"{tp2} --overlap-grad-reduce", 4) is None
    assert mode(f"{tp2} --sequence-parallel --tp-comm-overlap", 2) is None
