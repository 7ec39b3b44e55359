"""GPT-2 as Megatron-LM builds it, in plain PyTorch (no parallel code: ``gptrain.parallel`` transforms it).

Token + learned position embeddings, pre-LayerNorm blocks (causal self-attention through
``scaled_dot_product_attention``, a 4h GELU MLP, biases everywhere), a final LayerNorm, and an
output layer tied to the word embeddings. The vocabulary is padded (Megatron's rule) for fast
matrix shapes; padded rows never receive probability mass: the loss and the returned logits
only ever see the first ``vocab_size`` columns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.nn.attention import SDPBackend, sdpa_kernel

from gptrain.kernels import flash4
from gptrain.kernels.cublaslt import unavailable_reason as cublaslt_unavailable
from gptrain.model.linear import linear, linear_weight, mlp
from gptrain.model.loss import lm_cross_entropy


# Megatron's --attention-backend names onto PyTorch's SDPA kernels (None: PyTorch's own choice)
SDPA_BACKENDS = {
    "auto": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "fused": [SDPBackend.CUDNN_ATTENTION],
    "unfused": [SDPBackend.MATH],
    "local": [SDPBackend.MATH],
    # FlashAttention-4's kernels on packed QKV where GPT.use_flash4 enables them (kernels/flash4.py);
    # SDPA's own choice where they cannot run
    "flash4": None,
}


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tensor_parallel: int = 1) -> int:
    """Megatron's ``_vocab_size_with_padding``: round up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tensor_parallel
    return ((vocab_size + multiple - 1) // multiple) * multiple


@dataclass
class GPTConfig:
    num_layers: int = 24
    hidden_size: int = 1024
    num_attention_heads: int = 16
    ffn_hidden_size: int | None = None  # default 4 x hidden
    seq_length: int = 1024
    max_position_embeddings: int | None = None  # default seq_length
    vocab_size: int = 50257
    make_vocab_size_divisible_by: int = 128
    tensor_parallel_size: int = 1  # only for the vocabulary padding rule
    init_method_std: float = 0.02
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    # chunked loss that never holds the whole batch's logits (benchmarks/RESULTS.md has its cost)
    fused_cross_entropy: bool = False
    recompute: str | None = None  # None, "full" (whole blocks) or "selective" (core attention)
    attention_backend: str = "auto"  # Megatron's names: auto, flash, fused (cuDNN), unfused/local (math)
    # "cublaslt": every linear layer's matmuls autotuned through cuBLASLt where the device allows
    # (model/linear.py), "torch": PyTorch's own, "auto": cublaslt for micro-batches large enough to
    # hide its host cost (the trainer decides); with cublaslt, fc1's bias and GELU go into its epilogues
    linear_impl: str = "auto"
    bias_gelu_fusion: bool = True

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"--hidden-size {self.hidden_size} is not divisible by "
                             f"--num-attention-heads {self.num_attention_heads}")
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                             f"{self.max_position_embeddings}")
        if self.recompute not in (None, "full", "selective"):
            raise ValueError(f"recompute {self.recompute!r}: use full or selective")
        if self.linear_impl not in ("auto", "cublaslt", "torch"):
            raise ValueError(f"--linear-impl {self.linear_impl}: use auto, cublaslt or torch")
        if self.attention_backend not in SDPA_BACKENDS:
            raise ValueError(f"--attention-backend {self.attention_backend}: use one of {', '.join(SDPA_BACKENDS)}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, self.tensor_parallel_size)

    def num_parameters(self) -> int:
        h, f, L = self.hidden_size, self.ffn_hidden_size, self.num_layers
        per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        return self.padded_vocab_size * h + self.max_position_embeddings * h + L * per_layer + 2 * h

    def flops_per_token(self) -> float:
        """Model FLOPs per token, forward + backward (DESIGN.md section 5)."""
        non_embedding = self.num_parameters() - (self.padded_vocab_size + self.max_position_embeddings) * self.hidden_size
        output_layer = self.padded_vocab_size * self.hidden_size
        return 6.0 * (non_embedding + output_layer) + 12.0 * self.num_layers * self.hidden_size * self.seq_length


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.attention_dropout = cfg.attention_dropout
        self.backends = SDPA_BACKENDS[cfg.attention_backend]
        self.recompute_core = cfg.recompute == "selective"
        self.tuned = False  # set by GPT.use_cublaslt once device and dtype are final
        self.flash4 = False  # set by GPT.use_flash4

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout = self.attention_dropout if self.training else 0.0
        if self.backends is None or q.device.type != "cuda":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        with sdpa_kernel(self.backends):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = linear(x, self.qkv, self.tuned).view(b, s, 3, self.num_heads, h // self.num_heads)
        if self.flash4:  # reads q, k, v in place and returns (b, s, heads, dim): no transposes
            core = flash4.causal_attention
            y = checkpoint(core, qkv, use_reentrant=False) if self.recompute_core and self.training else core(qkv)
            return linear(y.reshape(b, s, h), self.proj, self.tuned)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        if self.recompute_core and self.training:
            y = checkpoint(self.core_attention, q, k, v, use_reentrant=False)
        else:
            y = self.core_attention(q, k, v)
        return linear(y.transpose(1, 2).reshape(b, s, h), self.proj, self.tuned)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.fc2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)
        self.tuned = self.fuse_bias_gelu = False  # set by GPT.use_cublaslt once device and dtype are final

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mlp(x, self.fc1, self.fc2, self.tuned, self.fuse_bias_gelu)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.mlp = MLP(cfg)
        self.hidden_dropout = cfg.hidden_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attn(self.ln1(x)), self.hidden_dropout, self.training)
        return x + F.dropout(self.mlp(self.ln2(x)), self.hidden_dropout, self.training)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        # keyed by index so names stay stable when pipeline stages drop layers
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.num_layers)})
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.compile_loss = False  # the trainer sets it with --compile: the fused loss's chunk kernel compiles
        self.tuned_head = False  # the output layer's matmuls through cuBLASLt (use_cublaslt)

    def use_cublaslt(self, fuse_bias_gelu: bool = True, allow_reference: bool = False) -> str | None:
        """Route every linear layer (and the output layer) through the autotuned cuBLASLt ops, with
        fc1's bias and GELU fused if asked; returns why not where they cannot run (device, dtype).
        ``allow_reference`` lets the CPU take the same ops as plain PyTorch (tests)."""
        weight = self.word_embeddings.weight
        reason = cublaslt_unavailable(weight.device, weight.dtype)
        if allow_reference and weight.device.type == "cpu":
            reason = None
        if self.cfg.hidden_size % 8 or self.cfg.ffn_hidden_size % 8:
            reason = (f"hidden size {self.cfg.hidden_size} / ffn size {self.cfg.ffn_hidden_size} not multiples of 8 "
                      "(cuBLASLt's epilogues need 16-byte rows)")
        for block in self.layers.values():
            block.attn.tuned = block.mlp.tuned = reason is None
            block.mlp.fuse_bias_gelu = reason is None and fuse_bias_gelu
        self.tuned_head = reason is None
        return reason

    def use_flash4(self, allow_reference: bool = False) -> str | None:
        """Run every layer's core attention on FlashAttention-4's kernels (kernels/flash4.py);
        returns why not where they cannot (device, dtype, dropout, package missing).
        ``allow_reference`` lets the CPU take the same ops as plain PyTorch (tests)."""
        weight = self.word_embeddings.weight
        dropout = self.cfg.attention_dropout
        head_dim = self.cfg.hidden_size // self.cfg.num_attention_heads
        reason = flash4.unavailable_reason(weight.device, weight.dtype, head_dim, dropout)
        if allow_reference and weight.device.type == "cpu" and not dropout:
            reason = None
        for block in self.layers.values():
            block.attn.flash4 = reason is None
        return reason

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Megatron's init: N(0, std) weights, output projections N(0, std / sqrt(2 L)), zero biases.

        Drawn on the CPU from one generator in a fixed order, so the full weights depend only on the
        seed, never on the device or on how the model is later sharded.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        scaled_std = self.cfg.init_method_std / math.sqrt(2.0 * self.cfg.num_layers)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                value = torch.zeros(param.shape)
            elif "layernorm" in name or ".ln" in name:
                value = torch.ones(param.shape)
            else:
                std = scaled_std if name.endswith(("attn.proj.weight", "mlp.fc2.weight")) else self.cfg.init_method_std
                value = torch.empty(param.shape).normal_(0.0, std, generator=gen)
            param.copy_(value.to(param.dtype))

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.word_embeddings(tokens) + self.position_embeddings(positions)
        x = F.dropout(x, self.cfg.hidden_dropout, self.training)
        for block in self.layers.values():
            if self.cfg.recompute == "full" and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.final_layernorm(x)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the real vocabulary, or with ``labels`` the mean token cross-entropy."""
        h = self.hidden_states(tokens)
        if labels is not None:
            return lm_cross_entropy(h, self.word_embeddings.weight, labels, self.cfg.vocab_size,
                                    fused=self.cfg.fused_cross_entropy, compiled=self.compile_loss,
                                    tuned=self.tuned_head)
        return F.linear(h, self.word_embeddings.weight[: self.cfg.vocab_size])
