"""The tiny test model, defined once: 2 layers, hidden size 32, 4 heads. Tests take its flags
(``TINY_FLAGS`` + their own run flags) or its config (``tiny_config(**their sizes)``, no dropout)."""
from __future__ import annotations

from gptrain.model.gpt import GPTConfig

TINY_SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
TINY_FLAGS = "--num-layers 2 --hidden-size 32 --num-attention-heads 4".split()


def tiny_config(**overrides) -> GPTConfig:
    return GPTConfig(**{**TINY_SHAPE, "hidden_dropout": 0.0, "attention_dropout": 0.0, **overrides})


def hf_twin(model):
    """transformers' GPT2LMHeadModel with ``model``'s weights, set up to greedy-decode as gptrain does
    (no eos, pad 0): the reference the decode tests compare against. Skips without transformers."""
    import pytest

    transformers = pytest.importorskip("transformers")
    from gptrain.interop.hf import hf_config_kwargs, to_hf_state_dict

    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_config_kwargs(model.cfg))).eval()
    hf.load_state_dict(to_hf_state_dict(model), strict=False)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf
