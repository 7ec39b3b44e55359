"""Decode tokens/s of a ~1B Llama-style gptrain model (random init, no download) in bf16: gptrain's
generation (the CUDA-graph step of the model's own layers, inference/graph_step.py, and the eager
KV-cache loop) against Hugging Face transformers'
``LlamaForCausalLM.generate`` on the same weights (converted by ``interop/hf_llama``), with its
static cache and with its default dynamic cache, greedy, at each batch size, in one process.

    python3 benchmarks/decode_llama.py [--batch-sizes 1 32] [--prompt-tokens 32] [--new-tokens 256]
"""
from __future__ import annotations

import argparse

import torch

from gptrain.inference.generate import SamplingParams, generate
from gptrain.inference.graph_step import graph_step_generate
from gptrain.model.gpt import GPT, GPTConfig
from decode_speed import first_difference, timed  # benchmarks/ is the script's folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--layers", type=int, default=16)
    args = p.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    import transformers

    from gptrain.interop.hf_llama import llama_config_dict, to_llama_state_dict

    cfg = GPTConfig(num_layers=args.layers, hidden_size=2048, num_attention_heads=32, group_query_attention=True, num_query_groups=8,
                    ffn_hidden_size=5632, swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                    untie_embeddings_and_output_weights=True, add_bias_linear=False, seq_length=2048,
                    max_position_embeddings=2048, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPT(cfg)
    model.init_weights(1234)
    hf_cfg = llama_config_dict(cfg, bos=0, eos=0)
    hf_cfg.pop("architectures")
    hf_cfg.pop("model_type")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg, attn_implementation="sdpa"))
    hf.load_state_dict(to_llama_state_dict(model), strict=True)
    model = model.to("cuda", torch.bfloat16).eval()
    hf = hf.to("cuda", torch.bfloat16).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"model: {cfg.num_parameters():,} parameters ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads} heads, {cfg.num_query_groups} K/V groups, SwiGLU {cfg.ffn_hidden_size})", flush=True)
    gen = torch.Generator().manual_seed(0)
    n = args.new_tokens
    params = SamplingParams(max_new_tokens=n, temperature=0.0)
    for b in args.batch_sizes:
        prompts = torch.randint(0, cfg.vocab_size, (b, args.prompt_tokens), generator=gen)
        rows = prompts.tolist()
        t_ours, ours = timed(lambda: graph_step_generate(model, rows, params), args.repeats)
        t_eager, eager = timed(lambda: generate(model, rows, params), 1)
        agree = [first_difference(g.generated, e.generated, n) for g, e in zip(ours, eager)]
        line = (f"batch {b:3d}: gptrain (graph step) {b * n / t_ours:9.1f} tokens/s ({1e3 * t_ours / n:.2f} ms/step), "
                f"gptrain eager {b * n / t_eager:9.1f} tokens/s, greedy tokens identical for the first {min(agree)} "
                f"(mean {sum(agree) / len(agree):.0f}) of {n}")
        ids, mask = prompts.cuda(), torch.ones_like(prompts).cuda()
        for name, kw in (("HF static cache", {"cache_implementation": "static"}), ("HF dynamic cache", {})):
            with torch.no_grad():
                t_hf, theirs = timed(lambda: hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                                         do_sample=False, **kw), args.repeats)
            theirs = theirs[:, args.prompt_tokens:].tolist()
            same = [first_difference(g.generated, h, n) for g, h in zip(ours, theirs)]
            line += (f"; {name} {b * n / t_hf:9.1f} tokens/s (gptrain {t_hf / t_ours:.2f}x), greedy tokens identical "
                     f"for the first {min(same)} (mean {sum(same) / len(same):.0f}) of {n}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
