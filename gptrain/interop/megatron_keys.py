"""Megatron-LM's parameter names and tensor-parallel layouts, in gptrain's terms: which gptrain
parameter a checkpoint key is, how its tensor-parallel shards merge, and the legacy fused-QKV order.

Two layouts: megatron-core's ``GPTModel`` (``embedding.*``, ``decoder.layers.N.*``,
``output_layer.weight``; local and Transformer Engine layer specs) and the legacy GPT model of
Megatron-LM, Megatron-DeepSpeed and the 345M release (``language_model.{embedding,encoder|transformer}.*``,
``word_embeddings_for_head`` on the last pipeline stage). Tensor-parallel shards are concatenated
(QKV and fc1 on dim 0, proj and fc2 weights on dim 1, the vocabulary-parallel embeddings on dim 0,
LayerNorms and row-parallel biases from rank 0). The legacy fused QKV is reordered per
tensor-parallel shard to the per-head ``[heads, 3, head_dim]`` rows gptrain uses, according to
``checkpoint_version`` (0: ``[3, heads, dim]``, 1.0: ``[heads, dim, 3]``, >= 2.0 and megatron-core:
already per head).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

# rule: "cat0" / "cat1" concatenate the tensor-parallel shards on that dim, "rank0" takes rank 0's
_CORE_LAYER = {
    "input_layernorm.weight": ("ln1.weight", "rank0"),
    "input_layernorm.bias": ("ln1.bias", "rank0"),
    "self_attention.linear_qkv.layer_norm_weight": ("ln1.weight", "rank0"),  # Transformer Engine
    "self_attention.linear_qkv.layer_norm_bias": ("ln1.bias", "rank0"),
    "self_attention.linear_qkv.weight": ("attn.qkv.weight", "cat0"),
    "self_attention.linear_qkv.bias": ("attn.qkv.bias", "cat0"),
    "self_attention.linear_proj.weight": ("attn.proj.weight", "cat1"),
    "self_attention.linear_proj.bias": ("attn.proj.bias", "rank0"),
    "pre_mlp_layernorm.weight": ("ln2.weight", "rank0"),
    "pre_mlp_layernorm.bias": ("ln2.bias", "rank0"),
    "mlp.linear_fc1.layer_norm_weight": ("ln2.weight", "rank0"),  # Transformer Engine
    "mlp.linear_fc1.layer_norm_bias": ("ln2.bias", "rank0"),
    "mlp.linear_fc1.weight": ("mlp.fc1.weight", "cat0"),
    "mlp.linear_fc1.bias": ("mlp.fc1.bias", "cat0"),
    "mlp.linear_fc2.weight": ("mlp.fc2.weight", "cat1"),
    "mlp.linear_fc2.bias": ("mlp.fc2.bias", "rank0"),
}
_CORE_GLOBAL = {
    "embedding.word_embeddings.weight": ("word_embeddings.weight", "cat0"),
    "embedding.position_embeddings.weight": ("position_embeddings.weight", "rank0"),
    "decoder.final_layernorm.weight": ("final_layernorm.weight", "rank0"),
    "decoder.final_layernorm.bias": ("final_layernorm.bias", "rank0"),
    "output_layer.weight": ("output_layer.weight", "cat0"),
}
_LEGACY_LAYER = {
    "input_layernorm.weight": ("ln1.weight", "rank0"),
    "input_layernorm.bias": ("ln1.bias", "rank0"),
    "query_key_value.weight": ("attn.qkv.weight", "qkv"),
    "query_key_value.bias": ("attn.qkv.bias", "qkv"),
    "dense.weight": ("attn.proj.weight", "cat1"),
    "dense.bias": ("attn.proj.bias", "rank0"),
    "post_attention_layernorm.weight": ("ln2.weight", "rank0"),
    "post_attention_layernorm.bias": ("ln2.bias", "rank0"),
    "mlp.dense_h_to_4h.weight": ("mlp.fc1.weight", "cat0"),
    "mlp.dense_h_to_4h.bias": ("mlp.fc1.bias", "cat0"),
    "mlp.dense_4h_to_h.weight": ("mlp.fc2.weight", "cat1"),
    "mlp.dense_4h_to_h.bias": ("mlp.fc2.bias", "rank0"),
}
_LEGACY_GLOBAL = {
    "language_model.embedding.word_embeddings.weight": ("word_embeddings.weight", "cat0"),
    "language_model.embedding.position_embeddings.weight": ("position_embeddings.weight", "rank0"),
    "word_embeddings_for_head.weight": ("output_layer.weight", "cat0"),
    "language_model.output_layer.weight": ("untied_output_layer.weight", "cat0"),
}
_CORE_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LEGACY_LAYER_KEY = re.compile(r"^language_model\.(?:encoder|transformer)\.layers\.(\d+)\.(.+)$")
_LEGACY_FINAL = re.compile(r"^language_model\.(?:encoder|transformer)\.final_layernorm\.(weight|bias)$")
_IGNORED = re.compile(r"(\._extra_state|\.inv_freq|^_extra_state)$")


def flatten(tree, prefix="") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, name + "."))
        else:
            out[name] = v
    return out


def layout_of(keys) -> str:
    if any(k.startswith("language_model.") for k in keys):
        return "legacy"
    if any(k.startswith(("decoder.", "embedding.")) for k in keys):
        return "megatron-core"
    raise ValueError("neither megatron-core GPTModel keys (embedding.*, decoder.*) nor legacy GPT keys "
                     f"(language_model.*): first keys {sorted(keys)[:3]}")


def map_key(key: str, layout: str):
    """(gptrain name with a local layer index or None, local layer index or None, rule); None if ignored."""
    if _IGNORED.search(key):
        return None
    if layout == "megatron-core":
        if key in _CORE_GLOBAL:
            name, rule = _CORE_GLOBAL[key]
            return name, None, rule
        m = _CORE_LAYER_KEY.match(key)
        if m and m.group(2) in _CORE_LAYER:
            name, rule = _CORE_LAYER[m.group(2)]
            return name, int(m.group(1)), rule
    else:
        if key in _LEGACY_GLOBAL:
            name, rule = _LEGACY_GLOBAL[key]
            return name, None, rule
        m = _LEGACY_FINAL.match(key)
        if m:
            return f"final_layernorm.{m.group(1)}", None, "rank0"
        m = _LEGACY_LAYER_KEY.match(key)
        if m:
            sub = re.sub(r"^(?:self_attention|attention)\.", "", m.group(2))
            if sub in _LEGACY_LAYER and (sub.startswith(("input_", "post_", "mlp.")) or sub != m.group(2)):
                name, rule = _LEGACY_LAYER[sub]
                return name, int(m.group(1)), rule
    raise KeyError(key)


def legacy_qkv_to_per_head(t: torch.Tensor, version: float, local_heads: int) -> torch.Tensor:
    """One tensor-parallel shard's fused QKV rows (Megatron's ``fix_query_key_value_ordering``)."""
    if version >= 2.0:
        return t
    rest = t.shape[1:]
    if version == 0:
        t = t.reshape(3, local_heads, -1, *rest).transpose(0, 1)  # [3, np, hn] -> [np, 3, hn]
    elif version == 1.0:
        t = t.reshape(local_heads, -1, 3, *rest).transpose(1, 2)  # [np, hn, 3] -> [np, 3, hn]
    else:
        raise ValueError(f"checkpoint_version {version} has no known QKV order (0, 1.0 or >= 2.0)")
    return t.reshape(-1, *rest).contiguous()


def merge_shards(shards: list[torch.Tensor], rule: str, name: str, folder: Path) -> torch.Tensor:
    """One full tensor from its tensor-parallel shards by ``rule`` (``rank0``, ``cat0``, ``cat1``)."""
    if len(shards) == 1 or rule == "rank0":
        t = shards[0]
        own = t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.is_contiguous()
        return t if own else t.contiguous().clone()
    dim = 1 if rule == "cat1" else 0
    shapes = {tuple(s.shape[:dim] + s.shape[dim + 1:]) for s in shards}
    if len(shapes) != 1:
        raise ValueError(f"{folder}: tensor-parallel shards of {name} disagree in shape "
                         f"{[tuple(s.shape) for s in shards]}")
    return torch.cat(shards, dim=dim)
