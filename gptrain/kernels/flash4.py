"""Causal attention on packed QKV through FlashAttention-4's kernels (the CuTe-DSL kernels of the
``flash-attn-4`` package, which also run on Hopper), as ``torch.library`` custom ops.

Why not SDPA: torch's SDPA has no FlashAttention-3/4 kernel for Hopper, and it takes q, k, v as
separate tensors, so the backward writes dq, dk, dv apart and autograd then copies them into the
qkv gradient. Here the forward reads q, k, v as strided views of the qkv matmul's output
(batch, seq, heads, 3, head_dim), Megatron's per-head order, and the backward writes its gradients straight into one packed
buffer of that layout: no transposes and no gradient assembly.

The package is optional (``pip install 'gptrain[flash4]'``); ``unavailable_reason`` says why the
kernels cannot run, and the model then stays on SDPA. On other devices the ops compute the same
thing with SDPA's math, which is also the reference the tests check against.
"""
from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F

_MODULE = "flash_attn.cute.interface"


@functools.cache
def _interface():
    return importlib.import_module(_MODULE)


def unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int, dropout: float) -> str | None:
    """Why FlashAttention-4 cannot run this attention (None: it can)."""
    if dropout > 0:
        return f"attention dropout {dropout} (FlashAttention-4 has no dropout)"
    if device.type != "cuda":
        return f"{device.type} device (FlashAttention-4 needs CUDA)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{dtype} activations (FlashAttention-4 runs bf16/fp16)"
    major, _ = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"compute capability {major}.x (FlashAttention-4 runs on Hopper and Blackwell)"
    if head_dim % 8 or not 8 <= head_dim <= 256:
        return f"head dim {head_dim} (FlashAttention-4 needs a multiple of 8 up to 256)"
    try:
        _interface()
    except ImportError as err:
        return f"flash-attn-4 not installed ({err}); pip install 'gptrain[flash4]'"
    except (RuntimeError, OSError) as err:  # installed but its CuTe runtime does not load
        return f"flash-attn-4 does not load: {err}"
    return None


def _probabilities(qkv: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """q, k, v as (batch, heads, seq, dim) in fp32 (or fp64), the causal softmax P and each row's
    log-sum-exp."""
    q, k, v = qkv.to(torch.promote_types(qkv.dtype, torch.float32)).permute(3, 0, 2, 1, 4)
    s = q.size(2)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=qkv.device).triu(1), float("-inf"))
    lse = scores.logsumexp(-1)
    return q, k, v, torch.exp(scores - lse[..., None]), lse


def _reference(qkv: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA math on (batch, seq, heads, 3, dim): the output (batch, seq, heads, dim) and the
    log-sum-exp of each row of scores (batch, heads, seq) in fp32, as the kernels return them."""
    _, _, v, p, lse = _probabilities(qkv, scale)
    return (p @ v).transpose(1, 2).to(qkv.dtype).contiguous(), lse.float()


def _reference_backward(grad_out: torch.Tensor, qkv: torch.Tensor, scale: float) -> torch.Tensor:
    """The attention backward written out (autograd is off inside a custom op's kernel)."""
    q, k, v, p, _ = _probabilities(qkv, scale)
    do = grad_out.to(q.dtype).transpose(1, 2)
    dv = p.transpose(-1, -2) @ do
    dp = do @ v.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq, dk = (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale
    return torch.stack([dq, dk, dv]).permute(1, 3, 2, 0, 4).to(qkv.dtype).contiguous()


@torch.library.custom_op("gptrain::flash4_fwd", mutates_args=())
def flash4_fwd(qkv: torch.Tensor, scale: float, cudnn_forward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of packed qkv (batch, seq, heads, 3, dim): (out, lse), both contiguous.

    ``cudnn_forward``: the forward on cuDNN's kernel (through PyTorch), which on Hopper runs head
    dim 64 faster than FlashAttention-4's (benchmarks/RESULTS.md); its log-sum-exp is the same
    quantity, so FlashAttention-4's backward takes it unchanged."""
    if not qkv.is_cuda:
        return _reference(qkv, scale)
    if cudnn_forward:
        b, s, h, _, _ = qkv.shape
        q, k, v = qkv.permute(3, 0, 2, 1, 4)
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, True, False, scale=scale)[:2]
        lse = lse.squeeze(-1) if lse.dim() == 4 else lse
        if lse.shape != (b, h, s):
            raise RuntimeError(f"cuDNN attention returned a log-sum-exp of shape {tuple(lse.shape)}, "
                               f"expected {(b, h, s)}; use --attention-backend fused")
        # cuDNN lays its output out like q, (batch, seq, heads, dim) in memory: no copy here
        return out.transpose(1, 2).contiguous(), lse.contiguous()
    q, k, v = qkv.unbind(3)
    out, lse, *_ = _interface()._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)
    return out, lse


@flash4_fwd.register_fake
def _(qkv, scale, cudnn_forward):
    b, s, h, _, d = qkv.shape
    return qkv.new_empty(b, s, h, d), qkv.new_empty(b, h, s, dtype=torch.float32)


@torch.library.custom_op("gptrain::flash4_bwd", mutates_args=())
def flash4_bwd(grad_out: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               scale: float) -> torch.Tensor:
    """The gradient of packed qkv, written by the kernels in place of its three views."""
    if not qkv.is_cuda:
        return _reference_backward(grad_out, qkv, scale)
    grad = torch.empty_like(qkv)
    dq, dk, dv = grad.unbind(3)
    q, k, v = qkv.unbind(3)
    _interface()._flash_attn_bwd(q, k, v, out, grad_out, lse, scale, True, dq=dq, dk=dk, dv=dv)
    return grad


@flash4_bwd.register_fake
def _(grad_out, qkv, out, lse, scale):
    return torch.empty_like(qkv)


def _setup(ctx, inputs, output):
    qkv, scale, _ = inputs
    out, lse = output
    ctx.save_for_backward(qkv, out, lse)
    ctx.scale = scale


def _backward(ctx, grad_out, _grad_lse):
    qkv, out, lse = ctx.saved_tensors
    return flash4_bwd(grad_out.contiguous(), qkv, out, lse, ctx.scale), None, None


flash4_fwd.register_autograd(_backward, setup_context=_setup)


def causal_attention(qkv: torch.Tensor, cudnn_forward: bool = True) -> torch.Tensor:
    """softmax(q k^T / sqrt(d), causal) v for packed qkv (batch, seq, heads, 3, dim); returns
    (batch, seq, heads, dim), the layout the output projection reads without a transpose. The
    backward always runs FlashAttention-4's kernel; the forward cuDNN's unless told otherwise."""
    return flash4_fwd(qkv, qkv.shape[-1] ** -0.5, cudnn_forward)[0]


def sdpa_causal_attention(qkv: torch.Tensor) -> torch.Tensor:
    """The same through SDPA (for comparisons)."""
    q, k, v = qkv.permute(3, 0, 2, 1, 4)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
