"""Cross-entropy over a row of logits that also writes the row's gradient, in one pass over memory.

``softmax_xent`` returns each token's loss, ``logsumexp(x) - x[label]``, and ``softmax(x) -
onehot(label)``, the gradient of that loss with respect to the logits, in the logits' dtype. Done
in the forward pass, it lets the output layer drop its logits at once and makes the loss's backward
a scaling of two small matmul outputs (model/loss.py). On CUDA one Triton program per row reads the
row twice, the second time from L2, and writes the gradient once: about 1 read and 1 write of the
(tokens x vocabulary) logits, against 2 reads and 1 write for a compiled cross-entropy's forward
and backward kernels. Columns from ``vocab_size`` on (the padding of the output layer) get no
probability and no gradient. Elsewhere the op runs the same math in PyTorch, which is also the
reference the kernel is checked against (benchmarks/check_xent.py).
"""
from __future__ import annotations

import functools

import torch

from gptrain.kernels.ops import linear_fwd

_BLOCK = 4096  # columns per step: 8 KB of bf16, a row of 50304 in 13 steps


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def softmax_xent_kernel(logits_ptr, grad_ptr, labels_ptr, loss_ptr, stride_logits, stride_grad,
                            vocab_size, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        src = logits_ptr + row * stride_logits
        label = tl.load(labels_ptr + row)
        # pass 1: running max and sum of exponentials per lane; -1e30 (not -inf) for columns past
        # vocab_size keeps exp(m - m_new) finite in lanes that see only padding
        m = tl.full([BLOCK], -1e30, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab_size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(src + cols, mask=cols < vocab_size, other=-1e30).to(tl.float32)
            m_new = tl.maximum(m, x)
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
        row_max = tl.max(m, 0)
        lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), 0))
        tl.store(loss_ptr + row, lse - tl.load(src + label).to(tl.float32))
        # pass 2: the gradient, softmax - onehot, over the whole padded width (padding gets 0)
        dst = grad_ptr + row * stride_grad
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(src + cols, mask=cols < vocab_size, other=-1e30).to(tl.float32)
            p = tl.exp(x - lse)
            p = tl.where(cols == label, p - 1.0, p)
            tl.store(dst + cols, p.to(grad_ptr.dtype.element_ty), mask=cols < width)

    return softmax_xent_kernel


def _reference(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    x = x.masked_fill(torch.arange(x.shape[1], device=x.device) >= vocab_size, float("-inf"))
    lse = torch.logsumexp(x, dim=1)
    loss = lse - x.gather(1, labels[:, None]).squeeze(1)
    grad = torch.exp(x - lse[:, None])
    grad[torch.arange(x.shape[0], device=x.device), labels] -= 1
    return loss.float(), grad.to(logits.dtype)


def _launch(logits: torch.Tensor, grad: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    rows, width = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _kernel()[(rows,)](logits, grad, labels, loss, logits.stride(0), grad.stride(0), vocab_size, width,
                       BLOCK=_BLOCK, num_warps=16)
    return loss


@torch.library.custom_op("gptrain::softmax_xent", mutates_args=())
def softmax_xent(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss (fp32) and d loss / d logits (the logits' dtype) of (rows x width) logits
    against labels (rows,), counting only the first vocab_size columns."""
    if not logits.is_cuda:
        return _reference(logits, labels, vocab_size)
    grad = torch.empty_like(logits)
    return _launch(logits, grad, labels, vocab_size), grad


@softmax_xent.register_fake
def _(logits, labels, vocab_size):
    return logits.new_empty(logits.shape[0], dtype=torch.float32), torch.empty_like(logits)


@torch.library.custom_op("gptrain::linear_softmax_xent", mutates_args=())
def linear_softmax_xent(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                        vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax_xent(h @ weight.T)`` with the gradient written over the logits: one (rows x width)
    buffer instead of two at the loss, the peak of a training step's memory."""
    logits = linear_fwd(h, weight, None)
    if not logits.is_cuda:
        return _reference(logits, labels, vocab_size)
    # in place is safe: each program reads a block of its own row before it writes that block
    return _launch(logits, logits, labels, vocab_size), logits


@linear_softmax_xent.register_fake
def _(h, weight, labels, vocab_size):
    return h.new_empty(h.shape[0], dtype=torch.float32), h.new_empty(h.shape[0], weight.shape[0])
