"""Tile sweep of the fused decode step's matrix-vector kernel (kernels/decode.py) on the 345M's weight
shapes, in bf16, at 1 and 32 rows: microseconds per call and the weight bytes per second it reaches,
next to cuBLAS's linear at the same shapes. Each timing runs the kernel over enough copies of the
weight to exceed the L2 cache (as a decode step streams the model from memory), in a CUDA graph
(no launch gaps), and divides.

    python3 benchmarks/decode_kernels.py [--quick] [--json TILES.json]

Prints, per shape, the best tiles at 1 row (with their time at 32 rows) and the TILES table;
``--json`` writes it for ``decode_speed.py --tiles``. Tiles never depend on the rows (batch
invariance), so one setting serves both.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton.testing

from gptrain.kernels import decode

SHAPES = {"qkv": (3072, 1024), "proj": (1024, 1024), "fc1": (4096, 1024), "fc2": (1024, 4096),
          "head": (50257, 1024)}


L2_BYTES = 64 << 20  # more than an H100's 50 MB L2


def time_us(fn, copies: int) -> float:
    """Microseconds per call of ``fn(i)`` over copies i = 0 .. copies-1, in one CUDA graph."""
    return 1e3 * triton.testing.do_bench_cudagraph(lambda: [fn(i) for i in range(copies)], rep=25) / copies


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer tiles")
    p.add_argument("--json", help="write the best tiles here")
    p.add_argument("--wide", action="store_true", help="wide input steps only (512 or 1024 inputs a step)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--no-attention", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    grid = dict(BLOCK_N=[16, 32, 64], BLOCK_K=[64, 128, 256], num_warps=[2, 4, 8], num_stages=[2, 3, 4, 5],
                SPLIT=[1, 2, 4, 8])
    if args.quick:
        grid = dict(BLOCK_N=[16, 32, 64], BLOCK_K=[128, 256], num_warps=[4], num_stages=[3, 4], SPLIT=[1, 2, 4])
    if args.wide:
        grid = dict(BLOCK_N=[16, 32], BLOCK_K=[512, 1024], num_warps=[4, 8], num_stages=[1, 2], SPLIT=[1, 2, 4])
    best_table = {}
    for name, (n, k) in SHAPES.items():
        if name not in args.shapes:
            continue
        copies = max(1, -(-L2_BYTES // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        b = torch.randn(n, device=dev, dtype=torch.bfloat16)
        ln = torch.nn.LayerNorm(k, device=dev, dtype=torch.bfloat16)
        xs = {m: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for m in (1, 32)}
        kw = {"bias": b, "ln": ln} if k == 1024 and name != "proj" else {"bias": b}
        if name == "head":
            kw = {"ln": ln}
        results = []
        for values in itertools.product(*grid.values()):
            tiles = dict(zip(grid, values))
            if tiles["BLOCK_N"] * tiles["BLOCK_K"] > 16384 and tiles["num_stages"] > 3:
                continue
            if k % (tiles["SPLIT"] * tiles["BLOCK_K"]) or (tiles["SPLIT"] > 1 and (n > 8192 or "ln" in kw)):
                continue  # (a LayerNorm's kernel never splits its input)
            decode.TILES[(n, k)] = tiles
            try:
                t1 = time_us(lambda i: decode.ln_linear(xs[1], ws[i], **kw), copies)
                t32 = time_us(lambda i: decode.ln_linear(xs[32], ws[i], **kw), copies)
            except Exception as err:  # noqa: BLE001 - out of shared memory and the like: skip the tile
                print(f"  {name} {tiles}: {type(err).__name__}", flush=True)
                continue
            results.append((t1, t32, tiles))
        del decode.TILES[(n, k)]
        results.sort(key=lambda r: r[0] + r[1] / 8)  # batch 1 first, batch 32 counted lightly
        gb = n * k * 2 / 1e9
        cublas1 = time_us(lambda i: torch.nn.functional.linear(xs[1], ws[i], kw.get("bias")), copies)
        cublas32 = time_us(lambda i: torch.nn.functional.linear(xs[32], ws[i], kw.get("bias")), copies)
        print(f"{name} ({n} x {k}, {gb * 1e3:.1f} MB): cuBLAS linear alone {cublas1:.1f} us at 1 row "
              f"({gb / cublas1 * 1e6:.0f} GB/s), {cublas32:.1f} us at 32", flush=True)
        for t1, t32, tiles in results[:5]:
            print(f"  {tiles}: {t1:.1f} us at 1 row ({gb / t1 * 1e6:.0f} GB/s), {t32:.1f} us at 32", flush=True)
        default = decode.tiles(n, k)
        t1 = time_us(lambda i: decode.ln_linear(xs[1], ws[i], **kw), copies)
        t32 = time_us(lambda i: decode.ln_linear(xs[32], ws[i], **kw), copies)
        print(f"  default {default}: {t1:.1f} us at 1 row, {t32:.1f} us at 32", flush=True)
        best_table[(n, k)] = results[0][2]
    print("TILES =", best_table, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([[list(shape), t] for shape, t in best_table.items()], f)
    if args.no_attention:
        return
    # attention: one layer at batch 1 and 32, positions 288 (the decode benchmark's end) and 1000
    default_chunk = decode.ATTENTION_CHUNK
    for chunk in (32, 64, 128):
        decode.ATTENTION_CHUNK = chunk
        for rows in (1, 32):
            for pos in (40, 100, 288, 1000):
                kv = torch.randn(2, rows, 16, 1024, 64, device=dev, dtype=torch.bfloat16)
                qkv = torch.randn(rows, 3072, device=dev, dtype=torch.bfloat16)
                positions = torch.full((rows,), pos, device=dev)
                t = time_us(lambda i: decode.decode_attention(qkv, kv, positions), 1)
                print(f"attention, chunks of {chunk}, {rows} rows at position {pos}: {t:.1f} us", flush=True)
    decode.ATTENTION_CHUNK = default_chunk


if __name__ == "__main__":
    main()
