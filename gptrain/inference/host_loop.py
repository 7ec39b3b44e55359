"""What the decode loops (``rows.py``'s ``RowDecoder`` and slots.py over it, graph_step.py's step of a
model's own layers) share on the host: capturing a step as a CUDA graph, writing a number into a
device buffer without a sync, and reading each step's chosen ids back without stalling the device
(the host queues ``AHEAD`` steps before it waits for the oldest one)."""
from __future__ import annotations

import time
from typing import Callable

import torch

AHEAD = 4  # steps the host queues before it reads a step's ids back


class _Cache(dict):
    """What a model's decode loops keep between requests; copies and pickles of the model get an
    empty one (CUDA graphs and caches are not copied with the weights)."""

    def __deepcopy__(self, memo):
        return _Cache()

    def __reduce__(self):
        return _Cache, ()


def model_cache(model: torch.nn.Module, name: str) -> dict:
    """A dict kept on ``model`` under ``name``: decoders and graphs cached for a model go when the
    model goes (a module-level dict keyed by ``id(model)`` kept every model alive)."""
    cache = model.__dict__.get(name)
    if cache is None:
        cache = _Cache()
        object.__setattr__(model, name, cache)
    return cache


def release_model_caches(model: torch.nn.Module) -> None:
    """Drop the decode loops' caches kept on ``model`` (CUDA graphs among them) and free them now:
    an NCCL communicator whose collectives a live CUDA graph captured hangs in its destruction
    (pytorch issue 115388), so a tensor-parallel process releases its graphs before it ends."""
    names = [name for name, value in model.__dict__.items() if isinstance(value, _Cache)]
    if not names:
        return
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for name in names:
        del model.__dict__[name]
    import gc

    gc.collect()


def set_item(buf: torch.Tensor, index: int, value) -> None:
    """``buf[index] = value`` for a Python number, without waiting for the device: an assignment copies
    the number from pageable host memory, which on CUDA waits for every step queued ahead; ``fill_``
    hands it to a kernel launch instead."""
    buf[index].fill_(value)


def capture(step: Callable[[], None], reset: Callable[[], None], pool=None,
            warmups: int = 2) -> torch.cuda.CUDAGraph:
    """``step`` captured as a CUDA graph in ``pool``, after ``warmups`` eager runs on a side stream
    (compiles, cuBLAS workspaces, lazy inits); ``reset`` runs before each (the warm-ups write to the
    step's buffers, so a graph is captured before a request's state goes in)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            reset()
            step()
    torch.cuda.current_stream().wait_stream(stream)
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step()
    return graph


class StepReader:
    """Each step's ids (a row of the device tensor ``ids``, step-major, or a row given at issue) to
    the host: on CUDA a pinned slot and an event per step in flight, copied when the step is issued
    and read once the event has passed; elsewhere read when issued (the step already ran). Counts
    its waits in ``stats``."""

    def __init__(self, ids: torch.Tensor, stats: dict):
        self.ids, self.stats = ids, stats
        self.host = self.events = None
        self.eager: list[list[int] | None] = [None] * AHEAD
        if ids.is_cuda:
            self.host = torch.zeros(AHEAD, ids.shape[1], dtype=ids.dtype, pin_memory=True)
            self.events = [torch.cuda.Event() for _ in range(AHEAD)]

    def issued(self, t: int, row: torch.Tensor | None = None) -> None:
        """Step ``t`` is queued: its ids' copy (``row``, default ``ids[t]``) goes in behind it."""
        row = self.ids[t] if row is None else row
        slot = t % AHEAD
        if self.host is None:
            self.eager[slot] = row.tolist()
            return
        self.host[slot, :row.shape[0]].copy_(row, non_blocking=True)
        self.events[slot].record()

    def read(self, t: int) -> list[int]:
        """Step ``t``'s ids (steps are read in order, and at most ``AHEAD`` are queued unread)."""
        slot = t % AHEAD
        if self.host is None:
            return self.eager[slot]
        begin = time.perf_counter()
        self.events[slot].synchronize()
        self.stats["wait_s"] += time.perf_counter() - begin
        self.stats["host_waits"] += 1
        return self.host[slot].tolist()
