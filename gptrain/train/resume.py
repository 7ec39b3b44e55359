"""What a start does with the checkpoint folders it is given, so that a folder holding complete
checkpoints is never trained over from scratch, and a checkpoint is never resumed by a model it
was not trained as.

- ``load_folder``: the folder to resume from. ``--load`` that does not exist is an error, unless
  ``--save`` is the same folder (the documented pattern: the same folder for both from the first
  run on); without ``--load``, a ``--save`` holding complete checkpoints is resumed from (said).
- ``refuse_overwriting``: a ``--save`` folder holding complete checkpoints newer than the start,
  of another run than the one loaded, stops the run naming them (its tracker would move backwards
  and its newer ``iter_*`` folders would be overwritten).
- ``check_saved_config``: Megatron's ``check_checkpoint_args``, for every architecture setting of
  the saved config and the tokenizer; each difference named, ``--use-checkpoint-args`` (Megatron's
  flag) takes the saved values instead (``with_checkpoint_args``).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from gptrain.checkpoint_kind import TRACKER, checkpoint_kind
from gptrain.flag_tables import MODEL_FLAGS
from gptrain.train.checkpoint_files import complete_checkpoints, is_complete, iteration_dir, read_tracker

# GPTConfig fields that do not change what the weights mean: a resume may change them
NOT_ARCHITECTURE = {"init_method_std", "attention_dropout", "hidden_dropout", "seq_length", "tensor_parallel_size"}


def _same(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def _names(found: list[Path], at_most: int = 3) -> str:
    return ", ".join(p.name for p in found[:at_most]) + (f" and {len(found) - at_most} more" if len(found) > at_most else "")


def load_folder(load: str | None, save: str | None, log) -> str | None:
    """The folder to resume from (None: a fresh start, which nothing complete is lost to)."""
    saved = complete_checkpoints(save) if save else []
    if load:
        if not Path(load).exists():
            if save and _same(save, load):
                return None  # the first run of the documented pattern
            hint = f"; --save {save} holds complete checkpoints ({_names(saved)}): pass --load {save}" if saved else (
                f" (to start fresh and resume later, pass the same folder to --save and --load)")
            raise ValueError(f"--load {load} does not exist{hint}")
        if (Path(load) / TRACKER).is_file() or complete_checkpoints(load) or not Path(load).is_dir() \
                or checkpoint_kind(load, none_ok=True) == "huggingface":
            return load
        if save and _same(save, load):
            return None  # --save's own folder, empty so far
        raise ValueError(f"--load {load} holds no checkpoint (no {TRACKER}, no complete iter_* folder)")
    if saved:
        log(f"WARNING: no --load, but --save {save} holds complete checkpoints ({_names(saved)}): resuming from "
            "the newest instead of training over them (pass --load to say so, or another --save for a new run)")
        return save
    return None


def refuse_overwriting(save: str | None, loaded_from: str | None, start: int) -> None:
    """Stop before training if ``--save`` holds complete checkpoints past ``start`` of another run."""
    if not save or (loaded_from and _same(save, loaded_from)):
        return
    newer = [p for p in complete_checkpoints(save) if p.name != "release" and int(p.name[5:]) > start]
    if newer:
        source = f"--load {loaded_from}" if loaded_from else "a fresh start"
        raise ValueError(f"--save {save} holds complete checkpoints of another run newer than iteration {start} "
                         f"({_names(newer)}; its tracker names {read_tracker(save)}): training from {source} would "
                         f"overwrite them; resume from them with --load {save}, or pass another --save")


def saved_config(path: Path) -> dict:
    """The run config saved in checkpoint folder ``path`` ({} for one written before configs were saved)."""
    try:
        return json.loads((path / "state.json").read_text()).get("config") or {}
    except (OSError, ValueError):
        return {}


def _flag_name(field: str) -> str:
    if field == "vocab_size":
        return "the tokenizer's vocabulary size"
    declared = MODEL_FLAGS.get(field)
    return declared.names[0] if declared is not None else "--" + field.replace("_", "-")


def _follows(name: str, saved: dict, now: dict) -> bool:
    """A value resolved from settings named already: the K/V groups without --group-query-attention
    (the heads), --kv-channels left at hidden / heads."""
    if name == "num_query_groups":
        return not saved.get("group_query_attention") and not now["group_query_attention"]
    if name == "kv_channels":
        return all(m.get("kv_channels", 0) * m.get("num_attention_heads", 0) == m.get("hidden_size")
                   for m in (saved, now))
    return False


def config_differences(saved: dict, cfg) -> list[str]:
    """Each architecture or tokenizer setting that differs: ``--flag SAVED in the checkpoint, NOW here``."""
    out = []
    now_model = dataclasses.asdict(cfg.model)
    for name, value in (saved.get("model") or {}).items():
        if name in NOT_ARCHITECTURE or name not in now_model or now_model[name] == value \
                or _follows(name, saved["model"], now_model):
            continue
        out.append(f"{_flag_name(name)} {value} in the checkpoint, {now_model[name]} here")
    data = saved.get("data") or {}
    for name, what in (("tokenizer_sha256", "tokenizer (vocabulary and merges sha256)"), ("eod_token", "eod token")):
        theirs, ours = data.get(name), getattr(cfg.data, name)
        if theirs is not None and ours is not None and theirs != ours:
            shown = (str(theirs)[:12] + "...", str(ours)[:12] + "...") if name == "tokenizer_sha256" else (theirs, ours)
            out.append(f"{what} {shown[0]} in the checkpoint, {shown[1]} here")
    return out


def check_saved_config(path: Path, cfg) -> None:
    """Refuse to resume ``path`` with other architecture or tokenizer settings, naming each."""
    differences = config_differences(saved_config(path), cfg)
    if differences:
        hint = "pass the checkpoint's values" + ("" if any("tokenizer" in d for d in differences) else
                                                 ", or --use-checkpoint-args to take them from it")
        raise ValueError(f"{path} was trained with other settings: {'; '.join(differences)}; {hint}")


def _newest_saved_folder(root: str) -> Path | None:
    """The folder whose config --use-checkpoint-args reads: the tracker's if complete, else the newest complete."""
    iteration = read_tracker(root)
    if iteration is not None and is_complete(iteration_dir(root, iteration))[0]:
        return iteration_dir(root, iteration)
    found = complete_checkpoints(root)
    return found[0] if found else None


def with_checkpoint_args(cfg, log):
    """``--use-checkpoint-args``: the run's config with the architecture of the ``--load`` checkpoint."""
    load = cfg.train.load
    folder = _newest_saved_folder(load) if load else None
    model = saved_config(folder).get("model") if folder else None
    if not model:
        raise ValueError(f"--use-checkpoint-args needs --load with a gptrain checkpoint that saved its config"
                         f"{'' if not load else f' ({load} has none)'}")
    now = dataclasses.asdict(cfg.model)
    taken = {k: v for k, v in model.items()
             if k in now and k not in NOT_ARCHITECTURE | {"vocab_size"} and now[k] != v}  # the tokenizer sets that
    for name, value in taken.items():
        log(f" > --use-checkpoint-args: {_flag_name(name)} {value} (from {folder.name}; {now[name]} on the command line)")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **taken))
