"""What each rank of a layout holds, computed on the meta-device model without building the
layout: Megatron's per-rank parameter counts (``--dry-run`` prints them, seeds/004's lines).

Megatron's rules: tensor parallelism splits QKV and fc1 by output rows (weights and biases), the
attention projection and fc2 by input columns (their biases stay whole), and the word embeddings by
vocabulary rows (padded to a multiple of 128 x TP); LayerNorms and position embeddings stay whole.
Pipeline stages take consecutive layers; the first holds the embeddings, the last the final
LayerNorm and, with more than one stage, its own copy of the tied word embeddings.
"""
from __future__ import annotations

import torch

from gptrain.model.gpt import GPT, GPTConfig
from gptrain.parallel.dims import ParallelDims

_COLUMN = ("attn.qkv.weight", "attn.qkv.bias", "mlp.fc1.weight", "mlp.fc1.bias")  # split by output rows
_ROW = ("attn.proj.weight", "mlp.fc2.weight")  # split by input columns


def _tp_numel(name: str, numel: int, tp: int) -> int:
    if name.endswith(_COLUMN + _ROW) or name == "word_embeddings.weight":
        return numel // tp
    return numel


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    per_stage = num_layers // pp
    return range(stage * per_stage, (stage + 1) * per_stage)


def parameter_counts(cfg: GPTConfig, dims: ParallelDims) -> dict[tuple[int, int], int]:
    """{(tensor rank, pipeline rank): parameters held}; the data-parallel ranks hold the same."""
    with torch.device("meta"):
        model = GPT(cfg)
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    counts = {}
    for stage in range(dims.pp):
        layers = {str(i) for i in stage_layers(cfg.num_layers, dims.pp, stage)}
        total = 0
        for name, numel in sizes.items():
            if name.startswith("layers."):
                held = name.split(".")[1] in layers
            elif name in ("word_embeddings.weight", "position_embeddings.weight"):
                held = stage == 0 or (name == "word_embeddings.weight" and stage == dims.pp - 1)
            else:  # final LayerNorm
                held = stage == dims.pp - 1
            if held:
                total += _tp_numel(name, numel, dims.tp)
        for t in range(dims.tp):
            counts[(t, stage)] = total
    return counts
