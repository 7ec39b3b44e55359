"""Dropout for tensor-parallel runs, as Megatron draws it: outside the tensor-parallel regions (the
embeddings' and the blocks' hidden dropout, on activations every tensor-parallel rank holds whole)
the same mask on every rank; inside them (attention dropout on each rank's own heads) a different
stream per rank, from the process generator seeded per tensor-parallel rank (train/run.py).

The outside mask is a hash of (step counter, layer, element's index in the whole sequence) rather
than a draw from the process generator, so it needs no generator state to agree across ranks and
works inside compiled graphs; a sequence-parallel shard computes exactly its slice of the whole
sequence's mask. One device keeps ``F.dropout``.
"""
from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (int64 tensors holding 32-bit values; the products
    stay below 2^59)."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def hashed_dropout(x: torch.Tensor, p: float, step: torch.Tensor, salt: int, shard: int = 0,
                   shards: int = 1) -> torch.Tensor:
    """Dropout of ``x`` (batch, seq, hidden) with a mask that depends only on ``step`` (an int64
    tensor), ``salt`` (which dropout site) and each element's position in the whole sequence, of
    which ``x`` holds part ``shard`` of ``shards`` (sequence parallelism)."""
    if p <= 0.0:
        return x
    b, s, h = x.shape
    dev = x.device
    rows = torch.arange(b, device=dev).view(b, 1, 1) * (s * shards)
    positions = (torch.arange(s, device=dev) + shard * s).view(1, s, 1)
    index = (rows + positions) * h + torch.arange(h, device=dev).view(1, 1, h)
    # the step's high bits (iteration >= 2^15 once the loop shifts it by 16) fold in through their
    # own hash, so masks never repeat; they are zero below that, leaving those keys as they were
    low = (((step & 0x7FFFFFFF) * 0x9E3779B1) + salt * 0x85EBCA6B) & _MASK32
    key = _mix32(_mix32(step >> 31) ^ low)
    bits = _mix32((index & _MASK32) ^ key ^ _mix32(index >> 32))
    keep = bits >= int(p * 2 ** 32)
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))
