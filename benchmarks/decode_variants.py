"""Batch-1 and batch-32 decode step variants of the 345M GPT (bf16, random init) on one GPU: one
step's CUDA graph replayed at the 256-position attention bucket (CUDA events), for the eager step,
the compiled block tails (compile="tail") and the compiled whole block step (compile="block") with
its matrix products as fused reductions (gemv) or cuBLAS, attention as fused reductions or SDPA,
and torch.compile's default mode (coordinate-descent tuning) or max-autotune-no-cudagraphs.

    python3 benchmarks/decode_variants.py [--budget-s 230] [--generate]
"""
from __future__ import annotations

import argparse
import time

import torch

from gptrain.inference.fast import Decoder, Mode, _compiled_steps
from gptrain.model.gpt import GPT, GPTConfig

VARIANTS = {
    1: [("eager", {}), ("block gemv", {"compile": "block", "gemv": True}),
        ("block gemv sdpa", {"compile": "block", "gemv": True, "sdpa": True}),
        ("tail", {"compile": "tail"}),
        ("block cublas", {"compile": "block", "gemv": False}),
        ("block gemv max-autotune-no-cudagraphs", {"compile": "block", "gemv": True,
                                                   "compile_mode": "max-autotune-no-cudagraphs"})],
    32: [("eager", {}), ("block cublas", {"compile": "block", "gemv": False}),
         ("block cublas sdpa", {"compile": "block", "gemv": False, "sdpa": True}),
         ("tail", {"compile": "tail"}),
         ("block gemv", {"compile": "block", "gemv": True})],
}


def replay_ms(decoder: Decoder, length: int, reps: int = 100) -> tuple[float, float]:
    begin = time.perf_counter()
    graph = decoder._graph(Mode(), length)
    build = time.perf_counter() - begin
    decoder.position.fill_(100)
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        decoder.position.fill_(100)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            graph.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / reps)
    return best, build


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=230.0)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--only", nargs="*", default=None, help="variant names to run")
    args = p.parse_args()
    start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = True
    model = GPT(GPTConfig(hidden_dropout=0.0, attention_dropout=0.0))
    model.init_weights(1234)
    model = model.to("cuda", torch.bfloat16).eval()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    order = [(b, name, kw) for i in range(max(len(v) for v in VARIANTS.values()))
             for b in args.batches for name, kw in VARIANTS[b][i:i + 1]]
    for b, name, kw in order:
        if args.only and name not in args.only:
            continue
        if time.perf_counter() - start > args.budget_s:
            print(f"batch {b:3d} {name}: skipped (budget)", flush=True)
            continue
        try:
            if kw.get("compile_mode"):
                import torch._inductor.config as inductor_config

                inductor_config.coordinate_descent_tuning = True
            decoder = Decoder(model, b, **kw)
            ms, build = replay_ms(decoder, args.length)
            print(f"batch {b:3d} {name:40s}: {ms:.4f} ms/step, {b / ms * 1e3:10.1f} tokens/s "
                  f"(L={args.length}; compile and capture {build:.1f} s)", flush=True)
            del decoder
        except Exception as err:  # noqa: BLE001
            print(f"batch {b:3d} {name}: failed: {type(err).__name__}: {str(err)[:400]}", flush=True)
    print(f"total {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
