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
from gptrain.parallel.pipeline import stage_layer_counts

_COLUMN = ("attn.qkv.weight", "attn.qkv.bias", "mlp.fc1.weight", "mlp.fc1.bias",  # split by output rows
           "mlp.gate.weight", "mlp.gate.bias", "mlp.up.weight", "mlp.up.bias")
_ROW = ("attn.proj.weight", "mlp.fc2.weight")  # split by input columns


def _tp_numel(name: str, numel: int, tp: int) -> int:
    if name.endswith(_COLUMN + _ROW) or name in ("word_embeddings.weight", "output_layer.weight"):
        return numel // tp
    return numel


def stage_layers(num_layers: int, pp: int, stage: int, first: int | None = None, last: int | None = None) -> range:
    counts = stage_layer_counts(num_layers, pp, first, last)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def parameter_counts(cfg: GPTConfig, dims: ParallelDims, first: int | None = None,
                     last: int | None = None) -> dict[tuple[int, int], int]:
    """{(tensor rank, pipeline rank): parameters held}; the data-parallel ranks hold the same.
    ``first`` / ``last``: the first / last stage's layers of an uneven split."""
    with torch.device("meta"):
        model = GPT(cfg)
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    counts = {}
    for stage in range(dims.pp):
        layers = {str(i) for i in stage_layers(cfg.num_layers, dims.pp, stage, first, last)}
        total = 0
        for name, numel in sizes.items():
            if name.startswith("layers."):
                held = name.split(".")[1] in layers
            elif name in ("word_embeddings.weight", "position_embeddings.weight"):
                tied = not cfg.untie_embeddings_and_output_weights
                held = stage == 0 or (name == "word_embeddings.weight" and tied and stage == dims.pp - 1)
            else:  # the final LayerNorm and an untied output layer
                held = stage == dims.pp - 1
            if held:
                total += _tp_numel(name, numel, dims.tp)
        for t in range(dims.tp):
            counts[(t, stage)] = total
    return counts
