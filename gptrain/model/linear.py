"""Linear layers and the MLP on the custom matmul ops of ``gptrain.kernels.ops``.

``TunedLinear`` is ``nn.Linear`` with its three matmuls (forward with the bias in its epilogue, input
gradient, weight gradient) as autotuned cuBLASLt calls; bias gradients are plain sums, which
torch.compile fuses into the kernel that produced the gradient. In ``FusedBiasGeluMLP`` (fc1 ->
tanh GELU -> fc2; Megatron's --bias-gelu-fusion, as TransformerEngine runs it) fc1's bias and GELU live in its forward matmul's epilogue, which also writes GELU's input for the
backward, and the backward matmul through fc2's weight applies GELU's derivative in its own
epilogue: the 4h-wide activation never takes an extra trip through memory for elementwise work.

Both are installed by the kernel converter (kernels/convert.py) as module swaps; without it the
model keeps plain ``nn.Linear`` (which fp8's Float8Linear replaces).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptrain.kernels.ops import linear_bias_gelu, linear_dgelu, linear_dgrad, linear_fwd, linear_wgrad


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        x2 = _rows(x)
        ctx.save_for_backward(x2, w)
        ctx.has_bias = b is not None
        return linear_fwd(x2, w, b).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x2, w = ctx.saved_tensors
        g = _rows(grad_out)
        grad_x = linear_dgrad(g, w).view(*grad_out.shape[:-1], w.shape[1]) if ctx.needs_input_grad[0] else None
        return grad_x, linear_wgrad(g, x2), g.sum(0) if ctx.has_bias else None


class _FusedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2):
        x2 = _rows(x)
        act, pre = linear_bias_gelu(x2, w1, b1)
        ctx.save_for_backward(x2, w1, w2, act, pre)
        return linear_fwd(act, w2, b2).view(*x.shape[:-1], w2.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x2, w1, w2, act, pre = ctx.saved_tensors
        g = _rows(grad_out)
        grad_pre = linear_dgelu(g, w2, pre)
        grad_x = linear_dgrad(grad_pre, w1).view(*grad_out.shape[:-1], w1.shape[1])
        return grad_x, linear_wgrad(grad_pre, x2), grad_pre.sum(0), linear_wgrad(g, act), g.sum(0)


class TunedLinear(nn.Linear):
    """``nn.Linear`` whose three matmuls run on the autotuned cuBLASLt ops (same parameters, same
    names: the kernel converter swaps the class of an existing layer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Linear.apply(x, self.weight, self.bias)


class FusedBiasGeluMLP(nn.Module):
    """fc1 -> tanh GELU -> fc2 with fc1's bias and GELU in its matmul's epilogue and GELU's
    derivative in the backward's (Megatron's --bias-gelu-fusion); swapped in for ``MLP``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FusedMLP.apply(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias)


def linear_weight(x: torch.Tensor, weight: torch.Tensor, tuned: bool) -> torch.Tensor:
    """``x @ weight.T`` without a module (the tied output layer)."""
    return _Linear.apply(x, weight, None) if tuned else F.linear(x, weight)
