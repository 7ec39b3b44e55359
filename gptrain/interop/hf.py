"""Weights between gptrain's GPT and Hugging Face ``transformers`` ``GPT2LMHeadModel``, both ways.

HF's GPT-2 stores linear weights as ``Conv1D`` (input x output), so every matrix is transposed;
its fused QKV is ordered ``[3, heads, head_dim]`` where gptrain (like Megatron) uses per-head
``[heads, 3, head_dim]``, so those rows are permuted; its vocabulary is unpadded, so the padded rows
of gptrain's embedding are dropped (export) or zero-filled (import).
"""
from __future__ import annotations

import torch

from gptrain.model.gpt import GPT, GPTConfig

_LAYER_MAP = {  # gptrain name -> (HF name, transposed)
    "ln1.weight": ("ln_1.weight", False), "ln1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True), "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True), "attn.proj.bias": ("attn.c_proj.bias", False),
    "ln2.weight": ("ln_2.weight", False), "ln2.bias": ("ln_2.bias", False),
    "mlp.fc1.weight": ("mlp.c_fc.weight", True), "mlp.fc1.bias": ("mlp.c_fc.bias", False),
    "mlp.fc2.weight": ("mlp.c_proj.weight", True), "mlp.fc2.bias": ("mlp.c_proj.bias", False),
}


def qkv_to_per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Fused QKV rows (weight or bias, rows first) from [3, heads, dim] to [heads, 3, dim]."""
    return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


def qkv_from_per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Fused QKV rows from [heads, 3, dim] back to [3, heads, dim]."""
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


def hf_config_kwargs(cfg: GPTConfig) -> dict:
    """Arguments for ``transformers.GPT2Config`` describing the same architecture."""
    return dict(vocab_size=cfg.vocab_size, n_positions=cfg.max_position_embeddings, n_embd=cfg.hidden_size,
                n_layer=cfg.num_layers, n_head=cfg.num_attention_heads, n_inner=cfg.ffn_hidden_size,
                activation_function="gelu_new", layer_norm_epsilon=cfg.layernorm_epsilon,
                resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout, attn_pdrop=cfg.attention_dropout,
                initializer_range=cfg.init_method_std, tie_word_embeddings=True)


def to_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    cfg, sd = model.cfg, model.state_dict()
    out = {
        "transformer.wte.weight": sd["word_embeddings.weight"][: cfg.vocab_size].clone(),
        "transformer.wpe.weight": sd["position_embeddings.weight"].clone(),
        "transformer.ln_f.weight": sd["final_layernorm.weight"].clone(),
        "transformer.ln_f.bias": sd["final_layernorm.bias"].clone(),
    }
    for i in range(cfg.num_layers):
        for ours, (theirs, transposed) in _LAYER_MAP.items():
            t = sd[f"layers.{i}.{ours}"]
            if ours.startswith("attn.qkv."):
                t = qkv_from_per_head(t, cfg.num_attention_heads)
            out[f"transformer.h.{i}.{theirs}"] = (t.t() if transposed else t).contiguous().clone()
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], cfg: GPTConfig) -> GPT:
    """A gptrain GPT holding the weights of a HF GPT-2 state dict (``transformer.`` prefix optional)."""
    sd = {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v for k, v in hf_sd.items()}
    model = GPT(cfg)
    wte = sd["transformer.wte.weight"]
    if wte.shape != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"HF word embeddings are {tuple(wte.shape)}, the config expects "
                         f"({cfg.vocab_size}, {cfg.hidden_size})")
    word = torch.zeros(cfg.padded_vocab_size, cfg.hidden_size, dtype=wte.dtype)
    word[: cfg.vocab_size] = wte
    ours = {"word_embeddings.weight": word, "position_embeddings.weight": sd["transformer.wpe.weight"],
            "final_layernorm.weight": sd["transformer.ln_f.weight"], "final_layernorm.bias": sd["transformer.ln_f.bias"]}
    for i in range(cfg.num_layers):
        for name, (theirs, transposed) in _LAYER_MAP.items():
            t = sd[f"transformer.h.{i}.{theirs}"]
            t = t.t().contiguous() if transposed else t
            ours[f"layers.{i}.{name}"] = qkv_to_per_head(t, cfg.num_attention_heads) if name.startswith("attn.qkv.") else t
    ours["output_layer.weight"] = word  # the same parameter (tied)
    model.load_state_dict(ours, strict=True)
    return model
