"""The server's in-flight (continuous) batching: ``InflightEngine`` runs one decode loop over
``max_batch`` slots (inference/slots.py) on its worker thread. Between two steps it takes queued
jobs, gives each waiting row a free slot (its prompt prefilled in pieces, at most one piece of
``chunk`` tokens between two steps while rows decode; a prompt of one piece, on CUDA, in one graph
replay behind the steps queued ahead: slot_join.py), reads a step's ids and applies the stop
rules and stream hooks (``row_done``, as ``generate``), and frees the slot of a row that ended: at
its stop rule or length, when its client went away (``job.cancel``) or when its job ran past
``request_timeout`` (``Timeout``). A request thus starts at the next step instead of waiting for
the running batch, and a short one ends before a long one that started before it.

A seeded row gives the same text as alone, under any load (slots.py: its numbers depend only on
it). Jobs asking for log-probabilities take the static batch path (engine.py's ``generate_fn``,
one call between two steps, the running rows waiting for it); so does every job of an engine whose
model ``SlotDecoder`` cannot run (the server picks engine.py's ``Engine`` then).
"""
from __future__ import annotations

import time
import traceback
from collections import deque
from dataclasses import dataclass, field

import torch

from gptrain.inference.steps import Mode
from gptrain.inference.generate import Generation, SamplingParams, check_request, generate, row_done
from gptrain.inference.host_loop import AHEAD
from gptrain.inference.slots import PREFILL_CHUNK, SlotDecoder
from gptrain.serve.engine import Cancelled, Engine, Job, _settle


END_CHECK_S = 0.005  # how often running jobs are checked for a client gone or a time-out


def _guarded(on_token):
    """A job's stream hook whose exception ends only its own row."""
    def hook(index: int, token: int):
        try:
            return on_token(index, token)
        except Exception:  # noqa: BLE001 - a broken stream must not end the other rows
            return True
    return hook


@dataclass
class _Row:
    task: "_Task"
    index: int  # the row within its job
    params: SamplingParams
    gen: Generation
    slot: int = -1
    filled: int = 0  # prompt tokens prefilled
    first: int = -1  # the step of its first token (-1: its prompt is still going in)
    count: int = 0
    last: float | None = None  # when its last token came (None: none yet)


@dataclass
class _Task:
    job: Job
    rows: list[_Row] = field(default_factory=list)
    left: int = 0


class InflightEngine(Engine):
    def __init__(self, model, tokenizer, max_batch: int = 64, max_queue: int = 256, generate_fn=generate,
                 request_timeout: float = 0, use_graph: bool = True, chunk: int = PREFILL_CHUNK):
        """``generate_fn``: the batch path, for jobs asking for log-probabilities."""
        self.decoder = SlotDecoder(model, max_batch, use_graph=use_graph, chunk=chunk)
        self._tasks: list[_Task] = []
        self._waiting_rows: deque[_Row] = deque()  # taken from the queue, no slot yet
        self._slot_rows: list[_Row | None] = [None] * max_batch
        self._read = 0  # the next step to read
        self._live: tuple | None = None  # (decoding rows, their Mode, slots used), None: to recompute
        self._checked = 0.0  # when jobs were last checked for cancellation and time-outs
        self._occupied = 0  # slots holding a row
        self._warming: deque = deque()  # graphs still to capture while idle (warm_up_in_background)
        self._warm_report = None
        self._warm_began = 0.0
        super().__init__(model, tokenizer, max_batch=max_batch, max_queue=max_queue, generate_fn=generate_fn,
                         request_timeout=request_timeout)

    def _enqueue(self, job: Job) -> None:
        self._queue.put(job)  # rows take slots one by one: no parts needed

    # ---- the worker thread
    def _run(self) -> None:
        clock = self.metrics.loop
        while not self._stop.is_set() or self._tasks:
            try:
                if self._warming and not self._tasks and self._queue.empty():
                    self._warm_next()
                    continue
                begin = time.perf_counter()
                idle = not self._tasks
                self._take()
                if begin - self._checked >= END_CHECK_S:
                    self._end_tasks()
                    self._checked = begin
                taken = time.perf_counter()
                clock.add("idle" if idle else "take", taken - begin)
                self._admit()
                admitted = time.perf_counter()
                clock.add("admit", admitted - taken)
                self._advance(clock, admitted)
            except Exception as err:  # noqa: BLE001 - reported to every running request
                self._fail_all(err)
            self.busy = bool(self._tasks)

    def _take(self) -> None:
        """Queued jobs into waiting rows (blocking briefly when there is nothing to do)."""
        idle = not self._tasks
        while not self._stop.is_set() and len(self._waiting_rows) < self.max_batch:
            job = self._get(0.2 if idle else 0.0)
            if job is None:
                return
            idle = False
            if job.logprobs or job.top_logprobs:
                self._release(len(job.prompts))
                self._run_batch([job])  # the static path, between two steps
                continue
            task = _Task(job, left=len(job.prompts))
            for i, (prompt, params) in enumerate(zip(job.prompts, job.params)):
                task.rows.append(_Row(task, i, params, Generation(tokens=list(prompt), prompt_length=len(prompt))))
            self._tasks.append(task)
            self._waiting_rows.extend(task.rows)

    def _end_tasks(self) -> None:
        """Jobs whose client went away or whose time is up end here, their slots freed."""
        now = time.perf_counter()
        for task in list(self._tasks):
            if task.job.cancel.is_set():
                self._end(task, error=Cancelled("the client went away"))
            elif task.job.expired(now):
                self._end(task, error=self.timeout_error())

    def _admit(self) -> None:
        """Waiting rows into free slots: prompts in pieces, at most ``chunk`` tokens of them while
        rows decode (the first piece always)."""
        budget = self.decoder.chunk if self._live_rows()[0] else float("inf")
        spent = 0
        while self._waiting_rows:
            row = self._waiting_rows[0]
            prompt = row.gen.tokens
            if row.slot < 0:
                try:
                    check_request([prompt], [row.params], self.window)
                except ValueError as err:
                    self._end(row.task, error=err)
                    continue
                if row.params.max_new_tokens == 0:  # score only: nothing to decode
                    self._waiting_rows.popleft()
                    self._release(1)
                    self._row_ended(row)
                    continue
                free = [s for s, r in enumerate(self._slot_rows) if r is None]
                if not free:
                    return
                row.slot = free[0]
                self._slot_rows[row.slot] = row
                self._live = None
                self._occupied += 1
                self._occupancy()
            piece = min(len(prompt), (row.filled // self.decoder.chunk + 1) * self.decoder.chunk) - row.filled
            if spent and spent + piece > budget:
                return
            colon = row.task.job.no_newline_after_colon
            row.filled = self.decoder.prefill(row.slot, prompt, row.filled, row.params, colon)
            spent += piece
            if row.filled == len(prompt):
                self.metrics.prompt_joins.inc()
                row.first = self.decoder.issued
                self._live = None
                self._waiting_rows.popleft()
                self._release(1)

    def _decoding(self) -> list[_Row]:
        return [r for r in self._slot_rows if r is not None and r.first >= 0]

    def _live_rows(self) -> tuple[list[_Row], Mode, int]:
        """The decoding rows, the Mode of their steps and the slots a step covers (recomputed only when a
        row joins, starts decoding or leaves)."""
        if self._live is None:
            rows = self._decoding()
            colon = any(r.task.job.no_newline_after_colon for r in rows)
            mode = Mode.of([r.params for r in rows], (self.eol.colon, self.eol.eol) if colon else None)
            used = 1 + max((s for s, r in enumerate(self._slot_rows) if r is not None), default=0)
            self._live = (rows, mode, used)
        return self._live

    def _advance(self, clock, begin: float) -> None:
        """Issues steps up to ``AHEAD`` ahead of the oldest unread, then reads that one."""
        decoder = self.decoder
        rows, mode, used = self._live_rows()
        issued = 0
        while rows and decoder.issued - self._read < AHEAD:
            decoder.step(mode, used)
            issued += 1
        if issued:
            self.metrics.decode_steps.inc(issued)
            self.metrics.decode_rows.inc(issued * len(rows))
        if decoder.issued == self._read:
            clock.add("issue", time.perf_counter() - begin)
            return
        asked = time.perf_counter()
        clock.add("issue", asked - begin)
        t, ids = self._read, decoder.read(self._read)
        now = time.perf_counter()
        clock.add("wait", now - asked)
        self._read += 1
        delivered = 0
        for row in rows:
            if 0 <= row.first <= t and row.slot >= 0 and self._slot_rows[row.slot] is row:
                self._token(row, ids[row.slot], now)
                delivered += 1
        if delivered:
            self.metrics.generated_tokens.inc(delivered)
        clock.add("tokens", time.perf_counter() - now)

    def _token(self, row: _Row, token: int, now: float) -> None:
        job = row.task.job
        if row.last is None:
            self.metrics.ttft.observe(now - job.submitted)
        else:
            self.metrics.itl.observe(now - row.last)
        row.last = now
        row.gen.tokens.append(token)
        row.count += 1
        if row_done(row.gen, row.index, token, row.count, row.params, self.eol,
                    None if job.on_token is None else _guarded(job.on_token)):
            self._row_ended(row)

    def _row_ended(self, row: _Row) -> None:
        if row.slot >= 0:
            self._free(row)
        task = row.task
        task.left -= 1
        if task.left == 0:
            self._tasks.remove(task)
            self.batches += 1
            _settle(task.job.future, result=[r.gen for r in task.rows])

    def _free(self, row: _Row) -> None:
        self._slot_rows[row.slot] = None
        self._live = None
        self._occupied -= 1
        self.decoder.park(row.slot)
        row.slot = -1
        self._occupancy()  # before its job's answer goes out

    def _occupancy(self) -> None:
        self.metrics.batch(self._occupied)

    def _end(self, task: _Task, error: BaseException) -> None:
        for row in task.rows:
            if row.slot >= 0:
                self._free(row)
        waiting = [r for r in self._waiting_rows if r.task is task]
        if waiting:
            self._waiting_rows = deque(r for r in self._waiting_rows if r.task is not task)
            self._release(len(waiting))
        if task in self._tasks:
            self._tasks.remove(task)
        _settle(task.job.future, error=error)

    def _fail_all(self, err: Exception) -> None:
        for task in list(self._tasks):
            self._end(task, error=err)
        if isinstance(err, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()

    def warm_up(self) -> None:
        self.decoder.warm_up()

    def warm_up_in_background(self, report=None) -> int:
        """The graphs ``warm_up`` captures, captured one at a time by the worker thread while no
        request is running (a request that comes first captures what it needs, as without a warm-up);
        ``report(line)`` is called once they are all in. Returns how many there are."""
        steps = self.decoder.warm_up_steps()
        self._warm_report, self._warm_began = report, time.perf_counter()
        self._warming.extend(steps)
        return len(steps)

    @property
    def warming(self) -> int:
        """Graphs of the background warm-up not captured yet."""
        return len(self._warming)

    def _warm_next(self) -> None:
        step = self._warming.popleft()
        try:
            step()
        except Exception as err:  # noqa: BLE001 - reported; the graphs left are captured on first use
            left = len(self._warming) + 1
            self._warming.clear()
            if isinstance(err, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
                why = "out of GPU memory (lower --max-batch)"
            else:  # not expected: the whole traceback, for a bug report
                why = "".join(traceback.format_exception(err)).rstrip()
            if self._warm_report:
                self._warm_report(f"decode graphs: warm-up stopped with {left} left to capture on first use: {why}")
            return
        if not self._warming and self._warm_report:
            graphs = self.decoder.rows.stats["graphs"]
            self._warm_report(f"decode graphs: {graphs} captured in the background in "
                              f"{time.perf_counter() - self._warm_began:.1f} s")
