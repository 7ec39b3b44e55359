"""--grad-reduce-copy-engine: --overlap-grad-reduce's buckets all-reduced by copy-engine transfers between two
GPUs (parallel/copy_engine.py). Where it cannot run it is refused in one line before anything is built; on two
GPUs the exchange sums as NCCL does (odd sizes, fp32 and bf16, on a side stream) and a data-parallel run with it
gives the losses of the same run on NCCL."""
from __future__ import annotations

import re
import pytest
import torch
import torch.distributed as dist

from distributed import TINY, losses, spawn, torchrun
from gptrain.config import parse_megatron_args
from gptrain.parallel.grad_buckets import GradBuckets
from gptrain.train.build import parallel_dims
from gptrain.train.startup import check_before_build

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                              reason="needs two CUDA GPUs (the GPU lane on a two-GPU machine)")


@pytest.mark.parametrize("extra,world,message", [
    ([], 2, "--grad-reduce-copy-engine reduces --overlap-grad-reduce's buckets: it needs --overlap-grad-reduce"),
    (["--overlap-grad-reduce", "--zero-stage", "1"], 2, "it needs --overlap-grad-reduce with plain data parallelism"),
    (["--overlap-grad-reduce"], 4, "--grad-reduce-copy-engine joins two GPUs of one host: data-parallel size 4"),
])
def test_the_layout_it_cannot_serve_is_refused(extra, world, message):
    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1", "--grad-reduce-copy-engine", *extra], world_size=world)
    with pytest.raises(ValueError, match=message):
        parallel_dims(cfg, world)


def test_a_cpu_run_is_refused_before_the_build():
    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1", "--overlap-grad-reduce", "--grad-reduce-copy-engine"],
                                 world_size=2)
    assert parallel_dims(cfg, 2).dp == 2  # the layout itself is one it serves
    with pytest.raises(ValueError, match="joins two GPUs of one host by their copy engines: the device here is cpu"):
        check_before_build(cfg)


def _gloo_buckets(rank: int) -> None:
    dist.init_process_group("gloo")
    flat = torch.zeros(10)
    with pytest.raises(ValueError, match="--grad-reduce-copy-engine: it needs CUDA GPUs"):
        GradBuckets(flat, [flat[:4], flat[4:]], dist.group.WORLD, 2, copy_engine=True)
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_buckets_refuse_it_off_cuda():
    spawn(2, _gloo_buckets)


def _exchange(rank: int) -> None:
    from gptrain.parallel.copy_engine import CopyEngineAllReduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    for dtype in (torch.float32, torch.bfloat16):
        ce = CopyEngineAllReduce(dist.group.WORLD, 1001, dtype, torch.device("cuda", rank))
        for n in (1001, 1000, 7, 1):
            x = torch.randn(n, device="cuda", generator=torch.Generator("cuda").manual_seed(rank * 100 + n)).to(dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            ce(x)
            torch.testing.assert_close(x, expected, rtol=0, atol=0)
            y = torch.randn(n, device="cuda").to(dtype)
            expected = y.clone()
            dist.all_reduce(expected)
            ce.start(y).wait()
            torch.testing.assert_close(y, expected, rtol=0, atol=0)
        # several started before the first wait, as the buckets start them during the backward
        parts = [torch.randn(n, device="cuda").to(dtype) for n in (1001, 3, 500)]
        expected = [p.clone() for p in parts]
        for e in expected:
            dist.all_reduce(e)
        for started in [ce.start(p) for p in parts]:
            started.wait()
        for p, e in zip(parts, expected):
            torch.testing.assert_close(p, e, rtol=0, atol=0)
        with pytest.raises(ValueError, match="set up for up to 1001"):
            ce(torch.zeros(1002, device="cuda", dtype=dtype))
    dist.destroy_process_group()


@pytest.mark.gpu
@TWO_GPUS
def test_the_exchange_sums_as_nccl_does():
    spawn(2, _exchange)


@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize("reduce", [[], ["--grad-reduce-in-bf16"]], ids=["fp32", "bf16-reduction"])
def test_data_parallel_with_it_equals_the_nccl_run(reduce):
    flags = [f for f in TINY if f not in ("--device", "cpu")] + ["--train-iters", "4", "--overlap-grad-reduce",
                                                                  "--ddp-bucket-size", "100000", *reduce]
    nccl = losses(torchrun(2, flags))
    out = torchrun(2, flags + ["--grad-reduce-copy-engine"])
    assert "all-reduced by the copy engines" in out
    copy_engine = losses(out)
    assert sorted(copy_engine) == [1, 2, 3, 4]
    assert all(copy_engine[i] == pytest.approx(nccl[i], rel=1e-6) for i in nccl)


def test_the_planner_counts_its_buffers():
    """The symmetric buffer holds a bucket's two halves in the reduction's dtype, on top of NCCL's run; for
    tensor parallelism a micro-batch's input gradient."""
    from gptrain.plan.memory import stage_memory

    def buckets(extra: list[str]) -> float:
        argv = TINY + ["--train-iters", "1", "--overlap-grad-reduce", "--ddp-bucket-size", "1000", *extra]
        cfg, _ = parse_megatron_args(argv, world_size=2)
        return stage_memory(cfg, parallel_dims(cfg, 2), 10_000, 2, 0, 1, False).buckets

    assert buckets([]) == 0
    assert buckets(["--grad-reduce-copy-engine"]) == 4 * 1000
    assert buckets(["--grad-reduce-in-bf16"]) == 2 * 1000
    assert buckets(["--grad-reduce-in-bf16", "--grad-reduce-copy-engine"]) == 2 * 1000 + 2 * 1000
    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1", "--tensor-model-parallel-size", "2",
                                         "--tp-comm-copy-engine"], world_size=2)
    m = cfg.model
    assert stage_memory(cfg, parallel_dims(cfg, 2), 10_000, 2, 0, 1, False).buckets == \
        4 * cfg.train.micro_batch_size * m.seq_length * m.hidden_size


# ---- --tp-comm-copy-engine: a column-parallel layer's input gradient summed beside its weight gradients


@pytest.mark.parametrize("extra,world,message", [
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"], 2, "without --tp-comm-overlap"),
    (["--tensor-model-parallel-size", "4"], 4, "it needs --tensor-model-parallel-size 2 (got 4)"),
    ([], 2, "it needs --tensor-model-parallel-size 2 (got 1)"),
])
def test_tensor_parallel_layouts_it_cannot_serve_are_refused(extra, world, message):
    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1", "--tp-comm-copy-engine", *extra], world_size=world)
    with pytest.raises(ValueError, match="--tp-comm-copy-engine moves a tensor-parallel pair's activations"):
        parallel_dims(cfg, world)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parallel_dims(cfg, world)


@pytest.mark.parametrize("layout", [[], ["--sequence-parallel"]], ids=["tp2", "tp2-sp"])
def test_autocast_is_refused_with_it(layout):
    """Its ops multiply inside themselves in the parameters' dtype: fp32 parameters under autocast are refused."""
    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1", "--tensor-model-parallel-size", "2", "--bf16",
                                         "--autocast", "--tp-comm-copy-engine", *layout], world_size=2)
    with pytest.raises(ValueError, match="--tp-comm-copy-engine with --autocast is not built"):
        parallel_dims(cfg, 2)


def _build_asking_for_it(rank: int) -> None:
    from gptrain.parallel.dims import init_distributed
    from gptrain.train.build import build_training

    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1", "--tensor-model-parallel-size", "2",
                                         "--tp-comm-copy-engine"], world_size=2)
    cfg.model.vocab_size = 50257
    dims = parallel_dims(cfg, 2)
    device = init_distributed(torch.device("cpu"))
    with pytest.raises(ValueError, match="--tp-comm-copy-engine joins two GPUs of one host by their copy engines: "
                                         "the device here is cpu"):
        build_training(cfg, device, dims, dims.build_mesh("cpu"), log=lambda s: None)
    dist.destroy_process_group()


def test_a_cpu_build_asking_for_it_is_refused_too():
    """`gptrain bench` and the benchmarks build without check_before_build: the build itself refuses the flag on a
    CPU (asked for, the copy engines never fall back to NCCL)."""
    spawn(2, _build_asking_for_it)


def test_a_cpu_tensor_parallel_run_with_it_is_refused_before_the_build():
    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1", "--tensor-model-parallel-size", "2",
                                         "--tp-comm-copy-engine"], world_size=2)
    assert parallel_dims(cfg, 2).tp == 2
    with pytest.raises(ValueError, match="--tp-comm-copy-engine joins two GPUs of one host by their copy engines"):
        check_before_build(cfg)


def test_both_flags_together_are_refused():
    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1", "--tensor-model-parallel-size", "2",
                                         "--tp-comm-copy-engine", "--no-tp-comm-copy-engine"], world_size=2)
    with pytest.raises(ValueError, match="--tp-comm-copy-engine and --no-tp-comm-copy-engine contradict each other"):
        parallel_dims(cfg, 2)


@pytest.mark.parametrize("extra,world,wanted", [
    (["--tensor-model-parallel-size", "2"], 2, True),  # the default for a pair
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, True),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 4, False),  # TP2 x DP2: not yet run on GPUs
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 4, False),
    (["--tensor-model-parallel-size", "2", "--recompute-activations", "--recompute-granularity", "full",
      "--recompute-method", "uniform"], 2, False),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-copy-engine"], 4, True),  # asked for
    (["--tensor-model-parallel-size", "2", "--no-tp-comm-copy-engine"], 2, False),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"], 2, False),  # async TP's own
    (["--tensor-model-parallel-size", "2", "--bf16", "--autocast"], 2, False),  # its ops take the parameters' dtype
    (["--tensor-model-parallel-size", "4"], 4, False),
    ([], 2, False),
], ids=["tp2", "tp2+sp", "tp2+spxdp2", "tp2xpp2", "full-recompute", "required", "opted-out", "async-tp", "autocast",
        "tp4", "dp2"])
def test_the_copy_engines_are_tp2s_default_where_they_can_serve_it(extra, world, wanted):
    from gptrain.train.build import tp_copy_engine_wanted

    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1", *extra], world_size=world)
    assert tp_copy_engine_wanted(cfg, parallel_dims(cfg, world)) is wanted


def test_the_planner_prices_the_default_as_the_trades():
    """TP2 + SP without a flag is predicted as the copy engines' trades (what runs on GPUs of one host), faster than
    the same layout on NCCL, and with the trades' buffer in its memory; TP2 alone as the copy engines' backward."""
    from gptrain.plan.hardware import load_gpu
    from gptrain.plan.search import predict

    gpu = load_gpu("h200", None, None, measured=False)
    m345 = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
            "--max-position-embeddings", "1024", "--bf16", "--compile", "--micro-batch-size", "16",
            "--global-batch-size", "16", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--mock-data",
            "--train-iters", "1"]
    p = {name: predict(parse_megatron_args(m345 + extra, world_size=2)[0].with_tokenizer(50257, 50256), 2, gpu, 8)
         for name, extra in (("default", []), ("required", ["--tp-comm-copy-engine"]),
                             ("nccl", ["--no-tp-comm-copy-engine"]))}
    assert p["default"].tokens_per_s_per_gpu == p["required"].tokens_per_s_per_gpu
    assert p["default"].tokens_per_s_per_gpu > 1.1 * p["nccl"].tokens_per_s_per_gpu
    assert p["default"].peak_gib > p["nccl"].peak_gib
    # without sequence parallelism: the backward's sums beside the weight gradients, a few percent (s30-s34)
    plain = [a for a in m345 if a != "--sequence-parallel"]
    tp2 = {name: predict(parse_megatron_args(plain + extra, world_size=2)[0].with_tokenizer(50257, 50256), 2, gpu, 8)
           for name, extra in (("default", []), ("nccl", ["--no-tp-comm-copy-engine"]))}
    gain = tp2["default"].tokens_per_s_per_gpu / tp2["nccl"].tokens_per_s_per_gpu
    assert 1.01 < gain < 1.1, gain


def _layers_backward(rank: int, device: str) -> None:
    """A column-parallel linear and the fused MLP, each rank on its shard: the same gradients through the op as
    through the functional all-reduce (on CPU the op's gloo path in fp32, on GPUs its copy engines in bf16: the
    fused MLP's cuBLASLt kernels take half precision only, as training runs them)."""
    from gptrain.parallel.copy_engine import all_reduce_beside_wgrads
    from gptrain.parallel.tensor_parallel import _ColumnFusedMLP, _ColumnParallel

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cuda":
        from gptrain.parallel.copy_engine import set_up_tp_exchange

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        set_up_tp_exchange(dist.group.WORLD, 2 * 8 * 16, dtype, torch.device("cuda", rank), 60.0)
    else:
        dist.init_process_group("gloo")
    group = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(0)  # the same whole tensors on both ranks
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {}  # bf16: assert_close's own

    def draw(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)
    x, w, b, out_grad = draw(2, 8, 16), draw(12, 16), draw(12), draw(2, 8, 12)
    w1, b1, w2, mlp_grad = draw(24, 16), draw(24), draw(16, 24), draw(2, 8, 16)
    shards = {"w": w.chunk(2)[rank], "b": b.chunk(2)[rank], "w1": w1.chunk(2)[rank], "b1": b1.chunk(2)[rank],
              "w2": w2.chunk(2, dim=1)[rank]}
    got = {}
    for copy_engine in (False, True):
        xs = [x.clone().requires_grad_() for _ in range(2)]
        p = {k: v.clone().requires_grad_() for k, v in shards.items()}
        y = _ColumnParallel.apply(xs[0], p["w"], p["b"], group, 2, False, 8, False, copy_engine)
        (y * out_grad.chunk(2, dim=-1)[rank]).sum().backward()
        z = _ColumnFusedMLP.apply(xs[1], p["w1"], p["b1"], p["w2"], group, 2, False, 8, copy_engine)
        (z * mlp_grad).sum().backward()
        got[copy_engine] = [xs[0].grad, xs[1].grad] + [p[k].grad for k in sorted(p)]
    for a, c in zip(got[False], got[True]):
        torch.testing.assert_close(c, a, **tol)
    # the op itself: the sum and the weight gradients
    t, g, inp = draw(10, 4) + rank, draw(10, 3), draw(10, 5)
    summed, wg = all_reduce_beside_wgrads(t, [g], [inp], False, group)
    expected = t.clone()
    dist.all_reduce(expected)
    torch.testing.assert_close(summed, expected, rtol=0, atol=0)
    torch.testing.assert_close(wg, g.t() @ inp, **tol)
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_layers_give_the_same_gradients_through_the_op_on_cpu():
    spawn(2, _layers_backward, "cpu")


def _compiled_backward(rank: int) -> None:
    """Under torch.compile the op is one node of the backward graph, with the functional all-reduce's gradients."""
    from gptrain.parallel.tensor_parallel import _ColumnFusedMLP, _ColumnParallel

    dist.init_process_group("gloo")
    group = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 8, 16, generator=gen), torch.randn(12, 16, generator=gen), torch.randn(12, generator=gen)
    w2 = torch.randn(16, 12, generator=gen)
    got = {}
    for copy_engine in (False, True):
        xx, ww, bb, ww2 = x.clone().requires_grad_(), w.chunk(2)[rank].clone().requires_grad_(), \
            b.chunk(2)[rank].clone().requires_grad_(), w2.chunk(2, dim=1)[rank].clone().requires_grad_()

        def step(a, p, q, r, copy_engine=copy_engine):
            y = _ColumnParallel.apply(a, p, q, group, 2, False, 8, False, copy_engine).square().sum()
            return y + _ColumnFusedMLP.apply(a, p, q, r, group, 2, False, 8, copy_engine).square().sum()
        torch.compile(step)(xx, ww, bb, ww2).backward()
        got[copy_engine] = (xx.grad, ww.grad, bb.grad, ww2.grad)
    for a, c in zip(got[False], got[True]):
        torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-6)
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_op_compiles_into_the_backward_on_cpu():
    spawn(2, _compiled_backward)


@pytest.mark.gpu
@TWO_GPUS
def test_the_layers_give_the_same_gradients_through_the_copy_engines():
    spawn(2, _layers_backward, "cuda")


@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize("layout,line", [
    ([], "input gradients summed by the copy engines"),
    (["--sequence-parallel"], "sequence-parallel gathers and scatters as copy-engine trades"),
], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("extra", [[], ["--bf16", "--compile"]], ids=["fp32-eager", "bf16-compiled-graphs"])
def test_tensor_parallel_with_it_equals_the_nccl_run(layout, line, extra):
    """The same losses and gradient norms as the run on NCCL, at a learning rate under which each iteration's
    gradient norm shows the updates before it (the tiny model's loss barely moves in four iterations)."""
    flags = [f for f in TINY if f not in ("--device", "cpu")] + ["--train-iters", "4", "--tensor-model-parallel-size",
                                                                  "2", "--lr", "3e-2", *layout, *extra]
    nccl_out = torchrun(2, flags + ["--no-tp-comm-copy-engine"])
    out = torchrun(2, flags)  # the copy engines by default on two GPUs of one host
    assert line in out and "(the default; --no-tp-comm-copy-engine: NCCL's)" in out
    assert "tensor parallel: NCCL's collectives" not in out
    nccl, copy_engine = losses(nccl_out), losses(out)
    assert sorted(copy_engine) == [1, 2, 3, 4]
    rel = 2e-3 if extra else 1e-5
    assert all(copy_engine[i] == pytest.approx(nccl[i], rel=rel) for i in nccl)
    norms = [[float(n) for n in re.findall(r"grad norm: (\S+) \|", o)] for o in (nccl_out, out)]
    assert len(norms[0]) == 4 and norms[0][3] < 0.8 * norms[0][0]  # the updates show in the norms
    assert norms[1] == pytest.approx(norms[0], rel=2e-2 if extra else 0, abs=0 if extra else 2e-3)


# ---- --tp-comm-copy-engine with --sequence-parallel: the regions' gathers and scatters as copy-engine trades, half
# the tokens at a time under the matmuls (parallel/sequence_parallel_ce.py)


def _sp_regions(rank: int, device: str, compiled: bool = False) -> None:
    """A column-parallel entry, a row-parallel exit and the fused MLP region with sequence parallelism, each rank on
    its half of the tokens: the outputs and every gradient through the copy-engine ops equal those through the
    functional all-gather and reduce-scatter (on CPU the trades are gloo's send and receive, in fp32; on GPUs the
    copy engines, in bf16)."""
    from gptrain.parallel.tensor_parallel import (_ColumnFusedMLP, _ColumnParallel, _ExitRegion, _FusedMLPCE,
                                                  _GatherColumnCE, _RowScatterCE)
    from gptrain.model.linear import linear_weight

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cuda":
        from gptrain.parallel.peer_swap import set_up_swap

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        set_up_swap(dist.group.WORLD, 8 * 16, dtype, torch.device("cuda", rank), 60.0)
    else:
        dist.init_process_group("gloo")
    group = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(0)  # the same whole tensors on both ranks

    def draw(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)
    seq, tuned = 8, device == "cuda"
    x, w, b, w_row, h = draw(2, seq, 16), draw(12, 16), draw(12), draw(16, 12), draw(2, seq, 12)
    w1, b1, w2 = draw(24, 16), draw(24), draw(16, 24)

    def mine(t):  # this rank's half of the 16 tokens
        return t.view(-1, t.shape[-1])[rank * seq:(rank + 1) * seq].view(1, seq, t.shape[-1])
    # each rank's output gradients as a model gives them: its columns of every token, or every column of its tokens
    grads = {"col": draw(2, seq, 12).chunk(2, dim=-1)[rank], "row": mine(draw(2, seq, 16)),
             "mlp": mine(draw(2, seq, 16))}
    x_mine = mine(x)
    shards = {"w": w.chunk(2)[rank], "b": b.chunk(2)[rank], "w_row": w_row.chunk(2, dim=1)[rank],
              "h": h.chunk(2, dim=-1)[rank], "w1": w1.chunk(2)[rank], "b1": b1.chunk(2)[rank],
              "w2": w2.chunk(2, dim=1)[rank]}

    def regions(xs, p, copy_engine):
        if copy_engine:
            col = _GatherColumnCE.apply(xs[0], p["w"], p["b"], group, seq, tuned)
            row = _RowScatterCE.apply(p["h"], p["w_row"], group, tuned)
            mlp = _FusedMLPCE.apply(xs[1], p["w1"], p["b1"], p["w2"], group)
        else:
            col = _ColumnParallel.apply(xs[0], p["w"], p["b"], group, 2, True, seq, tuned, False)
            row = _ExitRegion.apply(linear_weight(p["h"], p["w_row"], tuned), group, 2, True)
            mlp = _ExitRegion.apply(_ColumnFusedMLP.apply(xs[1], p["w1"], p["b1"], p["w2"], group, 2, True, seq,
                                                          False), group, 2, True)
        return ((col * grads["col"]).sum() + (row * grads["row"]).sum() + (mlp * grads["mlp"]).sum()), (col, row, mlp)

    got = {}
    for copy_engine in (False, True):
        xs = [x_mine.clone().requires_grad_() for _ in range(2)]
        p = {k: v.clone().requires_grad_() for k, v in shards.items()}
        run = torch.compile(regions) if compiled and copy_engine else regions
        loss, outs = run(xs, p, copy_engine)
        loss.backward()
        got[copy_engine] = [*outs, xs[0].grad, xs[1].grad] + [p[k].grad for k in sorted(p)]
    assert [t.shape for t in got[True]] == [t.shape for t in got[False]]
    for a, c in zip(got[False], got[True]):
        if dtype == torch.float32:
            torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)
        else:  # bf16: the halves' matmuls round apart from the whole ones' by an ulp, and sums of two partials
            # can cancel, so a few ulps at the tensor's scale
            assert (c.float() - a.float()).abs().max() <= 2 ** -6 * a.float().abs().max()
    dist.destroy_process_group()


def _trades(rank: int) -> None:
    """Trades by the copy engines in a random order of slots (repeats included), each rank held up at random
    moments: every trade receives what the other rank sent in it, eagerly and replayed from a CUDA graph, where the
    receiving slot is read by a kernel on the current stream and by a copy on the side stream."""
    from gptrain.parallel.peer_swap import GATHER, SCATTER, set_up_swap, start_trade

    device = torch.device("cuda", rank)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=device)
    n = 1 << 20
    set_up_swap(dist.group.WORLD, n, torch.bfloat16, device, 60.0)
    group = dist.group.WORLD.group_name
    order = torch.Generator().manual_seed(1)  # the same slots on both ranks
    slots = [GATHER if torch.rand((), generator=order) < 0.5 else SCATTER for _ in range(64)]
    delays = torch.Generator().manual_seed(2 + rank)  # different hold-ups on each rank
    naps = [[int(t) for t in torch.randint(0, 200_000, (3,), generator=delays)] for _ in slots]

    def late_copy(i, copies):
        def copy(received):
            torch.cuda._sleep(naps[i][1])  # the side stream slow to read what landed
            copies[i].copy_(received)
        return copy

    def run(errors, copies):
        for i, slot in enumerate(slots):
            torch.cuda._sleep(naps[i][0])  # this rank late to send
            sent = torch.full((n,), float(rank * 100 + i % 100), device=device, dtype=torch.bfloat16)
            arriving = start_trade(sent, group, slot)
            arriving.on_side(late_copy(i, copies))
            received = arriving.wait()
            torch.cuda._sleep(naps[i][2])  # the current stream slow to read it
            errors += (received != float((1 - rank) * 100 + i % 100)).sum()
            arriving.join()

    for graphed in (False, True):
        errors = torch.zeros((), dtype=torch.int64, device=device)
        copies = torch.zeros(len(slots), n, dtype=torch.bfloat16, device=device)
        if graphed:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run(errors, copies)
            for _ in range(3):
                graph.replay()
        else:
            run(errors, copies)
        expected = torch.tensor([float((1 - rank) * 100 + i % 100) for i in range(len(slots))], device=device)
        assert int(errors) == 0
        assert torch.equal(copies.float(), expected[:, None].expand(-1, n))
    dist.destroy_process_group()


@pytest.mark.gpu
@TWO_GPUS
def test_the_trades_receive_what_the_other_rank_sent():
    spawn(2, _trades)


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_sequence_parallel_regions_give_the_same_values_and_gradients_through_the_trades_on_cpu(compiled):
    spawn(2, _sp_regions, "cpu", compiled)


@pytest.mark.gpu
@TWO_GPUS
def test_sequence_parallel_regions_give_the_same_values_and_gradients_through_the_copy_engines():
    spawn(2, _sp_regions, "cuda")
