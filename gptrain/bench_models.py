"""The plain PyTorch models ``gptrain bench`` times gptrain against: the simplest strong GPT-2
(nanoGPT's) and, for a Llama-style config, torchtitan's Llama (RMSNorm, RoPE, grouped-query
attention through SDPA, SwiGLU, untied head, no biases), each of the config's shape."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def model_kind(m) -> str:
    return "GPT-2 style" if m.gpt2_layout else "Llama style"


def baseline_for(m) -> nn.Module:
    if m.gpt2_layout:
        return BaselineGPT(m.padded_vocab_size, m.seq_length, m.hidden_size, m.num_attention_heads, m.num_layers)
    if not (m.swiglu and m.normalization == "RMSNorm" and m.position_embedding_type == "rope"):
        raise ValueError("bench's baseline is GPT-2 or Llama (--swiglu --normalization RMSNorm "
                         "--position-embedding-type rope); this config mixes them")
    return BaselineLlama(m.padded_vocab_size, m.hidden_size, m.num_attention_heads, m.num_query_groups,
                         m.kv_channels, m.ffn_hidden_size, m.num_layers, m.seq_length, m.rotary_base,
                         m.layernorm_epsilon)


class BaselineGPT(nn.Module):
    """The simplest strong GPT-2: nn.Linear/LayerNorm/SDPA, tied head, plain cross-entropy; ``recompute``:
    each block's activations recomputed in the backward (torch.utils.checkpoint)."""

    def __init__(self, vocab: int, seq: int, hidden: int, heads: int, layers: int, recompute: bool = False):
        super().__init__()
        self.heads, self.recompute = heads, recompute
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln1=nn.LayerNorm(hidden), qkv=nn.Linear(hidden, 3 * hidden), proj=nn.Linear(hidden, hidden),
            ln2=nn.LayerNorm(hidden), fc=nn.Linear(hidden, 4 * hidden), out=nn.Linear(4 * hidden, hidden)))
            for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        for p in self.parameters():
            nn.init.normal_(p, std=0.02) if p.ndim == 2 else None

    def _block(self, blk, x):
        b, s, _ = x.shape
        q, k, v = blk["qkv"](blk["ln1"](x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + blk["proj"](y.transpose(1, 2).reshape(b, s, -1))
        return x + blk["out"](F.gelu(blk["fc"](blk["ln2"](x)), approximate="tanh"))

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = checkpoint(self._block, blk, x, use_reentrant=False) if self.recompute else self._block(blk, x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def _rope(x, cos, sin):
    """Rotate-half RoPE (HF's / torchtitan's non-interleaved form) over the whole head."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class BaselineLlama(nn.Module):
    """torchtitan's Llama in plain PyTorch: what a careful user writes without a framework."""

    def __init__(self, vocab, hidden, heads, groups, head_dim, ffn, layers, seq, base, eps):
        super().__init__()
        self.heads, self.groups, self.head_dim = heads, groups, head_dim
        self.embed = nn.Embedding(vocab, hidden)
        q, kv = heads * head_dim, groups * head_dim
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            n1=nn.RMSNorm(hidden, eps=eps), qkv=nn.Linear(hidden, q + 2 * kv, bias=False),
            o=nn.Linear(q, hidden, bias=False), n2=nn.RMSNorm(hidden, eps=eps),
            gate_up=nn.Linear(hidden, 2 * ffn, bias=False), down=nn.Linear(ffn, hidden, bias=False)))
            for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(hidden, eps=eps), nn.Linear(hidden, vocab, bias=False)
        inv = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(seq).float(), inv).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for p in self.parameters():
            nn.init.normal_(p, std=0.02) if p.ndim == 2 else None

    def forward(self, idx, targets):
        b, s = idx.shape
        x = self.embed(idx)
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        q_width, kv_width = self.heads * self.head_dim, self.groups * self.head_dim
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["n1"](x)).split([q_width, kv_width, kv_width], dim=-1)
            q = _rope(q.view(b, s, self.heads, -1).transpose(1, 2), cos, sin)
            k = _rope(k.view(b, s, self.groups, -1).transpose(1, 2), cos, sin)
            v = v.view(b, s, self.groups, -1).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.groups != self.heads)
            x = x + blk["o"](y.transpose(1, 2).reshape(b, s, -1))
            gate, up = blk["gate_up"](blk["n2"](x)).chunk(2, dim=-1)
            x = x + blk["down"](F.silu(gate) * up)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
