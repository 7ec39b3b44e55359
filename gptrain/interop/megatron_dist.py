"""Read Megatron-LM's ``--ckpt-format torch_dist`` checkpoints (its default since core_r0.8): one
``torch.distributed.checkpoint`` folder per iteration (``__R_S.distcp`` shards, ``.metadata``,
``metadata.json`` saying ``{"sharded_backend": "torch_dist"}``), into full gptrain tensors.

Nothing in the folder runs: the ``.metadata`` pickle goes through gptrain's allow-list unpickler
(:mod:`gptrain.train.safe_dcp`), the tensors through DCP with ``torch.load(weights_only=True)``, and
the byte entries (Megatron's ``common_state``: ``args``, ``iteration``, ``checkpoint_version``; an
older ``common.pt`` file) through the restricted unpickler of :mod:`gptrain.interop.safe_unpickle`.

Megatron saves every tensor at its global shape whatever the layout it trained at: the per-layer
tensors of ``decoder.layers.*`` stacked on a leading layer dimension (global layer numbers, all
pipeline stages and virtual chunks), the tensor-parallel shards already joined (the fused QKV rows
per head, as gptrain keeps them), the word embeddings padded for the saving run's TP size. So a
read needs no layout: the tensors are cut per layer and named as :mod:`megatron_keys` names them.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from gptrain.checkpoint_kind import is_torch_dist  # noqa: F401 (the one test of the format)
from gptrain.interop.megatron_keys import map_key
from gptrain.interop.safe_unpickle import load_pickle_bytes, load_pickle_safely
from gptrain.train.safe_dcp import load_safely, read_metadata_safely
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

BACKEND_FILE = "metadata.json"  # {"sharded_backend": "torch_dist", ...}
_STACKED = re.compile(r"^decoder\.layers\.(?!\d+\.)(.+)$")  # decoder.layers.<name>, layer dim first
# megatron-core's optimizer state (a ChainedOptimizer prefixes chained_N.) and schedule: read by megatron_optim
_OPTIMIZER = re.compile(r"^(chained_\d+\.)?(optimizer|opt_param_scheduler)(\.|/|$)")
_SKIPPED = re.compile(r"(^|\.)_extra_state(/|$)|^rerun_state_machine_state(/|$)|^common_state(/|$)|^rng_state")


def byte_entry(folder: Path, metadata, name: str):
    """The object in the byte entry ``name`` (or ``name/shard_...``: a megatron-core ShardedObject) through
    the restricted unpickler (a one-object list, as Megatron-LM of today saves a ShardedObject, unwrapped); None
    where there is none."""
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn == name or index.fqn.startswith(name + "/"):
            with open(folder / info.relative_path, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
            if len(data) != info.length:
                raise ValueError(f"{folder / info.relative_path}: shorter than its {name} entry")
            value = load_pickle_bytes(data, f"{folder / info.relative_path} ({name})")
            return value[0] if isinstance(value, list) and len(value) == 1 else value
    return None


def common_state(folder: Path, metadata) -> dict:
    """Megatron's common state: the ``common_state`` byte entry (Megatron-LM of today) or ``common.pt``."""
    state = byte_entry(folder, metadata, "common_state")
    if state is None:
        common = folder / "common.pt"
        state = load_pickle_safely(common) if common.is_file() else {}
    if not isinstance(state, dict):
        raise ValueError(f"{folder}: Megatron's common state is a {type(state).__name__}, not a dict")
    return state


def model_keys(folder: Path, metadata) -> dict[str, TensorStorageMetadata]:
    keys = {}
    for key, entry in metadata.state_dict_metadata.items():
        if _SKIPPED.search(key) or isinstance(entry, BytesStorageMetadata):
            continue
        if _OPTIMIZER.search(key):
            continue  # not the model's (interop/megatron_optim.py reads them for training's --load)
        keys[key] = entry
    if not keys:
        raise ValueError(f"{folder}: a torch_dist checkpoint without model tensors")
    return keys


def read_entries(folder: Path, entries: dict[str, TensorStorageMetadata]) -> dict[str, torch.Tensor]:
    """The named tensor entries of the folder, whole, through the safe DCP reader."""
    tensors = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype) for key, entry in entries.items()}
    load_safely(tensors, folder, allow_bytes=True, no_dist=True)
    return tensors


def gptrain_tensors(tensors: dict[str, torch.Tensor], args: dict, folder: Path):
    """megatron-core's global tensors (model keys) as gptrain's per-layer names, and the tied output layer's
    copy (None without one). The optimizer's per-parameter state goes through here too, by its model key."""
    state: dict[str, torch.Tensor] = {}
    output_copy = None
    for key, tensor in tensors.items():
        stacked = _STACKED.match(key)
        per_layer = [(f"decoder.layers.{i}.{stacked.group(1)}", t) for i, t in enumerate(tensor.unbind(0))] \
            if stacked else [(key, tensor)]
        for name, value in per_layer:
            try:
                mapped = map_key(name, "megatron-core")
            except KeyError:
                raise ValueError(f"{folder}: unsupported model key {key!r} (gptrain's GPT has no such "
                                 "parameter)") from None
            if mapped is None:
                continue
            gname, layer, _ = mapped
            if gname == "output_layer.weight" and not args.get("untie_embeddings_and_output_weights"):
                output_copy = value  # the tied copy; an untied one is a parameter (SwiGLU's fc1 is [gate; up] here)
                continue
            full = f"layers.{layer}.{gname}" if layer is not None else gname
            if full in state:
                raise ValueError(f"{folder}: two keys map to {full}")
            state[full] = value.clone()
    return state, output_copy


def read_torch_dist(folder, iteration):
    """A :class:`~gptrain.interop.megatron.MegatronCheckpoint` from the torch_dist iteration folder."""
    from gptrain.interop.megatron import MegatronCheckpoint, check_supported, finish_state

    folder = Path(folder)
    metadata = read_metadata_safely(folder, allow_bytes=True)
    common = common_state(folder, metadata)
    raw_args = common.get("args")
    args = dict(vars(raw_args)) if isinstance(raw_args, argparse.Namespace) else dict(raw_args or {})
    check_supported(args, folder)
    tensors = read_entries(folder, model_keys(folder, metadata))

    state, output_copy = gptrain_tensors(tensors, args, folder)
    iteration = common.get("iteration", iteration)
    version = common.get("checkpoint_version")
    tp = int(args.get("tensor_model_parallel_size") or 1)
    pp = int(args.get("pipeline_model_parallel_size") or 1)
    finish_state(state, args, folder, tp, pp)
    emb = state["word_embeddings.weight"]
    matches = None if output_copy is None else bool(output_copy.shape == emb.shape and torch.equal(output_copy, emb))
    return MegatronCheckpoint(args=args, iteration=iteration, state=state,
                              checkpoint_version=None if version is None else float(version),
                              layout="megatron-core torch_dist", tp=tp, pp=pp,
                              output_layer_matches_embeddings=matches)
