"""The server's generation queue: requests wait in a bounded queue, and one worker thread runs
whatever has gathered as one batch (rows of several requests together), then the next. A batch
holds at most ``max_batch`` rows: a larger request is split into parts of ``max_batch`` rows, each
queued when the one before has run (so other requests take their turn between them). A request
with more rows than the whole queue can hold is refused (``TooLarge``), one that does not fit now
gets ``QueueFull``. A cancelled job (``job.cancel``: its client went away) is dropped from the
queue, or its rows end at their next token. A job still running ``request_timeout`` seconds after
it was queued ends with ``Timeout`` (0: never). This is the static batch path; ``inflight.py``'s
engine lets requests join and leave a running batch at every step.

Rows never affect each other: each has its own sampling settings and seed, and a seeded row's
noise depends only on its seed and position (inference/sampling.py). Streaming requests get each
token through a callback on the worker thread; a callback returning True ends its row (a client
that went away, a stop string). The engine keeps the server's metrics (metrics.py): queue depth,
batch occupancy, generated tokens, time to first token and between tokens, timed on the host where
each token already arrives.
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
from gptrain.serve.metrics import Metrics


class QueueFull(Exception):
    """No room now: retry later (HTTP 503)."""


class TooLarge(Exception):
    """More rows than the queue holds at all: retrying cannot help (HTTP 413)."""


class Cancelled(Exception):
    """The job's client went away before it ended."""


class Timeout(Exception):
    """The job ran past the server's --request-timeout (HTTP 504)."""


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
    cancel: threading.Event = field(default_factory=threading.Event)  # set: drop it / end its rows
    submitted: float = 0.0  # time.perf_counter() when it was queued (time to first token)
    deadline: float = float("inf")  # time.perf_counter() after which it ends with Timeout

    def expired(self, now: float | None = None) -> bool:
        return (time.perf_counter() if now is None else now) > self.deadline


class Engine:
    def __init__(self, model, tokenizer, max_batch: int = 64, max_queue: int = 256, gather_ms: float = 2.0,
                 generate_fn=generate, request_timeout: float = 0):
        self.model, self.tokenizer = model, tokenizer
        self.request_timeout = request_timeout
        self.max_batch, self.max_queue, self.gather_s = max_batch, max_queue, gather_ms / 1000
        self.generate_fn = generate_fn
        self.window = model.cfg.max_position_embeddings
        self.eol = EolIds(eol=_single(tokenizer, "\n", 198), double_eol=_single(tokenizer, "\n\n", 628),
                          colon=_single(tokenizer, ":", 25))
        self._queue: queue.Queue[Job] = queue.Queue()
        self._carry: Job | None = None  # taken but did not fit the last batch: it starts the next
        self._lock = threading.Lock()
        self._waiting = 0  # rows queued, not yet running
        self.batches = 0
        self.busy = False
        self.metrics = Metrics(max_batch, queued=lambda: self._waiting)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gptrain-generate", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Future:
        rows = len(job.prompts)
        job.submitted = time.perf_counter()
        if self.request_timeout > 0:
            job.deadline = job.submitted + self.request_timeout
        if rows > self.max_queue:
            raise TooLarge(f"the request has {rows} rows (prompts x n) and the server holds at most {self.max_queue} "
                           f"(--max-queue): send at most {self.max_queue} per request")
        with self._lock:
            if self._waiting + rows > self.max_queue:
                raise QueueFull(f"the queue holds {self._waiting} prompts (limit {self.max_queue}); retry later")
            self._waiting += rows  # a split job reserves all its rows now
        self._enqueue(job)
        return job.future

    def _enqueue(self, job: Job) -> None:
        if len(job.prompts) <= self.max_batch:
            self._queue.put(job)
        else:
            _Split(self, job).queue_next()

    def timeout_error(self) -> Timeout:
        return Timeout(f"the request ran longer than the server's --request-timeout ({self.request_timeout:g} s)")

    def _release(self, rows: int) -> None:
        with self._lock:
            self._waiting -= rows

    def close(self, timeout: float | None = 10) -> None:
        """Stop taking batches; wait for the running one (``timeout`` None: however long it takes)."""
        self._stop.set()
        self._thread.join(timeout=timeout)

    def _get(self, timeout: float) -> Job | None:
        """The next job that is still wanted (cancelled ones are dropped here), or None."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if not job.cancel.is_set() and not job.expired():
                return job
            self._release(len(job.prompts))
            _settle(job.future, error=Cancelled("the client went away") if job.cancel.is_set() else self.timeout_error())

    def _take(self) -> list[Job]:
        first, self._carry = self._carry, None
        if first is not None and first.cancel.is_set():
            self._release(len(first.prompts))
            _settle(first.future, error=Cancelled("the client went away"))
            first = None
        first = first or self._get(0.2)
        if first is None:
            return []
        jobs, rows = [first], len(first.prompts)
        deadline = time.monotonic() + self.gather_s
        while rows < self.max_batch:
            job = self._get(deadline - time.monotonic())
            if job is None:
                break
            if rows + len(job.prompts) > self.max_batch:
                self._carry = job  # it starts the next batch
                break
            jobs.append(job)
            rows += len(job.prompts)
        self._release(rows)
        return jobs

    def _run(self) -> None:
        while not self._stop.is_set():
            jobs = self._take()
            if not jobs:
                continue
            self.busy = True
            self.metrics.batch(sum(len(j.prompts) for j in jobs))
            try:
                self._run_batch(jobs)
            finally:
                self.metrics.batch(0)
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
        last = [None] * len(prompts)  # each row's last token time (None: none yet)
        timed_out: set[int] = set()  # jobs whose rows the timeout ended
        ttft, itl = self.metrics.ttft, self.metrics.itl

        def on_token(row: int, token: int):
            j, r = owner[row]
            now = time.perf_counter()
            if last[row] is None:
                ttft.observe(now - jobs[j].submitted)
            else:
                itl.observe(now - last[row])
            last[row] = now
            if jobs[j].cancel.is_set():
                return True  # its client went away: the row ends here
            if jobs[j].expired(now):
                timed_out.add(j)
                return True
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
                _settle(job.future, error=err)
            if isinstance(err, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
            return
        self.metrics.generated_tokens.inc(sum(len(g.generated) for g in results))
        grouped: list[list[Generation]] = [[] for _ in jobs]
        for (j, _), res in zip(owner, results):
            grouped[j].append(res)
        for j, (job, res) in enumerate(zip(jobs, grouped)):
            _settle(job.future, **({"error": self.timeout_error()} if j in timed_out else {"result": res}))


class _Split:
    """A job of more than ``max_batch`` rows, run as parts of ``max_batch`` rows in turn: each
    part is queued when the one before has run. Its rows are reserved in the queue count from the
    start; a part that fails or is cancelled ends the job and releases the rows not queued yet."""

    def __init__(self, engine: Engine, job: Job):
        self.engine, self.job, self.start, self.results = engine, job, 0, []

    def queue_next(self) -> None:
        job, end = self.job, min(self.start + self.engine.max_batch, len(self.job.prompts))
        offset = self.start
        hook = None if job.on_token is None else (lambda row, token: job.on_token(offset + row, token))
        part = Job(prompts=job.prompts[offset:end], params=job.params[offset:end], logprobs=job.logprobs,
                   top_logprobs=job.top_logprobs, on_token=hook, no_newline_after_colon=job.no_newline_after_colon,
                   cancel=job.cancel, submitted=job.submitted, deadline=job.deadline)
        part.future.add_done_callback(self._done)
        self.engine._queue.put(part)

    def _done(self, part: Future) -> None:  # on the engine's thread (or the one that cancelled)
        self.start += self.engine.max_batch
        total = len(self.job.prompts)
        failed = part.exception()
        if failed is None and self.job.cancel.is_set() and self.start < total:
            failed = Cancelled("the client went away")
        if failed is not None:
            self.engine._release(max(0, total - self.start))
            _settle(self.job.future, error=failed)
            return
        self.results += part.result()
        if self.start >= total:
            _settle(self.job.future, result=self.results)
        else:
            self.queue_next()


def _settle(future: Future, result=None, error: BaseException | None = None) -> None:
    """Set a job's outcome unless it already has one (its waiter may have cancelled it)."""
    if future.done():
        return
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except Exception:  # noqa: BLE001 - cancelled in between
        pass


def _single(tokenizer, text: str, fallback: int) -> int:
    ids = tokenizer.encode(text)
    return ids[0] if len(ids) == 1 else fallback
