"""The model's forward pass with a key/value cache: each step feeds only the new tokens.

The blocks' own modules (LayerNorms, the QKV and output projections, the MLP) are called as they
are, so kernel swaps and tensor-parallel plans apply unchanged; only attention differs from
``GPT.forward``: the new queries attend to the cached keys of every earlier position. Query
position ``start + i`` may see key positions ``0 .. start + i`` (a causal mask aligned to the end,
which SDPA's ``is_causal`` is not when the queries are fewer than the keys).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gptrain.model.gpt import GPT


class KVCache:
    """Keys and values of every layer, (layers, batch, local heads, max_len, head_dim) each, views
    of one ``kv`` tensor (layers, 2, ...) so that a decode step writes a layer's key and value with
    one copy."""

    def __init__(self, model: GPT, batch: int, max_len: int, device=None, dtype=None):
        param = model.layers["0"].attn.qkv.weight
        local = getattr(param, "to_local", lambda: param)()  # a tensor-parallel shard holds whole heads
        # K/V heads: the groups' (each heads / groups queries, a key and a value) or every head's
        cfg = model.cfg
        heads = local.shape[0] // ((cfg.num_attention_heads // cfg.num_query_groups + 2) * cfg.head_dim)
        shape = (model.cfg.num_layers, batch, heads, max_len, model.cfg.head_dim)
        device = device or local.device
        dtype = dtype or local.dtype
        self.kv = torch.zeros((shape[0], 2) + shape[1:], device=device, dtype=dtype)
        self.k, self.v = self.kv[:, 0], self.kv[:, 1]
        self.max_len = max_len


def forward_cached(model: GPT, tokens: torch.Tensor, start: int, cache: KVCache) -> torch.Tensor:
    """Hidden states (batch, q, hidden) of ``tokens`` (batch, q) at positions start .. start+q-1,
    the cache holding positions 0 .. start-1; their keys and values are added to it."""
    b, q = tokens.shape
    end = start + q
    if end > cache.max_len:
        raise ValueError(f"position {end - 1} is beyond the cache's {cache.max_len} positions")
    positions = torch.arange(start, end, device=tokens.device)
    x = model.word_embeddings(tokens)
    if model.position_embeddings is not None:  # RoPE is applied by the attention's heads()
        x = x + model.position_embeddings(positions)
    mask = None
    if q > 1 and start > 0:
        keys = torch.arange(end, device=tokens.device)
        mask = keys[None, :] <= positions[:, None]
    for i, block in enumerate(model.layers.values()):
        query, key, value = block.attn.heads(block.attn.qkv(block.ln1(x)), positions)  # (batch, heads, q, dim)
        cache.k[i, :, :, start:end] = key
        cache.v[i, :, :, start:end] = value
        gqa = key.shape[1] != query.shape[1]
        y = F.scaled_dot_product_attention(query, cache.k[i, :, :, :end], cache.v[i, :, :, :end],
                                           attn_mask=mask, is_causal=q > 1 and start == 0, enable_gqa=gqa)
        x = x + block.attn.proj(y.transpose(1, 2).reshape(b, q, -1))
        x = x + block.mlp(block.ln2(x))
    return model.final_layernorm(x)


def logits_of(model: GPT, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits over the real vocabulary."""
    return model.output_layer(hidden).float()
