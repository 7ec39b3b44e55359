"""The server's generation queue: requests wait in a bounded queue, and one worker thread runs
whatever has gathered as one batch (rows of several requests together), then the next.

Rows never affect each other: each has its own sampling settings and seed, and a seeded row's
noise depends only on its seed and position (inference/sampling.py). Streaming requests get each
token through a callback on the worker thread; a callback returning True ends its row (a client
that went away, a stop string).
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from gptrain.inference.generate import EolIds, Generation, SamplingParams, generate


class QueueFull(Exception):
    pass


@dataclass
class Job:
    prompts: list[list[int]]
    params: list[SamplingParams]
    logprobs: bool = False
    top_logprobs: int = 0
    on_token: Callable[[int, int], bool | None] | None = None  # (row within this job, token)
    # extra logit rules: rows where a newline may not follow a colon (Megatron's prevent_newline_after_colon)
    no_newline_after_colon: bool = False
    future: Future = field(default_factory=Future)


class Engine:
    def __init__(self, model, tokenizer, max_batch: int = 64, max_queue: int = 256, gather_ms: float = 2.0,
                 generate_fn=generate):
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_queue, self.gather_s = max_batch, max_queue, gather_ms / 1000
        self.generate_fn = generate_fn
        self.window = model.cfg.max_position_embeddings
        self.eol = EolIds(eol=_single(tokenizer, "\n", 198), double_eol=_single(tokenizer, "\n\n", 628),
                          colon=_single(tokenizer, ":", 25))
        self._queue: queue.Queue[Job] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0  # rows queued, not yet running
        self.batches = 0
        self.busy = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gptrain-generate", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Future:
        with self._lock:
            if self._waiting + len(job.prompts) > self.max_queue:
                raise QueueFull(f"the queue holds {self._waiting} prompts (limit {self.max_queue}); retry later")
            self._waiting += len(job.prompts)
        self._queue.put(job)
        return job.future

    def close(self, timeout: float | None = 10) -> None:
        """Stop taking batches; wait for the running one (``timeout`` None: however long it takes)."""
        self._stop.set()
        self._thread.join(timeout=timeout)

    def _take(self) -> list[Job]:
        try:
            first = self._queue.get(timeout=0.2)
        except queue.Empty:
            return []
        jobs, rows = [first], len(first.prompts)
        deadline = time.monotonic() + self.gather_s
        while rows < self.max_batch:
            try:
                job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if rows + len(job.prompts) > self.max_batch:
                self._queue.put(job)  # it runs in the next batch
                break
            jobs.append(job)
            rows += len(job.prompts)
        with self._lock:
            self._waiting -= rows
        return jobs

    def _run(self) -> None:
        while not self._stop.is_set():
            jobs = self._take()
            if not jobs:
                continue
            self.busy = True
            try:
                self._run_batch(jobs)
            finally:
                self.busy = False
                self.batches += 1

    def _run_batch(self, jobs: list[Job]) -> None:
        prompts, params, owner, colon_rows = [], [], [], []
        for j, job in enumerate(jobs):
            for r, (p, s) in enumerate(zip(job.prompts, job.params)):
                colon_rows.append(job.no_newline_after_colon)
                prompts.append(p)
                params.append(s)
                owner.append((j, r))

        def on_token(row: int, token: int):
            j, r = owner[row]
            hook = jobs[j].on_token
            if hook is None:
                return None
            try:
                return hook(r, token)
            except Exception:  # a broken stream must not end the other rows
                return True

        try:
            results = self.generate_fn(self.model, prompts, params, logprobs=any(j.logprobs for j in jobs),
                                       top_logprobs=max(j.top_logprobs for j in jobs), eol=self.eol,
                                       on_token=on_token, no_newline_after_colon=colon_rows)
        except Exception as err:  # noqa: BLE001 - reported to every waiting request
            for job in jobs:
                job.future.set_exception(err)
            if isinstance(err, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
            return
        grouped: list[list[Generation]] = [[] for _ in jobs]
        for (j, _), res in zip(owner, results):
            grouped[j].append(res)
        for job, res in zip(jobs, grouped):
            job.future.set_result(res)


def _single(tokenizer, text: str, fallback: int) -> int:
    ids = tokenizer.encode(text)
    return ids[0] if len(ids) == 1 else fallback
