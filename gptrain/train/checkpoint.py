"""What a checkpoint holds and how the ranks write and read it, through
``torch.distributed.checkpoint`` (DCP): every rank writes its own shards, nothing in them is loaded
as code (``safe_dcp``: DCP's metadata pickle through an allow-list, tensor entries only), and shapes
do not depend on the layout (the word embeddings are stored at the real vocabulary's size, without
the padding). The folders, their manifest, publishing and recovery are ``checkpoint_files.py``'s.

    SAVE/iter_0000500/.metadata, __*_*.distcp  DCP: "model/<name>" fp32 weights (the main copies when
                                               the model itself runs in bf16), "optim/<name>/<key>"
                                               AdamW state
    SAVE/iter_0000500/rng_rank00000.safetensors, rng_rank00000.json   each rank's generator states
    SAVE/iter_0000500/state.json              iteration, consumed samples, lr schedule, loss scaler,
                                              layout, the resolved run config, and (written last) the
                                              manifest: every file's size and sha256

A failed save (a full disk) is one line agreed by all ranks, with its partial files removed.
``Checkpointer`` is the trainer's: synchronous saves, or ``--async-save``'s staging into reused host
buffers (``HostStager``) and writing in a background thread.
"""
from __future__ import annotations

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor
import shutil
import time
import traceback as tb
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from gptrain.parallel.shards import copy_full_into
from gptrain.parallel.collectives import distributed
from gptrain.train.checkpoint_files import (UNPADDED, discard, find_gptrain_iteration_dir, iteration_dir,
                                            newest_complete, publish, rank0_log, this_rank, tmp_dir,
                                            write_rank_sums)
from gptrain.train.durable import save_safetensors, write_durable
from gptrain.train.signals import deferred_signals
from gptrain.train.safe_dcp import load_safely, read_metadata_safely

# one process without a process group is a normal run here; --async-save's writer thread would
# print DCP's warning about it outside any local warnings filter
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


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


def _unpadded(name: str, t: torch.Tensor, vocab_size: int, host: bool = True) -> torch.Tensor:
    """What is stored for ``t``: the embedding-shaped tensors whole and cut to the real vocabulary
    (the same on every rank, so DCP writes it once), everything else as it is (DTensor shards).
    ``host=False`` leaves the cut on its device, for a stager that copies it to the host anyway."""
    if name not in UNPADDED or t.dim() != 2:
        return t
    full = t.full_tensor() if isinstance(t, DTensor) else t
    cut = full.detach()[:vocab_size].float()
    return cut.cpu() if host else cut


def init_optimizer_state(params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter AdamW's state (zeros), so a checkpoint can be loaded into it in place."""
    for p in params.values():
        if p not in optimizer.state or not optimizer.state[p]:
            optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                  "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def _state_dict(params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer | None,
                vocab_size: int, host: bool = True, layout=None) -> dict[str, torch.Tensor]:
    """What DCP writes or reads in place. ``layout`` (parallel/tensor_parallel.ShardLayout) shows
    tensor-parallel shards as DTensors of the full tensors (``checkpoint_view``)."""
    view = layout.checkpoint_view if layout is not None else (lambda name, t: t)
    out = {f"model/{name}": _unpadded(name, view(name, p), vocab_size, host) for name, p in params.items()}
    if optimizer is not None:
        for name, p in params.items():
            for key, value in optimizer.state.get(p, {}).items():
                out[f"optim/{name}/{key}"] = _unpadded(name, view(name, value), vocab_size, host)
    return out


class CheckpointError(RuntimeError):
    """A save that could not complete (a full disk, ...): one line; its partial files are removed
    and the previous checkpoints are kept."""


def _where(trace) -> str:
    """The innermost frame of a traceback or StackSummary, as ``file.py:line in function``."""
    frames = tb.extract_tb(trace) if isinstance(trace, types.TracebackType) else trace
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {Path(f.filename).name}:{f.lineno} in {f.name})"


def _describe(err: BaseException, trace=None, depth: int = 0) -> str:
    """``Type: first line of the message (at file:line in function)``; DCP's CheckpointException as
    each rank's underlying exception (identical ones grouped), an explicit cause appended."""
    failures = getattr(err, "failures", None)  # DCP's CheckpointException: rank -> (exception, trace)
    if isinstance(failures, dict) and failures:
        by_text: dict[str, list[int]] = {}
        for rank, failure in sorted(failures.items()):
            exc, stack = failure if isinstance(failure, tuple) else (failure, None)
            by_text.setdefault(_describe(exc, stack, depth + 1), []).append(rank)
        return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {text}"
                         for text, r in by_text.items())
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    text += _where(trace if trace is not None else err.__traceback__)
    if err.__cause__ is not None and depth < 3:
        text += f", caused by {_describe(err.__cause__, depth=depth + 1)}"
    return text


def _reason(err: BaseException) -> str:
    """One line for a failed save: the operating system's words where there are some (a full disk),
    else the underlying exception's type, message and place, per rank for DCP's failures."""
    stack, seen = [err], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.strerror:
            return e.strerror + (f" ({e.filename})" if e.filename else "")
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
        stack += [e.__cause__, e.__context__]
    return _describe(err)


def _together(what: str, fn, where: str, root: Path) -> None:
    """Run ``fn`` on this rank; if it failed on any rank, every rank raises the same CheckpointError
    (no rank is left waiting in a collective)."""
    error = None
    try:
        fn()
    except (Exception, CheckpointException) as err:
        error = err
    failed = torch.tensor([0.0 if error is None else 1.0])
    if distributed():
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
    if failed.item():
        if this_rank() == 0:
            discard(where)
        reason = _reason(error) if error is not None else "it failed on another rank"
        raise CheckpointError(f"could not {what}: {reason}; its partial files were removed and "
                              f"{newest_complete(root)}") from None


_hasher: ThreadPoolExecutor | None = None


def _then_checksums(future, folder: Path, rank: int):
    """``--async-save``: a future that completes once DCP's writer is done and this rank's files
    are hashed, in a thread of its own (off the training loop)."""
    global _hasher
    if _hasher is None:
        _hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gptrain-checksums")
    upload = getattr(future, "upload_completion", future)
    return _hasher.submit(lambda: (upload.result(), write_rank_sums(folder, rank)))


@dataclass
class PendingSave:
    """A save whose data is still being written (``--async-save``); ``finish_save`` publishes it."""
    root: Path
    iteration: int | str
    final: Path
    state: dict
    future: object


def save_checkpoint(root: str | os.PathLike, iteration: int, params: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer, state: dict, vocab_size: int, *, async_save: bool = False,
                    stager=None, process_group=None, layout=None) -> Path | PendingSave:
    """``params``: the name -> tensor map the optimizer updates (fp32 main copies, or FSDP2's
    fp32 shards). Every rank calls this. With ``async_save`` the tensors are staged in host memory,
    written by a background thread, and ``finish_save`` publishes the checkpoint once they are durable.

    The copy is written into a temporary folder, fsynced, renamed into place and only then named by
    the tracker; re-saving an existing iteration moves the old copy aside until the new one is in
    place (``recover`` puts it back after a crash in between)."""
    root = Path(root)
    final = iteration_dir(root, iteration)
    tmp = tmp_dir(final)
    rank = this_rank()
    what = f"save the checkpoint of iteration {iteration} to {root}"

    def prepare():
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()

    with deferred_signals():
        _together(what, prepare, str(final), root)
        future = None

        def write():
            nonlocal future
            with warnings.catch_warnings():  # one process without a process group is a normal run here
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
                if async_save:
                    state_dict = _state_dict(params, optimizer, vocab_size, host=not isinstance(stager, HostStager),
                                             layout=layout)
                    future = dcp.async_save(state_dict, checkpoint_id=str(tmp),
                                            async_stager=stager, process_group=process_group,
                                            no_dist=not distributed())
                else:
                    dcp.save(_state_dict(params, optimizer, vocab_size, layout=layout), checkpoint_id=str(tmp))
            rng_tensors, rng_scalars = _rng_state()
            save_safetensors(rng_tensors, tmp / f"rng_rank{rank:05d}.safetensors")
            write_durable(tmp / f"rng_rank{rank:05d}.json", json.dumps(rng_scalars))
            if future is None:
                write_rank_sums(tmp, rank)
            else:
                future = _then_checksums(future, tmp, rank)

        _together(what, write, str(final), root)
        pending = PendingSave(root, iteration, final, state, future)
        if async_save:
            return pending
        return finish_save(pending)


def finish_save(pending: PendingSave) -> Path:
    """Wait for the data of a save (every rank), then rank 0 publishes it: the manifest and
    fsyncs, the rename into place, the tracker."""
    final, root, iteration = pending.final, pending.root, pending.iteration
    what = f"save the checkpoint of iteration {iteration} to {root}"
    with deferred_signals():
        if pending.future is not None:
            upload = getattr(pending.future, "upload_completion", pending.future)
            _together(what, upload.result, str(final), root)
        _together(what, lambda: publish(root, iteration, pending.state) if this_rank() == 0 else None,
                  str(final), root)
    return final


def load_checkpoint(root: str | os.PathLike, params: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer | None, vocab_size: int, load_rng: bool = True,
                    log=None, layout=None, path: Path | None = None) -> dict | None:
    """Restore into ``params`` (as for saving) and ``optimizer``; return the saved state dict, or
    None if there is no checkpoint. ``path``: the iteration folder, already chosen by
    ``find_gptrain_iteration_dir``."""
    path = path or find_gptrain_iteration_dir(root, log)
    if path is None:
        return None
    try:
        return _load_from(path, params, optimizer, vocab_size, load_rng, log, layout)
    except (ValueError, FileNotFoundError):
        raise
    except Exception as err:  # noqa: BLE001 - a checkpoint without checksums (older gptrain) that is damaged
        raise ValueError(f"{path} could not be read ({_describe(err)}): it is damaged; move it aside to "
                         f"resume from an older checkpoint") from None


def _load_from(path: Path, params, optimizer, vocab_size: int, load_rng: bool, log, layout) -> dict:
    stored = read_metadata_safely(path).state_dict_metadata
    if optimizer is not None and not any(k.startswith("optim/") for k in stored):
        rank0_log(log, f" > {path} holds weights only (a converted checkpoint): the optimizer starts fresh")
        optimizer = None
    if optimizer is not None:
        init_optimizer_state(params, optimizer)
    targets = _state_dict(params, optimizer, vocab_size, layout=layout)
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
        load_safely(targets, path)
    # the unpadded embedding-shaped tensors were read whole: pad with zeros and keep this rank's shard
    for key, value in targets.items():
        name = key.split("/")[1]
        if name not in UNPADDED or value.dim() != 2:
            continue
        dest = params[name] if key.startswith("model/") else optimizer.state[params[name]][key.rsplit("/", 1)[1]]
        # the padded table whole (dest may be a tensor-parallel shard of it), then this rank's part
        shape = layout.full_shape(name, dest.shape) if layout is not None else tuple(dest.shape)
        padded = torch.zeros(shape, dtype=torch.float32)
        padded[:vocab_size] = value
        copy_full_into(dest, padded, layout.region(name, shape) if layout is not None else None)
    state = json.loads((path / "state.json").read_text())
    rng = path / f"rng_rank{this_rank():05d}.safetensors"
    if load_rng and rng.is_file():
        _set_rng_state(load_file(rng), json.loads(rng.with_suffix(".json").read_text()))
    return state


class HostStager(AsyncStager):
    """``async_save``'s staging: host copies of the state dict in buffers allocated (pinned, on a GPU)
    by the first save and reused by every later one, so a save blocks training only for the copy.
    DCP's own DefaultStager cannot be reused in torch 2.11 (its ``stage`` closes itself: the
    second save fails with ``KeyError: <class 'type'>``) and allocates and pins every time there.
    The caller must not stage again before the previous save's writer is done with the buffers
    (``Checkpointer`` finishes one save before it starts the next)."""

    _synchronize_after_execute = False  # stage() returns with the copy complete

    def __init__(self, pin: bool):
        self.pin = pin
        self.buffers: dict | None = None
        self._layout: dict | None = None

    @staticmethod
    def _layout_of(state_dict: dict) -> dict:
        return {k: (type(v), tuple(v.shape), v.dtype,
                    tuple(v.to_local().shape) if isinstance(v, DTensor) else None) for k, v in state_dict.items()}

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):  # DCP's own way to a host DTensor (the same mesh and placements)
            # on a CPU it deep-copies the DTensor, which fails for a view into a larger storage (the distributed
            # optimizer's rows): a clone of its own then
            return _create_cpu_state_dict({"t": t.detach().clone() if t.device.type == "cpu" else t},
                                          pin_memory=self.pin)["t"]
        # allocated pinned at once: DCP's helper pins a pageable copy, twice the work on the first save
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)

    @torch.no_grad()
    def stage(self, state_dict: dict) -> dict:
        layout = self._layout_of(state_dict)
        if layout != self._layout:  # first save, or another model: new buffers
            self.buffers = None  # the old ones go before the new ones are allocated
            self.buffers = {k: self._buffer(v) for k, v in state_dict.items()}
            self._layout = layout
        staged = _copy_state_dict(state_dict, self.buffers, non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize()  # the device-to-host copies were queued behind the optimizer's kernels
        return staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self.buffers = self._layout = None


class Checkpointer:
    """The trainer's saves, synchronous or (``--async-save``) through DCP's ``async_save``: the
    tensors are copied into host buffers (``HostStager``: pinned on a GPU, kept from save to save)
    while training waits, a background thread writes them, and the checkpoint is published
    (manifest, fsync, rename, tracker) once every rank has finished writing. One save at a time:
    the previous one finishes before the next starts and before the run ends."""

    def __init__(self, async_save: bool, log=print):
        self.async_save, self.log = async_save, log
        self.pending: PendingSave | None = None
        self._started = 0.0
        self._stager = None
        self._group = None

    def save(self, root, iteration: int, params: dict[str, torch.Tensor], optimizer, state: dict,
             vocab_size: int, layout=None) -> None:
        self.finish()
        start = time.perf_counter()
        self.log(f"saving checkpoint at iteration {iteration:7d} to {root}" + (" (asynchronously)" if self.async_save else ""))
        if not self.async_save:
            save_checkpoint(root, iteration, params, optimizer, state, vocab_size, layout=layout)
            self.log(f"  successfully saved checkpoint at iteration {iteration:7d} to {root} "
                     f"({time.perf_counter() - start:.2f} s)")
            return
        if self._group is None and distributed():  # the writer thread's collectives stay off the training group
            self._group = torch.distributed.new_group(backend="gloo")
        if self._stager is None:
            self._stager = HostStager(pin=any(p.is_cuda for p in params.values()))
        with deferred_signals():  # a signal while staging takes effect once the save is recorded as pending
            self.pending = save_checkpoint(root, iteration, params, optimizer, state, vocab_size, async_save=True,
                                           stager=self._stager, process_group=self._group, layout=layout)
            self._started = start
        self.log(f"  training blocked {time.perf_counter() - start:.2f} s; the checkpoint is written in the background")

    def poll(self) -> None:
        """Publish the pending save if every rank's writer is done (every rank calls this)."""
        if self.pending is None:
            return
        upload = getattr(self.pending.future, "upload_completion", self.pending.future)
        done = torch.tensor([1.0 if upload.done() else 0.0])
        if distributed():
            torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MIN)
        if done.item():
            self.finish()

    def finish(self) -> None:
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        finish_save(pending)
        self._log_published(pending)

    def finish_interrupted(self, timeout_s: float = 300.0) -> None:
        """After a signal without ``--exit-signal-handler``: the pending background save still
        lands. No collective on the training group (the other ranks may be anywhere in the step):
        each rank waits for its own writer, and rank 0 publishes once its writer succeeded, which
        DCP reports only after every rank's data is written (its own gather on the writers' group)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        upload = getattr(pending.future, "upload_completion", pending.future)
        if this_rank() == 0:
            self.log(f"  waiting for the background save of iteration {pending.iteration} to finish "
                     f"(at most {timeout_s:.0f} s; a launcher may kill the run sooner)")
        try:
            with deferred_signals():
                upload.result(timeout=timeout_s)
                if this_rank() == 0:
                    publish(pending.root, pending.iteration, pending.state)
        except Exception as err:  # noqa: BLE001 - the run is stopping: say what was lost, keep the rest
            if this_rank() == 0:
                discard(str(pending.final))
                self.log(f"  the background save of iteration {pending.iteration} did not finish "
                         f"({_reason(err)}); {newest_complete(pending.root)}")
            return
        self._log_published(pending, ", finished after the signal")

    def _log_published(self, pending: PendingSave, note: str = "") -> None:
        self.log(f"  successfully saved checkpoint at iteration {pending.iteration:7d} to {pending.root} "
                 f"({time.perf_counter() - self._started:.2f} s, in the background{note})")

    def close(self) -> None:
        self.finish()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
