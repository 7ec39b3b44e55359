"""What a grid-wide barrier costs inside one persistent Triton kernel (one program a multiprocessor),
by how the waiting programs watch the flag: an atomic read (session 11's barrier), a volatile load,
or an acquire load (PTX ``ld.acquire.gpu``); or with a count that only grows (no reset: each program
adds one, by an atomic or by a ``red`` that returns nothing, and waits for the round's total). One launch of ``ITER``
barriers against one of none, timed with CUDA events; each mode also checks that no program got
past a barrier early (a checking launch: every program adds to a counter per round; a program reading a round's
count short of the grid is an error; the timed launches do not count).

    python3 benchmarks/grid_barrier.py
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _acquire_load(ptr):
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", [ptr.to(tl.int64)],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _arrive(ptr):  # one thread of the program adds one, by a reduction that returns nothing
    tl.inline_asm_elementwise("{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                              "@p red.release.gpu.global.add.u32 [$1], 1; mov.u32 $0, 0; }", "=r,l",
                              [ptr.to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def barrier_kernel(count_ptr, flag_ptr, rounds_ptr, errors_ptr, ITER: tl.constexpr, MODE: tl.constexpr,
                   CHECK: tl.constexpr):
    programs = tl.num_programs(0)
    for i in range(ITER):
        if CHECK:
            tl.atomic_add(rounds_ptr + i, 1, sem="relaxed")
        tl.debug_barrier()
        if MODE >= 3:  # a count that only grows: arrive without waiting for the add, wait for the round's total
            target = (i + 1) * programs
            if MODE == 3:
                tl.atomic_add(count_ptr, 1, sem="release")
            else:
                _arrive(count_ptr)
            while _acquire_load(count_ptr) < target:  # spin until the round's total has arrived
                pass
        else:
            generation = tl.atomic_add(flag_ptr, 0, sem="acquire")
            if tl.atomic_add(count_ptr, 1, sem="acq_rel") == programs - 1:
                tl.atomic_xchg(count_ptr, 0, sem="relaxed")
                tl.atomic_add(flag_ptr, 1, sem="release")
            elif MODE == 0:
                while tl.atomic_add(flag_ptr, 0, sem="acquire") == generation:
                    pass
            elif MODE == 1:
                while tl.load(flag_ptr, volatile=True) == generation:
                    pass
                tl.atomic_add(flag_ptr, 0, sem="acquire")
            else:
                while _acquire_load(flag_ptr) == generation:
                    pass
        tl.debug_barrier()
        if CHECK:
            seen = tl.atomic_add(rounds_ptr + i, 0, sem="relaxed")
            tl.atomic_add(errors_ptr, (seen < programs).to(tl.int32), sem="relaxed")


def main() -> None:
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    iters = 2000
    for mode, name in enumerate(("atomic read", "volatile load", "ld.acquire.gpu", "growing count, atomic",
                                 "growing count, red")):
        times = {}
        for n in (0, iters):
            count = torch.zeros(1, device=dev, dtype=torch.int32)
            flag = torch.zeros(1, device=dev, dtype=torch.int32)
            rounds = torch.zeros(max(n, 1), device=dev, dtype=torch.int32)
            errors = torch.zeros(1, device=dev, dtype=torch.int32)
            barrier_kernel[(sms,)](count, flag, rounds, errors, ITER=n, MODE=mode, CHECK=True, num_warps=4)
            torch.cuda.synchronize()
            early = int(errors.item())
            best = float("inf")
            for _ in range(5):
                count.zero_()
                flag.zero_()
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                barrier_kernel[(sms,)](count, flag, rounds, errors, ITER=n, MODE=mode, CHECK=False, num_warps=4)
                end.record()
                torch.cuda.synchronize()
                best = min(best, begin.elapsed_time(end) * 1e3)
            times[n] = (best, early)
        per = (times[iters][0] - times[0][0]) / iters
        print(f"{name:16s}: {per:.2f} us a barrier over {sms} programs ({iters} in one launch: "
              f"{times[iters][0]:.0f} us; empty launch {times[0][0]:.1f} us); early passes: {times[iters][1]}", flush=True)


if __name__ == "__main__":
    main()
