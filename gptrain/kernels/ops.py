"""The matmuls of a linear layer's forward and backward as ``torch.library`` custom ops.

On CUDA each runs as one autotuned cuBLASLt call (``cublaslt.py``), with the bias, GELU or GELU's
derivative inside the matmul's epilogue; on other devices as plain PyTorch, which is also the
reference the CUDA kernels are checked against (benchmarks/check_cublaslt.py).
Custom ops keep ``torch.compile`` from tracing into ctypes: it sees them through their fake
implementations and calls them whole.

Shapes: x (tokens x in), w (out x in) as nn.Linear holds it, g (tokens x out) a gradient.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gptrain.kernels import cublaslt as lt


def _lt(t: torch.Tensor) -> lt.CublasLt:
    return lt.cublaslt(t.device.index)


def gelu_tanh_derivative(x: torch.Tensor) -> torch.Tensor:
    """d/dx of 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3): what cuBLASLt's DGELU applies."""
    c = math.sqrt(2.0 / math.pi)
    t = torch.tanh(c * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)


@torch.library.custom_op("gptrain::linear_fwd", mutates_args=())
def linear_fwd(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T + bias``."""
    if not x.is_cuda:
        return F.linear(x, w, bias)
    return linear_fwd_into(x, w, bias, x.new_empty(x.shape[0], w.shape[0]), tuned=True)


@linear_fwd.register_fake
def _(x, w, bias):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("gptrain::linear_dgrad", mutates_args=())
def linear_dgrad(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``g @ w``: the gradient at a linear layer's input."""
    if not g.is_cuda:
        return g @ w
    return linear_dgrad_into(g, w, g.new_empty(g.shape[0], w.shape[1]), tuned=True)


@linear_dgrad.register_fake
def _(g, w):
    return g.new_empty(g.shape[0], w.shape[1])


@torch.library.custom_op("gptrain::linear_wgrad", mutates_args=())
def linear_wgrad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``g.T @ x``: the weight gradient. The bias gradient (g.sum(0)) stays outside: under
    torch.compile it fuses into the elementwise kernel that produced g, where cuBLASLt's BGRADB
    epilogue measured slower than the plain GEMM plus a separate sum (benchmarks/RESULTS.md)."""
    if not g.is_cuda:
        return g.t() @ x
    return _lt(g).gemm(g, x, g.new_empty(g.shape[1], x.shape[1]), trans_a=True)


@linear_wgrad.register_fake
def _(g, x):
    return g.new_empty(g.shape[1], x.shape[1])


@torch.library.custom_op("gptrain::linear_bias_gelu", mutates_args=())
def linear_bias_gelu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gelu_tanh(pre), pre)`` with ``pre = x @ w.T + bias``; pre is kept for the backward."""
    if not x.is_cuda:
        pre = F.linear(x, w, bias)
        return F.gelu(pre, approximate="tanh"), pre
    pre = x.new_empty(x.shape[0], w.shape[0])
    out = torch.empty_like(pre)
    linear_bias_gelu_into(x, w, bias, out, pre)
    return out, pre


@linear_bias_gelu.register_fake
def _(x, w, bias):
    pre = x.new_empty(x.shape[0], w.shape[0])
    return torch.empty_like(pre), torch.empty_like(pre)


@torch.library.custom_op("gptrain::linear_dgelu", mutates_args=())
def linear_dgelu(g: torch.Tensor, w: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``(g @ w) * gelu_tanh'(pre)``: from the gradient at fc2's output to the one at fc1's output."""
    if not g.is_cuda:
        return (g @ w) * gelu_tanh_derivative(pre)
    return linear_dgelu_into(g, w, pre, torch.empty_like(pre))


@linear_dgelu.register_fake
def _(g, w, pre):
    return torch.empty_like(pre)


# ---- the same matmuls written into a given tensor (a row slice of a larger one), for the ops that assemble a
# sequence-parallel region's output half by half (parallel/sequence_parallel_ce.py); plain functions, called from
# inside other custom ops. ``tuned``: cuBLASLt on CUDA; otherwise, and off CUDA, torch's matmuls with ``out=``.


def linear_fwd_into(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                    tuned: bool) -> torch.Tensor:
    """``out = x @ w.T + bias``."""
    if tuned and x.is_cuda:
        epilogue = lt.EPILOGUE_DEFAULT if bias is None else lt.EPILOGUE_BIAS
        return _lt(x).gemm(x, w, out, trans_b=True, epilogue=epilogue, bias=bias)
    if bias is None:
        return torch.mm(x, w.t(), out=out)
    return torch.addmm(bias, x, w.t(), out=out)


def linear_dgrad_into(g: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tuned: bool) -> torch.Tensor:
    """``out = g @ w``."""
    if tuned and g.is_cuda:
        return _lt(g).gemm(g, w, out)
    return torch.mm(g, w, out=out)


def linear_bias_gelu_into(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, out: torch.Tensor,
                          pre: torch.Tensor) -> None:
    """``pre = x @ w.T + bias``, ``out = gelu_tanh(pre)``."""
    if x.is_cuda:
        _lt(x).gemm(x, w, out, trans_b=True, epilogue=lt.EPILOGUE_GELU_AUX_BIAS, bias=bias, aux=pre)
        return
    torch.addmm(bias, x, w.t(), out=pre)
    out.copy_(F.gelu(pre, approximate="tanh"))


def linear_dgelu_into(g: torch.Tensor, w: torch.Tensor, pre: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = (g @ w) * gelu_tanh'(pre)``."""
    if g.is_cuda:
        return _lt(g).gemm(g, w, out, epilogue=lt.EPILOGUE_DGELU, aux=pre)
    return torch.mul(g @ w, gelu_tanh_derivative(pre), out=out)


def linear_matmuls(tuned: bool):
    """(forward ``(x, w, bias)``, input gradient ``(g, w)``, weight gradient ``(g, x)``) of a linear layer: the
    cuBLASLt ops or torch's."""
    if tuned:
        return linear_fwd, linear_dgrad, linear_wgrad
    return (lambda x, w, b: F.linear(x, w, b)), (lambda g, w: g @ w), (lambda g, x: g.t() @ x)
