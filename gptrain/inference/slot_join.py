"""A request joining ``SlotDecoder`` (slots.py) in one go: its prompt (at most one piece) padded to
a power-of-two length (``prefill_bucket``) and prefilled in the one-row staging cache of rows.py's
``PrefillGraphs``, then the staged keys and values, the last prompt position's logits and the row's
settings (start, current token, sampling) written into the slot, all as one CUDA graph per padded
length. The host's part is one pinned copy of the join's numbers (slot, tokens, settings) and one
replay: the running rows' queued steps never wait for it, and it costs a few launches, not a few
hundred.

Padding after the prompt changes nothing at its positions (causal attention); the padded
positions' keys and values land in the slot past the prompt, where the row's own decode writes
each position before attending over it (``decode_attention``). A prompt always takes the same
padded length, alone or under load, so its numbers do not depend on the batch. Elsewhere than CUDA
the same function runs eagerly (tests).
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


class SlotJoin:
    def __init__(self, decoder, stage: PrefillGraphs):
        """``decoder``: the ``SlotDecoder`` (its rows, and its graphs' memory pool, shared)."""
        self.decoder, self.rows, self.stage = decoder, decoder.rows, stage
        self.use_graph = decoder.use_graph
        self.packed = torch.zeros(TOKENS + self.rows.window, dtype=torch.long, device=self.rows.logits.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @torch.no_grad()
    def run(self, slot: int, prompt: list[int], start: int, params: SamplingParams, colon: bool) -> None:
        """``prompt`` into ``slot``, which decodes from position ``start + step`` from the next step."""
        length = prefill_bucket(len(prompt), self.rows.window)
        # packed in numpy: every torch call gives the interpreter lock up and may wait to get it back
        # (the server's HTTP thread runs meanwhile), so the join makes as few as it can
        packed = np.zeros(TOKENS + length, dtype=np.int64)
        packed[FLOATS:SLOT].view(np.float32)[:] = (params.temperature, params.top_p, params.top_p_decay,
                                                   params.top_p_bound)
        packed[SLOT:TOKENS] = (slot, len(prompt) - 1, prompt[-1], start, params.top_k, params.seed, int(colon))
        packed[TOKENS:TOKENS + len(prompt)] = prompt
        host = torch.from_numpy(packed)
        if self.packed.is_cuda:  # pinned: the copy is queued behind the running steps, no wait
            host = host.pin_memory()
        self.packed[:TOKENS + length].copy_(host, non_blocking=True)
        if not self.use_graph:
            self._join(length)
            return
        graph = self.graphs.get(length)
        if graph is None:
            # the warm-up runs write what the replay writes (the join's numbers are loaded): harmless
            graph = capture(lambda: self._join(length), lambda: None, self.decoder.pool, warmups=1)
            self.decoder.pool = graph.pool()
            self.graphs[length] = graph
            self.rows.stats["graphs"] += 1
        graph.replay()

    def _join(self, length: int) -> None:
        """On the device, every index a tensor (one graph serves every slot and prompt length up to
        ``length``)."""
        rows, stage, packed = self.rows, self.stage, self.packed
        slot = packed[SLOT:SLOT + 1]
        stage.tokens[0, :length].copy_(packed[TOKENS:TOKENS + length])
        stage.last.copy_(packed[LAST:LAST + 1])
        stage._forward(length)
        rows.kv[:, :, :, :, :length].index_copy_(2, slot, stage.cache.kv[:, :, :, :, :length])
        rows.logits.index_copy_(0, slot, stage.logits)
        for buf, at in ((rows.current, CURRENT), (rows.start, START), (rows.top_k, TOP_K), (rows.seeds, SEED)):
            buf.index_copy_(0, slot, packed[at:at + 1])
        rows.colon_rows.index_copy_(0, slot, packed[COLON:COLON + 1] != 0)
        floats = packed[FLOATS:SLOT].view(torch.float32)
        for i, buf in enumerate((rows.temperature, rows.top_p, rows.decay, rows.bound)):
            buf.index_copy_(0, slot, floats[i:i + 1])
