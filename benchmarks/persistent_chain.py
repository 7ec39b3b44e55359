"""Can a persistent kernel hide a product's ramp by loading its next weights before it waits? A chain
of J matrix-vector products (2048 x 2048 bf16 weights, 8 MB each, J of them: past L2), each one's
output the next one's input, one row: as J kernels in a CUDA graph (each program loads its tile when it
starts), and as one persistent launch (a program per 16 rows of every weight; a grid barrier with a
count that only grows between products) that loads its tile of product j + 1 before it waits for
product j's output (preload) or after (no preload), and asks L2 for its tiles of the products 1 or 2
further on (a `prefetch.global.L2` a line). Time a product, and the output against torch.

    python3 benchmarks/persistent_chain.py
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from decode_speed import replay_ms
from grid_barrier import _acquire_load, _arrive


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs.to(tl.int64)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def stage_kernel(w_ptr, x_ptr, y_ptr, N: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.arange(0, N)
    w = tl.load(w_ptr + rows[:, None] * N + cols[None, :])
    x = tl.load(x_ptr + cols)
    tl.store(y_ptr + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1))


@triton.jit
def chain_kernel(w_ptr, xs_ptr, count_ptr, J, N: tl.constexpr, BN: tl.constexpr, PRELOAD: tl.constexpr,
                 AHEAD_L2: tl.constexpr):
    pid, programs = tl.program_id(0), tl.num_programs(0)
    rows = pid * BN + tl.arange(0, BN)
    cols = tl.arange(0, N)
    tile = rows[:, None] * N + cols[None, :]
    lines = pid * BN * N * 2 + tl.arange(0, BN * N * 2 // 128) * 128  # this program's tile, by 128-byte line
    w = tl.load(w_ptr + tile)
    if AHEAD_L2 > 0:
        for a in range(1, AHEAD_L2 + 1):
            _prefetch_l2(w_ptr.to(tl.pointer_type(tl.int8), bitcast=True) + a * N * N * 2 + lines)
    for j in range(J):
        if j > 0:
            while _acquire_load(count_ptr) < j * programs:
                pass
            if not PRELOAD:
                w = tl.load(w_ptr + j * N * N + tile)
        x = tl.load(xs_ptr + j * N + cols, cache_modifier=".cg")
        tl.store(xs_ptr + (j + 1) * N + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1))
        tl.debug_barrier()
        _arrive(count_ptr)
        if AHEAD_L2 > 0:  # the tile AHEAD_L2 + 1 products on, into L2
            if j + 1 + AHEAD_L2 < J:
                _prefetch_l2(w_ptr.to(tl.pointer_type(tl.int8), bitcast=True) + (j + 1 + AHEAD_L2) * N * N * 2 + lines)
        if PRELOAD:
            if j + 1 < J:
                w = tl.load(w_ptr + (j + 1) * N * N + tile)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, nargs="+", default=[2048, 1024])
    for n in parser.parse_args().n:
        chain(n, n * 16 // 2048 if n >= 1024 else 8)


def chain(N: int, BN: int) -> None:
    print(f"{N} x {N} weights ({N * N * 2 / 1e6:.1f} MB), {N // BN} programs of {BN} rows:", flush=True)
    dev = "cuda"
    torch.manual_seed(0)
    J = 48
    ws = torch.randn(J, N, N, device=dev, dtype=torch.bfloat16) * N ** -0.5
    x0 = torch.randn(N, device=dev)
    reference = x0.double()
    for j in range(J):
        reference = ws[j].double() @ reference
    programs = N // BN

    xs = torch.zeros(J + 1, N, device=dev)
    xs[0] = x0

    def stages():
        for j in range(J):
            stage_kernel[(programs,)](ws[j], xs[j], xs[j + 1], N=N, BN=BN, num_warps=8)

    err, us = checked_us(stages, xs[J], reference)
    print(f"J kernels in a graph: {us / J:.2f} us a product ({N * N * 2 * J / us / 1e3:.0f} GB/s); "
          f"relative error {err:.1e}", flush=True)
    count = torch.zeros(1, device=dev, dtype=torch.int32)
    for preload, ahead in ((True, 0), (False, 0), (True, 1)):
        def persistent():
            count.zero_()
            chain_kernel[(programs,)](ws, xs, count, J, N=N, BN=BN, PRELOAD=preload, AHEAD_L2=ahead, num_warps=8)

        xs[1:].zero_()
        err, us = checked_us(persistent, xs[J], reference)
        print(f"one persistent launch, {'preload' if preload else 'no preload'}, L2 prefetch {ahead} further: "
              f"{us / J:.2f} us a product ({N * N * 2 * J / us / 1e3:.0f} GB/s); relative error {err:.1e}", flush=True)


def checked_us(run, out: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """``run``'s output against the float64 reference (relative to its largest entry), then the
    microseconds of one replay of ``run`` captured as a CUDA graph."""
    run()
    torch.cuda.synchronize()
    err = (out.double() - reference).abs().max().item() / reference.abs().max().item()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return err, 1e3 * replay_ms(graph, reps=20)


if __name__ == "__main__":
    main()
