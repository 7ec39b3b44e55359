"""Language-model loss over the tied output layer.

``lm_cross_entropy`` returns the mean token cross-entropy of ``h @ W.T`` against ``labels``,
counting only the first ``vocab_size`` columns (the padded rows of W get no probability and no
gradient). The logits are computed at the padded width and the padding masked to -inf: a width of
50257 would give the matmul unaligned rows.

The fused path computes the loss and both gradients chunk by chunk in the forward pass, so the
(tokens x vocabulary) logits of the whole batch never exist at once: at micro-batch 16 and seq
1024 that saves the 1.6 GB bf16 logits, their gradient and the fp32 copies of the plain loss. Each
chunk's softmax and gradient run as one compiled kernel when ``compiled`` is set.

With the output layer on the cuBLASLt ops (``tuned``), the plain path takes the loss's gradient in
the forward pass too, but over the whole batch (``_TunedHeadCrossEntropy``): one kernel writes each
token's loss and, over the logits, ``softmax - onehot`` (kernels/xent.py), so the logits and their
gradient share one buffer, and the backward is two matmuls of that gradient scaled by the incoming gradient.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptrain.kernels.ops import linear_dgrad, linear_wgrad
from gptrain.kernels.xent import linear_softmax_xent
from gptrain.model.linear import linear_weight

CHUNK_ELEMENTS = 1 << 27  # logits per chunk at most (256 MB in bf16)


def _mask_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    if logits.shape[-1] == vocab_size:
        return logits
    column = torch.arange(logits.shape[-1], device=logits.device)
    return logits.masked_fill(column >= vocab_size, float("-inf"))


def _chunk_loss_and_grads(h_chunk, w, y, vocab_size: int, inv_tokens: float):
    """Summed loss of one chunk, d(mean loss)/d h_chunk, and this chunk's share of d/d w."""
    logits = _mask_padding((h_chunk @ w.T).float(), vocab_size)
    lse = torch.logsumexp(logits, dim=-1)
    loss = (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
    # d(mean loss)/d logits = (softmax - onehot) / tokens
    probs = torch.exp(logits - lse[:, None])
    column = torch.arange(logits.shape[-1], device=logits.device)
    g = ((probs - (column[None, :] == y[:, None]).float()) * inv_tokens).to(w.dtype)
    return loss, g @ w, g.T @ h_chunk


@functools.cache
def _compiled_chunk():
    """The chunk kernel through torch.compile, wrapped on first use: the wrapping imports inductor, about a
    second of every process that imports the training stack (dry runs, each torchrun worker)."""
    return torch.compile(_chunk_loss_and_grads, dynamic=False)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    device_type = t.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return t.dtype


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, vocab_size: int, dtype: torch.dtype, compiled: bool):
        n_tokens = h.shape[0]
        # a power of two tokens per chunk keeps every chunk but perhaps the last one shape (one compile)
        chunk = 1 << max(0, (CHUNK_ELEMENTS // weight.shape[0]).bit_length() - 1)
        fn = _compiled_chunk() if compiled else _chunk_loss_and_grads
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(dtype)
            hc = h.to(dtype)
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_h = torch.empty_like(hc)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
            for start in range(0, n_tokens, chunk):
                loss, gh, gw = fn(hc[start : start + chunk], w, labels[start : start + chunk], vocab_size,
                                  1.0 / n_tokens)
                total += loss
                grad_h[start : start + chunk] = gh
                # a bf16 product rounded once per chunk, as autocast's own weight gradients are
                grad_w += gw
        ctx.save_for_backward(grad_h, grad_w)
        ctx.h_dtype, ctx.w_dtype = h.dtype, weight.dtype
        return total / n_tokens

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return (grad_h * grad_out).to(ctx.h_dtype), (grad_w * grad_out).to(ctx.w_dtype), None, None, None, None


@torch.compiler.disable  # a loop of large matmuls between compiled regions; the chunk kernel compiles alone
def _fused(h, weight, labels, vocab_size, compiled):
    if not torch.is_grad_enabled() or not (h.requires_grad or weight.requires_grad):
        with torch.no_grad():
            return _plain(h, weight, labels, vocab_size)
    return _FusedLinearCrossEntropy.apply(h, weight, labels, vocab_size, _compute_dtype(h), compiled)


class _TunedHeadCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``h @ weight.T``: d loss / d logits = (softmax - onehot) / tokens is
    known in the forward pass up to the incoming gradient, a scalar, so it is computed there and
    the backward scales the two matmul outputs instead of the (tokens x vocabulary) gradient."""

    @staticmethod
    def forward(ctx, h, weight, labels, vocab_size: int):
        losses, grad_logits = linear_softmax_xent(h, weight, labels, vocab_size)
        ctx.save_for_backward(h, weight, grad_logits)
        return losses.mean()

    @staticmethod
    def backward(ctx, grad_out):
        h, weight, grad_logits = ctx.saved_tensors
        scale = grad_out / grad_logits.shape[0]
        grad_h = (linear_dgrad(grad_logits, weight) * scale).to(h.dtype) if ctx.needs_input_grad[0] else None
        grad_w = (linear_wgrad(grad_logits, h) * scale).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None


def _plain(h, weight, labels, vocab_size, tuned=False):
    # not fp16: the unscaled gradient's matmuls sum over all tokens, which fp16 could overflow at a
    # small loss scale where the scaled plain path would not (bf16 has fp32's range)
    if tuned and h.dtype != torch.float16 and torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _TunedHeadCrossEntropy.apply(h, weight, labels, vocab_size)
    logits = _mask_padding(linear_weight(h, weight, tuned), vocab_size)
    return F.cross_entropy(logits.float(), labels)


def lm_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                     fused: bool = True, compiled: bool = False, tuned: bool = False,
                     loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of logits ``h @ weight[:vocab_size].T`` over the tokens of ``labels``
    (Megatron's ``sum(losses * loss_mask) / sum(loss_mask)`` with a mask)."""
    h2, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    if loss_mask is not None:  # --eod-mask-loss: per-token losses on the plain path
        logits = _mask_padding(linear_weight(h2, weight, False), vocab_size)
        losses = F.cross_entropy(logits.float(), y, reduction="none")
        mask = loss_mask.reshape(-1).to(losses.dtype)
        return (losses * mask).sum() / mask.sum().clamp(min=1.0)
    if fused:
        return _fused(h2, weight, y, vocab_size, compiled)
    return _plain(h2, weight, y, vocab_size, tuned)


class LMLoss(nn.Module):
    """The language-model loss chosen by config: the plain loss (default), or chunked fused
    linear + cross-entropy (``--fused-cross-entropy``). The kernel converter sets ``tuned`` (the
    output layer on cuBLASLt, loss gradient in the forward pass) and ``compiled`` (the fused
    loss's chunk kernel under --compile). No parameters: the output layer's weight is passed in."""

    def __init__(self, vocab_size: int, fused: bool = False):
        super().__init__()
        self.vocab_size, self.fused = vocab_size, fused
        self.tuned = self.compiled = False

    def forward(self, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        return lm_cross_entropy(h, weight, labels, self.vocab_size, fused=self.fused, compiled=self.compiled,
                                tuned=self.tuned, loss_mask=loss_mask)
