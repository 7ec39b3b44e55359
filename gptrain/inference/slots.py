"""In-flight (continuous) batching on the device: ``SlotDecoder`` keeps a ``RowDecoder``'s static
cache as ``slots`` rows, one request row per slot, each at its own position. Between two steps a
free slot takes a new prompt (``prefill``) and a finished row frees its slot (``park``); the running
rows never wait for a whole batch. A prompt of one piece (at most ``chunk`` tokens) joins on CUDA
through ``SlotJoin`` (slot_join.py): padded to a power-of-two length, prefilled alone on a side
stream beside the steps queued ahead, then written into the slot with the row's settings in order
with the steps. Its numbers are those of the padded prefill (as the batch path's ``PrefillGraphs``,
not the unpadded eager prefill's), the same alone and under load. A longer
prompt goes in eagerly (``forward_cached`` on that row alone) in pieces of ``chunk`` tokens at fixed
boundaries, so the running rows wait at most a piece; so does every prompt elsewhere than CUDA.

A step runs the first ``rows`` slots (a batch bucket: 1, 2, 4, ... covering the highest slot in
use), one CUDA graph per (Mode, bucket), captured on first use while rows are live: the state a
warm-up step would change (logits, last ids, top_p, the step counter) is saved and put back, and
what else it writes (each row's next cache position, this step's ids) the real step writes again.

Positions: a row's position is ``start + step`` (RowDecoder's rule); a row joining at device step
``s`` gets ``start = len(prompt) - s``, so its sampling noise, seeded by (seed, position), is the
one it gets alone. A free slot decodes from position 0 (finite numbers, never read), a slot whose
prompt is still going in sits at the last position (its decode writes land where no prompt goes).
The step counter indexes each step's ids, so before it reaches the window it is folded into
``start`` (``_rebase``). Numbers of a row depend only on that row (batch-invariant kernels, the
prompt's own prefill): a seeded request gives the same text alone or joining any running batch.
Not served here (the server's batch path keeps them): log-probabilities, and models that
``RowDecoder`` cannot run (``plain_model`` false: Llama-style layers, kernel swaps, tensor
parallelism).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from gptrain.inference.steps import Mode, bucket
from gptrain.inference.generate import SamplingParams
from gptrain.inference.host_loop import StepReader, capture, set_item
from gptrain.inference.kv_cache import forward_cached
from gptrain.inference.rows import RowCache, RowDecoder, prefill_bucket
from gptrain.inference.slot_join import SlotJoin
from gptrain.kernels.ln_fold import refresh_ln_constants

PREFILL_CHUNK = 256  # prompt tokens prefilled between two decode steps (at most, piece boundaries fixed)


class SlotDecoder:
    def __init__(self, model, slots: int, use_graph: bool = True, chunk: int = PREFILL_CHUNK,
                 padded: bool | None = None):
        """``padded``: prompts of one piece join through ``SlotJoin`` (default: on CUDA with graphs;
        True elsewhere runs it eagerly, for tests)."""
        # its own RowDecoder, not the model's cached one: the server's batch path may run that one
        # between two of this decoder's steps
        self.rows = RowDecoder(model, bucket(slots), use_graph=use_graph)
        self.model, self.slots, self.chunk = model, slots, chunk
        self.window = self.rows.window
        self.use_graph = self.rows.use_graph
        self.outs: dict[int, torch.Tensor] = {self.rows.batch: self.rows.out}  # bucket -> (window, bucket) ids
        self.graphs: dict[tuple[Mode, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.join = None
        if padded if padded is not None else self.use_graph:
            self.join = SlotJoin(self, prefill_bucket(min(chunk, self.window), self.window))
        self.issued = 0  # steps issued (host numbering, never reset)
        self.base = 0  # the host number of device step 0
        self.parked: set[int] = set(range(self.rows.batch))  # slots decoding nothing
        self.reader = StepReader(self.rows.out, self.rows.stats)
        self.rows.start.zero_()
        self.rows.step_index.zero_()
        self.rows.logits.zero_()

    # ---- slots, between steps
    def _device_step(self) -> int:
        return self.issued - self.base

    def park(self, slot: int) -> None:
        """``slot`` decodes nothing from the next step: position 0 onwards, its ids never read."""
        self.parked.add(slot)
        set_item(self.rows.start, slot, -self._device_step())

    @torch.no_grad()
    def prefill(self, slot: int, prompt: list[int], begin: int, params: SamplingParams, colon: bool) -> int:
        """Prompt tokens ``begin ..`` up to the next piece boundary into ``slot``'s cache; returns
        where it stopped. At the prompt's end the slot decodes from the next step."""
        rows, dev = self.rows, self.rows.logits.device
        if begin == 0:
            self.parked.discard(slot)
            refresh_ln_constants()  # weights changed in place since the last request (cheap if not)
            if self.join is not None and len(prompt) <= self.chunk:
                self.join.run(slot, prompt, len(prompt) - self._device_step(), params, colon)
                return len(prompt)
            set_item(rows.start, slot, self.window)  # the last position while its prompt goes in
        end = min(len(prompt), (begin // self.chunk + 1) * self.chunk)
        tokens = torch.tensor([prompt[begin:end]])
        if dev.type == "cuda":  # a pageable copy would wait for the steps queued ahead
            tokens = tokens.pin_memory().to(dev, non_blocking=True)
        hidden = forward_cached(self.model, tokens, begin, RowCache(rows.kv, slot))
        if end == len(prompt):
            rows.logits[slot] = self.model.output_layer(hidden[0, -1]).float()
            set_item(rows.current, slot, prompt[-1])
            rows._load_row(slot, params, colon)
            set_item(rows.start, slot, len(prompt) - self._device_step())
        return end

    # ---- steps
    @torch.no_grad()
    def step(self, mode: Mode, used: int) -> int:
        """Issues one step of the slots below ``used`` (rounded up to a bucket); returns its number."""
        b = min(bucket(max(1, used)), self.rows.batch)
        if self._device_step() >= self.window:
            self._rebase()
        out = self._out(b)
        if self.use_graph:
            self._graph(mode, b, out).replay()
            self.rows.stats["replays"] += 1
        else:
            self.rows.step(mode, b, out)
        t = self.issued
        self.reader.issued(t, out[t - self.base])
        self.issued += 1
        self.rows.stats["steps"] += 1
        return t

    def _out(self, b: int) -> torch.Tensor:
        if b not in self.outs:
            self.outs[b] = torch.zeros(self.window, b, device=self.rows.out.device, dtype=torch.long)
        return self.outs[b]

    def read(self, t: int) -> list[int]:
        """Step ``t``'s ids, one per slot of its bucket (in order; at most ``AHEAD`` unread)."""
        return self.reader.read(t)

    def _rebase(self) -> None:
        """Folds the step counter into ``start`` (positions unchanged), free slots back to position 0."""
        rows = self.rows
        rows.start.add_(rows.step_index)
        rows.step_index.zero_()
        self.base = self.issued
        for slot in self.parked:
            set_item(rows.start, slot, 0)

    def _graph(self, mode: Mode, b: int, out: torch.Tensor) -> torch.cuda.CUDAGraph:
        graph = self.graphs.get((mode, b))
        if graph is None:
            rows = self.rows
            state = (rows.padded_logits, rows.current, rows.top_p, rows.step_index)
            saved = [s.clone() for s in state]

            def restore():
                for s, v in zip(state, saved):
                    s.copy_(v)

            graph = capture(lambda: rows.step(mode, b, out), restore, self.pool)
            self.pool = graph.pool()
            self.graphs[(mode, b)] = graph
            rows.stats["graphs"] += 1
        return graph

    def warm_up_steps(self) -> list[Callable[[], None]]:
        """What ``warm_up`` does, one graph each (the server runs them while idle): the greedy and the
        sampled step of every bucket and the join of every padded length, small before large."""
        steps: list[Callable[[], None]] = []
        if self.use_graph:
            b = 1
            while b <= self.rows.batch:
                steps += [functools.partial(self._warm_step, Mode(greedy=greedy), b) for greedy in (True, False)]
                b *= 2
        if self.join is not None and self.join.use_graph:
            longest = min(self.chunk, self.window - 1)
            lengths = {min(prefill_bucket(n, self.window), longest) for n in range(1, longest + 1)}
            steps += [functools.partial(self._warm_join, n) for n in sorted(lengths)]
        return steps

    def warm_up(self) -> None:
        """Every graph a request can need, captured now (idle: nothing is decoding)."""
        for step in self.warm_up_steps():
            step()

    def _warm_step(self, mode: Mode, b: int) -> None:
        self._graph(mode, b, self._out(b))

    def _warm_join(self, length: int) -> None:
        """A prompt of ``length`` tokens into a free slot and out, through each stage of the join's
        ring (each has its own graphs; idle only)."""
        try:
            for stage in range(len(self.join.stages)):
                self.parked.discard(0)
                self.join.run(0, [0] * length, length - self._device_step(), SamplingParams(temperature=0.0), False,
                              stage_index=stage)
        finally:
            self.park(0)  # free again, also when the capture failed
