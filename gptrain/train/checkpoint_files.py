"""Where a checkpoint lives on disk and how a folder becomes one, never losing work: Megatron's
directory layout, the manifest that makes a folder complete, publishing a written folder, and the
recovery at start. Plain files only; what the folders hold and how the ranks write and read it is
``checkpoint.py``'s.

    SAVE/latest_checkpointed_iteration.txt    "500" (or "release")
    SAVE/iter_0000500/...                      the ranks' files (checkpoint.py), then state.json
                                               (written last): its manifest lists every file's size
                                               and sha256 (each rank hashes its own files after
                                               writing them, in --async-save's background thread)
    SAVE/.iter_0000500.tmp/                    a save being written
    SAVE/.iter_0000500.old/                    a copy of the same iteration, moved aside by a re-save
    SAVE/.gptrain.lock                         the running job's lock (save_lock.py), no checkpoint content

Never losing work: everything is written into ``.iter_0000500.tmp`` and fsynced, rank 0 renames it
into place (a copy of the same iteration is moved aside first, never deleted before), fsyncs the
folder, and only then replaces the tracker (``publish``). A start puts back a copy moved aside by a
killed save and removes temporary folders (``recover``); a tracker naming a missing or incomplete
folder, or one whose files fail their checksums, falls back to the newest complete and intact
checkpoint, with one line; so does a folder without a tracker (``find_gptrain_iteration_dir``);
a failed save's partial files are removed (``discard``).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from gptrain.checkpoint_kind import TRACKER
from gptrain.file_hash import file_sha256, known_sha256
from gptrain.parallel.collectives import barrier, distributed
from gptrain.train.durable import crash_point, fsync_tree, replace_durable, write_durable
from gptrain.train.save_lock import cleaning

FORMAT = "gptrain-checkpoint/2"
UNPADDED = ("word_embeddings.weight", "output_layer.weight")  # stored without the vocabulary padding


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


def this_rank() -> int:
    return torch.distributed.get_rank() if distributed() else 0


def tmp_dir(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp")


def aside_dir(final: Path) -> Path:
    return final.with_name(f".{final.name}.old")


def _iteration_of(name: str) -> int | str | None:
    if name == "release":
        return "release"
    if len(name) == 12 and name.startswith("iter_") and name[5:].isdigit():
        return int(name[5:])
    return None


def _sums_file(folder: Path, rank: int) -> Path:
    return folder / f"sums_rank{rank:05d}.json"


def write_rank_sums(folder: Path, rank: int) -> None:
    """After this rank's files are written: their sha256 into ``sums_rankRRRRR.json``, which
    ``publish`` folds into the manifest. DCP names rank r's data files ``__r_*.distcp``; rank 0
    also writes ``.metadata``."""
    own = sorted(p for p in folder.iterdir() if p.is_file() and (
        p.name.startswith(f"__{rank}_") or p.name.startswith(f"rng_rank{rank:05d}.")
        or (rank == 0 and p.name == ".metadata")))
    write_durable(_sums_file(folder, rank), json.dumps({p.name: file_sha256(p) for p in own}))


def _gather_sums(folder: Path) -> dict[str, str]:
    sums: dict[str, str] = {}
    for f in sorted(folder.glob("sums_rank*.json")):
        sums.update(json.loads(f.read_text()))
        f.unlink()
    return sums


def is_complete(path: Path) -> tuple[bool, str]:
    """Whether a checkpoint folder holds everything its manifest (``state.json``, written last)
    lists, at the listed sizes; else False and what is wrong."""
    if not path.is_dir():
        return False, "missing"
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError):
        return False, "incomplete (no readable state.json)"
    files = state.get("files")
    if files is None:  # written before manifests: state.json came after the DCP files
        return ((path / ".metadata").is_file(), "incomplete (no .metadata)")
    for name, size in files.items():
        f = path / name
        if not f.is_file() or f.stat().st_size != size:
            return False, f"incomplete ({name} missing or truncated)"
    return True, ""


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The complete checkpoint folders under ``root``, newest first (``release`` last)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(it, p) for p in root.iterdir() if (it := _iteration_of(p.name)) is not None and is_complete(p)[0]]
    return [p for _, p in sorted(found, key=lambda x: -1 if x[0] == "release" else x[0], reverse=True)]


def newest_complete(root: str | os.PathLike) -> str:
    """For messages: the newest complete checkpoint, or that there is none."""
    found = complete_checkpoints(root) if root else []
    return f"the newest complete checkpoint is {found[0]}" if found else f"there is no complete checkpoint in {root}"


def rank0_log(log, message: str) -> None:
    """``message`` from rank 0 only, through ``log`` (default: stderr)."""
    if this_rank() == 0:
        (log or (lambda s: print(s, file=sys.stderr, flush=True)))(message)


def recover(root: str | os.PathLike | None, log=None) -> None:
    """At start (every rank calls it): put back a checkpoint that a killed re-save had moved aside,
    and remove the temporary folders of killed or failed saves, saying what was done."""
    if root and this_rank() == 0 and Path(root).is_dir():
        with cleaning(root) as (allowed, holder):
            if allowed:
                _recover(Path(root), log)
            else:
                rank0_log(log, f"WARNING: {root} is in use by another gptrain run{holder}: its temporary folders "
                               "are left alone")
    barrier()


def _recover(root: Path, log) -> None:
    """recover()'s work, under the folder's lock."""
    for aside in sorted(root.glob(".*.old")):
        final = root / aside.name[1:-len(".old")]
        if _iteration_of(final.name) is None:
            continue
        if is_complete(final)[0]:
            shutil.rmtree(aside)
            continue
        if final.exists():
            shutil.rmtree(final)
        replace_durable(aside, final)
        rank0_log(log, f"WARNING: restored {final}, which a save killed before its replacement was complete "
                       "had moved aside")
    stale = sorted(p for p in root.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp"))
    for p in stale:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    if stale:
        rank0_log(log, f"WARNING: removed {len(stale)} temporary folder(s) of interrupted saves from {root}: "
                       + ", ".join(p.name for p in stale))


def discard(final_name: str) -> None:
    """Rank 0 after a failed save: remove the partial copy, put back a copy moved aside."""
    final = Path(final_name)
    shutil.rmtree(tmp_dir(final), ignore_errors=True)
    aside = aside_dir(final)
    if aside.exists() and not final.exists():
        os.replace(aside, final)


def publish(root: Path, iteration: int | str, state: dict) -> None:
    """Rank 0, once every rank's files are written into the temporary folder: the manifest
    (``state.json`` with every file's size), the fsyncs, the rename into place, the tracker."""
    final = iteration_dir(root, iteration)
    tmp, aside = tmp_dir(final), aside_dir(final)
    checksums = _gather_sums(tmp)
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = {**state, "iteration": iteration, "format": FORMAT, "files": files, "checksums": checksums}
    write_durable(tmp / "state.json", json.dumps(manifest, indent=1))
    fsync_tree(tmp)
    crash_point("written", iteration)
    if final.exists():  # saving an iteration again: the old copy stays until the new one is in place
        if aside.exists():
            shutil.rmtree(aside)
        replace_durable(final, aside)
        crash_point("moved-aside", iteration)
    replace_durable(tmp, final)
    crash_point("renamed", iteration)
    write_durable(root / f".{TRACKER}.tmp", str(iteration))
    replace_durable(root / f".{TRACKER}.tmp", root / TRACKER)
    crash_point("tracker", iteration)
    if aside.exists():
        shutil.rmtree(aside)


def _first_bad_file(path: Path) -> str | None:
    """The first file of ``path`` whose sha256 differs from its manifest's (None: all agree, or a
    manifest from before checksums). The ranks share the hashing and agree on the answer."""
    try:
        sums = json.loads((path / "state.json").read_text()).get("checksums") or {}
    except (OSError, ValueError):
        return "state.json"
    names = sorted(sums)
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if distributed() else (0, 1)
    bad = len(names)
    for i in range(rank, len(names), world):
        f = path / names[i]
        if not f.is_file() or known_sha256(f) != sums[names[i]]:
            bad = i
            break
    if distributed():
        flag = torch.tensor([bad], dtype=torch.int64)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        bad = int(flag.item())
    return names[bad] if bad < len(names) else None


def find_gptrain_iteration_dir(root: str | os.PathLike, log=None) -> Path | None:
    """The folder to load: the tracker's, or, if that one is missing, incomplete or fails its
    checksums, the newest complete and intact one (one line says which and why); without a tracker
    the newest complete one (said too). None where there is no checkpoint at all."""
    root = Path(root)
    iteration = read_tracker(root)
    found = complete_checkpoints(root)
    if iteration is None:
        if not found:
            return None
        why, path = f"{root} has no {TRACKER}", None
    else:
        path = iteration_dir(root, iteration)
        if (path / "model.safetensors").is_file():
            raise ValueError(f"{path} is a gptrain-checkpoint/1 checkpoint, written before the fused QKV rows took "
                             "Megatron's per-head order; it cannot be resumed by this version (retrain, or load it "
                             "with gptrain 0.1)")
        ok, why = is_complete(path)
        why = f"{root / TRACKER} names {path.name}, which is {why}"
    candidates = ([path] if path is not None and ok else []) + [p for p in found if p != path]
    for candidate in candidates:
        bad = _first_bad_file(candidate)
        if bad is None:
            if candidate != path:
                rank0_log(log, f"WARNING: {why}: loading the newest complete checkpoint, {candidate.name}, instead")
            return candidate
        why = f"{candidate} is damaged ({bad} does not match its checksum)"
    raise FileNotFoundError(f"{why}, and {root} holds no " + ("other intact checkpoint" if found else
                            "complete checkpoint (a Megatron model_optim_rng.pt checkpoint is read by --load directly)"))
