"""A request joining ``SlotDecoder`` (slots.py) in one go: its prompt (at most one piece) padded to
a power-of-two length (``prefill_bucket``) and prefilled alone into a one-row staging cache, then
the staged keys and values, the last prompt position's logits and the row's settings (start,
current token, sampling) written into the slot.

On CUDA the two halves are CUDA graphs on two streams. The prefill reads only the weights and its
own stage, so it runs on a side stream as soon as it is queued, beside the decode steps queued
ahead of it; the commit (a few copies) runs on the decode stream, in order with the steps, once its
prefill is done. The decode stream so pays a few copies per join instead of a whole forward pass.
A ring of stages lets several joins be in flight: a stage is prefilled again only after the
decode stream has committed it. Weights changed in place (between requests, on the decode stream)
make the next prefill wait for the decode stream's queue once. The host's part is one pinned copy of
the join's numbers and two replays; nothing waits for the device.

Padding after the prompt changes nothing at its positions (causal attention); the padded
positions' keys and values land in the slot past the prompt, where the row's own decode writes
each position before attending over it (``decode_attention``). A prompt always takes the same
padded length, alone or under load, so its numbers do not depend on the batch. Elsewhere than CUDA
the same functions run eagerly, one after the other (tests).
"""
from __future__ import annotations

import numpy as np
import torch

from gptrain.inference.generate import SamplingParams
from gptrain.inference.host_loop import capture
from gptrain.inference.rows import PrefillGraphs, prefill_bucket

# the packed numbers of a join (int64): two words holding four fp32 settings, then the ints, then the
# padded prompt
FLOATS, SLOT, LAST, CURRENT, START, TOP_K, SEED, COLON, TOKENS = 0, 2, 3, 4, 5, 6, 7, 8, 9
RING = 4  # joins whose prefills may be in flight at once


class _Stage:
    """One join in flight: its packed numbers and the one-row cache its padded prompt fills, with
    its graphs (by padded length) and the events that order it between the two streams."""

    def __init__(self, model, longest: int, dev: torch.device):
        self.prefill = PrefillGraphs(model, longest, use_graph=False)  # its buffers and forward pass
        self.packed = torch.zeros(TOKENS + longest, dtype=torch.long, device=dev)
        self.prefills: dict[int, torch.cuda.CUDAGraph] = {}
        self.commits: dict[int, torch.cuda.CUDAGraph] = {}
        cuda = dev.type == "cuda"
        self.ready = torch.cuda.Event() if cuda else None  # its prefill is done (side stream)
        self.free = torch.cuda.Event() if cuda else None  # its commit is done (decode stream)


class SlotJoin:
    def __init__(self, decoder, longest: int, ring: int = RING):
        """``decoder``: the ``SlotDecoder`` (its rows, and its graphs' memory pool, shared by the
        commits); ``longest``: the longest padded prompt that joins this way."""
        self.decoder, self.rows = decoder, decoder.rows
        self.use_graph = decoder.use_graph
        dev = self.rows.logits.device
        self.stages = [_Stage(decoder.model, longest, dev) for _ in range(ring if self.use_graph else 1)]
        self.joins = 0
        self.side = torch.cuda.Stream(device=dev) if self.use_graph else None
        self.side_pool = None  # the prefills' graphs: never beside each other, but beside the steps
        self.params = list(decoder.model.parameters())
        self.versions = None  # the weights' versions the side stream last caught up with

    @property
    def graphs(self) -> int:
        return sum(len(s.prefills) + len(s.commits) for s in self.stages)

    @torch.no_grad()
    def run(self, slot: int, prompt: list[int], start: int, params: SamplingParams, colon: bool,
            stage_index: int | None = None) -> None:
        """``prompt`` into ``slot``, which decodes from position ``start + step`` from the next step
        (through stage ``stage_index`` of the ring; default the next in turn)."""
        length = prefill_bucket(len(prompt), self.rows.window)
        if stage_index is None:
            stage_index = self.joins % len(self.stages)
            self.joins += 1
        stage = self.stages[stage_index]
        # packed in numpy: every torch call gives the interpreter lock up and may wait to get it back
        # (the server's HTTP thread runs meanwhile), so the join makes as few as it can
        packed = np.zeros(TOKENS + length, dtype=np.int64)
        packed[FLOATS:SLOT].view(np.float32)[:] = (params.temperature, params.top_p, params.top_p_decay,
                                                   params.top_p_bound)
        packed[SLOT:TOKENS] = (slot, len(prompt) - 1, prompt[-1], start, params.top_k, params.seed, int(colon))
        packed[TOKENS:TOKENS + len(prompt)] = prompt
        host = torch.from_numpy(packed)
        if not self.use_graph:
            stage.packed[:TOKENS + length].copy_(host)
            self._prefill(stage, length)
            self._commit(stage, length)
            return
        host = host.pin_memory()  # pinned: the copy waits for nothing on the host
        decode = torch.cuda.current_stream()
        versions = sum(p._version for p in self.params)
        with torch.cuda.stream(self.side):
            if versions != self.versions:  # the first join, or weights changed in place (on the decode
                self.side.wait_stream(decode)  # stream): the prefill reads them only after that work
                self.versions = versions
            self.side.wait_event(stage.free)  # the stage's last commit has read it
            stage.packed[:TOKENS + length].copy_(host, non_blocking=True)
            graph = stage.prefills.get(length)
            if graph is None:
                graph = capture(lambda: self._prefill(stage, length), lambda: None, self.side_pool, warmups=1)
                self.side_pool = graph.pool()
                stage.prefills[length] = self._count(graph)
            graph.replay()
            stage.ready.record(self.side)
        decode.wait_event(stage.ready)
        graph = stage.commits.get(length)
        if graph is None:
            # the warm-up run writes what the replay writes (the join's numbers are loaded): harmless
            graph = capture(lambda: self._commit(stage, length), lambda: None, self.decoder.pool, warmups=1)
            self.decoder.pool = graph.pool()
            stage.commits[length] = self._count(graph)
        graph.replay()
        stage.free.record(decode)

    def _count(self, graph: torch.cuda.CUDAGraph) -> torch.cuda.CUDAGraph:
        self.rows.stats["graphs"] += 1
        return graph

    @staticmethod
    def _prefill(stage: _Stage, length: int) -> None:
        """The padded prompt through the model into the stage: reads the weights and the stage only."""
        prefill, packed = stage.prefill, stage.packed
        prefill.tokens[0, :length].copy_(packed[TOKENS:TOKENS + length])
        prefill.last.copy_(packed[LAST:LAST + 1])
        prefill._forward(length)

    def _commit(self, stage: _Stage, length: int) -> None:
        """The stage into its slot, every index a tensor (one graph serves every slot)."""
        rows, packed = self.rows, stage.packed
        slot = packed[SLOT:SLOT + 1]
        rows.kv[:, :, :, :, :length].index_copy_(2, slot, stage.prefill.cache.kv[:, :, :, :, :length])
        rows.logits.index_copy_(0, slot, stage.prefill.logits)
        for buf, at in ((rows.current, CURRENT), (rows.start, START), (rows.top_k, TOP_K), (rows.seeds, SEED)):
            buf.index_copy_(0, slot, packed[at:at + 1])
        rows.colon_rows.index_copy_(0, slot, packed[COLON:COLON + 1] != 0)
        floats = packed[FLOATS:SLOT].view(torch.float32)
        for i, buf in enumerate((rows.temperature, rows.top_p, rows.decay, rows.bound)):
            buf.index_copy_(0, slot, floats[i:i + 1])
