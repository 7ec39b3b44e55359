"""Per-shape time of the 345M's decode-step matrix products on one GPU, bf16, through CUDA graphs
(launch cost excluded): F.linear with bias (cuBLASLt epilogue), without bias, and the bias added
after, for M = 1 .. 64 rows. Prints microseconds and the weight bytes' share of peak bandwidth.

    python3 benchmarks/decode_gemm.py
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def graph_time(fn, reps: int = 50) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (10 * reps)


def main() -> None:
    torch.manual_seed(0)
    print("device:", torch.cuda.get_device_name(), "torch", torch.__version__)
    shapes = {"qkv": (3072, 1024), "proj": (1024, 1024), "fc1": (4096, 1024), "fc2": (1024, 4096), "head": (50304, 1024)}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for m in (1, 8, 32, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bias = graph_time(lambda: F.linear(x, w, b))
            t_plain = graph_time(lambda: F.linear(x, w))
            t_sep = graph_time(lambda: F.linear(x, w) + b)
            t_mv = graph_time(lambda: torch.mv(w, x[0])) if m == 1 else float("nan")
            gbs = w.numel() * 2 / (min(t_bias, t_plain) * 1e-6) / 1e9
            print(f"{name:5} N={n:5} K={k:5} M={m:3}: bias {t_bias:7.2f} us, no bias {t_plain:7.2f} us, "
                  f"+bias after {t_sep:7.2f} us, mv {t_mv:7.2f} us; best {gbs:6.0f} GB/s of weights")


if __name__ == "__main__":
    main()
