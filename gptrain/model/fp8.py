"""fp8 matmuls for the transformer layers through torchao's float8 training (``--fp8``).

Every ``nn.Linear`` of the blocks becomes a ``Float8Linear``: inputs, weights and output gradients
are scaled per tensor (or per row) and cast to fp8 just before each matmul; the weights, the
optimizer and everything outside the matmuls stay as they were. The tied output layer and the
embeddings keep bf16: the vocabulary projection is where fp8 costs the most accuracy.

Formats follow Megatron's ``--fp8-format``: ``hybrid`` is e4m3 for inputs and weights and e5m2
for gradients, ``e4m3`` is e4m3 everywhere (torchao's rowwise recipe is always e4m3: its per-row
scales leave e5m2's range unneeded).
"""
from __future__ import annotations

import dataclasses

import torch


def _linear_filter(module: torch.nn.Module, fqn: str) -> bool:
    # fp8 matmuls need both dimensions divisible by 16
    return fqn.startswith("layers.") and module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_fp8(model: torch.nn.Module, fmt: str, recipe: str, emulate: bool = False) -> int:
    """Swap the blocks' linear layers for torchao's Float8Linear; returns how many were swapped."""
    try:
        from torchao.float8 import CastConfig, Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise RuntimeError("--fp8 needs torchao's float8 training: pip install 'torchao>=0.15'") from err
    if not emulate:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
            raise RuntimeError("--fp8 needs a GPU with fp8 matmuls (Ada or Hopper, compute capability 8.9+)")
    config = Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "tensorwise" and fmt == "e4m3":
        e4m3 = CastConfig(target_dtype=torch.float8_e4m3fn)
        config = Float8LinearConfig(cast_config_input=e4m3, cast_config_weight=e4m3, cast_config_grad_output=e4m3)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    before = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    convert_to_float8_training(model, module_filter_fn=_linear_filter, config=config)
    after = sum(type(m) is torch.nn.Linear for m in model.modules())
    return before - after
