"""The architecture of gptrain's GPT (GPTConfig) and Megatron's vocabulary padding rule, apart from
model/gpt.py so that the flag declarations (config.py, `gptrain train --help`) need no torch."""
from __future__ import annotations

from dataclasses import dataclass


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tensor_parallel: int = 1) -> int:
    """Megatron's ``_vocab_size_with_padding``: round up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tensor_parallel
    return ((vocab_size + multiple - 1) // multiple) * multiple


@dataclass
class GPTConfig:
    """The architecture (what a checkpoint's weights mean); kernels and parallelism live apart
    (config.KernelConfig, config.ParallelConfig)."""
    num_layers: int = 24
    hidden_size: int = 1024
    num_attention_heads: int = 16
    ffn_hidden_size: int | None = None  # default 4 x hidden
    seq_length: int = 1024
    max_position_embeddings: int | None = None  # default seq_length
    vocab_size: int = 50257
    make_vocab_size_divisible_by: int = 128
    tensor_parallel_size: int = 1  # only for the vocabulary padding rule (Megatron pads to 128 x TP)
    init_method_std: float = 0.02
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    # the Llama family's choices (Megatron's flags and defaults); the defaults build GPT-2
    swiglu: bool = False
    normalization: str = "LayerNorm"
    position_embedding_type: str = "learned_absolute"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    group_query_attention: bool = False
    num_query_groups: int | None = None  # default: 1 with --group-query-attention (Megatron's), else the heads
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    kv_channels: int | None = None  # default: hidden / heads
    apply_layernorm_1p: bool = False  # Megatron's zero-centred norm weights: the scale applied is 1 + weight

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            # Megatron's: SwiGLU's two input matrices keep about 4h's parameters, a multiple of 64
            self.ffn_hidden_size = (int((4 * self.hidden_size * 2 / 3) / 64) * 64 if self.swiglu
                                    else 4 * self.hidden_size)
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"--hidden-size {self.hidden_size} is not divisible by "
                                 f"--num-attention-heads {self.num_attention_heads} (or give --kv-channels)")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        check_architecture(self)
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                             f"{self.max_position_embeddings}")

    @property
    def head_dim(self) -> int:
        return self.kv_channels

    @property
    def gpt2_layout(self) -> bool:
        """Whether this is the GPT-2 architecture the fused kernels and parallel plans were written for."""
        return (not self.swiglu and self.normalization == "LayerNorm" and not self.apply_layernorm_1p
                and self.position_embedding_type ==
                "learned_absolute" and self.num_query_groups == self.num_attention_heads and self.add_bias_linear
                and not self.untie_embeddings_and_output_weights
                and self.kv_channels * self.num_attention_heads == self.hidden_size)

    @property
    def rotary_dim(self) -> int:
        """Megatron's: the first int(kv_channels x rotary_percent) channels of each head rotate."""
        return int(self.kv_channels * self.rotary_percent)

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, self.tensor_parallel_size)

    def embedding_parameters(self) -> int:
        """The word (and learned position) embeddings and an untied output layer."""
        h = self.hidden_size
        positions = self.max_position_embeddings if self.position_embedding_type == "learned_absolute" else 0
        output = self.padded_vocab_size if self.untie_embeddings_and_output_weights else 0
        return (self.padded_vocab_size + positions + output) * h

    def num_parameters(self) -> int:
        h, f, L = self.hidden_size, self.ffn_hidden_size, self.num_layers
        q, kv = self.num_attention_heads * self.kv_channels, self.num_query_groups * self.kv_channels
        norm = 2 * h if self.normalization == "LayerNorm" else h
        bias = 1 if self.add_bias_linear else 0
        qkv = h * (q + 2 * kv) + (q + 2 * kv) * (1 if self.add_bias_linear or self.add_qkv_bias else 0)
        inputs = 2 * f if self.swiglu else f  # SwiGLU: gate and up
        mlp = h * inputs + inputs * bias + f * h + h * bias
        per_layer = 2 * norm + qkv + (q * h + h * bias) + mlp
        return self.embedding_parameters() + L * per_layer + norm

    def flops_per_token(self) -> float:
        """Model FLOPs per token, forward + backward (DESIGN.md section 5): 6 x the matmul weights
        (the layers' and the output layer's) + the attention scores' and values' 12 L s (heads x kv)."""
        non_embedding = self.num_parameters() - self.embedding_parameters()
        output_layer = self.padded_vocab_size * self.hidden_size
        attention = 12.0 * self.num_layers * self.num_attention_heads * self.kv_channels * self.seq_length
        return 6.0 * (non_embedding + output_layer) + attention


def check_architecture(cfg: GPTConfig) -> None:
    """Megatron's choices and refusals for the Llama-family flags (num_query_groups resolved here)."""
    if cfg.normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"--normalization {cfg.normalization}: LayerNorm or RMSNorm")
    if cfg.position_embedding_type not in ("learned_absolute", "rope", "none"):
        raise ValueError(f"--position-embedding-type {cfg.position_embedding_type}: learned_absolute, rope or none")
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups
    if not cfg.group_query_attention:
        if groups not in (None, heads):  # Megatron ignores it silently; gptrain ignores no flag
            raise ValueError(f"--num-query-groups {groups} takes effect only with --group-query-attention")
        cfg.num_query_groups = groups = heads
    elif groups is None:
        cfg.num_query_groups = groups = 1  # Megatron's default: one K/V head (multi-query attention)
    if groups < 1 or heads % groups:
        raise ValueError(f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}: "
                         "each K/V group serves the same number of query heads")
    if cfg.position_embedding_type == "rope":
        if not 0.0 < cfg.rotary_percent <= 1.0:
            raise ValueError(f"--rotary-percent {cfg.rotary_percent}: in (0, 1]")
        if cfg.rotary_dim < 2 or cfg.rotary_dim % 2:
            raise ValueError(f"--rotary-percent {cfg.rotary_percent} x --kv-channels {cfg.kv_channels} rotates "
                             f"{cfg.rotary_dim} channels of each head: an even number is needed")
        if cfg.rotary_base <= 0:
            raise ValueError(f"--rotary-base {cfg.rotary_base}: a positive number")
    # (the heads' own split is checked with the layout); Megatron copies groups when TP is a multiple of them: not built
    if cfg.group_query_attention and groups % cfg.tensor_parallel_size:
        raise ValueError(f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size "
                         f"{cfg.tensor_parallel_size}: each tensor-parallel rank holds whole K/V groups")
