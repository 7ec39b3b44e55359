"""The kernel converter: installs gptrain's fast ops on a built model by swapping modules, and
says what runs and why (the run log's `` > linear layers:`` and `` > attention:`` lines).

Runs on the meta-device model, before parallelisation, with the device and dtype the parameters
will have. Where a kernel cannot run (device, dtype, sizes, package missing, a layout it does not
compose with) the plain module stays and the reason is returned; asked for by name and unable to
run is an error, not a silent fallback.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend

from gptrain.kernels import flash4
from gptrain.kernels.cublaslt import unavailable_reason as cublaslt_unavailable
from gptrain.model.gpt import GPT, MLP, CausalSelfAttention
from gptrain.model.linear import FusedBiasGeluMLP, TunedLinear
from gptrain.model.loss import LMLoss

# Megatron's --attention-backend names onto PyTorch's SDPA kernels (None: PyTorch's own choice)
SDPA_BACKENDS = {
    "auto": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "fused": [SDPBackend.CUDNN_ATTENTION],
    "unfused": [SDPBackend.MATH],
    "local": [SDPBackend.MATH],
    "flash4": None,
}

# --linear-impl auto: below this many tokens per micro-batch the cuBLASLt ops' host cost (~290
# ctypes/custom-op calls per micro-batch for 24 layers) outweighs their gain (benchmarks/RESULTS.md);
# every ZeRO stage (FSDP2) adds per-block hooks and gathers on the host, so it needs larger micro-batches
# to hide them (ZeRO-1/2 on the cuBLASLt ops were host-bound at 16,384 tokens, RESULTS.md s24)
AUTO_CUBLASLT_MIN_TOKENS = 16384
AUTO_CUBLASLT_MIN_TOKENS_SHARDED = 32768


@dataclass(frozen=True)
class KernelChoice:
    """What runs for one part of the model (linear layers, attention) and, where it is not the fast
    path or was forced by a flag, why; ``str()`` is the run log's text, "impl (reason)"."""
    impl: str  # "torch", "cuBLASLt, autotuned[, bias-GELU fused]", "SDPA", "SDPA, PyTorch's pick", ...
    reason: str | None = None

    def __str__(self) -> str:
        return self.impl if self.reason is None else f"{self.impl} ({self.reason})"

    def brief(self, verbose: bool) -> str:
        """The log line's text without the reason, which --verbose keeps."""
        return str(self) if verbose or self.reason is None else f"{self.impl} (--verbose: why)"


class Flash4Attention(nn.Module):
    """Core attention on FlashAttention-4's kernels, reading packed qkv in place (kernels/flash4.py)."""

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        return flash4.causal_attention(qkv)


def use_cublaslt(model: GPT, loss: LMLoss | None, device: torch.device, dtype: torch.dtype,
                 fuse_bias_gelu: bool = True, allow_reference: bool = False) -> str | None:
    """Swap every linear layer (and the loss's output layer) onto the autotuned cuBLASLt ops, with
    fc1's bias and GELU fused if asked; returns why not where they cannot run.
    ``allow_reference`` lets the CPU take the same ops as plain PyTorch (tests)."""
    reason = cublaslt_unavailable(device, dtype)
    if allow_reference and device.type == "cpu":
        reason = None
    cfg = model.cfg
    if cfg.hidden_size % 8 or cfg.ffn_hidden_size % 8:
        reason = (f"hidden size {cfg.hidden_size} / ffn size {cfg.ffn_hidden_size} not multiples of 8 "
                  "(cuBLASLt's epilogues need 16-byte rows)")
    if reason is not None:
        return reason
    for block in model.layers.values():
        for layer in list(block.modules()):  # QKV, proj, the MLP's (fc1 or gate and up, fc2)
            if type(layer) is nn.Linear:
                layer.__class__ = TunedLinear
        if fuse_bias_gelu and type(block.mlp) is MLP:
            block.mlp.__class__ = FusedBiasGeluMLP
    if loss is not None:
        loss.tuned = True
    return None


def use_flash4(model: GPT, device: torch.device, dtype: torch.dtype, allow_reference: bool = False) -> str | None:
    """Swap every layer's core attention onto FlashAttention-4's kernels; returns why not where
    they cannot run. ``allow_reference`` lets the CPU take the same ops as plain PyTorch (tests)."""
    dropout = model.cfg.attention_dropout
    reason = flash4.unavailable_reason(device, dtype, model.cfg.head_dim, dropout)
    if allow_reference and device.type == "cpu" and not dropout:
        reason = None
    if any(type(block.attn) is not CausalSelfAttention for block in model.layers.values()):
        reason = "grouped-query or rotary attention runs on SDPA (FlashAttention-4 here reads packed per-head QKV)"
    if reason is None:
        for block in model.layers.values():
            block.attn.core = Flash4Attention()
    return reason


def linear_choice(model: GPT, loss: LMLoss | None, kernels, device: torch.device, dtype: torch.dtype,
                  tokens_per_micro_batch: int, fp8: bool,
                  min_tokens: int = AUTO_CUBLASLT_MIN_TOKENS, tensor_parallel: int = 1,
                  compiled: bool = False) -> KernelChoice:
    if kernels.linear_impl == "torch":
        return KernelChoice("torch", "--linear-impl torch")
    if fp8:
        return KernelChoice("torch", "fp8 layers do their own matmuls")
    if kernels.linear_impl == "auto" and compiled and kernels.recompute == "full":
        # compiled with full recompute, the cuBLASLt layers' outputs stayed alive across the recomputed
        # blocks (a GPU memory profile of the 2.7B at micro-batch 16 found every fc1's two outputs held)
        return KernelChoice("torch", "auto: full recompute under torch.compile keeps the cuBLASLt layers' outputs; "
                            "--linear-impl cublaslt forces them")
    # a tensor-parallel rank's matmuls do 1/tp of the work for the same host cost per call
    work = tokens_per_micro_batch // tensor_parallel
    if kernels.linear_impl == "auto" and work < min_tokens:
        zero = " under ZeRO" if min_tokens != AUTO_CUBLASLT_MIN_TOKENS else ""
        per_rank = f" / tensor-parallel size {tensor_parallel}" if tensor_parallel > 1 else ""
        return KernelChoice("torch", f"auto: {tokens_per_micro_batch} tokens per micro-batch{per_rank}; cuBLASLt's "
                            f"host cost shows below {min_tokens}{zero}, --linear-impl cublaslt forces it")
    reason = use_cublaslt(model, loss, device, dtype, fuse_bias_gelu=kernels.bias_gelu_fusion)
    if reason is not None:
        return KernelChoice("torch", f"cuBLASLt not usable: {reason}")
    return KernelChoice("cuBLASLt, autotuned" + (", bias-GELU fused" if kernels.bias_gelu_fusion else ""))


def attention_choice(model: GPT, kernels, device: torch.device, dtype: torch.dtype) -> KernelChoice:
    backend = kernels.attention_backend
    if backend not in ("auto", "flash4"):
        for block in model.layers.values():
            block.attn.core.backends = SDPA_BACKENDS[backend]
        return KernelChoice("SDPA", f"--attention-backend {backend}")
    reason = use_flash4(model, device, dtype)
    if reason is None:
        return KernelChoice("FlashAttention-4 on packed QKV")
    if backend == "flash4":
        raise ValueError(f"--attention-backend flash4 cannot run: {reason}")
    return KernelChoice("SDPA, PyTorch's pick", f"FlashAttention-4 not usable: {reason}")


def apply_kernels(model: GPT, loss: LMLoss, kernels, device: torch.device, dtype: torch.dtype,
                  tokens_per_micro_batch: int, fp8: bool = False, compiled: bool = False,
                  sharded: bool = False, tensor_parallel: int = 1) -> dict[str, KernelChoice]:
    """Install the kernels the config asks for where they can run; returns what runs, by part.
    ``sharded``: a ZeRO stage on FSDP2."""
    loss.compiled = compiled
    min_tokens = AUTO_CUBLASLT_MIN_TOKENS_SHARDED if sharded else AUTO_CUBLASLT_MIN_TOKENS
    return {"linear layers": linear_choice(model, loss, kernels, device, dtype, tokens_per_micro_batch, fp8,
                                           min_tokens=min_tokens, tensor_parallel=tensor_parallel, compiled=compiled),
            "attention": attention_choice(model, kernels, device, dtype)}
