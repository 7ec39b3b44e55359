import pytest
import torch

from gptrain.interop.hf import from_hf_state_dict, hf_config_kwargs, to_hf_state_dict
from gptrain.model import loss as loss_module
from gptrain.model.gpt import GPT, GPTConfig
from gptrain.model.loss import LMLoss
from gptrain.train.build import TrainModule

from tiny import tiny_config

TINY = dict(hidden_size=64, seq_length=32, vocab_size=1000)  # the tiny model, wider


def test_345m_parameter_count_and_padding():
    cfg = GPTConfig()
    assert cfg.padded_vocab_size == 50304
    assert cfg.num_parameters() == 354_871_296
    with torch.device("meta"):
        assert sum(p.numel() for p in GPT(cfg).parameters()) == 354_871_296
    assert GPTConfig(tensor_parallel_size=2).padded_vocab_size == 50432
    assert GPTConfig(tensor_parallel_size=4).padded_vocab_size == 50688
    assert cfg.flops_per_token() == pytest.approx(2.425e9, rel=1e-3)


def test_logits_equal_hugging_face_both_ways():
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config(**TINY)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_config_kwargs(cfg))).eval()
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_length))
    ours = from_hf_state_dict(hf.state_dict(), cfg).eval()
    with torch.no_grad():
        expected = hf(tokens).logits
        assert torch.allclose(ours.logits(tokens), expected, atol=1e-5, rtol=1e-5)
        # and back: our random init exported into HF gives the same logits
        mine = GPT(cfg)
        mine.init_weights(7)
        mine.eval()
        hf.load_state_dict(to_hf_state_dict(mine))
        assert torch.allclose(hf(tokens).logits, mine.logits(tokens), atol=1e-5, rtol=1e-5)


def test_padding_gets_no_probability_or_gradient(monkeypatch):
    cfg = tiny_config(**TINY)
    assert cfg.padded_vocab_size == 1024
    model = GPT(cfg)
    model.init_weights(0)
    module = TrainModule(model, LMLoss(cfg.vocab_size))
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 1024 * 10)  # several chunks
    losses = {}
    for fused in (True, False):
        module.loss.fused = fused
        model.zero_grad()
        losses[fused] = module(tokens[:, :-1], tokens[:, 1:])
        losses[fused].backward()
        assert model.word_embeddings.weight.grad[cfg.vocab_size:].abs().max() == 0
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses[(fused, "grads")] = grads
    assert torch.allclose(losses[True], losses[False], atol=1e-6)
    for name, g in losses[(True, "grads")].items():
        assert torch.allclose(g, losses[(False, "grads")][name], atol=1e-6), name
    # changing the padded rows changes nothing
    with torch.no_grad():
        before = module(tokens[:, :-1], tokens[:, 1:])
        model.word_embeddings.weight[cfg.vocab_size:] = 1e3
        assert torch.equal(module(tokens[:, :-1], tokens[:, 1:]), before)


def test_init_is_deterministic_and_scaled():
    a, b = GPT(tiny_config(**TINY)), GPT(tiny_config(**TINY))
    a.init_weights(3)
    b.init_weights(3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    std = a.layers["0"].mlp.fc2.weight.std().item()
    assert std == pytest.approx(0.02 / 2.0, rel=0.1)  # 0.02 / sqrt(2 * 2 layers)
    assert a.layers["0"].attn.qkv.bias.abs().sum() == 0 and torch.all(a.final_layernorm.weight == 1)
