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
Pipeline-parallel runs (each stage's parameters in its own buffers) are not imported.
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


def _in_buffer_order(tensors: dict[str, torch.Tensor], args: dict) -> dict[str, tuple[torch.Tensor, str]]:
    """The model's weights (gptrain names, fc1 whole) with their tensor-parallel rules, in the order
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
            name = f"layers.{layer}.{name}" if stacked else name
            ranked.append(((group, layer, index), name, (value, rule)))
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
    if pp != 1:
        raise LayoutNotRecovered(f"a TP{tp} x PP{pp} run's buffers: read for one pipeline stage only")
    if len({chain for chain, _ in groups}) != 1 or [g for _, g in groups] != list(range(tp)):
        raise LayoutNotRecovered(f"buffers of data-parallel groups {groups} in a TP{tp} run (one per TP rank "
                                 "expected)")
    weights = _in_buffer_order(read_entries(folder, model_keys(folder, metadata)), args)
    ranks = []
    for chain, group in groups:  # the group index is the TP rank at PP1
        mine = {name: _shard(value, rule, tp, group) for name, (value, rule) in weights.items()}
        ranks.append(_rank_state(folder, metadata, {k: v for k, v in buckets.items() if k[:2] == (chain, group)},
                                 mine))
    out = {name: {kind: _join([r[name][kind] for r in ranks], rule, name, folder) for kind in ranks[0][name]}
           for name, (_, rule) in weights.items()}
    param_groups = []
    for chain, group in groups:
        prefix = f"chained_{chain}." if any(k[0] for k in buckets) else ""
        saved = byte_entry(folder, metadata, f"{prefix}optimizer.distributed.dp_group_idx_{group}.optimizer")
        param_groups += (saved or {}).get("param_groups", []) if isinstance(saved, dict) else []
    return out, param_groups
