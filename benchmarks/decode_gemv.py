"""The decode step's block products on the CUDA cores (``gemv_kernel``, the single-stream decoder's: a
program's whole weight tile loaded at once, its rows in turn) against the tensor-core kernel
(``ln_linear_kernel``), on the 345M's shapes with the step's epilogues, bf16, at 1 and 32 rows, weights
cold in L2, in CUDA graphs (us); the CUDA-core kernel at 8, 16 and 32 output columns a program.

    python3 benchmarks/decode_gemv.py
"""
from __future__ import annotations

import torch

from gptrain.kernels import decode

from decode_kernels import L2_BYTES, time_us

STEP = {"qkv": (3072, 1024, "ln"), "proj": (1024, 1024, "residual"), "fc1": (4096, 1024, "ln gelu"),
        "fc2": (1024, 4096, "residual")}


def main() -> None:
    dev = "cuda"
    torch.manual_seed(0)
    for name, (n, k, epilogue) in STEP.items():
        copies = max(1, -(-L2_BYTES // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        kw = {"bias": torch.randn(n, device=dev, dtype=torch.bfloat16)}
        if "ln" in epilogue:
            kw["ln"] = torch.nn.LayerNorm(k, device=dev, dtype=torch.bfloat16)
        kw["gelu"] = "gelu" in epilogue
        x = torch.randn(32, k, device=dev, dtype=torch.bfloat16)
        res = torch.randn(32, n, device=dev, dtype=torch.bfloat16)
        line = f"{name} ({n} x {k}, {epilogue}):"
        for label, gemv, block_n in [("tensor cores", False, 8)] + [(f"CUDA cores, {bn} columns a program", True, bn)
                                                                   for bn in (8, 16, 32)]:
            decode.GEMV_BLOCK_N[n] = block_n
            times = []
            for m in (1, 32):
                extra = {"residual": res[:m]} if epilogue == "residual" else {}
                times.append(time_us(lambda i: decode.ln_linear(x[:m], ws[i], gemv=gemv, **kw, **extra), copies))
            line += f"\n  {label:34s}: {times[0]:6.2f} us at 1 row, {times[1]:6.2f} us at 32"
        decode.GEMV_BLOCK_N.clear()
        print(line, flush=True)


if __name__ == "__main__":
    main()
