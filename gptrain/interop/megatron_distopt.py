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

Read for runs of one tensor- and pipeline-parallel rank (one ``dp_group_idx``); other layouts keep
each TP/PP rank's shards in its own buffers and are not imported (the message names the layout).
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch

from gptrain.interop.megatron_dist import byte_entry, gptrain_tensors, model_keys, read_entries

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


def _in_buffer_order(tensors: dict[str, torch.Tensor], args: dict, folder: Path) -> dict[str, torch.Tensor]:
    """The model's weights (gptrain names, fc1 whole), in the order megatron-core's buffers most likely hold
    them: its module order reversed. The checkpoint's keys come in module order (embeddings, one layer's
    parameters, final norm, output layer), with the layers stacked, so a layer's index goes before the key's."""
    ranked = []
    seen_layers = False
    for index, (key, tensor) in enumerate(tensors.items()):
        stacked = key.startswith("decoder.layers.")
        seen_layers |= stacked
        group = 1 if stacked else 2 if seen_layers else 0
        for name, value in gptrain_tensors({key: tensor}, args, folder)[0].items():
            layer = int(name.split(".")[1]) if stacked else 0
            ranked.append(((group, layer, index), name, value))
    return {name: value for _, name, value in sorted(ranked, key=lambda r: r[0], reverse=True)}


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


def read_dp_reshardable(folder: Path, metadata, args: dict) -> tuple[dict[str, dict[str, torch.Tensor]], list]:
    """(gptrain name (fc1 whole) -> {"main", "exp_avg", "exp_avg_sq"} at the parameter's shape, the saved
    optimizers' param_groups (where the step is))."""
    buckets = _buckets(metadata.state_dict_metadata)
    groups = {key[:2] for key in buckets}
    if len(groups) != 1:
        tp, pp = int(args.get("tensor_model_parallel_size") or 1), int(args.get("pipeline_model_parallel_size") or 1)
        raise LayoutNotRecovered(f"{len(groups)} data-parallel groups' buffers (a TP{tp} x PP{pp} run): read for "
                                 "TP1 x PP1 runs only")
    weights = _in_buffer_order(read_entries(folder, model_keys(folder, metadata)), args, folder)
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
    param_groups = []
    for chain, group in sorted(groups):
        prefix = f"chained_{chain}." if any(k[0] for k in buckets) else ""
        saved = byte_entry(folder, metadata, f"{prefix}optimizer.distributed.dp_group_idx_{group}.optimizer")
        param_groups += (saved or {}).get("param_groups", []) if isinstance(saved, dict) else []
    return out, param_groups
