"""Checkpoints in Megatron's directory layout, with no pickled code inside.

    SAVE/latest_checkpointed_iteration.txt   "500" (or "release")
    SAVE/iter_0000500/model.safetensors      fp32 weights by gptrain parameter name (the main copies
                                             when the model itself runs in bf16)
    SAVE/iter_0000500/optimizer.safetensors  AdamW moments by parameter name, and step counts
    SAVE/iter_0000500/rng.safetensors        torch CPU/CUDA generator states, numpy's MT state
    SAVE/iter_0000500/state.json             iteration, consumed samples, lr schedule, loss scaler,
                                             python/numpy RNG scalars, the resolved run config

Everything is written into a temporary directory that is renamed into place, then the tracker file
is replaced atomically: a crash mid-save leaves the previous checkpoint as the latest.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

TRACKER = "latest_checkpointed_iteration.txt"


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


def _rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = state
    np_state = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(np_state[1], dtype=np.int64))
    py_version, py_internal, py_gauss = random.getstate()
    scalars = {"numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])],
               "python": [py_version, list(py_internal), py_gauss]}
    return tensors, scalars


def _set_rng_state(tensors: dict[str, torch.Tensor], scalars: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    name, pos, has_gauss, cached = scalars["numpy"]
    np.random.set_state((name, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = scalars["python"]
    random.setstate((version, tuple(internal), gauss))


def _params(model_or_params) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint holds, by name: a module's parameters, or a given name -> tensor map
    (the fp32 main parameters when the model itself is bf16)."""
    if isinstance(model_or_params, torch.nn.Module):
        return dict(model_or_params.named_parameters())
    return dict(model_or_params)


def _optimizer_tensors(params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in params.items():
        state = optimizer.state.get(param, {})
        for key, value in state.items():
            out[f"{name}::{key}"] = value.detach().reshape(value.shape).to("cpu").contiguous()
    return out


def save_checkpoint(root: str | os.PathLike, iteration: int, model, optimizer: torch.optim.Optimizer,
                    state: dict) -> Path:
    """``model``: a module, or a name -> tensor map of the parameters the optimizer updates."""
    params = _params(model)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = iteration_dir(root, iteration)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    weights = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in params.items()}
    save_file(weights, tmp / "model.safetensors")
    save_file(_optimizer_tensors(params, optimizer), tmp / "optimizer.safetensors")
    rng_tensors, rng_scalars = _rng_state()
    save_file(rng_tensors, tmp / "rng.safetensors")
    (tmp / "state.json").write_text(json.dumps({**state, "iteration": iteration, "rng": rng_scalars}, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    tracker_tmp = root / f".{TRACKER}.tmp-{os.getpid()}"
    tracker_tmp.write_text(str(iteration))
    os.replace(tracker_tmp, root / TRACKER)
    return final


def load_checkpoint(root: str | os.PathLike, model, optimizer: torch.optim.Optimizer | None,
                    load_rng: bool = True) -> dict | None:
    """Restore into ``model`` (a module or a name -> tensor map, as for saving) and ``optimizer``;
    return the saved state dict, or None if there is no checkpoint."""
    iteration = read_tracker(root)
    if iteration is None:
        return None
    path = iteration_dir(root, iteration)
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path}/model.safetensors is missing although {Path(root) / TRACKER} names it "
                                "(a Megatron model_optim_rng.pt checkpoint must be imported first)")
    params = _params(model)
    device = next(iter(params.values())).device
    weights = load_file(path / "model.safetensors", device=str(device))
    missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not fit the model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}): check the model flags against the saved config")
    with torch.no_grad():
        for name, tensor in params.items():
            if weights[name].shape != tensor.shape:
                raise ValueError(f"{path}: {name} has shape {tuple(weights[name].shape)} in the checkpoint and "
                                 f"{tuple(tensor.shape)} in the model: check the model flags against the saved config")
            tensor.copy_(weights[name])
    state = json.loads((path / "state.json").read_text())
    if optimizer is not None and (path / "optimizer.safetensors").is_file():
        saved = load_file(path / "optimizer.safetensors", device=str(device))
        for name, param in params.items():
            entries = {k.split("::", 1)[1]: v for k, v in saved.items() if k.split("::", 1)[0] == name}
            if entries:
                optimizer.state[param] = entries
    if load_rng and (path / "rng.safetensors").is_file():
        _set_rng_state(load_file(path / "rng.safetensors"), state["rng"])
    return state
