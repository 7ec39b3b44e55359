"""Megatron's distributed optimizer (``--use-distributed-optimizer``) in its default torch_dist format,
``dp_reshardable`` (Megatron-LM's _build_sharded_state_dict_metadata): per parameter, the fp32 main
weights and Adam's moments, for training's ``--load``.

That format saves the optimizer's own buffers: per gradient buffer (one per (param dtype, grad dtype)) and
bucket, flat fp32 tensors ``optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<i>.dtype_(<param>, <grad>)
.bucket_idx_<b>.{param,exp_avg,exp_avg_sq}`` holding the bucket's parameters one after another, each
starting at a multiple of 64 elements (megatron-core's ParamAndGradBuffer, padding between them), and
no record of which parameter sits where. The order is megatron-core's module order reversed, which
the checkpoint's key order gives; the main weights check it slot by slot: the model weights (saved
beside them) are the main weights cast to the model's dtype, so each slot is named by the weight that
equals it, the next one in the expected order where several do (bf16 LayerNorm weights near 1 are
often all equal: bf16's spacing there, 2^-7, is larger than many steps of updates). A parameter placed
nowhere, or a slot no weight equals, means the layout is not what this reader expects, and nothing is
imported.

A tensor-parallel run keeps each TP rank's buffers under its own ``dp_group_idx`` (the rank in
megatron-core's model-parallel group: the TP rank at PP1), holding that rank's shards of the parameters
(QKV/fc1 rows, proj/fc2 columns, the embeddings' vocabulary rows, LayerNorms and row-parallel biases
whole): the slots are matched against each rank's slices of the saved (global) weights, and the shards'
state joined by the weights' rules (:func:`megatron_keys.merge_shards`, SwiGLU's per-rank ``[gate; up]``).
A pipeline-parallel run's stages likewise (``dp_group_idx`` = stage x TP + TP rank), each matched against
its own parameters only: its layers (Megatron's even split), the embeddings on the first stage, the final
norm and output layer on the last, where a tied output layer is a copy of the word embeddings with a
slot of its own (dropped after the match: the first stage's is the parameter). Uneven or virtual
pipeline splits are not imported.
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch

from gptrain.interop import megatron_llama as llama
from gptrain.interop.megatron_dist import byte_entry, model_keys, read_entries
from gptrain.interop.megatron_keys import map_key, merge_shards

ALIGN = 64  # megatron-core's _pad_start_of_param_if_needed under the distributed optimizer
STATES = ("param", "exp_avg", "exp_avg_sq")
_BUCKET = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\."
                     r"dtype_(.+)\.bucket_idx_(\d+)\.(" + "|".join(STATES) + r")$")


class LayoutNotRecovered(Exception):
    """The buffers' parameter layout could not be recovered (the message says why)."""


def _buckets(keys) -> dict[tuple, dict[str, str]]:
    """(chain, group, buffer, dtype, bucket) -> state -> key, in buffer order."""
    found: dict[tuple, dict[str, str]] = defaultdict(dict)
    for key in keys:
        m = _BUCKET.match(key)
        if m:
            chain, group, gbuf, dtype, bucket, state = m.groups()
            found[(int(chain or 0), int(group), int(gbuf), dtype, int(bucket))][state] = key
    return dict(sorted(found.items()))


# Megatron-LM's arguments for pipeline splits other than num_layers / PP layers per stage
_UNEVEN = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout",
           "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
           "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage")
TIED_COPY = "output_layer.weight"  # the last stage's copy of the tied word embeddings


def _stage_of(group: int, layer: int, args: dict, pp: int) -> int:
    """The pipeline stage holding a parameter: group 0 (embeddings) the first, 2 (final norm, output) the last."""
    if group == 1:
        return layer // (int(args["num_layers"]) // pp)
    return 0 if group == 0 else pp - 1


def _in_buffer_order(tensors: dict[str, torch.Tensor], args: dict, pp: int) -> dict[str, tuple]:
    """The model's weights (gptrain names, fc1 whole) with their tensor-parallel rules and stages, in the order
    megatron-core's buffers most likely hold them: its module order reversed. The checkpoint's keys come in
    module order (embeddings, one layer's parameters, final norm, output layer), with the layers stacked,
    so a layer's index goes before the key's."""
    ranked = []
    seen_layers = False
    for index, (key, tensor) in enumerate(tensors.items()):
        stacked = key.startswith("decoder.layers.")
        seen_layers |= stacked
        group = 1 if stacked else 2 if seen_layers else 0
        per_layer = enumerate(tensor.unbind(0)) if stacked else [(0, tensor)]
        for layer, value in per_layer:
            mapped = map_key(key.replace("decoder.layers.", f"decoder.layers.{layer}.", 1) if stacked else key,
                             "megatron-core")
            if mapped is None:
                continue
            name, _, rule = mapped
            if name == "output_layer.weight" and not args.get("untie_embeddings_and_output_weights"):
                continue  # the tied copy: not a parameter at one pipeline stage
            if name.startswith("mlp.fc1.") and args.get("swiglu"):
                rule = llama.GLU  # [gate_i; up_i] per rank
            stage = _stage_of(group, layer, args, pp)
            name = f"layers.{layer}.{name}" if stacked else name
            ranked.append(((group, layer, index), name, (value, rule, stage)))
    if pp > 1 and not args.get("untie_embeddings_and_output_weights"):  # the last module of the last stage
        ranked.append(((3, 0, 0), TIED_COPY, (tensors["embedding.word_embeddings.weight"], "cat0", pp - 1)))
    return {name: value for _, name, value in sorted(ranked, key=lambda r: r[0], reverse=True)}


def _shard(value: torch.Tensor, rule: str, tp: int, rank: int) -> torch.Tensor:
    """Tensor-parallel rank ``rank``'s part of a global weight, as megatron-core splits it."""
    if tp == 1 or rule == "rank0":
        return value
    if rule == llama.GLU:
        return llama.shard_glu(value, tp, rank)
    return value.chunk(tp, dim=1 if rule == "cat1" else 0)[rank]


def _join(shards: list[torch.Tensor], rule: str, name: str, folder: Path) -> torch.Tensor:
    return llama.merge_glu(shards) if rule == llama.GLU else merge_shards(shards, rule, name, folder)


def _place(weights: dict[str, torch.Tensor], flat: torch.Tensor, taken: set[str]) -> dict[str, slice]:
    """Each parameter slot of one bucket's flat main weights, named by the model weight it equals, the first
    in ``weights``' order where several do (a parameter in ``taken`` sits in an earlier bucket)."""
    by_first: dict[float, list[str]] = defaultdict(list)  # candidates by their first element
    for name, w in weights.items():
        if name not in taken:
            by_first[w.reshape(-1)[0].item()].append(name)
    dtype = next(iter(weights.values())).dtype
    placed, pos = {}, 0
    while (start := -(-pos // ALIGN) * ALIGN) < flat.numel():
        for name in by_first.get(flat[start].to(dtype).item(), []):
            w = weights[name].reshape(-1)
            if start + w.numel() <= flat.numel() and torch.equal(flat[start:start + w.numel()].to(w.dtype), w):
                placed[name] = slice(start, start + w.numel())
                by_first[w[0].item()].remove(name)
                pos = start + w.numel()
                break
        else:
            raise LayoutNotRecovered(f"no weight equals the main weights at element {start} of a bucket")
    return placed


def _rank_state(folder: Path, metadata, buckets: dict, weights: dict[str, torch.Tensor]) -> dict:
    """One rank's buffers by parameter: name -> {"main", "exp_avg", "exp_avg_sq"} at ``weights``' shapes."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, states in buckets.items():
        if set(states) != set(STATES):
            raise LayoutNotRecovered(f"bucket {key} holds {sorted(states)}, not {list(STATES)}")
        flat = read_entries(folder, {k: metadata.state_dict_metadata[k] for k in states.values()})
        for name, where in _place(weights, flat[states["param"]], set(out)).items():
            shape = weights[name].shape
            out[name] = {"main" if s == "param" else s: flat[states[s]][where].view(shape).clone() for s in STATES}
    missing = sorted(set(weights) - set(out))
    if missing:
        raise LayoutNotRecovered(f"no main weights for {missing[:3]} ({len(missing)} in all)")
    return out


def read_dp_reshardable(folder: Path, metadata, args: dict) -> tuple[dict[str, dict[str, torch.Tensor]], list]:
    """(gptrain name (fc1 whole) -> {"main", "exp_avg", "exp_avg_sq"} at the parameter's shape, the saved
    optimizers' param_groups (where the step is))."""
    buckets = _buckets(metadata.state_dict_metadata)
    groups = sorted({key[:2] for key in buckets})
    tp, pp = int(args.get("tensor_model_parallel_size") or 1), int(args.get("pipeline_model_parallel_size") or 1)
    uneven = [a for a in _UNEVEN if args.get(a)] if pp > 1 else []
    if uneven or int(args["num_layers"]) % pp:
        raise LayoutNotRecovered(f"a PP{pp} split other than {args['num_layers']} / {pp} layers per stage "
                                 f"({', '.join(uneven) or 'uneven'})")
    if len({chain for chain, _ in groups}) != 1 or [g for _, g in groups] != list(range(tp * pp)):
        raise LayoutNotRecovered(f"buffers of data-parallel groups {groups} in a TP{tp} x PP{pp} run (one per "
                                 "model-parallel rank expected)")
    weights = _in_buffer_order(read_entries(folder, model_keys(folder, metadata)), args, pp)
    ranks = []
    for chain, group in groups:  # megatron-core's model-parallel rank: stage x TP + TP rank
        stage, tp_rank = divmod(group, tp)
        mine = {name: _shard(value, rule, tp, tp_rank) for name, (value, rule, s) in weights.items() if s == stage}
        ranks.append(_rank_state(folder, metadata, {k: v for k, v in buckets.items() if k[:2] == (chain, group)},
                                 mine))
    out = {}
    for name, (_, rule, stage) in weights.items():
        if name != TIED_COPY or args.get("untie_embeddings_and_output_weights"):
            shards = ranks[stage * tp:(stage + 1) * tp]
            out[name] = {kind: _join([r[name][kind] for r in shards], rule, name, folder) for kind in shards[0][name]}
    param_groups = []
    for chain, group in groups:
        prefix = f"chained_{chain}." if any(k[0] for k in buckets) else ""
        saved = byte_entry(folder, metadata, f"{prefix}optimizer.distributed.dp_group_idx_{group}.optimizer")
        param_groups += (saved or {}).get("param_groups", []) if isinstance(saved, dict) else []
    return out, param_groups
