"""Which kind of checkpoint a folder holds: the one decision that training's ``--load``, inference
(generate, serve, evaluate) and ``gptrain convert`` make.

- ``"megatron"``: Megatron-LM's tracker naming an iteration folder of ``mp_rank_*`` subfolders
  (``--ckpt-format torch``) or of a torch_dist checkpoint (``metadata.json``, DCP shards)
  (interop/megatron.py reads both; train/megatron_load.py loads them into a run);
- ``"huggingface"``: a Hugging Face GPT-2 folder, ``config.json`` beside the weights and no tracker
  (interop/hf.py);
- ``"gptrain"``: gptrain's own tracker naming a DCP iteration folder (train/checkpoint.py), or
  gptrain iteration folders without a tracker (the newest complete one is read, with a warning).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's name, which gptrain's checkpoints use too
KINDS = ("gptrain", "megatron", "huggingface")


class NoCheckpoint(FileNotFoundError):
    """The path holds no checkpoint of any kind gptrain reads."""


def _tracked_folder(root: Path) -> Path | None:
    """The iteration folder the tracker names (None without a readable tracker)."""
    tracker = root / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if text == "release":
        return root / "release"
    try:
        return root / f"iter_{int(text):07d}"
    except ValueError:
        return None  # not Megatron's; gptrain's reader names the bad tracker


def _is_megatron(root: Path) -> bool:
    folder = _tracked_folder(root)
    if folder is None or not folder.is_dir():
        return False
    return is_torch_dist(folder) or any(p.name.startswith("mp_rank_") for p in folder.iterdir())


def is_torch_dist(folder) -> bool:
    """Whether the iteration folder holds a Megatron torch_dist checkpoint: ``metadata.json`` naming the
    backend (gptrain's own DCP folders have ``state.json`` and no such file)."""
    path = Path(folder) / "metadata.json"
    if not path.is_file() or (Path(folder) / "state.json").is_file():
        return False
    try:
        return json.loads(path.read_text()).get("sharded_backend") == "torch_dist"
    except (ValueError, OSError, AttributeError):
        return False


def checkpoint_kind(path: str | os.PathLike, none_ok: bool = False) -> str | None:
    """``"gptrain"``, ``"megatron"`` or ``"huggingface"``; a path holding none of them raises
    NoCheckpoint saying what is missing, or with ``none_ok`` (training's --load and --save folders,
    which may not exist yet) gives None."""
    root = Path(path)
    tracked = (root / TRACKER).is_file()
    if _is_megatron(root):
        return "megatron"
    if (root / "config.json").is_file() and not tracked:
        return "huggingface"
    if tracked or (root.is_dir() and any(p.name.startswith("iter_") and (p / "state.json").is_file()
                                         for p in root.iterdir())):
        return "gptrain"
    if none_ok:
        return None
    if not root.exists():
        raise NoCheckpoint(f"{root}: no such checkpoint")
    raise NoCheckpoint(f"{root}: neither a gptrain/Megatron checkpoint (no {TRACKER}) "
                       "nor a Hugging Face folder (no config.json)")
