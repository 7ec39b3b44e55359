"""A fused decode step's input and output kernels: ``embed_rows`` (each row's position, its token's
and position's embeddings summed, the token recorded, in one kernel) before the blocks, and
``row_argmax`` (the greedy choice, a row's argmax) after the head. Like the block kernels in
:mod:`gptrain.kernels.decode` they compute a row the same way whatever the other rows hold (batch
invariance), and elsewhere than CUDA run as PyTorch ops.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from gptrain.kernels.decode import split_buffers, triton_cdiv, use_triton


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def argmax_kernel(logits_ptr, stride, N, part_ptr, lock_ptr, out_ptr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
                      CHUNKS_P2: tl.constexpr):
        row, chunk = tl.program_id(0), tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(logits_ptr + row.to(tl.int64) * stride + cols, mask=cols < N, other=float("-inf"))
        best = tl.max(v, axis=0)
        first = tl.min(tl.where(v == best, cols, N), axis=0)  # the lowest index of the maximum, as torch's
        parts = part_ptr + row.to(tl.int64) * (2 * CHUNKS_P2)
        tl.store(parts + chunk, best, cache_modifier=".cg")
        tl.store(parts + CHUNKS_P2 + chunk, first.to(tl.float32), cache_modifier=".cg")  # exact below 2^24
        tl.debug_barrier()
        if tl.atomic_add(lock_ptr + row, 1, sem="acq_rel") != CHUNKS - 1:
            return
        c = tl.arange(0, CHUNKS_P2)
        values = tl.load(parts + c, mask=c < CHUNKS, other=float("-inf"), cache_modifier=".cg")
        at = tl.load(parts + CHUNKS_P2 + c, mask=c < CHUNKS, other=N, cache_modifier=".cg")
        best = tl.max(values, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(values == best, at, N), axis=0).to(tl.int64))
        tl.atomic_xchg(lock_ptr + row, 0)  # ready for the next launch

    @triton.jit
    def embed_kernel(ids_ptr, start_ptr, step_ptr, word_ptr, pos_emb_ptr, x_ptr, positions_ptr, out_ids_ptr,
                     current_ptr, batch, last_position, H, BLOCK_H: tl.constexpr):
        row = tl.program_id(0)
        token = tl.load(ids_ptr + row)
        step = tl.load(step_ptr)
        position = tl.minimum(tl.load(start_ptr + row) + step, last_position)
        h = tl.arange(0, BLOCK_H)
        e = tl.load(word_ptr + token * H + h, mask=h < H, other=0.0).to(tl.float32) + \
            tl.load(pos_emb_ptr + position * H + h, mask=h < H, other=0.0).to(tl.float32)
        tl.store(x_ptr + row.to(tl.int64) * H + h, e.to(x_ptr.dtype.element_ty), mask=h < H)
        tl.store(positions_ptr + row, position)
        tl.store(out_ids_ptr + step * batch + row, token)
        tl.store(current_ptr + row, token)

    return argmax_kernel, embed_kernel


def define_kernels() -> None:
    """Imports Triton and defines this module's kernels now (``inference/early_init.py``: beside
    the checkpoint read); nothing is compiled."""
    _kernels()


ARGMAX_BLOCK = 2048  # logits a program scans


def row_argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's index of its largest value (the lowest such index, as ``torch.argmax``): chunks of
    a row in parallel, then the chunk that finishes last picks among them in a fixed order (a row's
    answer depends only on the row). ``logits`` (rows, n) fp32 with unit column stride."""
    rows, n = logits.shape
    if out is None:
        out = torch.empty(rows, device=logits.device, dtype=torch.long)
    if not use_triton(logits):
        return out.copy_(logits.argmax(dim=-1))
    assert logits.stride(1) == 1 and logits.dtype == torch.float32 and out.is_contiguous()
    chunks = triton_cdiv(n, ARGMAX_BLOCK)
    p2 = 1 << (chunks - 1).bit_length()
    parts, locks = split_buffers(logits.device, rows, 2 * p2)
    _kernels()[0][(rows, chunks)](logits, logits.stride(0), n, parts, locks, out, BLOCK=ARGMAX_BLOCK, CHUNKS=chunks,
                                  CHUNKS_P2=p2, num_warps=4)
    return out


def embed_rows(ids: torch.Tensor, start: torch.Tensor, step: torch.Tensor, word: torch.Tensor, pos_emb: torch.Tensor,
               x: torch.Tensor, positions: torch.Tensor, out_ids: torch.Tensor, current: torch.Tensor) -> None:
    """One decode step's input, in one kernel: each row's position ``min(start + step, window - 1)``
    into ``positions``, its token's and position's embeddings summed (in the model's dtype, as
    eager) into ``x``, and the token recorded at ``out_ids[step]`` and in ``current``."""
    rows, hidden = x.shape
    if not use_triton(x):
        positions.copy_((start[:rows] + step).clamp_(max=pos_emb.shape[0] - 1))
        x.copy_(F.embedding(ids, word) + F.embedding(positions, pos_emb))
        out_ids.index_copy_(0, step.view(1), ids[None])
        current.copy_(ids)
        return
    assert x.is_contiguous() and word.is_contiguous() and pos_emb.is_contiguous() and out_ids.shape[1] == rows
    _kernels()[1][(rows,)](ids, start, step, word, pos_emb, x, positions, out_ids, current, rows,
                           pos_emb.shape[0] - 1, hidden, BLOCK_H=1 << (hidden - 1).bit_length(), num_warps=4)
