"""Where a decode matrix-vector kernel's time goes on the 345M's shapes (bf16, one row, weights cold
in L2, in CUDA graphs as benchmarks/decode_kernels.py times them): the fused kernel with and without
its LayerNorm prologue, an empty kernel (the launch floor), and a plain streaming read of the same
bytes (the memory floor for one kernel); the fused kernel at 1 and 32 rows.

    python3 benchmarks/decode_floor.py
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gptrain.kernels import decode

from decode_kernels import L2_BYTES, SHAPES, time_us


@triton.jit
def empty_kernel(x_ptr):
    pass


@triton.jit
def stream_kernel(w_ptr, out_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(STEPS):
        at = (pid * STEPS + s) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + at, mask=at < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def main() -> None:
    dev = "cuda"
    torch.manual_seed(0)
    x1 = torch.zeros(1, device=dev)
    print(f"empty kernel: {time_us(lambda i: empty_kernel[(1,)](x1), 64):.2f} us; "
          f"on 132 programs: {time_us(lambda i: empty_kernel[(132,)](x1), 64):.2f} us", flush=True)
    for name, (n, k) in SHAPES.items():
        copies = max(1, -(-L2_BYTES // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        b = torch.randn(n, device=dev, dtype=torch.bfloat16)
        ln = torch.nn.LayerNorm(k, device=dev, dtype=torch.bfloat16)
        x = torch.randn(32, k, device=dev, dtype=torch.bfloat16)
        line = f"{name} ({n} x {k}):"
        for rows in (1, 32):
            for label, kw in (("with LN", {"ln": ln, "bias": b}), ("no LN", {"bias": b})):
                line += f" {rows} row(s) fused {label} {time_us(lambda i: decode.ln_linear(x[:rows], ws[i], **kw), copies):.2f} us;"
        x = x[:1]
        line += f" cuBLAS {time_us(lambda i: torch.nn.functional.linear(x, ws[i], b), copies):.2f} us;"
        numel = n * k
        out = torch.empty(4096, device=dev)
        for block, steps in ((1024, 8), (2048, 8), (4096, 4), (1024, 32)):
            programs = triton.cdiv(numel, block * steps)
            if programs > 4096:
                continue
            t = time_us(lambda i: stream_kernel[(programs,)](ws[i], out, numel, BLOCK=block, STEPS=steps, num_warps=4),
                        copies)
            line += f" stream {programs} programs x {block * steps * 2 // 1024} KB: {t:.2f} us ({numel * 2 / t / 1e3:.0f} GB/s);"
        print(line, flush=True)


if __name__ == "__main__":
    main()
