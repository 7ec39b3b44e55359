"""Linear layers and the MLP on the custom matmul ops of ``gptrain.kernels.ops``.

``linear`` is ``layer(x)`` with its three matmuls (forward with the bias in its epilogue, input
gradient, weight gradient) as autotuned cuBLASLt calls; bias gradients are plain sums, which
torch.compile fuses into the kernel that produced the gradient. ``mlp`` is fc1 -> tanh GELU ->
fc2; with ``fuse_bias_gelu`` (Megatron's --bias-gelu-fusion, as TransformerEngine runs it) fc1's
bias and GELU live in its forward matmul's epilogue, which also writes GELU's input for the
backward, and the backward matmul through fc2's weight applies GELU's derivative in its own
epilogue: the 4h-wide activation never takes an extra trip through memory for elementwise work.

With ``tuned`` off both are the plain modules (which fp8's Float8Linear replaces).
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


def linear(x: torch.Tensor, layer: nn.Linear, tuned: bool) -> torch.Tensor:
    return _Linear.apply(x, layer.weight, layer.bias) if tuned else layer(x)


def linear_weight(x: torch.Tensor, weight: torch.Tensor, tuned: bool) -> torch.Tensor:
    """``x @ weight.T`` without a module (the tied output layer)."""
    return _Linear.apply(x, weight, None) if tuned else F.linear(x, weight)


def mlp(x: torch.Tensor, fc1: nn.Linear, fc2: nn.Linear, tuned: bool, fuse_bias_gelu: bool) -> torch.Tensor:
    if tuned and fuse_bias_gelu:
        return _FusedMLP.apply(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias)
    # tanh GELU: Megatron's fused bias-GELU and Hugging Face GPT-2's "gelu_new"
    return linear(F.gelu(linear(x, fc1, tuned), approximate="tanh"), fc2, tuned)
