"""Choosing the next token: greedy, temperature, top-k and top-p (nucleus), per row of a batch.

Sampling is the Gumbel-max trick with noise that is a hash of (seed, position, token id), not a
generator's state: a row's sample depends only on its own logits, its seed and its position, so a
seeded request gives the same text alone or batched with any other requests, in any order, and the
step has no host-side state (it can be captured in a CUDA graph).
"""
from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32) on int64 tensors holding values in [0, 2^32):
    products wrap modulo 2^64, so their low 32 bits are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """(batch, vocab) standard Gumbel noise, a pure function of each row's seed and position."""
    token = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    row = _mix32((seeds.to(torch.int64) & _MASK32) ^ _mix32(positions.to(torch.int64) & _MASK32))
    bits = _mix32(row[:, None] ^ _mix32(token + 0x9E3779B9)[None, :])
    bits = _mix32(bits ^ (seeds.to(torch.int64)[:, None] >> 32 & _MASK32))
    u = (bits.to(torch.float64) + 0.5) / 4294967296.0  # in (0, 1), never 0 or 1
    return (-torch.log(-torch.log(u))).to(torch.float32)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Logits with the tokens outside each row's top-k / nucleus set to -inf (Megatron's rules:
    top_k 0 and top_p 0 mean no filter; the most likely token always stays)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    remove = rank >= k[:, None]
    cumulative = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)  # mass ranked above
    remove |= (top_p[:, None] > 0) & (before > top_p[:, None])
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The next token of each row of ``logits`` (batch, vocab), fp32. A row is greedy when its
    temperature is 0 or its top_k is 1; ``positions`` is the position the token will take."""
    logits = logits.float()
    greedy_ids = logits.argmax(dim=-1)
    greedy = (temperature <= 0) | (top_k == 1)
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    filtered = filter_logits(scaled, top_k, top_p)
    sampled = (filtered + gumbel_noise(seeds, positions, logits.shape[-1])).argmax(dim=-1)
    return torch.where(greedy, greedy_ids, sampled)
