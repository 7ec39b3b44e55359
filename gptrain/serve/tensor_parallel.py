"""Tensor-parallel serving, as Megatron serves: rank 0 runs the HTTP server and the queue; for each
batch it broadcasts the work to the other ranks, and every rank runs the same generation step by
step: GPT-2's layers through the fused decode step (rows.py; its all-reduces and the broadcast of
rank 0's chosen ids inside the step's graph), others through the graph step of their own modules
with rank 0's ids broadcast after each step (inference/tensor_parallel.py's StepSync). The other ranks loop waiting for work until rank 0 says stop.

Work travels as tensors (nothing pickled) on a gloo group of its own, on the CPU and with a long
timeout, since an idle server waits for its next request as long as it likes: a fixed header
(kind, rows, token and stop-id counts, logprob settings, the newline ids), then an int64 payload
(prompt lengths, per-row integer settings, stop-id counts, the prompt ids, the stop ids) and a
float64 payload (per-row temperature, top_p, top_p_decay, top_p_bound).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from gptrain.inference.generate import EolIds, SamplingParams, check_request
from gptrain.inference.graph_step import graph_step_generate
from gptrain.inference.rows import fused_generate
from gptrain.inference.steps import fused_decodable
from gptrain.inference.tensor_parallel import StepSync

STOP, WORK = 0, 1
_HEADER = 9  # kind, rows, prompt tokens, stop ids, logprobs, top_logprobs, eol, double eol, colon
_INTS = ("max_new_tokens", "top_k", "seed", "stop_on_eol", "stop_on_double_eol")
_FLOATS = ("temperature", "top_p", "top_p_decay", "top_p_bound")
_IDLE_TIMEOUT = timedelta(days=365)


@dataclass
class Work:
    prompts: list[list[int]]
    params: list[SamplingParams]
    logprobs: bool
    top_logprobs: int
    eol: EolIds
    no_newline_after_colon: list[bool]


class WorkChannel:
    """Rank 0 -> every rank: a batch of work, or stop. Created on every rank (a collective)."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        self.rank = dist.get_rank()

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=0, group=self.group)
        return t

    @staticmethod
    def pack(work: Work) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The header and payloads of ``work``, built whole before anything is sent, so a bad
        value fails here with the ranks still in step."""
        p, rows = work.params, len(work.prompts)
        stops = [list(s.stop_ids) for s in p]
        header = [WORK, rows, sum(map(len, work.prompts)), sum(map(len, stops)), int(work.logprobs),
                  work.top_logprobs, work.eol.eol, work.eol.double_eol, work.eol.colon]
        ints = [len(x) for x in work.prompts]
        for s, colon in zip(p, work.no_newline_after_colon):
            ints += [int(getattr(s, name)) for name in _INTS] + [int(colon)]
        ints += [len(s) for s in stops]
        ints += [t for x in work.prompts for t in x] + [t for s in stops for t in s]
        floats = [float(getattr(s, name)) for s in p for name in _FLOATS]
        return (torch.tensor(header, dtype=torch.int64), torch.tensor(ints, dtype=torch.int64),
                torch.tensor(floats, dtype=torch.float64))

    def send(self, packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        for t in packed:
            self._broadcast(t)

    def stop(self) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = STOP
        self._broadcast(header)

    def receive(self) -> Work | None:
        """The next batch (on a rank other than 0), or None: stop."""
        header = self._broadcast(torch.zeros(_HEADER, dtype=torch.int64)).tolist()
        kind, rows, n_tokens, n_stops, logprobs, top_logprobs, eol, double_eol, colon = header
        if kind == STOP:
            return None
        per_row = len(_INTS) + 1
        ints = self._broadcast(torch.zeros(rows * (2 + per_row) + n_tokens + n_stops, dtype=torch.int64)).tolist()
        floats = self._broadcast(torch.zeros(rows * len(_FLOATS), dtype=torch.float64)).tolist()
        lengths, ints = ints[:rows], ints[rows:]
        settings, ints = ints[: rows * per_row], ints[rows * per_row:]
        stop_counts, ints = ints[:rows], ints[rows:]
        prompts, params, colons = [], [], []
        for r in range(rows):
            prompts.append(ints[: lengths[r]])
            ints = ints[lengths[r]:]
        for r in range(rows):
            row = settings[r * per_row:(r + 1) * per_row]
            stop_ids, ints = tuple(ints[: stop_counts[r]]), ints[stop_counts[r]:]
            values = dict(zip(_INTS, row))
            values.update(zip(_FLOATS, floats[r * len(_FLOATS):(r + 1) * len(_FLOATS)]))
            for flag in ("stop_on_eol", "stop_on_double_eol"):
                values[flag] = bool(values[flag])
            params.append(SamplingParams(stop_ids=stop_ids, **values))
            colons.append(bool(row[-1]))
        return Work(prompts, params, bool(logprobs), top_logprobs, EolIds(eol, double_eol, colon), colons)


def tensor_parallel_generate(model, prompts, params, use_graph: bool, sync: StepSync, **kw):
    """One batch on every rank alike: GPT-2's layers through the fused decode step (rows.py: its
    all-reduces and the broadcast of rank 0's ids inside the step, no host sync), other layers through
    the graph step of their own modules with rank 0's ids sent after each step (``sync``)."""
    if fused_decodable(model):
        return fused_generate(model, prompts, params, use_graph=use_graph, **kw)
    return graph_step_generate(model, prompts, params, use_graph=use_graph, sync=sync, **kw)


class LeaderGenerate:
    """Rank 0's ``generate`` for the engine: check the batch, send it, generate in step with the
    other ranks. A failure after the batch was sent leaves the ranks out of step: the process
    exits (torchrun then stops the others)."""

    def __init__(self, channel: WorkChannel, group, device: torch.device, use_graph: bool = True):
        self.channel, self.sync, self.device, self.use_graph = channel, StepSync(group), device, use_graph

    def __call__(self, model, prompts, params, logprobs=False, top_logprobs=0, eol=None, on_token=None,
                 no_newline_after_colon=None):
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if not prompts:
            return []
        check_request(prompts, params, model.cfg.max_position_embeddings)  # a ValueError before anything is sent
        eol = eol or EolIds()
        colons = list(no_newline_after_colon or [False] * len(prompts))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the engine's thread
        packed = self.channel.pack(Work(prompts, params, logprobs, top_logprobs, eol, colons))
        try:
            self.channel.send(packed)  # from here on the other ranks are in this batch
            return tensor_parallel_generate(model, prompts, params, self.use_graph, self.sync, logprobs=logprobs,
                                            top_logprobs=top_logprobs, eol=eol, on_token=on_token,
                                            no_newline_after_colon=colons)
        except BaseException as err:  # noqa: BLE001 - the other ranks are mid-batch: nothing can go on
            print(f"gptrain serve: error: rank 0 failed while generating with the other tensor-parallel ranks "
                  f"({type(err).__name__}: {err}); stopping", file=sys.stderr, flush=True)
            os._exit(1)


def follow(model, channel: WorkChannel, group, use_graph: bool = True) -> int:
    """A rank other than 0: generate each batch rank 0 sends, in step with it, until it says stop
    (``use_graph``: as rank 0's, so that every rank captures the same graphs)."""
    sync = StepSync(group)
    batches = 0
    try:
        while (work := channel.receive()) is not None:
            tensor_parallel_generate(model, work.prompts, work.params, use_graph, sync, logprobs=work.logprobs,
                                     top_logprobs=work.top_logprobs, eol=work.eol,
                                     no_newline_after_colon=work.no_newline_after_colon)
            batches += 1
    except Exception as err:  # noqa: BLE001 - out of step with rank 0: one line, and torchrun stops the rest
        print(f"gptrain serve: error: rank {channel.rank} failed after {batches} batches "
              f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); stopping",
              file=sys.stderr, flush=True)
        os._exit(1)
    return batches
