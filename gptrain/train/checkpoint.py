"""Checkpoints in Megatron's directory layout through ``torch.distributed.checkpoint`` (DCP): every
rank writes its own shards, nothing pickled is ever loaded as code, and shapes do not depend on the
layout (the word embeddings are stored at the real vocabulary's size, without the padding).

    SAVE/latest_checkpointed_iteration.txt    "500" (or "release")
    SAVE/iter_0000500/.metadata, __*_*.distcp  DCP: "model/<name>" fp32 weights (the main copies when
                                               the model itself runs in bf16), "optim/<name>/<key>"
                                               AdamW state
    SAVE/iter_0000500/rng_rank00000.safetensors, rng_rank00000.json   each rank's generator states
    SAVE/iter_0000500/state.json              iteration, consumed samples, lr schedule, loss scaler,
                                              layout, the resolved run config

Everything is written into a temporary directory that rank 0 renames into place once every rank
has finished, then the tracker file is replaced atomically: a crash mid-save leaves the previous
checkpoint as the latest.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from gptrain.model.gpt import copy_full_into
from gptrain.parallel.collectives import barrier, distributed

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT = "gptrain-checkpoint/2"
UNPADDED = "word_embeddings.weight"  # stored without the vocabulary padding


def iteration_dir(root: str | os.PathLike, iteration: int | str) -> Path:
    return Path(root) / ("release" if iteration == "release" else f"iter_{int(iteration):07d}")


def read_tracker(root: str | os.PathLike) -> int | str | None:
    path = Path(root) / TRACKER
    if not path.is_file():
        return None
    text = path.read_text().strip()
    if text == "release":
        return "release"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path}: expected an iteration number or 'release', found {text!r}") from None


def _rank() -> int:
    return torch.distributed.get_rank() if distributed() else 0


def _rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    np_state = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(np_state[1], dtype=np.int64))
    py_version, py_internal, py_gauss = random.getstate()
    scalars = {"numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])],
               "python": [py_version, list(py_internal), py_gauss]}
    return tensors, scalars


def _set_rng_state(tensors: dict[str, torch.Tensor], scalars: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch_cuda"])
    name, pos, has_gauss, cached = scalars["numpy"]
    np.random.set_state((name, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = scalars["python"]
    random.setstate((version, tuple(internal), gauss))


def _unpadded(name: str, t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """What is stored for ``t``: the embedding-shaped tensors whole and cut to the real vocabulary
    (the same on every rank, so DCP writes it once), everything else as it is (DTensor shards)."""
    if name != UNPADDED or t.dim() != 2:
        return t
    full = t.full_tensor() if isinstance(t, DTensor) else t
    return full.detach()[:vocab_size].float().cpu()


def init_optimizer_state(params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter AdamW's state (zeros), so a checkpoint can be loaded into it in place."""
    for p in params.values():
        if p not in optimizer.state or not optimizer.state[p]:
            optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                  "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def _state_dict(params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer | None,
                vocab_size: int) -> dict[str, torch.Tensor]:
    out = {f"model/{name}": _unpadded(name, p, vocab_size) for name, p in params.items()}
    if optimizer is not None:
        for name, p in params.items():
            for key, value in optimizer.state.get(p, {}).items():
                out[f"optim/{name}/{key}"] = _unpadded(name, value, vocab_size)
    return out


def save_checkpoint(root: str | os.PathLike, iteration: int, params: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer, state: dict, vocab_size: int) -> Path:
    """``params``: the name -> tensor map the optimizer updates (fp32 main copies, or FSDP2's
    fp32 shards). Every rank calls this."""
    root = Path(root)
    final = iteration_dir(root, iteration)
    tmp = root / f".{final.name}.tmp"
    rank = _rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    with warnings.catch_warnings():  # one process without a process group is a normal run here
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        dcp.save(_state_dict(params, optimizer, vocab_size), checkpoint_id=tmp)
    rng_tensors, rng_scalars = _rng_state()
    save_file(rng_tensors, tmp / f"rng_rank{rank:05d}.safetensors")
    (tmp / f"rng_rank{rank:05d}.json").write_text(json.dumps(rng_scalars))
    barrier()
    if rank == 0:
        (tmp / "state.json").write_text(json.dumps({**state, "iteration": iteration, "format": FORMAT}, indent=1))
        old = root / f".{final.name}.old"
        if final.exists():  # saving an iteration again: the previous copy goes only once the new one is in place
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        tracker_tmp = root / f".{TRACKER}.tmp"
        tracker_tmp.write_text(str(iteration))
        os.replace(tracker_tmp, root / TRACKER)
        if old.exists():
            shutil.rmtree(old)
    barrier()
    return final


def load_checkpoint(root: str | os.PathLike, params: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer | None, vocab_size: int, load_rng: bool = True) -> dict | None:
    """Restore into ``params`` (as for saving) and ``optimizer``; return the saved state dict, or
    None if there is no checkpoint."""
    iteration = read_tracker(root)
    if iteration is None:
        return None
    path = iteration_dir(root, iteration)
    if (path / "model.safetensors").is_file():
        raise ValueError(f"{path} is a gptrain-checkpoint/1 checkpoint, written before the fused QKV rows took "
                         "Megatron's per-head order; it cannot be resumed by this version (retrain, or load it "
                         "with gptrain 0.1)")
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path}/.metadata is missing although {Path(root) / TRACKER} names it "
                                "(a Megatron model_optim_rng.pt checkpoint must be imported first)")
    if optimizer is not None:
        init_optimizer_state(params, optimizer)
    targets = _state_dict(params, optimizer, vocab_size)
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    missing = sorted(k for k in targets if k not in stored and (k.startswith("model/") or optimizer is not None))
    if missing:
        raise ValueError(f"{path}: checkpoint does not fit the model (missing {missing[:3]}): check the model flags "
                         "against the saved config")
    for key, target in targets.items():
        shape = tuple(stored[key].size) if hasattr(stored[key], "size") else None
        if shape is not None and shape != tuple(target.shape):
            raise ValueError(f"{path}: {key.split('/', 1)[1]} has shape {shape} in the checkpoint and "
                             f"{tuple(target.shape)} in the model: check the model flags against the saved config")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        dcp.load(targets, checkpoint_id=path)
    # the unpadded embedding-shaped tensors were read whole: pad with zeros and keep this rank's shard
    for key, value in targets.items():
        name = key.split("/")[1]
        if name != UNPADDED or value.dim() != 2:
            continue
        dest = params[name] if key.startswith("model/") else optimizer.state[params[name]][key.rsplit("/", 1)[1]]
        padded = torch.zeros(dest.shape, dtype=torch.float32)
        padded[:vocab_size] = value
        copy_full_into(dest, padded)
    state = json.loads((path / "state.json").read_text())
    rng = path / f"rng_rank{_rank():05d}.safetensors"
    if load_rng and rng.is_file():
        _set_rng_state(load_file(rng), json.loads(rng.with_suffix(".json").read_text()))
    return state
