"""The fused decode loop (inference/rows.py) and its kernels (kernels/decode.py): on CPU the loop
with the kernels' PyTorch references (every feature against ``generate`` and greedy against
transformers run in test_decode_features.py; here rows at their own positions, padded
prefill, reuse); on a GPU (the GPU lane)
the Triton kernels against their references, their batch invariance bit for bit, and the captured
loop against ``generate``."""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from gptrain.inference.generate import SamplingParams, generate
from gptrain.inference.kv_cache import KVCache, forward_cached
from gptrain.inference import rows as rows_module
from gptrain.inference.rows import (PrefillGraphs, RowDecoder, fused_generate, prefill_bucket, row_decoder_for,
                                   warm_up)
from gptrain.kernels import decode as kernels
from gptrain.kernels import decode_io, ln_fold
from gptrain.model.gpt import GPT, GPTConfig
from test_decode_features import _compare, tiny_model


def test_a_bucket_of_rows_per_request_size():
    """3 prompts decode in a decoder of 4 rows (the every-feature and transformers cases are in
    test_decode_features.py); the decoder is kept for the next request of that size."""
    model = tiny_model(seed=2)
    fused_generate(model, [[1, 2], [3], [4, 5, 6]], SamplingParams(max_new_tokens=3, temperature=0.0))
    decoder = row_decoder_for(model, 3)
    assert decoder.batch == 4 and decoder is row_decoder_for(model, 4)


def test_a_models_decoders_and_folded_constants_go_with_the_model():
    """Decoders, prompt graphs and a folded LayerNorm's constants are kept for a model while it lives
    and go with it (they were kept in module-level dicts that held every model alive); a copy of the
    model starts with none and decodes the same."""
    model = tiny_model(seed=6)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    text = fused_generate(model, [[1, 2]], params)[0].tokens
    assert generate(model, [[1, 2]], params)[0].tokens == text
    block, head = model.layers["0"], model.output_layer
    buffers = []
    for weight, ln in ((block.attn.qkv.weight, block.ln1), (head.weight[: head.vocab_size], model.final_layernorm)):
        consts = ln_fold.ln_constants(weight, ln)  # (the head's weight: a view made anew each call)
        expected = torch.stack([weight.double() @ ln.weight.double(), weight.double() @ ln.bias.double()])
        torch.testing.assert_close(consts.double(), expected, rtol=1e-5, atol=1e-6)
        assert ln_fold.ln_constants(weight, ln) is consts  # cached
        buffers.append(consts)
    with torch.no_grad():
        block.ln1.weight.mul_(2.0)  # changed in place: recomputed into the same buffer
    assert ln_fold.ln_constants(block.attn.qkv.weight, block.ln1) is buffers[0]
    torch.testing.assert_close(buffers[0][0].double(), block.attn.qkv.weight.double() @ block.ln1.weight.double(),
                               rtol=1e-5, atol=1e-6)
    del buffers, consts
    twin = copy.deepcopy(model)
    assert not rows_module.model_cache(twin, "_row_decoders")
    assert fused_generate(twin, [[1, 2]], params)[0].tokens == fused_generate(model, [[1, 2]], params)[0].tokens
    gone = weakref.ref(model)
    del model, block, head, weight, ln, twin
    gc.collect()
    ln_fold.refresh_ln_constants()
    assert gone() is None
    assert all(ln_fold._alive(entry) for entry in ln_fold._constants.values())


def test_single_stream_decoder_is_one_row_and_kept_apart():
    """``batch_invariant=False`` gives one prompt its own single-stream decoder (kept beside the
    batch-invariant one; on CPU both run the references, so the text is the same); a larger
    batch keeps the batch-invariant decoder; a single-stream decoder of two rows is refused."""
    model = tiny_model(seed=8)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    alone = fused_generate(model, [[2, 3, 4]], params)[0].tokens
    assert fused_generate(model, [[2, 3, 4]], params, batch_invariant=False)[0].tokens == alone
    single = row_decoder_for(model, 1, batch_invariant=False)
    assert single.gemv and single is not row_decoder_for(model, 1) and not row_decoder_for(model, 1).gemv
    assert not row_decoder_for(model, 2, batch_invariant=False).gemv
    with pytest.raises(ValueError, match="one row"):
        RowDecoder(model, 2, single_stream=True)


def test_warm_up_makes_each_bucket_and_changes_no_text():
    """The server's warm-up builds the decoder of every batch bucket up to its largest batch (and,
    on a GPU, their graphs and the prompt graphs); a request afterwards gives the same text."""
    model = tiny_model(seed=4, positions=64)
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=5)
    before = fused_generate(model, [[3, 4, 5]], params)[0].tokens
    assert warm_up(model, 3) == 4
    decoders = rows_module.model_cache(model, "_row_decoders")
    assert all((rows, True) in decoders for rows in (1, 2, 4)) and (8, True) not in decoders
    assert fused_generate(model, [[3, 4, 5]], params)[0].tokens == before


def test_rows_are_independent_and_decoder_reused():
    """A row's text does not depend on the other rows (alone, or beside others of other lengths and
    settings), a decoder keeps nothing of one request in the next, and a prompt may end at the last
    position."""
    model = tiny_model(seed=4)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (30, 12, 5, 90)]
    params = [SamplingParams(max_new_tokens=40, top_p=0.8, top_p_decay=0.5, top_p_bound=0.2, seed=1),
              SamplingParams(max_new_tokens=40, temperature=0.0), SamplingParams(max_new_tokens=100, seed=2),
              SamplingParams(max_new_tokens=166, temperature=0.9, seed=3)]  # 90 + 166 = all 256 positions
    together = fused_generate(model, prompts, params, logprobs=True)
    for i in range(4):
        alone = fused_generate(model, [prompts[i]], [params[i]], logprobs=True)
        _compare(alone, [together[i]], lp_tol=1e-5)
    _compare(together, generate(model, prompts, params, logprobs=True))
    _compare(fused_generate(model, prompts[::-1], params[::-1], logprobs=True), together[::-1], lp_tol=1e-5)
    with pytest.raises(ValueError, match="does not take sync"):
        fused_generate(model, prompts, params, sync=lambda c, g: (c, g))
    with pytest.raises(ValueError, match="exceeds the model's 256 positions"):
        fused_generate(model, [[1] * 250], SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="5 prompts for a decoder of 4 rows"):
        RowDecoder(model, 4).run(prompts + prompts[:1], params + params[:1])


def test_prefill_together_equals_alone():
    model = tiny_model(seed=7)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 300, (20,), generator=gen).tolist() for _ in range(3)]
    params = SamplingParams(max_new_tokens=30, temperature=0.8, seed=5)
    ref = generate(model, prompts, params, logprobs=True)
    _compare(fused_generate(model, prompts, params, logprobs=True, together=True), ref)
    _compare(fused_generate(model, prompts, params, logprobs=True), ref)


def test_padded_prefill_equals_exact_length():
    """A prompt prefilled at its padded length (zeros after it, as the CUDA prompt graphs do) gives
    the exact-length forward's keys, values, hidden states and last logits at its own positions."""
    model = tiny_model(seed=4)
    window = model.cfg.max_position_embeddings
    graphs = PrefillGraphs(model, window, use_graph=False)
    gen = torch.Generator().manual_seed(2)
    assert [prefill_bucket(n, window) for n in (1, 16, 17, 33, window - 1, window)] == \
        [16, 16, 32, 64, window, window]
    for n in (1, 5, 16, 17, 100, window):
        prompt = torch.randint(0, 300, (n,), generator=gen).tolist()
        padded = graphs.run(prompt)
        assert padded == prefill_bucket(n, window)
        cache = KVCache(model, 1, window)
        with torch.no_grad():
            hidden = forward_cached(model, torch.tensor([prompt]), 0, cache)
            logits = model.output_layer(hidden[:, -1]).float()
        torch.testing.assert_close(graphs.cache.kv[:, :, :, :, :n], cache.kv[:, :, :, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(graphs.hidden[:, :n], hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(graphs.logits, logits, rtol=1e-5, atol=1e-5)


def test_reference_kernels_math():
    """The kernels' PyTorch references against the model's own modules (fp32)."""
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(64)
    torch.nn.init.normal_(ln.weight)
    torch.nn.init.normal_(ln.bias)
    fc = torch.nn.Linear(64, 96)
    x, res = torch.randn(5, 64), torch.randn(5, 96)
    got = kernels.ln_linear(x, fc.weight, fc.bias, ln=ln, gelu=True, residual=res)
    with torch.no_grad():
        want = res + torch.nn.functional.gelu(fc(ln(x)), approximate="tanh")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # attention: rows at positions 0, 3 and 9 of a 12-position cache; the new key and value land there
    heads, dim, window = 2, 8, 12
    kv = torch.randn(2, 4, heads, window, dim)
    qkv = torch.randn(3, heads * 3 * dim)
    positions = torch.tensor([0, 3, 9])
    before = kv.clone()
    y = kernels.decode_attention(qkv, kv, positions)
    q, k, v = qkv.view(3, heads, 3, dim).unbind(2)
    for r, p in enumerate(positions.tolist()):
        assert torch.equal(kv[0, r, :, p], k[r]) and torch.equal(kv[1, r, :, p], v[r])
        keys = torch.cat([before[0, r, :, :p], k[r, :, None]], 1)
        values = torch.cat([before[1, r, :, :p], v[r, :, None]], 1)
        scores = torch.softmax((keys @ q[r, :, :, None])[..., 0] / dim ** 0.5, -1)
        torch.testing.assert_close(y[r].view(heads, dim), (scores[..., None] * values).sum(1), rtol=1e-5, atol=1e-6)
    assert torch.equal(kv[:, 3], before[:, 3])  # a row beyond the batch's rows is untouched


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU lane)")
SHAPES_345M = [(3072, 1024), (1024, 1024), (4096, 1024), (1024, 4096), (50257, 1024)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_references_and_are_batch_invariant(dtype):
    """Every 345M weight shape, each epilogue: the Triton kernel against its reference, and a row's
    output bit for bit the same alone, in a batch of 5 and in a batch of 37 (other rows random)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    # bf16: the LayerNorm's output is rounded to bf16 before a product over k = 1024 or 4096, in the
    # kernel and its reference alike, at different places; over 37 x 50,257 outputs the largest
    # difference reaches 5 standard deviations of that rounding (0.0225 seen on an H100)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 4e-2}
    for n, k in SHAPES_345M:
        w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(dtype)
        b = torch.randn(n, device="cuda", generator=gen).to(dtype)
        ln = torch.nn.LayerNorm(k, device="cuda", dtype=dtype)
        torch.nn.init.normal_(ln.weight, 1.0, 0.2, generator=gen)  # seeded: the same numbers every run
        torch.nn.init.normal_(ln.bias, 0.0, 0.2, generator=gen)
        x = (torch.randn(37, k, device="cuda", generator=gen) * 3).to(dtype)
        res = torch.randn(37, n, device="cuda", generator=gen).to(dtype)
        for kw in ({"ln": ln}, {"bias": b, "ln": ln, "gelu": True}, {"bias": b, "residual": res}):
            def run(rows):
                args = {key: (v[:rows] if key == "residual" else v) for key, v in kw.items()}
                return kernels.ln_linear(x[:rows], w, **args)
            full = run(37)
            want = kernels.reference_ln_linear(x, w, **kw)
            torch.testing.assert_close(full.float(), want.float().to(dtype).float(), **tol)
            assert torch.equal(run(1)[0], full[0]) and torch.equal(run(5), full[:5]), (n, k, list(kw))
        padded = torch.full((37, n + 61), -1.0, device="cuda")  # rows of a wider buffer
        kernels.ln_linear(x, w, ln=ln, out=padded[:, :n])
        torch.testing.assert_close(padded[:, :n], kernels.reference_ln_linear(x, w, ln=ln), **tol)
        assert (padded[:, n:] == -1).all()
    heads, dim, window, batch = 16, 64, 1024, 37
    kv = torch.randn(2, batch, heads, window, dim, device="cuda", generator=gen).to(dtype)
    qkv = torch.randn(batch, heads * 3 * dim, device="cuda", generator=gen).to(dtype)
    positions = torch.randint(0, window, (batch,), device="cuda", generator=gen)
    positions[:3] = torch.tensor([0, 1, window - 1])
    ref_kv = kv.clone()
    want = kernels.reference_decode_attention(qkv, ref_kv, positions)
    got = kernels.decode_attention(qkv, kv, positions)
    assert torch.equal(kv, ref_kv)
    torch.testing.assert_close(got.float(), want.to(dtype).float(), **tol)
    one = kernels.decode_attention(qkv[:1].contiguous(), kv.clone(), positions[:1])
    assert torch.equal(one[0], got[0])


@pytest.mark.gpu
@gpu
def test_row_argmax_equals_torch_and_is_batch_invariant():
    """The greedy choice's kernel: torch.argmax's index on rows of a padded buffer (ties take the
    lowest index, across chunk boundaries too; a row of -inf gives 0), the same for a row alone."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    vocab = 50257
    padded = torch.full((33, vocab + 47), float("-inf"), device="cuda")
    logits = padded[:, :vocab]
    logits.copy_(torch.randn(33, vocab, device="cuda", generator=gen))
    logits[1, 7] = logits[1, 40000] = 1e4
    edge = decode_io.ARGMAX_BLOCK
    logits[2, edge - 1] = logits[2, edge] = 1e4
    logits[3] = float("-inf")
    logits[4, vocab - 1] = 1e4
    got = decode_io.row_argmax(logits)
    assert torch.equal(got, logits.argmax(dim=-1)) and got[1] == 7 and got[2] == edge - 1 and got[4] == vocab - 1
    for rows in (1, 5):
        assert torch.equal(decode_io.row_argmax(logits[:rows]), got[:rows])


@pytest.mark.gpu
@gpu
def test_captured_loop_equals_generate(no_tf32):
    """fp32 on a GPU: the captured graphs (one per mode, every length) give generate's tokens and
    log-probabilities, sampled and greedy."""
    model = tiny_model(seed=5).cuda()
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (40, 3, 70, 9, 9)]
    params = [SamplingParams(max_new_tokens=150, temperature=0.0), SamplingParams(max_new_tokens=90, seed=3),
              SamplingParams(max_new_tokens=80, top_k=5, seed=4),
              SamplingParams(max_new_tokens=60, top_p=0.9, top_p_decay=0.9, top_p_bound=0.3, seed=7),
              SamplingParams(max_new_tokens=100, temperature=0.0, stop_ids=(7,))]
    for kw in ({}, {"logprobs": True, "top_logprobs": 2}):
        ref = generate(model, prompts, params, **kw)
        _compare(fused_generate(model, prompts, params, use_graph=False, **kw), ref)
        _compare(fused_generate(model, prompts, params, **kw), ref)
    decoder = row_decoder_for(model, len(prompts))
    assert decoder.use_graph and decoder.stats["graphs"] == 2  # one per mode, whatever the lengths
    # weights changed in place (as training or a checkpoint load does): the captured graphs follow,
    # the folded LayerNorms' constants included
    with torch.no_grad():
        block = model.layers["0"]
        block.ln1.bias.add_(0.5)
        block.ln2.weight.mul_(1.5)
        block.attn.qkv.weight.mul_(1.2)
        model.final_layernorm.bias.sub_(0.3)
    _compare(fused_generate(model, prompts, params), generate(model, prompts, params))


@pytest.mark.gpu
@gpu
def test_same_seed_same_text_in_any_batch_bf16():
    """The 345M shape in bf16 (random weights): a seeded request's tokens and log-probabilities are
    bit for bit the same alone and inside a batch of 32 other requests of other lengths and settings."""
    cfg = GPTConfig(num_layers=4, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPT(cfg)
    model.init_weights(3)
    model = model.to("cuda", torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
               for n in torch.randint(1, 200, (32,), generator=gen).tolist()]
    params = [SamplingParams(max_new_tokens=64, temperature=0.9, top_p=0.95, seed=i) for i in range(32)]
    batch = fused_generate(model, prompts, params, logprobs=True)
    for i in range(0, 32, 3):
        alone = fused_generate(model, [prompts[i]], [params[i]], logprobs=True)[0]
        assert alone.tokens == batch[i].tokens and alone.logprobs == batch[i].logprobs


@pytest.mark.gpu
@gpu
def test_single_stream_products_equal_references_and_repeat_per_row():
    """The CUDA-core products (``gemv``) of the single-stream decoder on the 345M's block shapes, each
    epilogue, in bf16: close to the reference (as the tensor-core kernel is), and each of several
    rows exactly what it is alone."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    for n, k in SHAPES_345M[:4]:
        w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(torch.bfloat16)
        assert kernels.gemv_fits(w)
        b = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
        ln = torch.nn.LayerNorm(k, device="cuda", dtype=torch.bfloat16)
        torch.nn.init.normal_(ln.weight, 1.0, 0.2)
        torch.nn.init.normal_(ln.bias, 0.0, 0.2)
        x = (torch.randn(3, k, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        res = torch.randn(3, n, device="cuda", generator=gen).to(torch.bfloat16)
        for kw in ({"ln": ln}, {"bias": b, "ln": ln, "gelu": True}, {"bias": b, "residual": res}):
            def run(rows):
                args = {key: (v[:rows] if key == "residual" else v) for key, v in kw.items()}
                return kernels.ln_linear(x[:rows], w, gemv=True, **args)
            three = run(3)
            want = kernels.reference_ln_linear(x, w, **kw)
            torch.testing.assert_close(three.float(), want.to(torch.bfloat16).float(), rtol=2e-2, atol=2e-2)
            assert torch.equal(run(1)[0], three[0]), (n, k, list(kw))
    assert not kernels.gemv_fits(torch.empty(50257, 1024, device="cuda", dtype=torch.bfloat16))
    assert not kernels.gemv_fits(torch.empty(1024, 1024, device="cuda"))  # fp32: the tensor-core kernel


@pytest.mark.gpu
@gpu
def test_single_stream_decoder_chooses_the_batched_decoders_tokens():
    """A lone prompt through the single-stream decoder (``batch_invariant=False``: CUDA-core products)
    in bf16 greedily picks the tokens the batch-invariant decoder picks (a peaked random model: no
    near-ties), and through its own decoder and graph."""
    model = tiny_model(seed=7).to("cuda", torch.bfloat16)
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    for prompt in ([5, 6, 7], [1], list(range(40, 90))):
        batched = fused_generate(model, [prompt], params)[0].tokens
        single = fused_generate(model, [prompt], params, batch_invariant=False)[0].tokens
        assert single == batched
    assert row_decoder_for(model, 1, batch_invariant=False).gemv and not row_decoder_for(model, 1).gemv
