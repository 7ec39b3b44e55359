"""The fused decode step with the weights to come asked of L2 ahead of the products that read them: from a
side stream (a prefetch or a load per unit, 1 or 2 products ahead), or by the products themselves
the next product's weights once its own are asked for ("end") or first thing ("start"), and/or the
attention kernel (latency-bound: the memory idles) asking for the output projection's or FC1's.
345M bf16 random init, 32-token prompt; per plan: the step graph early and late at batch 1, at
batch 32, a 256-token batch-1 request's tokens/s, and whether its greedy tokens equal the plan
without prefetch. First, how many bulk prefetches each compiled kernel holds.

    python3 benchmarks/decode_prefetch.py
"""
from __future__ import annotations

import time

import torch

from gptrain.inference import rows as rows_mod
from gptrain.inference.fast import Mode
from gptrain.inference.generate import SamplingParams
from gptrain.inference.rows import fused_generate, row_decoder_for
from gptrain.kernels import decode
from gptrain.model.gpt import GPT, GPTConfig

from decode_kernels import L2_BYTES, time_us
from decode_speed import replay_ms

OFF = {"rows.PREFETCH_PRODUCTS": False, "rows.PREFETCH_IN_ATTENTION": 0, "rows.STREAM_AHEAD": 0,
       "decode.PREFETCH_AT_END": True, "decode.STREAM_PROGRAMS": 32, "decode.STREAM_LOAD": False,
       "decode.STREAM_GRAIN": 128}
PLANS = {
    "off": {},
    "side stream 1 ahead, 32 programs": {"rows.STREAM_AHEAD": 1},
    "side stream 1 ahead, 132 programs": {"rows.STREAM_AHEAD": 1, "decode.STREAM_PROGRAMS": 132},
    "side stream 2 ahead, 32 programs": {"rows.STREAM_AHEAD": 2},
    "side stream 1 ahead, 32 programs, 32-byte grain": {"rows.STREAM_AHEAD": 1, "decode.STREAM_GRAIN": 32},
    "side stream 1 ahead, loads, 32 programs": {"rows.STREAM_AHEAD": 1, "decode.STREAM_LOAD": True},
    "side stream 1 ahead, loads, 132 programs": {"rows.STREAM_AHEAD": 1, "decode.STREAM_LOAD": True,
                                                 "decode.STREAM_PROGRAMS": 132},
    "side stream 2 ahead, loads, 66 programs": {"rows.STREAM_AHEAD": 2, "decode.STREAM_LOAD": True,
                                                "decode.STREAM_PROGRAMS": 66},
    "products at end (in-kernel)": {"rows.PREFETCH_PRODUCTS": True},
}


def apply(plan: dict) -> None:
    for key, value in {**OFF, **plan}.items():
        module, name = key.split(".")
        setattr(rows_mod if module == "rows" else decode, name, value)


def prefetch_instructions() -> str:
    found = []
    for fn in decode._kernels():
        for cache in getattr(fn, "device_caches", {}).values():
            for part in (cache if isinstance(cache, tuple) else (cache,)):
                if isinstance(part, dict):
                    for compiled in part.values():
                        ptx = getattr(compiled, "asm", {}).get("ptx", "")
                        if ptx:
                            found.append(f"{fn.__name__}:{ptx.count('prefetch.global.L2')}")
    return " ".join(found)


def l2_bound() -> None:
    """Each block product at one row with its weights hot in L2 (one copy, called again and again)
    against cold (enough copies to pass L2): what a perfect prefetch could save at most."""
    dev = "cuda"
    for name, (n, k, with_ln) in {"qkv": (3072, 1024, True), "proj": (1024, 1024, False),
                                  "fc1": (4096, 1024, True), "fc2": (1024, 4096, False)}.items():
        copies = max(1, -(-L2_BYTES // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        b = torch.randn(n, device=dev, dtype=torch.bfloat16)
        ln = torch.nn.LayerNorm(k, device=dev, dtype=torch.bfloat16) if with_ln else None
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        hot = time_us(lambda i: decode.ln_linear(x, ws[0], b, ln=ln), 8)
        cold = time_us(lambda i: decode.ln_linear(x, ws[i], b, ln=ln), copies)
        print(f"  {name} ({n} x {k}), one row: weights hot in L2 {hot:.2f} us, cold {cold:.2f} us", flush=True)


def main() -> None:
    l2_bound()
    cfg = GPTConfig(hidden_dropout=0.0, attention_dropout=0.0)
    model = GPT(cfg)
    model.init_weights(1234)
    model = model.to("cuda", torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (32,), generator=gen).tolist()
    prompts32 = [torch.randint(0, cfg.vocab_size, (32,), generator=gen).tolist() for _ in range(32)]
    params = SamplingParams(max_new_tokens=256, temperature=0.0)
    reference = None
    for name, plan in PLANS.items():
        apply(plan)
        rows_mod._decoders.clear()
        tokens = fused_generate(model, [prompt], params)[0].tokens
        fused_generate(model, prompts32, params)
        torch.cuda.synchronize()
        same = "reference" if reference is None else ("same tokens" if tokens == reference else "TOKENS DIFFER")
        reference = reference or tokens
        walls = []
        for _ in range(3):
            begin = time.perf_counter()
            fused_generate(model, [prompt], params)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - begin)
        wall = min(walls)
        line = f"{name:48s}: batch 1 {256 / wall:7.1f} tokens/s; {same};"
        for b in (1, 32):
            decoder = row_decoder_for(model, b)
            graph = decoder.graphs[Mode()]
            for at in (0, 200):
                line += f" b{b} step@{at} {1e3 * replay_ms(graph, lambda: decoder.step_index.fill_(at), reps=24):.1f} us;"
        print(line, flush=True)
    print("prefetches in PTX:", prefetch_instructions(), flush=True)


if __name__ == "__main__":
    main()
