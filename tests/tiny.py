"""The tiny test model, defined once: 2 layers, hidden size 32, 4 heads. Tests take its flags
(``TINY_FLAGS`` + their own run flags) or its config (``tiny_config(**their sizes)``, no dropout)."""
from __future__ import annotations

from gptrain.model.gpt import GPTConfig

TINY_SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
TINY_FLAGS = "--num-layers 2 --hidden-size 32 --num-attention-heads 4".split()


def tiny_config(**overrides) -> GPTConfig:
    return GPTConfig(**{**TINY_SHAPE, "hidden_dropout": 0.0, "attention_dropout": 0.0, **overrides})
