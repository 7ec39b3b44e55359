"""The host's side of ZeRO-Offload, measured: torch's fused CPU AdamW over fp32 parameters (what
``--cpu-offload`` runs on the host each step) at several thread counts, and the other passes an offload step
can make over the host's gradients and parameters (the gradient norm, casts between bf16 and fp32), DeepSpeed's
CPU Adam beside torch's where deepspeed is installed, and
the pinned host <-> GPU copy bandwidth of the step's gradient and parameter transfers, in fp32 and bf16; and
how much of the main thread a worker's AdamW leaves (the forward's operator calls beside it, the kernel called
on plain tensors or on DTensors, whose dispatch holds the GIL through the kernel); and
AdamW on a worker thread, as ``--overlap-cpu-optimizer-d2h-h2d`` runs it, beside what the main thread does
during the next forward: nothing, pure Python (the GIL), pinned copies to the GPU (host memory bandwidth),
small GPU kernels launched back to back (a core busy driving the GPU), waited for by spinning or by sleeping.

    python3 benchmarks/host_adamw.py [--params 500e6] [--threads 8 16 32] [--beside nothing python copies ...]

Beside each AdamW rate, the host memory bandwidth a streaming pass gets on as many threads: an AdamW well
below it is bound by its arithmetic, not by memory, and a faster kernel could help. Prints seconds per step
and the parameters per second each rate gives, so a step's host time for a model
of P parameters is about P / rate (the planner's OFFLOAD constants, gptrain/plan/timing.py, are per
parameter too).
"""
from __future__ import annotations

import argparse
import importlib.util
import time

import torch


def adamw_rate(n: int, threads: int, repeats: int = 3, deepspeed: bool = False) -> float:
    """Parameters per second of one fused CPU AdamW step over ``n`` fp32 parameters in 64 tensors (or of
    DeepSpeed's CPU Adam, its C++ kernel built on first use, with ``deepspeed``)."""
    torch.set_num_threads(threads)
    sizes = [n // 64] * 64
    params = [torch.randn(s).requires_grad_() for s in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    if deepspeed:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(params, lr=1e-4, weight_decay=0.1, adamw_mode=True)
    else:
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    opt.step()  # the moments allocated
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - start)
    return sum(sizes) / best


def stream_gbps(n: int, threads: int, repeats: int = 3) -> float:
    """GB/s of an in-place scale of ``n`` fp32 values (8 bytes an element: read and written), the host memory
    bandwidth a streaming pass gets: the ceiling of a memory-bound AdamW, which moves 28 bytes a parameter."""
    torch.set_num_threads(threads)
    a = torch.ones(n)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        a.mul_(1.0000001)
        best = min(best, time.perf_counter() - start)
    return 8 * n / best / 1e9


def pass_rate(n: int, what: str, repeats: int = 3) -> float:
    """Parameters per second of one host pass over ``n`` values in 64 tensors: ``norm`` (the fp32 gradients'
    L2 norm, torch._foreach_norm), ``upcast`` (bf16 -> fp32 into existing tensors) or ``downcast``."""
    sizes = [n // 64] * 64
    src = [torch.randn(s, dtype=torch.bfloat16 if what == "upcast" else torch.float32) for s in sizes]
    dst = [torch.empty(s, dtype=torch.float32 if what == "upcast" else torch.bfloat16) for s in sizes]
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        if what == "norm":
            torch.stack(torch._foreach_norm(src)).square().sum().sqrt().item()
        else:
            torch._foreach_copy_(dst, src)
        best = min(best, time.perf_counter() - start)
    return sum(sizes) / best


BESIDE = ("nothing", "python", "copies", "launches", "launches_blocking")


def adamw_beside(n: int, threads: int, beside: str, repeats: int = 3) -> tuple[float, float | None]:
    """Seconds of one fused CPU AdamW step over ``n`` fp32 parameters run on a worker thread while the main
    thread does ``beside`` until the worker is done: ``nothing`` (waits), ``python`` (a pure-Python loop),
    ``copies`` (pinned host -> GPU copies of 256 MiB), ``launches`` (tiny GPU kernels from Python, waited for
    as torch.cuda.synchronize waits: spinning), ``launches_blocking`` (the same, waited for on a blocking event).
    Returns the best step's seconds and, for ``copies``, the GB/s the main thread's copies ran at meanwhile
    (how much of the PCIe bandwidth the step leaves to the forward's copies in)."""
    import threading

    if beside not in BESIDE:
        raise ValueError(f"beside: one of {', '.join(BESIDE)}, not {beside!r}")
    torch.set_num_threads(threads)
    params = [torch.randn(n // 64).requires_grad_() for _ in range(64)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    opt.step()
    times: list[float] = []

    def worker():
        torch.set_num_threads(threads)  # a new thread's own OpenMP setting
        for _ in range(repeats):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)

    if beside == "copies":
        host = torch.empty(64 << 20, dtype=torch.float32, pin_memory=True)
        dev = torch.empty_like(host, device="cuda")
    elif beside.startswith("launches"):
        x = torch.zeros(1024, device="cuda")
    thread = threading.Thread(target=worker)
    copied, start = 0, time.perf_counter()
    thread.start()
    while thread.is_alive():
        if beside == "nothing":
            thread.join()
        elif beside == "python":
            sum(i * i for i in range(10_000))
        elif beside == "copies":
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            copied += host.numel() * host.element_size()
        elif beside in ("launches", "launches_blocking"):
            for _ in range(100):
                x.mul_(1.0001)
            if beside == "launches":
                torch.cuda.synchronize()  # CUDA's default wait: the main thread spins on its core
            else:
                done = torch.cuda.Event(blocking=True)  # the main thread sleeps until the kernels end
                done.record()
                done.synchronize()
    thread.join()
    return min(times), (copied / (time.perf_counter() - start) / 1e9 if beside == "copies" else None)


def main_thread_rate(n: int, threads: int, through: str, seconds: float = 0.3) -> float:
    """Operator calls per millisecond the main thread makes (each lets go of the GIL and takes it back, as the
    forward's do) while a worker thread runs fused AdamW over ``n`` parameters in 4 tensors, called
    ``through`` "plain" tensors, "dtensor" (FSDP2's parameters: the kernel inside DTensor's Python dispatch)
    or "nothing" (no worker: the main thread alone)."""
    import threading

    torch.set_num_threads(threads)
    params, created = [torch.zeros(n // 4) for _ in range(4)], False
    if through == "dtensor":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if not dist.is_initialized():
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
            created = True
        mesh = init_device_mesh("cpu", (1,))
        params = [distribute_tensor(p, mesh, [Shard(0)]) for p in params]
    params = [torch.nn.Parameter(p) for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    opt.step()
    stop = threading.Event()

    def worker():
        while not stop.is_set():
            opt.step()

    thread = threading.Thread(target=worker, daemon=True) if through != "nothing" else None
    try:
        if thread is not None:
            thread.start()
        x, calls, start = torch.zeros(4), 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            x.add_(1)
            calls += 1
        return calls / (1000 * (time.perf_counter() - start))
    finally:
        stop.set()
        if thread is not None and thread.is_alive():
            thread.join()
        if created:
            torch.distributed.destroy_process_group()


def copy_rate(nbytes: int, dtype: torch.dtype, to_device: bool, repeats: int = 5) -> float:
    """GB/s of one pinned host <-> GPU copy of ``nbytes``."""
    n = nbytes // torch.tensor([], dtype=dtype).element_size()
    host = torch.empty(n, dtype=dtype, pin_memory=True)
    dev = torch.empty(n, dtype=dtype, device="cuda")
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        (dev.copy_(host, non_blocking=True) if to_device else host.copy_(dev, non_blocking=True))
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=500e6)
    p.add_argument("--threads", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--beside", nargs="*", default=list(BESIDE), choices=BESIDE,
                   help="what the main thread does while a worker thread runs AdamW (copies, launches need a GPU)")
    p.add_argument("--beside-threads", type=int, nargs="*", default=None,
                   help="the worker's thread counts for the --beside rows (default: the largest of --threads)")
    args = p.parse_args()
    n = int(args.params)
    print(f"host: {torch.get_num_threads()} threads by default, torch {torch.__version__}")
    for t in args.threads:
        rate = adamw_rate(n, t)
        print(f"fused CPU AdamW, {n / 1e6:.0f}M fp32 parameters, {t} threads: {n / rate:.3f} s a step, "
              f"{rate / 1e9:.2f} G parameters/s ({28 * rate / 1e9:.0f} GB/s at 28 bytes a parameter; a streaming "
              f"pass on {t} threads: {stream_gbps(n, t):.0f} GB/s)")
    if importlib.util.find_spec("deepspeed") is not None:
        for t in args.threads:
            rate = adamw_rate(n, t, deepspeed=True)
            print(f"DeepSpeed's CPU Adam (AdamW mode), {n / 1e6:.0f}M fp32 parameters, {t} threads: {n / rate:.3f} s a "
                  f"step, {rate / 1e9:.2f} G parameters/s")
    torch.set_num_threads(max(args.threads))
    for what in ("norm", "upcast", "downcast"):
        rate = pass_rate(n, what)
        print(f"host pass '{what}', {n / 1e6:.0f}M values, {max(args.threads)} threads: {n / rate:.3f} s, "
              f"{rate / 1e9:.2f} G values/s")
    for threads in args.beside_threads or [max(args.threads)]:
        for beside in args.beside:
            if beside.startswith(("copies", "launches")) and not torch.cuda.is_available():
                continue
            seconds, gbps = adamw_beside(n, threads, beside)
            print(f"fused CPU AdamW on a worker thread, {n / 1e6:.0f}M parameters, {threads} threads, the main "
                  f"thread doing '{beside}': {seconds:.3f} s, {n / seconds / 1e9:.2f} G parameters/s"
                  + (f"; its copies meanwhile {gbps:.1f} GB/s" if gbps is not None else ""))
    for through in ("nothing", "plain", "dtensor"):
        rate = main_thread_rate(n, max(args.threads), through)
        print(f"main thread's operator calls beside fused CPU AdamW on a worker thread, {n / 1e6:.0f}M parameters, "
              f"{max(args.threads)} threads, called on {through if through != 'nothing' else '(no worker)'}"
              f"{' tensors' if through == 'plain' else 's' if through == 'dtensor' else ''}: {rate:,.1f} per ms")
    if torch.cuda.is_available():
        for dtype in (torch.float32, torch.bfloat16):
            for to_device in (True, False):
                gbps = copy_rate(2 << 30, dtype, to_device)
                print(f"pinned copy, 2 GiB {str(dtype).removeprefix('torch.')}, "
                      f"{'host -> GPU' if to_device else 'GPU -> host'}: {gbps:.1f} GB/s")


if __name__ == "__main__":
    main()
