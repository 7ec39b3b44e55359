"""Where one training step's device time goes: torch.profiler over a few real ``Trainer.train_step``
calls after warm-up, kernels grouped into matmul / attention / communication / loss / optimizer /
other; and whether the host keeps up: wall time per step against device time, host syncs, eager
DTensor dispatches and compiled-region calls per step. Under torchrun rank 0 prints.

    python benchmarks/profile_step.py --micro-batch-size 16 --bf16 --compile [model flags]
    torchrun --nproc-per-node 2 benchmarks/profile_step.py ... --tensor-model-parallel-size 2
    python benchmarks/profile_step.py ... --tensor-model-parallel-size 2 --simulate-world-size 2  # one rank alone

PROFILE_TRACE=path.json.gz also writes the profiled steps' Chrome trace (host threads and GPU streams);
PROFILE_RANKS=all: every rank reports, in turn (a pipeline's stages).
"""
import gzip
import math
import os
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from gptrain.bench import synthetic_trainer
from gptrain.parallel import simulate

M345 = ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
        "--max-position-embeddings 1024 --hidden-dropout 0 --attention-dropout 0").split()


def category(name: str) -> str:
    n = name.lower()
    if "nccl" in n or "allreduce" in n or "allgather" in n or "reducescatter" in n:
        return "communication (NCCL)"
    if "memcpy" in n:  # the copy engines: --tp-comm-copy-engine's trades (and any other copy the step makes)
        return "communication (memcpy, copy engines)"
    if "barrier" in n:  # symmetric memory's barrier kernels between the copy engines' transfers
        return "communication (barrier kernels)"
    if any(k in n for k in ("gemm", "cutlass", "sm90_xmma", "nvjet", "matmul", "_mm_", "cublas")):
        return "matmul"
    if any(k in n for k in ("flash", "fmha", "cudnn", "attention", "sdpa")):
        return "attention"
    if any(k in n for k in ("adam", "foreach", "multi_tensor", "norm_kernel", "lpnorm")):
        return "optimizer/grad norm"
    if "embedding" in n or "index" in n or "sort" in n or "scatter" in n:
        return "embedding/index"
    if n.startswith("triton"):
        return "triton (fused elementwise/LN/loss)"
    if "copy" in n or "elementwise" in n or "cast" in n or "fill" in n:
        return "copies/casts/fills"
    return "other"


def _union(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def timeline(prof, steps: int) -> None:
    """GPU time split into compute busy, communication alone (nothing else running) and idle (waiting
    for the host) over the profiled steps: says whether a step is compute-, comm- or host-bound."""
    kernels = [(e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
               for e in prof.profiler.kineto_results.events() if e.device_type() == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return
    comm = [(a, b) for a, b, n in kernels if category(n).startswith("communication")]
    compute = [(a, b) for a, b, n in kernels if not category(n).startswith("communication")]
    span = max(b for _, b, _ in kernels) - min(a for a, _, _ in kernels)
    busy_all, busy_compute = _union([(a, b) for a, b, _ in kernels]), _union(compute)
    ms = lambda ns: ns / steps / 1e6  # noqa: E731
    print(f"GPU timeline per step: span {ms(span):.1f} ms, compute kernels busy {ms(busy_compute):.1f} ms, "
          f"communication alone {ms(busy_all - busy_compute):.1f} ms, idle {ms(span - busy_all):.1f} ms "
          f"({len(comm) / steps:.0f} communication kernels per step, {ms(_union(comm)):.1f} ms in them)")
    # the idle time by the length of its gaps: a pipeline's bubble is a few long gaps, waits on the host many short
    gaps, end = [], None
    for a, b in sorted((a, b) for a, b, _ in kernels):
        if end is not None and a > end:
            gaps.append(a - end)
        end = b if end is None else max(end, b)
    for lo, hi in ((0, 1e5), (1e5, 1e6), (1e6, 1e7), (1e7, math.inf)):
        sel = [g for g in gaps if lo <= g < hi]
        print(f"  idle gaps {lo / 1e6:g}-{hi / 1e6:g} ms: {len(sel) / steps:.0f} a step, {ms(sum(sel)):.1f} ms")


def write_trace(prof, path: str) -> None:
    """The Chrome trace, gzipped when the path ends in .gz (a multi-second step's trace is tens of MB)."""
    plain = path.removesuffix(".gz")
    prof.export_chrome_trace(plain)
    if plain != path:
        with open(plain, "rb") as src, gzip.open(path, "wb") as dst:
            dst.write(src.read())
        os.remove(plain)
    print(f"trace written to {path}")


def main(argv):
    steps = 3
    trainer, loader = synthetic_trainer(M345 + argv, 100)
    cuda = trainer.device.type == "cuda"
    device_sync = torch.cuda.synchronize if cuda else (lambda: None)

    def sync():  # the device, and an optimizer step still on the host's thread (--overlap-cpu-optimizer-d2h-h2d)
        trainer.settle()
        device_sync()
    for _ in range(6):
        trainer.train_step(loader)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(loader)
    sync()
    wall = (time.perf_counter() - start) / steps
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            trainer.train_step(loader)
        sync()
    loader.close()
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0 and os.environ.get("PROFILE_RANKS") != "all":
        return
    if os.environ.get("PROFILE_RANKS") == "all":  # every rank's report (a pipeline's stages differ), one after another
        for r in range(int(os.environ.get("WORLD_SIZE", "1"))):
            if r == rank:
                print(f"== rank {rank}", flush=True)
                _report(prof, wall, steps, cuda, f".rank{rank}")
                sys.stdout.flush()
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
        return
    _report(prof, wall, steps, cuda)


def _report(prof, wall: float, steps: int, cuda: bool, suffix: str = "") -> None:
    if os.environ.get("PROFILE_TRACE"):
        path = os.environ["PROFILE_TRACE"]
        write_trace(prof, path.replace(".json", f"{suffix}.json") if suffix else path)
    host = {e.key: e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU}
    print(f"wall time per step (unprofiled): {wall * 1000:.1f} ms")
    for key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "aten::item",
                "aten::nonzero", "PythonSubclass", "CompiledFunction", "CompiledFunctionBackward",
                "Torch-Compiled Region", "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"):
        matches = sum(n for k, n in host.items() if k.startswith(key))
        print(f"host per step: {key}: {matches / steps:.1f}")
    if cuda:
        timeline(prof, steps)
        print("top host operations (self CPU time per step):")
        cpu = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
        for e in sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:25]:
            print(f"{e.self_cpu_time_total / steps / 1000:8.2f} ms/step {e.count // steps:5d}x  {e.key[:110]}")
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = [e for e in prof.key_averages() if e.device_type == kind]
    if not cuda:  # on the CPU the "kernels" are operators; only a smoke check of the script
        for e in events:
            e.self_device_time_total = e.self_cpu_time_total
    total = sum(e.self_device_time_total for e in events)
    groups = defaultdict(float)
    for e in events:
        groups[category(e.key)] += e.self_device_time_total
    print(f"device time per step: {total / steps / 1000:.1f} ms ({len(events)} distinct kernels)")
    print("| group | ms/step | share |")
    print("| --- | --- | --- |")
    for g, t in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"| {g} | {t / steps / 1000:.2f} | {100 * t / total:.1f}% |")
    print("\ntop kernels:")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:30]:
        print(f"{e.self_device_time_total / steps / 1000:8.2f} ms/step {e.count // steps:5d}x  "
              f"[{category(e.key)}] {e.key[:110]}")


if __name__ == "__main__":
    world, rank, rest = simulate.split_flags(sys.argv[1:])
    with simulate.simulated_world(world, rank):
        main(rest)
