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

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"--hidden-size {self.hidden_size} is not divisible by "
                             f"--num-attention-heads {self.num_attention_heads}")
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                             f"{self.max_position_embeddings}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

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
