"""The fused decode loop (inference/rows.py, the one ``generate`` and ``serve`` use on a GPU) against
``generate`` and transformers: every sampling and stop feature, log-probabilities, padding rows and
decoder reuse, run eagerly on CPU through the same step code its CUDA graphs capture (its graphs and
kernels on a GPU: test_row_decode.py and test_gpu_kernels.py, the GPU lane)."""
from __future__ import annotations

import pytest
import torch

from gptrain.inference.steps import bucket, length_bucket
from gptrain.inference.generate import EolIds, SamplingParams, generate
from gptrain.inference.rows import fused_generate
from gptrain.model.gpt import GPT
from tiny import hf_twin, tiny_config


def tiny_model(seed: int = 0, std: float = 0.2, positions: int = 256) -> GPT:
    # a large init std makes the next-token distributions peaked (no near-ties between implementations)
    cfg = tiny_config(seq_length=positions, vocab_size=300, init_method_std=std, make_vocab_size_divisible_by=64)
    model = GPT(cfg)
    model.init_weights(seed)
    return model.eval()


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 32, 33)] == [1, 2, 4, 4, 8, 32, 64]
    assert [length_bucket(n, 1024) for n in (1, 64, 65, 128, 129, 1000, 1024)] == [64, 64, 128, 128, 256, 1024, 1024]
    assert length_bucket(70, 100) == 100  # never beyond the window


def _compare(ours, ref, lp_tol=1e-4):
    assert [g.tokens for g in ours] == [g.tokens for g in ref]
    assert [g.finish_reason for g in ours] == [g.finish_reason for g in ref]
    for a, b in zip(ours, ref):
        assert len(a.logprobs) == len(b.logprobs)
        assert a.logprobs[1:] == pytest.approx(b.logprobs[1:], abs=lp_tol)
        assert len(a.top_logprobs) == len(b.top_logprobs)
        for x, y in zip(a.top_logprobs[1:], b.top_logprobs[1:]):
            assert list(x) == list(y)
            assert list(x.values()) == pytest.approx(list(y.values()), abs=lp_tol)


def test_every_feature_equals_generate():
    """Greedy, temperature, top-k, top-p with decay, seeds, stop ids, the eol rules, no eol after a
    colon, a stream hook that ends a row, prompt and top log-probabilities; prompts of different
    lengths (each row at its own position); 3 rows padded to 4."""
    loop = fused_generate
    model = tiny_model(seed=2)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (40, 3, 70)]
    greedy = SamplingParams(max_new_tokens=90, temperature=0.0)
    plain = generate(model, prompts, greedy)
    # stop ids and eol rules that the greedy text actually meets
    stop_id = plain[1].generated[30]
    colon, after = plain[0].generated[10], plain[0].generated[11]
    eol = EolIds(eol=after, double_eol=299, colon=colon)
    row2 = plain[2].generated
    first_new = next(i for i in range(5, len(row2)) if row2[i] not in row2[:i])  # an eol met first there
    eol_in_row2 = EolIds(eol=row2[first_new], double_eol=299, colon=colon)
    cases = [
        ([greedy, greedy, greedy], {}),
        ([SamplingParams(max_new_tokens=90, temperature=0.0, stop_ids=(stop_id,)),
          SamplingParams(max_new_tokens=90, temperature=0.0, stop_ids=(stop_id,)),
          SamplingParams(max_new_tokens=20, temperature=0.0, stop_on_eol=True)],
         {"eol": eol_in_row2, "logprobs": True}),
        ([SamplingParams(max_new_tokens=90, temperature=0.0), SamplingParams(max_new_tokens=60, temperature=0.7, seed=3),
          SamplingParams(max_new_tokens=80, top_k=5, seed=4)],
         {"eol": eol, "no_newline_after_colon": [True, False, True], "top_logprobs": 3}),
        ([SamplingParams(max_new_tokens=50, top_p=0.9, top_p_decay=0.9, top_p_bound=0.3, seed=7),
          SamplingParams(max_new_tokens=90, temperature=1.3, seed=8, stop_on_double_eol=True),
          SamplingParams(max_new_tokens=0)],
         {"logprobs": True, "eol": eol}),
    ]
    refs = []
    for params, kw in cases:
        ref = generate(model, prompts, params, **kw)
        ours = loop(model, prompts, params, **kw)
        _compare(ours, ref)
        refs.append(ref)
    # the rules met the text: the stop id, the eol stop, and the colon rule changed row 0's greedy text
    assert refs[1][1].generated == plain[1].generated[:plain[1].generated.index(stop_id) + 1]
    assert refs[1][2].generated == plain[2].generated[:first_new + 1]
    assert refs[2][0].generated[:11] == plain[0].generated[:11] and refs[2][0].generated[11] != after
    assert ref[2].generated == [] and len(ref[2].logprobs) == 70  # score only
    assert ours[2].generated == [] and len(ours[2].logprobs) == 70
    # a stream hook ending row 0 after 5 tokens; the hook sees every kept token in order
    seen, seen_ref = [], []
    hook = lambda store: (lambda row, tok: store.append((row, tok)) or (row == 0 and sum(r == 0 for r, _ in store) >= 5))  # noqa: E731
    ref = generate(model, prompts, greedy, on_token=hook(seen_ref))
    ours = loop(model, prompts, greedy, on_token=hook(seen))
    _compare(ours, ref)
    assert ours[0].finish_reason == "stop" and len(ours[0].generated) == 5
    assert sorted(seen) == sorted(seen_ref) and [x for x in seen if x[0] == 1] == [x for x in seen_ref if x[0] == 1]


@pytest.mark.parametrize("loop", [generate, fused_generate], ids=["generate", "fused"])
def test_newline_after_colon_inside_a_prompt_is_scored_not_banned(loop):
    """The no-newline-after-colon rule constrains generated tokens only: a prompt's own newline
    after a colon keeps its log-probability (a longer prompt beside a shorter one in the batch)."""
    model = tiny_model(seed=11, positions=64)
    prompts = [[5], [7, 25, 198, 9]]
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    eol = EolIds(eol=198, double_eol=299, colon=25)
    ruled = loop(model, prompts, params, eol=eol, logprobs=True, no_newline_after_colon=[True, True])
    free = loop(model, prompts, params, eol=eol, logprobs=True)
    assert ruled[1].logprobs[:4] == pytest.approx(free[1].logprobs[:4], abs=1e-5)
    assert ruled[1].logprobs[2] > -50


def test_greedy_equals_transformers_generate():
    model = tiny_model(seed=3)
    hf = hf_twin(model)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (50, 20)]
    ours = fused_generate(model, prompts, SamplingParams(max_new_tokens=100, temperature=0.0))
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=100, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert got.tokens == theirs[0].tolist()


def test_decoder_reused_across_requests():
    """A decoder keeps its cache and buffers between requests: nothing of one leaks into the next."""
    model = tiny_model(seed=4)
    gen = torch.Generator().manual_seed(6)
    a = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (30, 12)]
    b = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (5, 90)]
    pa = [SamplingParams(max_new_tokens=40, top_p=0.8, top_p_decay=0.5, top_p_bound=0.2, seed=1),
          SamplingParams(max_new_tokens=40, temperature=0.0)]
    pb = SamplingParams(max_new_tokens=100, temperature=0.9, seed=2)
    first = fused_generate(model, a, pa, logprobs=True)
    _compare(fused_generate(model, b, pb), generate(model, b, pb))
    _compare(fused_generate(model, a, pa, logprobs=True), first)
    _compare(first, generate(model, a, pa, logprobs=True))
    with pytest.raises(ValueError, match="does not take sync"):
        fused_generate(model, a, pa, sync=lambda c, g: (c, g))
    with pytest.raises(ValueError, match="exceeds the model's 256 positions"):
        fused_generate(model, [[1] * 250], SamplingParams(max_new_tokens=10))
