"""A request joining ``SlotDecoder`` through ``SlotJoin`` (inference/slot_join.py: the padded prompt
and the row's settings written into a slot in one go, a CUDA graph per padded length): seeded
requests joining a running batch, with steps queued ahead as the server queues them, give the
tokens they give alone through the same decoder, and greedy ones ``generate``'s. On CPU the join
runs eagerly (``padded=True``); on a GPU (the GPU lane) through its graphs, fp32 and bf16."""
from __future__ import annotations

import pytest
import torch

from gptrain.inference.steps import Mode
from gptrain.inference.generate import SamplingParams, generate
from gptrain.inference.host_loop import AHEAD
from gptrain.inference.slots import SlotDecoder
from test_decode_features import tiny_model


def drive(decoder: SlotDecoder, requests: list[tuple[list[int], SamplingParams]], slots: list[int],
          joins: list[int]) -> list[list[int]]:
    """Request ``i`` joins slot ``slots[i]`` once ``joins[i]`` steps have been issued since the call
    (up to ``AHEAD`` steps queued unread, as the server's loop); returns each one's new tokens."""
    n, origin, read = len(requests), decoder.issued, decoder.issued
    out: list[list[int]] = [[] for _ in range(n)]
    first: list[int | None] = [None] * n
    done = [False] * n
    while not all(done):
        for i, (prompt, params) in enumerate(requests):
            if first[i] is None and decoder.issued - origin >= joins[i]:
                filled = 0
                while filled < len(prompt):
                    filled = decoder.prefill(slots[i], prompt, filled, params, False)
                first[i] = decoder.issued
        live = [i for i in range(n) if first[i] is not None and not done[i]]
        mode = Mode.of([requests[i][1] for i in live] or [SamplingParams(temperature=0.0)])
        while decoder.issued - read < AHEAD:
            decoder.step(mode, 1 + max(slots[i] for i in live) if live else 1)
        ids = decoder.read(read)
        for i in live:
            if first[i] <= read:
                out[i].append(ids[slots[i]])
                if len(out[i]) == requests[i][1].max_new_tokens:
                    done[i] = True
                    decoder.park(slots[i])
        read += 1
    while read < decoder.issued:  # the steps queued past the last row's end
        decoder.read(read)
        read += 1
    return out


def check_joins(model, decoder: SlotDecoder | None = None, greedy_is_generate: bool = True) -> SlotDecoder:
    """A long request decodes in slot 0 while the others join slots 1 .. 3 at several steps (one
    prompt longer than the decoder's chunk of 32: pieces, eagerly); each gives its tokens alone
    (slot 0, an idle decoder), and greedy ones ``generate``'s."""
    gen = torch.Generator().manual_seed(3)
    lengths = (5, 17, 1, 40, 16)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in lengths]
    params = [SamplingParams(max_new_tokens=60, seed=1, top_p=0.9), SamplingParams(max_new_tokens=12, seed=2),
              SamplingParams(max_new_tokens=9, temperature=0.0), SamplingParams(max_new_tokens=10, top_k=5, seed=4),
              SamplingParams(max_new_tokens=8, temperature=0.0)]
    decoder = decoder or SlotDecoder(model, 4, chunk=32, padded=True)
    requests = list(zip(prompts, params))
    alone = [drive(decoder, [r], [0], [0])[0] for r in requests]
    loaded = drive(decoder, requests, [0, 1, 2, 3, 1], [0, 3, 3, 7, 20])
    assert loaded == alone
    if greedy_is_generate:
        for i in (2, 4):
            assert alone[i] == generate(model, [prompts[i]], params[i])[0].tokens[len(prompts[i]):], i
    return decoder


def check_burst(model, decoder: SlotDecoder, n: int = 6) -> None:
    """``n`` prompts join between the same two steps, beside a running row (on CUDA more than the
    join's ring has stages): each gives its tokens alone."""
    gen = torch.Generator().manual_seed(5)
    requests = [(torch.randint(0, 300, (3 + 2 * i,), generator=gen).tolist(),
                 SamplingParams(max_new_tokens=6 + i, seed=10 + i, top_p=0.8)) for i in range(n + 1)]
    alone = [drive(decoder, [r], [0], [0])[0] for r in requests]
    loaded = drive(decoder, requests, list(range(n + 1)), [0] + [2] * n)
    assert loaded == alone


def test_a_burst_of_joins_keeps_their_tokens_on_cpu():
    model = tiny_model(seed=4)
    check_burst(model, SlotDecoder(model, 8, chunk=32, padded=True))


def test_joins_keep_their_tokens_on_cpu():
    decoder = check_joins(tiny_model(seed=4))
    assert not decoder.join.use_graph


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU lane)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joins_through_graphs_keep_their_tokens(dtype, no_tf32):
    """bf16: alone and under load only (``generate``'s unpadded bf16 numbers may differ)."""
    model = tiny_model(seed=4).to("cuda", dtype)
    fp32 = dtype == torch.float32
    decoder = check_joins(model, SlotDecoder(model, 4, chunk=32), greedy_is_generate=fp32)
    assert decoder.join is not None and decoder.join.use_graph
    stages = decoder.join.stages
    assert len(stages) > 1  # joins in flight on the side stream
    assert set().union(*(s.prefills for s in stages)) == {16, 32}  # a stage's graphs: one per padded length
    assert all(set(s.prefills) == set(s.commits) for s in stages)
    decoder.warm_up()  # the step graphs of every bucket; joins after it keep their tokens
    check_joins(model, decoder, greedy_is_generate=fp32)
    burst = SlotDecoder(model, 8, chunk=32)
    assert len(burst.join.stages) < 6
    check_burst(model, burst)
