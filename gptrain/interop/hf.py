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


HF_WEIGHTS = "model.safetensors"
_SKIPPED = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers some GPT-2 exports carry


def hf_config_dict(cfg: GPTConfig, eod: int) -> dict:
    """``config.json`` of transformers' GPT-2 for ``cfg`` (written without importing transformers)."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **hf_config_kwargs(cfg),
            "bos_token_id": eod, "eos_token_id": eod, "torch_dtype": "float32"}


def gpt_config_from_hf(hf: dict, where: str) -> GPTConfig:
    """The GPTConfig of a transformers GPT-2 ``config.json`` (dict); anything gptrain cannot
    represent is an error naming the key."""
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{where}: model_type {hf.get('model_type')!r}; only gpt2 is supported")
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"{where}: activation_function {hf['activation_function']!r}; gptrain's MLP is the tanh "
                         "GELU (gelu_new)")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if hf.get(key):
            raise ValueError(f"{where}: {key} is set; gptrain's GPT-2 does not implement it")
    if hf.get("tie_word_embeddings") is False:
        raise ValueError(f"{where}: tie_word_embeddings is false; gptrain's output layer is the word embeddings")
    n_embd = hf.get("n_embd", 768)
    n_positions = hf.get("n_positions", 1024)
    return GPTConfig(num_layers=hf.get("n_layer", 12), hidden_size=n_embd, num_attention_heads=hf.get("n_head", 12),
                     ffn_hidden_size=hf.get("n_inner") or 4 * n_embd, seq_length=n_positions,
                     max_position_embeddings=n_positions, vocab_size=hf.get("vocab_size", 50257),
                     layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
                     init_method_std=hf.get("initializer_range", 0.02),
                     hidden_dropout=hf.get("resid_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1))


def load_hf_folder(path) -> GPT:
    """A gptrain GPT (fp32, on the CPU) from a Hugging Face GPT-2 folder: ``config.json`` and
    ``model.safetensors`` (or its sharded index). Pickled weights (``pytorch_model.bin``) are refused."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    folder = Path(path)
    config = folder / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{config}: missing (not a Hugging Face model folder)")
    cfg = gpt_config_from_hf(json.loads(config.read_text()), str(config))
    index = folder / f"{HF_WEIGHTS}.index.json"
    if (folder / HF_WEIGHTS).is_file():
        files = [folder / HF_WEIGHTS]
    elif index.is_file():
        files = [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        pickled = " (pytorch_model.bin is a pickle and is not read: save the model with safetensors)" \
            if (folder / "pytorch_model.bin").exists() else ""
        raise FileNotFoundError(f"{folder / HF_WEIGHTS}: missing{pickled}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update({k: v.float() for k, v in load_file(f).items() if not k.endswith(_SKIPPED)})
    return from_hf_state_dict(state, cfg)
