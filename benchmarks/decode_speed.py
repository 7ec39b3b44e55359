"""Decode tokens/s of the 345M GPT (random init, no download) in bf16: gptrain's fused CUDA-graph decode
loop (inference/rows.py, the one `gptrain generate` and `gptrain serve` run) next to its eager ``generate``
and Hugging Face transformers' ``generate`` on the same weights, at each batch size, greedy, in one
process; also the loop's variants (prompts prefilled together; a lone stream's decoder; rows sampled as
serve_load.py's requests). Counts how many greedy tokens agree.

    python3 benchmarks/decode_speed.py [--batch-sizes 1 32] [--prompt-tokens 32] [--new-tokens 256] [--profile]

``--profile``: the fused step's graph alone (one replay) and the top CUDA kernels of a torch.profiler trace
of a short request, at each batch size.
"""
from __future__ import annotations

import argparse
import time

import torch

from gptrain.inference.steps import Mode
from gptrain.inference.generate import SamplingParams, generate
from gptrain.inference.rows import fused_generate, row_decoder_for
from gptrain.model.gpt import GPT, GPTConfig


def timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up (graph capture, autotuning)
    torch.cuda.synchronize()
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, out


def first_difference(a: list[int], b: list[int], n: int) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n)


def replay_ms(graph: torch.cuda.CUDAGraph, before=None, reps: int = 50) -> float:
    """Mean ms of one replay over ``reps`` back-to-back replays (CUDA events)."""
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if before is not None:
        before()
    begin.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / reps


def explain_fused(model: GPT, rows: list[list[int]], new_tokens: int) -> None:
    """The fused loop's step alone (one graph replay) and its kernels per step (a profiler trace)."""
    b = len(rows)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    fused_generate(model, rows, params)
    decoder = row_decoder_for(model, b)
    graph = decoder.graphs[Mode()]
    step_ms = replay_ms(graph, lambda: decoder.step_index.fill_(0))
    from torch.profiler import ProfilerActivity, profile

    before = decoder.stats["steps"]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fused_generate(model, rows, params)
        torch.cuda.synchronize()
    steps = decoder.stats["steps"] - before
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.time_range.elapsed_us())
    count = sum(len(v) for v in kernels.values())
    busy = sum(sum(v) for v in kernels.values())
    print(f"  fused profile, batch {b}: one step's graph {step_ms:.3f} ms per replay; trace: {count / steps:.0f} "
          f"CUDA kernels/copies per step (prefill included), {busy / 1e3 / steps:.3f} ms of them per step; top:")
    for name, us in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:8]:
        print(f"    {sum(us) / 1e3 / steps:7.3f} ms/step {len(us) / steps:6.1f}/step {sum(us) / len(us):8.2f} us each  "
              f"{name[:100]}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--profile", action="store_true", help="explain where the time goes at each batch size")
    p.add_argument("--profile-tokens", type=int, default=32, help="new tokens of the profiled request")
    p.add_argument("--tiles", help="the fused kernels' tiles from decode_kernels.py --json")
    args = p.parse_args()
    if args.tiles:
        import json

        from gptrain.kernels import decode

        with open(args.tiles) as f:
            decode.TILES.update({tuple(shape): t for shape, t in json.load(f)})
        print("fused kernel tiles:", decode.TILES)
    assert torch.cuda.is_available(), "needs a GPU"
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = GPTConfig(hidden_dropout=0.0, attention_dropout=0.0)  # the 345M: 24 x 1024, 16 heads, 1024 positions
    model = GPT(cfg)
    model.init_weights(1234)
    model = model.to("cuda", torch.bfloat16).eval()
    hf = None
    if not args.skip_hf:
        import transformers

        from gptrain.interop.hf import hf_config_kwargs, to_hf_state_dict

        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_config_kwargs(cfg), attn_implementation="sdpa"))
        hf.load_state_dict(to_hf_state_dict(model.float()), strict=False)
        model = model.to(torch.bfloat16)
        hf = hf.to("cuda", torch.bfloat16).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}"
          + (f", transformers {transformers.__version__}" if hf is not None else ""))
    gen = torch.Generator().manual_seed(0)
    n = args.new_tokens
    params = SamplingParams(max_new_tokens=n, temperature=0.0)
    for b in args.batch_sizes:
        prompts = torch.randint(0, cfg.vocab_size, (b, args.prompt_tokens), generator=gen)
        rows = prompts.tolist()
        begin = time.perf_counter()
        fused_generate(model, rows, params)
        first = time.perf_counter() - begin
        t_fused, ours = timed(lambda: fused_generate(model, rows, params), args.repeats)
        t_eager, eager = timed(lambda: generate(model, rows, params), 1)
        agree = [first_difference(g.generated, e.generated, n) for g, e in zip(ours, eager)]
        line = (f"batch {b:3d}: gptrain (fused) {b * n / t_fused:10.1f} tokens/s ({1e3 * t_fused / n:.3f} ms/step, "
                f"prefill included; first call with Triton compiles and capture {first:.1f} s), gptrain eager "
                f"{b * n / t_eager:9.1f} tokens/s (greedy tokens identical for the first {min(agree)} "
                f"(mean {sum(agree) / len(agree):.0f}) of {n})")
        if hf is not None:
            ids = prompts.cuda()
            mask = torch.ones_like(ids)
            with torch.no_grad():
                t_hf, theirs = timed(lambda: hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                                         do_sample=False), args.repeats)
            theirs = theirs[:, args.prompt_tokens:].tolist()
            # bf16 rounding differs between the two implementations: count the tokens before the first difference
            same = [first_difference(g.generated, h, n) for g, h in zip(ours, theirs)]
            line += (f", HF generate {b * n / t_hf:9.1f} tokens/s ({t_hf / t_fused:.1f}x slower); "
                     f"greedy tokens identical to HF for the first {min(same)} (mean {sum(same) / len(same):.0f}) of {n}")
        print(line, flush=True)
        variants = ([("fused, prompts prefilled together", {"together": True})] if b > 1 else
                    [("fused, single stream: products on the CUDA cores", {"batch_invariant": False})])
        for name, kw in variants:
            t_variant, variant = timed(lambda: fused_generate(model, rows, params, **kw), args.repeats)
            agree = [first_difference(g.generated, e.generated, n) for g, e in zip(variant, eager)]
            print(f"batch {b:3d}: gptrain ({name}) {b * n / t_variant:10.1f} tokens/s ({1e3 * t_variant / n:.3f} "
                  f"ms/step, prefill included); greedy tokens identical to eager gptrain for the first {min(agree)} "
                  f"(mean {sum(agree) / len(agree):.0f}) of {n}", flush=True)
        # the same rows sampled as serve_load.py's requests (temperature 0.8, top-p 0.9, a seed each): the
        # engine figure a server under that load is held against (the choice adds a sort and the noise)
        sampled = [SamplingParams(max_new_tokens=n, temperature=0.8, top_p=0.9, seed=i) for i in range(b)]
        t_sampled, _ = timed(lambda: fused_generate(model, rows, sampled), args.repeats)
        print(f"batch {b:3d}: gptrain (fused, sampled: temperature 0.8, top-p 0.9) {b * n / t_sampled:10.1f} tokens/s "
              f"({1e3 * t_sampled / n:.3f} ms/step, prefill included)", flush=True)
        if b == 1:
            single = row_decoder_for(model, 1, batch_invariant=False)
            print(f"  single-stream step graph: {replay_ms(single.graphs[Mode()]):.3f} ms per replay", flush=True)
        if args.profile:
            explain_fused(model, rows, args.profile_tokens)


if __name__ == "__main__":
    main()
