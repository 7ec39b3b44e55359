"""Decode tokens/s of the 345M GPT (random init, no download) in bf16: gptrain's generation (CUDA-graph
decode step, static cache) next to Hugging Face transformers' ``generate`` on the same weights, at
each batch size, greedy, in one process. Also checks that both produce the same greedy tokens.

    python3 benchmarks/decode_speed.py [--batch-sizes 1 32] [--prompt-tokens 32] [--new-tokens 256]
"""
from __future__ import annotations

import argparse
import time

import torch

from gptrain.inference.fast import graph_generate
from gptrain.inference.generate import SamplingParams, generate
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args()
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
        t_eager, _ = timed(lambda: generate(model, rows, params), 1)
        line = (f"batch {b:3d}: gptrain (CUDA graph) {b * n / t_graph:10.1f} tokens/s, "
                f"gptrain eager {b * n / t_eager:9.1f} tokens/s")
        if hf is not None:
            ids = prompts.cuda()
            mask = torch.ones_like(ids)
            with torch.no_grad():
                t_hf, theirs = timed(lambda: hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                                         do_sample=False), args.repeats)
            theirs = theirs[:, args.prompt_tokens:].tolist()
            # bf16 rounding differs between the two implementations: count the tokens before the first difference
            same = [next((i for i, (x, y) in enumerate(zip(g.generated, h)) if x != y), n) for g, h in zip(ours, theirs)]
            line += (f", HF generate {b * n / t_hf:9.1f} tokens/s ({t_hf / t_graph:.1f}x slower); "
                     f"greedy tokens identical to HF for the first {min(same)} (mean {sum(same) / len(same):.0f}) of {n}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
