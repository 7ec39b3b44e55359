"""Decode tokens/s of the 345M GPT (random init, no download) in bf16: gptrain's generation (CUDA-graph
decode loop, static cache) next to its eager ``generate`` and Hugging Face transformers' ``generate`` on
the same weights, at each batch size, greedy, in one process. Also counts how many greedy tokens agree.

    python3 benchmarks/decode_speed.py [--batch-sizes 1 32] [--prompt-tokens 32] [--new-tokens 256] [--profile] [--compile]

``--profile`` explains the time at each batch size: the decode loop's host counters (prefill, host
work and waits per step, graph replays and host syncs per step), CUDA-event timings of one step's
graph at each attention bucket and of the token choice alone (argmax, and sampling with top-p), and
the top CUDA kernels of a torch.profiler trace of a short request.
"""
from __future__ import annotations

import argparse
import time

import torch

from gptrain.inference.fast import AHEAD, Mode, decoder_for, graph_generate, length_bucket
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


def explain(model: GPT, rows: list[list[int]], new_tokens: int) -> None:
    """Where one batch's decode time goes (see the module's docstring)."""
    b = len(rows)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    graph_generate(model, rows, params)  # captures what this request needs
    decoder = decoder_for(model, b)
    before = dict(decoder.stats)
    torch.cuda.synchronize()
    begin = time.perf_counter()
    graph_generate(model, rows, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - begin
    d = {k: decoder.stats[k] - before[k] for k in before}
    steps = d["steps"]
    ms = lambda seconds: 1e3 * seconds / steps  # noqa: E731
    print(f"  profile, batch {b}, {new_tokens} new tokens after a {len(rows[0])}-token prompt: "
          f"{1e3 * wall:.2f} ms in all, prefill launches {1e3 * d['prefill_s']:.2f} ms, {steps} steps: "
          f"{ms(wall - d['prefill_s']):.3f} ms/step ({ms(wall - d['prefill_s']) / b:.4f} ms/token); "
          f"per step on the host: {ms(d['loop_s'] - d['wait_s']):.3f} ms of work, {ms(d['wait_s']):.3f} ms "
          f"waiting for the GPU ({AHEAD} steps ahead); {d['replays'] / steps:.2f} graph replays and "
          f"{d['host_waits'] / steps:.2f} host syncs (an event wait before reading a step's ids) per step; "
          f"{len(decoder.graphs)} graphs captured so far", flush=True)
    # one step's graph alone at each attention bucket the request used (the state is scratch now)
    start, total = len(rows[0]), len(rows[0]) + new_tokens
    mode = Mode()
    times = []
    for length in sorted({length_bucket(t + 1, decoder.window) for t in range(start, total)}):
        graph = decoder.graphs[(mode, length)]
        first = max(1, length // 2 - 25)
        times.append(f"L={length}: {replay_ms(graph, lambda: decoder.position.fill_(first)):.3f}")
    # the token choice alone: argmax, and sampling (temperature 1, top-p 0.9: sort, cumsum, noise)
    decoder.temperature.fill_(1.0)
    decoder.top_p.fill_(0.9)
    decoder.position.fill_(start)
    choice = {}
    for name, m in (("argmax", Mode()), ("sampling", Mode(greedy=False))):
        decoder.choose(m)  # warm-up (sort's workspace)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decoder.choose(m)
        choice[name] = replay_ms(graph)
    print(f"  one step's graph (ms per replay, by attention bucket): {', '.join(times)}; of which the choice: "
          f"argmax {choice['argmax']:.3f} ms, sampling {choice['sampling']:.3f} ms (greedy runs argmax only)",
          flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        graph_generate(model, rows, params)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.time_range.elapsed_us())
    busy = sum(sum(v) for v in kernels.values())
    count = sum(len(v) for v in kernels.values())
    print(f"  trace: {count / steps:.0f} CUDA kernels/copies per step, {busy / 1e3 / steps:.3f} ms of them per step "
          f"(prefill included); top by time:")
    for name, us in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:12]:
        print(f"    {sum(us) / 1e3 / steps:7.3f} ms/step {len(us) / steps:6.1f}/step {sum(us) / len(us):8.2f} us each  "
              f"{name[:100]}", flush=True)


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
    p.add_argument("--compile", action="store_true",
                   help="also time the decode loop with each block's step through torch.compile (graph_generate(compile=True))")
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
        t_graph, ours = timed(lambda: graph_generate(model, rows, params), args.repeats)
        t_eager, eager = timed(lambda: generate(model, rows, params), 1)
        agree = [first_difference(g.generated, e.generated, n) for g, e in zip(ours, eager)]
        line = (f"batch {b:3d}: gptrain (CUDA graph) {b * n / t_graph:10.1f} tokens/s "
                f"({1e3 * t_graph / n:.3f} ms/step), gptrain eager {b * n / t_eager:9.1f} tokens/s "
                f"(greedy tokens identical for the first {min(agree)} (mean {sum(agree) / len(agree):.0f}) of {n})")
        if hf is not None:
            ids = prompts.cuda()
            mask = torch.ones_like(ids)
            with torch.no_grad():
                t_hf, theirs = timed(lambda: hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                                         do_sample=False), args.repeats)
            theirs = theirs[:, args.prompt_tokens:].tolist()
            # bf16 rounding differs between the two implementations: count the tokens before the first difference
            same = [first_difference(g.generated, h, n) for g, h in zip(ours, theirs)]
            line += (f", HF generate {b * n / t_hf:9.1f} tokens/s ({t_hf / t_graph:.1f}x slower); "
                     f"greedy tokens identical to HF for the first {min(same)} (mean {sum(same) / len(same):.0f}) of {n}")
        print(line, flush=True)
        begin = time.perf_counter()
        fused_generate(model, rows, params)
        first = time.perf_counter() - begin
        variants = [("fused", {})] + ([("fused, prompts prefilled together", {"together": True})] if b > 1 else
                                      [("fused, single stream: products on the CUDA cores", {"batch_invariant": False})])
        for name, kw in variants:
            t_fused, fused = timed(lambda: fused_generate(model, rows, params, **kw), args.repeats)
            agree = [first_difference(g.generated, e.generated, n) for g, e in zip(fused, eager)]
            print(f"batch {b:3d}: gptrain ({name}) {b * n / t_fused:10.1f} tokens/s ({1e3 * t_fused / n:.3f} ms/step, "
                  f"prefill included; first call with Triton compiles and capture {first:.1f} s); greedy tokens "
                  f"identical to eager gptrain for the first {min(agree)} (mean {sum(agree) / len(agree):.0f}) of {n}",
                  flush=True)
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
        if args.compile:
            try:
                begin = time.perf_counter()
                graph_generate(model, rows, params, compile=True)
                first = time.perf_counter() - begin
                t_comp, comp = timed(lambda: graph_generate(model, rows, params, compile=True), args.repeats)
                agree = [first_difference(g.generated, e.generated, n) for g, e in zip(comp, eager)]
                print(f"batch {b:3d}: gptrain (CUDA graph, compiled block steps) {b * n / t_comp:10.1f} tokens/s "
                      f"({1e3 * t_comp / n:.3f} ms/step; first call with compile and capture {first:.1f} s); greedy "
                      f"tokens identical to eager gptrain for the first {min(agree)} (mean {sum(agree) / len(agree):.0f})",
                      flush=True)
            except Exception as err:  # noqa: BLE001 - the other rows stand
                print(f"batch {b:3d}: compiled decode failed: {type(err).__name__}: {str(err).splitlines()[0][:300]}",
                      flush=True)
        if args.profile:
            explain(model, rows, args.profile_tokens)


if __name__ == "__main__":
    main()
