"""What a Megatron user reads when ``gptrain train`` starts, and what it checks before building anything:

- ``arguments_block``: Megatron's ``------------------------ arguments ------------------------`` dump
  (every argument under Megatron's name, its final value, sorted, dots to column 50), rank 0;
- ``datetime_line``: Megatron's ``[after ...] datetime: YYYY-MM-DD HH:MM:SS `` lines (``print_datetime``);
- ``check_before_build``: the paths and packages a run needs, each problem one line before the model is
  built: a ``--data-path`` naming a .bin/.idx/.jsonl file or nothing, a ``--save`` that cannot be written,
  a ``--load`` that is not a usable folder (``--exit-on-missing-checkpoint``: Megatron's exit instead),
  ``--wandb-project`` without wandb installed; rank 0 then takes ``--save``'s lock (train/save_lock.py: a
  second run on the same folder stops here, naming the holder).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
from datetime import datetime
from pathlib import Path

from gptrain.config import RunConfig, build_parser, field_flags

MISSING_CHECKPOINT_LINE = ">> '--exit-on-missing-checkpoint' set ... exiting. <<"  # Megatron's words


class ExitOnMissingCheckpoint(Exception):
    """``--exit-on-missing-checkpoint`` with a ``--load`` naming no checkpoint: Megatron prints its line
    and calls ``sys.exit()`` (exit status 0)."""


def datetime_line(what: str) -> str:
    """Megatron's ``print_datetime``: ``[what] datetime: 2023-07-16 10:56:55 `` (its trailing space too)."""
    return f"[{what}] datetime: {datetime.now().strftime('%Y-%m-%d %H:%M:%S')} "


def _megatron_name(option: str, negated: bool) -> str:
    """argparse's dest of a Megatron flag: dashes to underscores; ``--no-X`` storing False is X."""
    name = option.lstrip("-").replace("-", "_")
    return name[3:] if negated and name.startswith("no_") else name


def megatron_arguments(cfg: RunConfig, argv: list[str], world_size: int, data_parallel: int) -> dict[str, object]:
    """Every argument of the run under Megatron's name: the config's final values for the flags on its
    fields, the parsed values of the others (an accepted ``--no-X`` no-op as X's value), and what
    Megatron adds after parsing (world and data-parallel sizes, rank, padded vocabulary, parameter dtype)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    values: dict[str, object] = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        option = action.option_strings[0]
        negated = isinstance(action, (argparse._StoreFalseAction, argparse._StoreConstAction)) and \
            action.const is False or action.dest.startswith("compat:--no-")
        value = getattr(args, action.dest)
        if action.dest.startswith("compat:--no-"):
            value = not value
        values.setdefault(_megatron_name(option, negated), value)
    final = {}  # field name -> its final value (a derived flag on the same dest shows it too, e.g. --fp8)
    for section, flags in field_flags().items():
        for f in flags:
            final[f.dest] = getattr(getattr(cfg, section), f.dest)
            values[_megatron_name(f.name, f.action == "store_false")] = final[f.dest]
    for action in parser._actions:
        name = _megatron_name(action.option_strings[0], False) if action.option_strings else None
        if name in values and action.dest == name and name in final:
            values[name] = final[name]
    p = cfg.precision
    values.update(world_size=world_size, rank=0, data_parallel_size=data_parallel,
                  padded_vocab_size=cfg.model.padded_vocab_size,
                  params_dtype=f"torch.{'float16' if p.fp16 else 'bfloat16' if p.bf16 else 'float32'}")
    return values


def arguments_block(values: dict[str, object], title: str = "arguments") -> str:
    """Megatron's ``_print_args``: a title line, ``  name ..... value`` sorted case-insensitively, an end line."""
    lines = sorted((f"  {name} {'.' * (48 - len(name))} {value}" for name, value in values.items()), key=str.lower)
    return "\n".join([f"------------------------ {title} ------------------------", *lines,
                      f"-------------------- end of {title} ---------------------"])


def _check_data_path(prefix: str) -> None:
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            raise ValueError(f"--data-path {prefix}: give the prefix without {suffix} "
                             f"(--data-path {prefix[:-len(suffix)]}), as Megatron takes it")
    if prefix.endswith((".jsonl", ".json", ".jsonl.gz", ".jsonl.zst")) and not os.path.isfile(f"{prefix}.idx"):
        stem = prefix.split(".json")[0]
        raise ValueError(f"--data-path {prefix} is raw text: preprocess it first (gptrain preprocess --input {prefix} "
                         f"--output-prefix {stem} --append-eod), then pass --data-path {stem}_text_document")
    missing = [f"{prefix}{s}" for s in (".idx", ".bin") if not os.path.isfile(f"{prefix}{s}")]
    if missing:  # the reader's own message (pointing at PREFIX_text_document where that is there), sooner
        from gptrain.data.indexed import missing_dataset_message

        raise ValueError(f"--data-path: {missing_dataset_message(prefix, Path(missing[0]))}")


def _writable(folder: Path) -> bool:
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:  # a uniquely named probe: every rank (on every node) checks the same folder at once
        fd, probe = tempfile.mkstemp(prefix=".gptrain-write-check-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError:
        return False
    return True


def _check_save(save: str) -> None:
    path = Path(save)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--save {save} is a file, not a folder: give a folder for the checkpoints")
    if path.is_dir():
        if not _writable(path):
            raise ValueError(f"--save {save} is not writable: no checkpoint could be saved there")
        return
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--save {save} cannot be created: {parent} is a file")
    if not _writable(parent):
        raise ValueError(f"--save {save} cannot be created: {parent} is not writable")


def _check_load(load: str, save: str | None, exit_on_missing: bool) -> None:
    from gptrain.train import resume

    path = Path(load)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--load {load} is a file: give the checkpoint folder (the one holding "
                         "latest_checkpointed_iteration.txt)")
    if path.is_dir() and not os.access(path, os.R_OK | os.X_OK):
        raise ValueError(f"--load {load} is not readable")
    try:
        folder = resume.load_folder(load, save, lambda line: None)  # the real call logs; this one only checks
    except ValueError:
        if exit_on_missing:
            raise ExitOnMissingCheckpoint() from None
        raise
    if folder is None and exit_on_missing:
        raise ExitOnMissingCheckpoint()


def check_before_build(cfg: RunConfig) -> None:
    """Each problem with the run's paths (or wandb) as one ValueError line, before anything is built."""
    t = cfg.train
    if t.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ValueError("--wandb-project needs the wandb package, which is not installed: pip install wandb "
                         "(or leave out the --wandb-* flags)")
    from gptrain.device import pick_device

    if t.profile and not t.use_pytorch_profiler and (kind := pick_device(t.device).type) != "cuda":
        raise ValueError(f"--profile starts and stops nsys's capture through CUDA: this run is on {kind} (add "
                         "--use-pytorch-profiler for torch's profiler)")
    for flag_name, on in (("--grad-reduce-copy-engine", cfg.parallel.grad_reduce_copy_engine),
                          ("--tp-comm-copy-engine", cfg.parallel.tp_comm_copy_engine)):
        if on and (kind := pick_device(cfg.train.device).type) != "cuda":
            raise ValueError(f"{flag_name} joins two GPUs of one host by their copy engines: the device here is "
                             f"{kind} (leave the flag out)")
    if not cfg.data.mock_data:
        from gptrain.data.blend import parse_data_path

        for prefix in parse_data_path(cfg.data.data_path)[1]:
            _check_data_path(prefix)
    if t.save:
        _check_save(t.save)
    if t.load:
        _check_load(t.load, t.save, t.exit_on_missing_checkpoint)
    if t.save:
        from gptrain.train.checkpoint_files import this_rank

        if this_rank() == 0:  # one run per --save folder, before anything is written or cleaned there
            from gptrain.train.save_lock import lock_save_folder

            lock_save_folder(t.save)


def check_before_build_on_every_rank(cfg: RunConfig) -> None:
    """:func:`check_before_build` on each rank, then agreed: a path that fails on one node only (a node-local
    disk) stops every rank, instead of leaving the others waiting in the model's first collective."""
    import torch

    from gptrain.parallel.collectives import distributed

    error = None
    try:
        check_before_build(cfg)
    except Exception as err:  # noqa: BLE001 (re-raised below, after the other ranks know)
        error = err
    failed = torch.tensor([0.0 if error is None else 1.0])
    if distributed():
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
    if error is not None:
        raise error
    if failed.item():
        raise ValueError("a start-up check failed on another rank (its line names the problem); every rank stops")
