"""The GPT MLP (fc1 -> tanh GELU -> fc2) with the bias and GELU inside fc1's matmul epilogue.

Megatron's ``--bias-gelu-fusion`` as TransformerEngine runs it on Hopper: the forward matmul adds
the bias, applies GELU and also writes GELU's input (kept for the backward); the backward matmul
through fc2's weight multiplies by GELU's derivative and reduces fc1's bias gradient in its
epilogue. The 4h-wide activation then never makes an extra round trip through memory between a
matmul and an elementwise kernel, which is most of what the MLP's elementwise work costs.

On CUDA the two matmuls are cuBLASLt's GELU_AUX_BIAS and DGELU_BGRAD epilogues
(``gptrain.kernels.cublaslt``); elsewhere the same ops run as plain PyTorch, which is also the
reference the CUDA kernels are tested against. Both are ``torch.library`` custom ops, so
``torch.compile`` keeps them whole.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gptrain.kernels import cublaslt as lt


@torch.library.custom_op("gptrain::linear_bias_gelu", mutates_args=())
def linear_bias_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gelu(x @ weight.T + bias), x @ weight.T + bias)`` for a 2-D x."""
    if x.is_cuda:
        pre = x.new_empty(x.shape[0], weight.shape[0])
        out = torch.empty_like(pre)
        lt.cublaslt(x.device.index).matmul(x, weight, out, lt.EPILOGUE_GELU_AUX_BIAS, trans_w=True,
                                           bias=bias, aux=pre)
        return out, pre
    pre = F.linear(x, weight, bias)
    return F.gelu(pre, approximate="tanh"), pre


@linear_bias_gelu.register_fake
def _(x, weight, bias):
    pre = x.new_empty(x.shape[0], weight.shape[0])
    return torch.empty_like(pre), torch.empty_like(pre)


def _gelu_tanh_derivative(x: torch.Tensor) -> torch.Tensor:
    # d/dx 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3): the formula cuBLASLt and PyTorch use
    c = math.sqrt(2.0 / math.pi)
    t = torch.tanh(c * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)


@torch.library.custom_op("gptrain::linear_dgelu_bgrad", mutates_args=())
def linear_dgelu_bgrad(grad: torch.Tensor, weight: torch.Tensor, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d, d.sum(0))`` with ``d = (grad @ weight) * gelu'(pre)``: the gradient at fc1's output
    given the gradient at fc2's output, and fc1's bias gradient."""
    if grad.is_cuda:
        d = torch.empty_like(pre)
        bias_grad = pre.new_empty(pre.shape[1])
        lt.cublaslt(grad.device.index).matmul(grad, weight, d, lt.EPILOGUE_DGELU_BGRAD, trans_w=False,
                                              bias=bias_grad, aux=pre)
        return d, bias_grad
    d = (grad @ weight) * _gelu_tanh_derivative(pre)
    return d, d.sum(0)


@linear_dgelu_bgrad.register_fake
def _(grad, weight, pre):
    return torch.empty_like(pre), pre.new_empty(pre.shape[1])


class _FusedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2):
        x2 = x.reshape(-1, x.shape[-1])
        act, pre = linear_bias_gelu(x2, w1, b1)
        ctx.save_for_backward(x2, w1, w2, act, pre)
        return F.linear(act, w2, b2).view(*x.shape[:-1], w2.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x2, w1, w2, act, pre = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_w2, grad_b2 = g.t() @ act, g.sum(0)
        grad_pre, grad_b1 = linear_dgelu_bgrad(g, w2, pre)
        grad_w1, grad_x = grad_pre.t() @ x2, grad_pre @ w1
        return grad_x.view(grad_out.shape[:-1] + (w1.shape[1],)), grad_w1, grad_b1, grad_w2, grad_b2


def fused_mlp(x: torch.Tensor, fc1: torch.nn.Linear, fc2: torch.nn.Linear) -> torch.Tensor:
    """``fc2(gelu_tanh(fc1(x)))`` with fc1's bias and GELU fused into its matmuls."""
    return _FusedMLP.apply(x.contiguous(), fc1.weight, fc1.bias, fc2.weight, fc2.bias)


def unavailable_reason(fc1: torch.nn.Linear, fc2: torch.nn.Linear) -> str | None:
    """Why the fused MLP cannot run on these layers (None: it can)."""
    w = fc1.weight
    if fc1.bias is None or fc2.bias is None:
        return "the MLP has no biases"
    if fc2.weight.dtype != w.dtype:
        return "fc1 and fc2 hold different dtypes"
    if w.shape[0] % 8 or w.shape[1] % 8:
        return f"fc1 is {tuple(w.shape)}; the epilogues need sizes divisible by 8"
    return lt.unavailable_reason(w.device, w.dtype)
