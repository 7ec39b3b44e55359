"""Plain data parallelism's gradient reduction: every rank holds the whole model, and after the
step's last micro-batch the gradients are averaged over the data-parallel group in fp32.

With bf16/fp16 parameters the gradients already sit in one flat fp32 buffer (the main gradients of
train/main_params.py), so the reduction is one all-reduce of that buffer. With fp32 parameters the
gradients are flattened into one buffer for the all-reduce and copied back.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def average_flat(flat: torch.Tensor, group, size: int, reduce_dtype: torch.dtype | None = None) -> None:
    """``flat`` averaged over ``group`` in place; ``reduce_dtype`` (--grad-reduce-in-bf16): sent in it."""
    if reduce_dtype is None or reduce_dtype == flat.dtype:
        flat.div_(size)
        dist.all_reduce(flat, group=group)
        return
    low = flat.to(reduce_dtype).div_(size)
    dist.all_reduce(low, group=group)
    flat.copy_(low)


def average_gradients(grads: list[torch.Tensor], group, size: int, reduce_dtype: torch.dtype | None = None) -> None:
    """Average plain gradients (a tensor-parallel rank's shards) over ``group``."""
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    average_flat(flat, group, size, reduce_dtype)
    torch._foreach_copy_(grads, list(_unflatten_dense_tensors(flat, grads)))
