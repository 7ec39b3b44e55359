"""Where a batch-1 request's time goes beyond its steps' graphs (fused loop, 345M bf16 random init,
32-token prompt, 256 new tokens): the request's wall time, the time before the first step (prefill
and set-up), the step graph alone at early and late positions (attention grows with the position),
and the GPU's idle time between kernels over the request (a profiler trace).

    python3 benchmarks/decode_gaps.py
"""
from __future__ import annotations

import time

import torch

from gptrain.inference.fast import Mode
from gptrain.inference.generate import SamplingParams
from gptrain.inference.rows import fused_generate, row_decoder_for
from gptrain.model.gpt import GPT, GPTConfig

from decode_speed import replay_ms


def main() -> None:
    cfg = GPTConfig(hidden_dropout=0.0, attention_dropout=0.0)
    model = GPT(cfg)
    model.init_weights(1234)
    model = model.to("cuda", torch.bfloat16).eval()
    prompt = torch.randint(0, cfg.vocab_size, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=256, temperature=0.0)
    one = SamplingParams(max_new_tokens=1, temperature=0.0)
    for _ in range(2):
        fused_generate(model, [prompt], params)
    torch.cuda.synchronize()
    walls, firsts = [], []
    for _ in range(5):
        begin = time.perf_counter()
        fused_generate(model, [prompt], params)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - begin)
        begin = time.perf_counter()
        fused_generate(model, [prompt], one)
        torch.cuda.synchronize()
        firsts.append(time.perf_counter() - begin)
    wall, first = min(walls), min(firsts)
    print(f"request: {1e3 * wall:.2f} ms for 256 tokens ({256 / wall:.1f} tokens/s, {1e3 * wall / 256:.3f} ms/token); "
          f"a 1-token request (prefill, set-up, one step): {1e3 * first:.2f} ms", flush=True)
    decoder = row_decoder_for(model, 1)
    graph = decoder.graphs[Mode()]
    for at in (0, 64, 128, 192, 240):
        print(f"  step graph from step {at} (positions {32 + at}..{32 + at + 16}): "
              f"{replay_ms(graph, lambda: decoder.step_index.fill_(at), reps=16):.3f} ms per replay", flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fused_generate(model, [prompt], params)
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy = sum(end - start for start, end, _ in spans)
    total = spans[-1][1] - spans[0][0]
    gaps = [(spans[i + 1][0] - spans[i][1], spans[i][2][:50], spans[i + 1][2][:50]) for i in range(len(spans) - 1)]
    big = sorted(gaps, reverse=True)[:8]
    print(f"  trace: first kernel to last {total / 1e3:.2f} ms, kernels busy {busy / 1e3:.2f} ms, idle "
          f"{(total - busy) / 1e3:.2f} ms over {len(spans)} kernels/copies; gaps over 5 us: "
          f"{sum(g for g, *_ in gaps if g > 5) / 1e3:.2f} ms in {sum(g > 5 for g, *_ in gaps)}; largest:", flush=True)
    for g, a, b in big:
        print(f"    {g:8.1f} us after {a} before {b}")
    names: dict[str, list[float]] = {}
    for start, end, name in spans:
        names.setdefault(name[:60], []).append(end - start)
    for name, us in sorted(names.items(), key=lambda kv: -sum(kv[1]))[:10]:
        print(f"    {sum(us) / 1e3:7.3f} ms {len(us):6d}x {sum(us) / len(us):7.2f} us  {name}")


if __name__ == "__main__":
    main()
