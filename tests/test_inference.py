"""KV-cache decoding against full recomputation, greedy against transformers' generate, sampling
masks against transformers' logits warpers, seeds, stop rules and log-probabilities."""
from __future__ import annotations

import math

import pytest
import torch

from gptrain.inference.generate import EolIds, SamplingParams, generate, greedy
from gptrain.inference.kv_cache import KVCache, forward_cached, logits_of
from gptrain.inference.sampling import filter_logits, gumbel_noise, sample
from gptrain.model.gpt import GPT
from tiny import hf_twin, tiny_config


def tiny_model(seed: int = 0, std: float = 0.2, vocab: int = 300, positions: int = 64) -> GPT:
    # a large init std makes the random model's next-token distributions peaked (no near-ties)
    cfg = tiny_config(seq_length=positions, vocab_size=vocab, init_method_std=std, make_vocab_size_divisible_by=64)
    model = GPT(cfg)
    model.init_weights(seed)
    return model.eval()


def test_cached_forward_equals_full_recomputation():
    model = tiny_model()
    tokens = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model.logits(tokens)
        cache = KVCache(model, 3, 64)
        pieces, start = [], 0
        for q in (7, 1, 1, 12, 1, 5, 13):  # a prefill, single steps, and chunks after a prefix
            pieces.append(logits_of(model, forward_cached(model, tokens[:, start:start + q], start, cache)))
            start += q
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


def test_greedy_equals_transformers_generate():
    model = tiny_model(seed=3)
    hf = hf_twin(model)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (5, 11, 1, 8)]
    ours = generate(model, prompts, SamplingParams(max_new_tokens=20, temperature=0.0))  # one batch
    for prompt, mine in zip(prompts, ours):
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert mine.tokens == theirs[0].tolist()
        assert mine.finish_reason == "length"
    assert greedy(model, prompts[0], 20) == ours[0].generated


def test_filters_equal_transformers_warpers():
    transformers = pytest.importorskip("transformers")
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(5)) * 3
    for k in (1, 7, 100):
        ours = filter_logits(logits, torch.full((4,), k), torch.zeros(4))
        assert torch.equal(torch.isinf(ours), torch.isinf(TopKLogitsWarper(k)(None, logits.clone())))
    for p in (0.1, 0.5, 0.9):
        ours = filter_logits(logits, torch.zeros(4, dtype=torch.long), torch.full((4,), p))
        assert torch.equal(torch.isinf(ours), torch.isinf(TopPLogitsWarper(p)(None, logits.clone())))
    # per-row settings in one batch: each row as if alone
    mixed = filter_logits(logits, torch.tensor([0, 5, 0, 1]), torch.tensor([0.3, 0.0, 0.0, 0.0]))
    assert (~torch.isinf(mixed)).sum(dim=1).tolist()[1:] == [5, 500, 1]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = probs.log()[None].expand(20000, -1)
    draws = sample(logits, torch.ones(20000), torch.zeros(20000, dtype=torch.long), torch.zeros(20000),
                   seeds=torch.arange(20000), positions=torch.full((20000,), 3))
    freq = torch.bincount(draws, minlength=6).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015), freq
    # temperature 0.5 squares the odds; top_k 2 keeps the two most likely
    hot = sample(logits, torch.full((20000,), 0.5), torch.full((20000,), 2, dtype=torch.long), torch.zeros(20000),
                 seeds=torch.arange(20000), positions=torch.full((20000,), 3))
    assert set(hot.tolist()) == {0, 1}
    share = (hot == 0).float().mean().item()
    assert abs(share - 0.4 ** 2 / (0.4 ** 2 + 0.25 ** 2)) < 0.015
    noise = gumbel_noise(torch.tensor([7, 7, 8]), torch.tensor([1, 2, 1]), 1000)
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert abs(noise.mean().item() - 0.5772) < 0.1  # the Euler-Mascheroni constant


def test_seed_reproducible_alone_and_batched():
    model = tiny_model(std=0.05)
    p = SamplingParams(max_new_tokens=15, temperature=1.0, top_p=0.95, seed=1234)
    alone = generate(model, [[5, 6, 7]], p)[0].tokens
    batched = generate(model, [[9] * 10, [5, 6, 7], [1, 2]],
                       [SamplingParams(max_new_tokens=4, seed=1), p, SamplingParams(max_new_tokens=30, seed=2)])
    assert batched[1].tokens == alone
    other = generate(model, [[5, 6, 7]], SamplingParams(max_new_tokens=15, temperature=1.0, top_p=0.95, seed=99))
    assert other[0].tokens != alone


def test_stop_rules():
    model = tiny_model()
    free = generate(model, [[1, 2, 3]], SamplingParams(max_new_tokens=20, temperature=0.0))[0].generated
    stop = free[4]
    cut = generate(model, [[1, 2, 3]], SamplingParams(max_new_tokens=20, temperature=0.0, stop_ids=(stop,)))[0]
    assert cut.generated == free[: free.index(stop) + 1] and cut.finish_reason == "stop"
    eol = EolIds(eol=stop, double_eol=299)
    on_eol = generate(model, [[1, 2, 3]], SamplingParams(max_new_tokens=20, temperature=0.0, stop_on_eol=True), eol=eol)
    assert on_eol[0].generated == cut.generated
    double = generate(model, [[1, 2, 3]], SamplingParams(max_new_tokens=20, temperature=0.0, stop_on_double_eol=True),
                      eol=eol)[0].generated
    twice = [i for i in range(1, len(free)) if free[i] == stop and free[i - 1] == stop]
    assert double == (free[: twice[0] + 1] if twice else free)
    # the streaming hook can end a row
    seen = []
    hooked = generate(model, [[1, 2, 3]], SamplingParams(max_new_tokens=20, temperature=0.0),
                      on_token=lambda row, tok: seen.append(tok) or len(seen) == 3)[0]
    assert hooked.generated == free[:3] == seen


def test_logprobs_and_score_only():
    model = tiny_model()
    prompts = [[4, 8, 15, 16, 23, 42], [7, 7]]
    res = generate(model, prompts, [SamplingParams(max_new_tokens=5, temperature=1.0, seed=3),
                                    SamplingParams(max_new_tokens=0)], logprobs=True, top_logprobs=3)
    assert len(res[1].tokens) == 2 and res[1].logprobs[0] is None
    for g in res:
        with torch.no_grad():
            lp = torch.log_softmax(model.logits(torch.tensor([g.tokens])).float(), dim=-1)[0]
        expected = [None] + [lp[j - 1, g.tokens[j]].item() for j in range(1, len(g.tokens))]
        assert len(g.logprobs) == len(expected)
        for a, b in zip(g.logprobs[1:], expected[1:]):
            assert math.isclose(a, b, abs_tol=1e-4)
        for j in range(1, len(g.tokens)):
            top = lp[j - 1].topk(3)
            assert list(g.top_logprobs[j]) == top.indices.tolist()
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        generate(model, [[1] * 60], SamplingParams(max_new_tokens=5))


def test_release_model_caches_drops_the_decode_caches():
    """A tensor-parallel process frees its captured decode graphs before the process group ends
    (NCCL hangs destroying a communicator a live graph captured)."""
    from gptrain.inference.host_loop import model_cache, release_model_caches

    model = torch.nn.Linear(2, 2)
    model_cache(model, "_graph_steps")[1] = object()
    model_cache(model, "_row_decoders")["x"] = object()
    release_model_caches(model)
    assert "_graph_steps" not in model.__dict__ and "_row_decoders" not in model.__dict__
    assert dict(model_cache(model, "_graph_steps")) == {}
    assert model.weight.shape == (2, 2)
