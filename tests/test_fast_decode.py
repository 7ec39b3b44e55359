"""The device-resident decode loop (inference/fast.py) against ``generate`` and transformers: its
step's bucketed, masked attention against full recomputation, every sampling and stop feature,
log-probabilities, padding rows and decoder reuse (eagerly on CPU: the same step code the CUDA graphs
capture), and the captured graphs themselves on a GPU (the GPU lane)."""
from __future__ import annotations

import pytest
import torch

from gptrain.inference.fast import Decoder, bucket, decoder_for, graph_generate, length_bucket
from gptrain.inference.generate import EolIds, SamplingParams, generate
from gptrain.inference.rows import fused_generate
from gptrain.model.gpt import GPT
from tiny import tiny_config


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


def test_step_forward_equals_full_recomputation_across_buckets():
    model = tiny_model(std=0.05)
    tokens = torch.randint(0, 300, (2, 150), generator=torch.Generator().manual_seed(1))
    decoder = Decoder(model, 2)
    with torch.no_grad():
        full = model.logits(tokens)
        for t in range(150):
            decoder.position.fill_(t)
            decoder.forward(tokens[:, t], length_bucket(t + 1, 256))
            torch.testing.assert_close(decoder.logits, full[:, t], rtol=1e-5, atol=1e-5)
        # the bucket only bounds the work: a longer one (masked) gives the same logits
        decoder.position.fill_(149)
        decoder.forward(tokens[:, 149], 256)
        torch.testing.assert_close(decoder.logits, full[:, 149], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # an Inductor compile on CPU
def test_compiled_step_equals_full_recomputation():
    """The torch.compile'd block step (compile=True: qkv, cache write, attention, MLP, LayerNorms) in the step:
    logits and greedy text as the eager model's."""
    model = tiny_model(std=0.05, positions=128)
    tokens = torch.randint(0, 300, (2, 80), generator=torch.Generator().manual_seed(2))
    decoder = Decoder(model, 2, compile=True)
    with torch.no_grad():
        full = model.logits(tokens)
        for t in range(0, 80):
            decoder.position.fill_(t)
            decoder.forward(tokens[:, t], length_bucket(t + 1, 128))
            torch.testing.assert_close(decoder.logits, full[:, t], rtol=1e-4, atol=1e-4)
    prompts = [tokens[0, :20].tolist(), tokens[1, :7].tolist()]
    params = SamplingParams(max_new_tokens=60, temperature=0.0)
    _compare(graph_generate(model, prompts, params, compile=True, logprobs=True),
             generate(model, prompts, params, logprobs=True))


@pytest.mark.slow  # Inductor compiles on CPU
@pytest.mark.parametrize("settings", [{"compile": "block", "gemv": True, "sdpa": False},
                                      {"compile": "block", "gemv": False, "sdpa": True},
                                      {"compile": "block", "gemv": True, "sdpa": True},
                                      {"compile": "tail"}])
def test_compiled_block_step_equals_eager_step(settings):
    """The compiled whole block step (qkv, cache write, attention, MLP, LayerNorms; products as
    fused reductions or matmuls, attention as reductions or SDPA) and the compiled output head:
    in fp32 the eager step's logits and cache at every position, across attention buckets."""
    model = tiny_model(std=0.05, positions=128)
    tokens = torch.randint(0, 300, (2, 70), generator=torch.Generator().manual_seed(3))
    eager, compiled = Decoder(model, 2), Decoder(model, 2, **settings)
    with torch.no_grad():
        for t in range(70):
            for d in (eager, compiled):
                d.position.fill_(t)
                d.forward(tokens[:, t], length_bucket(t + 1, 128))
            torch.testing.assert_close(compiled.logits, eager.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(compiled.cache.kv, eager.cache.kv, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="compile="):
        Decoder(model, 1, compile="whole")


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


# both GPU decode loops, run on CPU as the tests' path: the CUDA-graph loop (attention buckets) and
# the fused loop (rows at their own positions, kernels/decode.py's references)
LOOPS = pytest.mark.parametrize("loop", [graph_generate, fused_generate], ids=["graph", "fused"])


@LOOPS
def test_every_feature_equals_generate(loop):
    """Greedy, temperature, top-k, top-p with decay, seeds, stop ids, the eol rules, no eol after a
    colon, a stream hook that ends a row, prompt and top log-probabilities; prompts of different
    lengths (across attention buckets; each row at its own position); 3 rows padded to 4."""
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


@pytest.mark.parametrize("loop", [generate, graph_generate, fused_generate], ids=["generate", "graph", "fused"])
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


@LOOPS
def test_greedy_equals_transformers_generate(loop):
    transformers = pytest.importorskip("transformers")
    from gptrain.interop.hf import hf_config_kwargs, to_hf_state_dict

    model = tiny_model(seed=3)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_config_kwargs(model.cfg))).eval()
    hf.load_state_dict(to_hf_state_dict(model), strict=False)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (50, 20)]
    ours = loop(model, prompts, SamplingParams(max_new_tokens=100, temperature=0.0))
    for prompt, got in zip(prompts, ours):  # 150 positions: the graph loop crosses the 64 and 128 buckets
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
    first = graph_generate(model, a, pa, logprobs=True)
    _compare(graph_generate(model, b, pb), generate(model, b, pb))
    _compare(graph_generate(model, a, pa, logprobs=True), first)
    _compare(first, generate(model, a, pa, logprobs=True))
    with pytest.raises(ValueError, match="does not take sync"):
        graph_generate(model, a, pa, sync=lambda c, g: (c, g))
    with pytest.raises(ValueError, match="exceeds the model's 256 positions"):
        graph_generate(model, [[1] * 250], SamplingParams(max_new_tokens=10))


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU lane)")


@pytest.mark.gpu
@gpu
def test_cuda_graphs_equal_eager_steps_and_generate(no_tf32):
    """On a GPU in fp32: the captured graphs (one per mode and attention bucket, replayed ahead of
    the host) give the eager steps' and generate's tokens, sampled and greedy, with log-probabilities."""
    model = tiny_model(seed=5).cuda()
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (40, 3, 70, 9, 9)]
    params = [SamplingParams(max_new_tokens=150, temperature=0.0), SamplingParams(max_new_tokens=90, seed=3),
              SamplingParams(max_new_tokens=80, top_k=5, seed=4),
              SamplingParams(max_new_tokens=60, top_p=0.9, top_p_decay=0.9, top_p_bound=0.3, seed=7),
              SamplingParams(max_new_tokens=100, temperature=0.0, stop_ids=(7,))]
    for kw in ({}, {"logprobs": True, "top_logprobs": 2}):
        ref = generate(model, prompts, params, **kw)
        eager = graph_generate(model, prompts, params, use_graph=False, **kw)
        graphs = graph_generate(model, prompts, params, **kw)
        _compare(eager, ref)
        _compare(graphs, ref)
    decoder = decoder_for(model, len(prompts))
    assert decoder.use_graph and decoder.stats["graphs"] == 6  # 2 modes x buckets 64, 128, 256
    greedy = SamplingParams(max_new_tokens=150, temperature=0.0)
    first = graph_generate(model, prompts[:1] * 8, greedy)  # 8 rows: the same decoder
    before = dict(decoder.stats)
    again = graph_generate(model, prompts[:1] * 8, greedy)
    assert [g.tokens for g in again] == [g.tokens for g in first] == [ref[0].tokens] * 8
    assert decoder.stats["replays"] - before["replays"] == 150  # one replay per position 40 .. 189
    assert decoder.stats["host_waits"] - before["host_waits"] == 150
    assert decoder.stats["graphs"] == before["graphs"]  # nothing captured again


@pytest.mark.gpu
@gpu
def test_cuda_graphs_with_compiled_tails_equal_generate(no_tf32):
    model = tiny_model(seed=6).cuda()
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (30, 12)]
    params = [SamplingParams(max_new_tokens=120, temperature=0.0), SamplingParams(max_new_tokens=100, seed=2)]
    _compare(graph_generate(model, prompts, params, compile=True, logprobs=True),
             generate(model, prompts, params, logprobs=True))
    assert decoder_for(model, 2, compile=True).stats["replays"] > 0
