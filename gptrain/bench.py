"""``gptrain bench``: training throughput of gptrain's real step against a plain PyTorch baseline.

Both run in this process on synthetic tokens, same shape, same micro-batch: gptrain through
``Trainer.train_step`` (the code ``gptrain train`` runs), the baseline as the simplest strong recipe
(a nanoGPT-style module, bf16 autocast, SDPA, fused AdamW, torch.compile, plain cross-entropy).
Prints ms/iteration, tokens/s per device, TFLOP/s, MFU against the datasheet peak and against a
bf16 matmul ceiling measured here, peak memory, and the ratio.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from contextlib import nullcontext

import torch

import gptrain

from gptrain.bench_models import baseline_for, model_kind
from gptrain.config import parse_megatron_args
from gptrain.data.gpt_dataset import MockGPTDataset
from gptrain.device import pick_device
from gptrain.parallel import simulate
from gptrain.parallel.dims import init_distributed, is_logging_rank, world_from_env
from gptrain.parallel.teardown import end_process_group
from gptrain.train import metrics
from gptrain.train.build import build_training, parallel_dims
from gptrain.data.loader import MicroBatchLoader
from gptrain.train.loop import Trainer


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_ceiling_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    n = 8192
    a, b = torch.randn(n, n, device=device, dtype=torch.bfloat16), torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync(device)
    return 2 * n ** 3 * 10 / (time.perf_counter() - start) / 1e12


def _progress(message: str) -> None:
    """``message`` and when, in seconds since gptrain's import: where a benchmark row's wall time goes."""
    if is_logging_rank():
        print(f"{message} [{time.perf_counter() - gptrain.STARTED:.1f} s]", flush=True)


class GcPauses:
    """Time the host spends in Python's garbage collector, from ``reset()`` until ``stop()``: a collection
    the step's own allocations trigger stalls the host at a moment of its choosing (training's answer is
    ``--manual-gc``)."""

    def __init__(self):
        self.seconds, self.collections, self._began, self._counting = 0.0, [0, 0, 0], None, True
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if not self._counting:
            return
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self.collections[info["generation"]] += 1
            self._began = None

    def reset(self) -> None:
        self.seconds, self.collections, self._counting = 0.0, [0, 0, 0], True

    def stop(self) -> None:
        """Count no further collections (those after the timed steps)."""
        self._counting, self._began = False, None

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


def measure(step, warmup: int, iters: int, device, label: str = "",
            settle=lambda: None, gc_pauses: GcPauses | None = None) -> tuple[float, float, float | None]:
    """Seconds per step, host seconds per step (until the last step returns, before the final
    synchronisation: far below the step time means the host runs ahead of the device; close to it
    means either a CPU-bound step or a full launch queue, which only a profile tells apart), and
    peak GPU memory in GiB (None off a GPU). ``settle`` waits for host work a step leaves running
    (the host's optimizer thread), counted in the step time like the device's. ``gc_pauses``: reset as the
    timed steps start and stopped as they end, so it holds their collections only."""
    begin = time.perf_counter()
    _progress(f"{label}: {warmup} warm-up iterations (compilation happens here) ...")
    for _ in range(warmup):
        step()
    settle()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _progress(f"{label}: timing {iters} iterations (warm-up took {time.perf_counter() - begin:.1f} s) ...")
    if gc_pauses is not None:
        gc_pauses.reset()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    host = (time.perf_counter() - start) / iters
    if gc_pauses is not None:
        gc_pauses.stop()
    settle()
    _sync(device)
    seconds = (time.perf_counter() - start) / iters
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    _progress(f"{label}: {1000 * seconds:.1f} ms per iteration")
    return seconds, host, peak


def synthetic_trainer(argv: list[str], iters: int, world: int | None = None) -> tuple[Trainer, MicroBatchLoader]:
    """The real Trainer (``gptrain train``'s) on synthetic tokens, and a loader feeding it; under
    torchrun, at the layout the flags and the world size give. ``world``: the layout's world size where it
    is not torchrun's (a one-GPU row run by a process of a larger world before its group exists)."""
    env_world = world_from_env()[0]
    world = world or env_world
    cfg, _ = parse_megatron_args(argv + ["--mock-data", "--train-iters", str(iters)], world_size=world)
    dims = parallel_dims(cfg, world)
    device = pick_device(cfg.train.device)
    if world == env_world:
        device = init_distributed(device, alone=dims.sharded)  # offload on one process: a group of one
    if device.type == "cuda" and device.index is None:  # this process's GPU (torchrun's local rank, once joined)
        device = torch.device("cuda", torch.cuda.current_device())
    parts = build_training(cfg, device, dims, dims.build_mesh(device.type), log=lambda s: None)
    data = MockGPTDataset("train", 10 ** 9, cfg.model.seq_length, cfg.model.vocab_size, cfg.data.seed)
    trainer = Trainer(cfg, parts, data, None, None, device, log=lambda s: None)
    return trainer, trainer.loader(data, 0)


def count_launches(step, device: torch.device, micro_batches: int, settle=lambda: None) -> str:
    """Kernel launches per micro-batch of one ``step`` (on a GPU; elsewhere the operators run); ``settle``
    waits for host work the step leaves running."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        step()
        settle()
        _sync(device)
    if cuda:
        n = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        return f"{n / micro_batches:,.0f} kernel launches per micro-batch"
    n = sum(1 for e in prof.events() if e.name.startswith("aten::"))
    return f"{n / micro_batches:,.0f} operators per micro-batch (no GPU: launches not counted)"


def bench_gptrain(argv: list[str], warmup: int, iters: int):
    trainer, loader = synthetic_trainer(argv, warmup + iters + 1)
    cfg, device = trainer.cfg, trainer.device
    step = lambda: trainer.train_step(loader)  # noqa: E731
    try:
        timing = measure(step, warmup, iters, device, "gptrain", settle=trainer.settle)
        launches = count_launches(step, device, cfg.train.micro_batches_per_step(trainer.dp_size), trainer.settle)
    finally:
        trainer.settle()
        loader.close()
    dims = trainer.parts.dims
    tokens = cfg.train.global_batch_size * cfg.model.seq_length // dims.world_size  # per device
    impls = {"linear layers": trainer.linear_impl, "attention": trainer.attention_impl,
             "layout": f"dp {dims.dp} tp {dims.tp} pp {dims.pp}, " + trainer.parts.impls["parameters"]
             + (f"; pipeline: {trainer.parts.impls['pipeline']}" if dims.pp > 1 else "")
             + (f"; tensor parallel: {trainer.parts.impls['tensor parallel']}"
                if "tensor parallel" in trainer.parts.impls else "")
             + (f"; optimizer: {trainer.parts.impls['optimizer']}" if "optimizer" in trainer.parts.impls else ""),
             "launches": launches}
    dp = trainer.dp_size
    del trainer
    return cfg, device, timing, tokens, impls, dp


def bench_baseline(cfg, device, warmup: int, iters: int, compile_model: bool = True, dp: int = 1):
    """nanoGPT's recipe (torchtitan's Llama for a Llama-style config); under several processes, as nanoGPT runs it: compiled, then DDP, gradient
    synchronisation only on the last micro-batch."""
    m = cfg.model
    model = baseline_for(m).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(model) if compile_model else model
    if dp > 1:
        fwd = torch.nn.parallel.DistributedDataParallel(fwd, device_ids=[device] if device.type == "cuda" else None)
    mbs, n_micro = cfg.train.micro_batch_size, cfg.train.micro_batches_per_step(dp)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def step():
        for i in range(n_micro):
            batch = torch.randint(0, m.vocab_size, (mbs, m.seq_length + 1), generator=gen).to(device, non_blocking=True)
            sync = nullcontext() if dp == 1 or i == n_micro - 1 else fwd.no_sync()
            with sync, torch.autocast(device.type, dtype=torch.bfloat16):
                loss = fwd(batch[:, :-1], batch[:, 1:]) / n_micro
            with sync:
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    timing = measure(step, warmup, iters, device, "baseline")
    del model, opt
    return timing


def _levers(cfg, impls: dict[str, str]) -> str:
    p, m = cfg.precision, cfg.kernels
    params = f"{p.name} params + fp32 main params" if p.half_params else f"{p.name} autocast, fp32 params" \
        if p.name != "fp32" else "fp32"
    parts = [params, f"fp8 {p.fp8}/{p.fp8_recipe}" if p.fp8 else "no fp8",
             "fused chunked loss" if m.fused_cross_entropy else "plain loss",
             f"recompute {m.recompute}" if m.recompute else "no recompute",
             f"dropout {cfg.model.hidden_dropout}/{cfg.model.attention_dropout}", f"compile {cfg.train.compile}",
             *(f"{what} {impl}" for what, impl in impls.items() if what != "launches")]
    return ", ".join(parts)


def bench_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="gptrain bench", description=__doc__.splitlines()[0],
        epilog="Every other flag is a `gptrain train` flag (model shape, --micro-batch-size, --bf16/--fp16, "
               "--compile, --fp8, --fused-cross-entropy, --attention-backend, recompute ...) and sets up the "
               "gptrain side; the baseline takes the same shape and micro-batch. Data is synthetic.")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations first (compilation happens here)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations")
    p.add_argument("--no-baseline", action="store_true", help="time gptrain only")
    p.add_argument("--baseline-no-compile", action="store_true", help="run the baseline eagerly")
    simulate.add_flags(p)
    args, model_flags = p.parse_known_args(argv)
    try:  # a bad flag: one line, no traceback
        parse_megatron_args(model_flags + ["--mock-data", "--train-iters", str(args.iters)],
                            world_size=args.simulate_world_size or world_from_env()[0])
    except ValueError as err:
        print(f"gptrain bench: error: {str(err).replace('gptrain train --help', 'gptrain bench --help')}",
              file=sys.stderr)
        return 2
    with simulate.simulated_world(args.simulate_world_size, args.simulate_rank):
        try:
            return _bench(args, model_flags)
        finally:  # CUDA graphs before the communicators they captured: NCCL can hang at exit otherwise
            end_process_group()


def _bench(args, model_flags: list[str]) -> int:
    simulated = args.simulate_world_size is not None
    _progress("gptrain: building the model ...")
    cfg, device, timing, tokens, impls, dp = bench_gptrain(model_flags, args.warmup, args.iters)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    label = f"gptrain, simulated rank {args.simulate_rank} of {args.simulate_world_size}" if simulated \
        else "gptrain (train step)"
    rows = [(label, *timing)]
    if not args.no_baseline and not simulated:  # the baseline has no simulated layout
        rows.append((f"baseline (plain PyTorch, {model_kind(cfg.model)})" + (f", DDP x{dp}" if dp > 1 else ""),
                     *bench_baseline(cfg, device, args.warmup, args.iters, not args.baseline_no_compile, dp)))
    if not is_logging_rank():
        return 0
    datasheet = metrics.device_peak_tflops(device, cfg.train.peak_tflops)
    ceiling = matmul_ceiling_tflops(device)
    fpt = cfg.model.flops_per_token()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; model: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, seq "
          f"{cfg.model.seq_length}, {cfg.model.num_parameters():,} parameters; micro-batch "
          f"{cfg.train.micro_batch_size}, global batch {cfg.train.global_batch_size}, {cfg.precision.name}, "
          f"compile {cfg.train.compile}; {fpt / 1e9:.3f} GFLOP/token; matmul ceiling "
          f"{'n/a' if ceiling is None else f'{ceiling:.0f} TFLOP/s'}")
    print(f"gptrain levers: {_levers(cfg, impls)}")
    if simulated:
        print(f"simulated: rank {args.simulate_rank} of {args.simulate_world_size} alone, collectives returning at "
              f"once (no communication): the rank's own compute and host time; {impls['launches']}")
    print("| what | ms/iter | host ms/iter | tokens/s/device | TFLOP/s | MFU (datasheet) | MFU (matmul ceiling) "
          "| peak mem GiB (GB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, sec, host, mem in rows:
        tps = tokens / sec
        tflops = tps * fpt / 1e12
        mfu = f"{100 * tflops / datasheet:.1f}%" if datasheet else "n/a"
        mfu_c = f"{100 * tflops / ceiling:.1f}%" if ceiling else "n/a"
        memory = "n/a" if mem is None else f"{mem:.2f} ({mem * 2 ** 30 / 1e9:.2f})"
        print(f"| {label} | {1000 * sec:.1f} | {1000 * host:.1f} | {tps:,.0f} | {tflops:.1f} | {mfu} | {mfu_c} "
              f"| {memory} |")
    if len(rows) == 2:
        print(f"gptrain / baseline tokens/s: {rows[1][1] / rows[0][1]:.3f}x"
              + ("" if device.type == "cuda" else
                 f" (on {device.type}: both run without their GPU kernels, so this ratio means something "
                 "only on a GPU)"))
    return 0
