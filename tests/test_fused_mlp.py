"""The fused bias-GELU MLP: its autograd (saved tensors, transposes, bias gradients) against plain
autograd, on the CPU reference path of the same custom ops; the cuBLASLt kernels behind them are
checked against these references on the GPU (benchmarks/check_fused_mlp.py)."""
import pytest
import torch
import torch.nn.functional as F

from gptrain.config import parse_megatron_args
from gptrain.model.fused_mlp import fused_mlp, linear_bias_gelu, linear_dgelu_bgrad
from gptrain.model.gpt import GPT, GPTConfig


def _mlp_pair(seed=0, h=16, f=64):
    torch.manual_seed(seed)
    fc1, fc2 = torch.nn.Linear(h, f).double(), torch.nn.Linear(f, h).double()
    with torch.no_grad():
        fc1.bias.normal_()
        fc2.bias.normal_()
    return fc1, fc2


def test_fused_mlp_matches_plain_forward_and_all_gradients():
    fc1, fc2 = _mlp_pair()
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, 16, dtype=torch.float64)
    plain = fc2(F.gelu(fc1(x), approximate="tanh"))
    plain_grads = torch.autograd.grad(plain, [x, fc1.weight, fc1.bias, fc2.weight, fc2.bias], g)
    fused = fused_mlp(x, fc1, fc2)
    fused_grads = torch.autograd.grad(fused, [x, fc1.weight, fc1.bias, fc2.weight, fc2.bias], g)
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-12)
    for name, a, b in zip(["x", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"], fused_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_ops_pass_opcheck():
    x, w1, b1 = torch.randn(6, 8), torch.randn(32, 8), torch.randn(32)
    torch.library.opcheck(linear_bias_gelu, (x, w1, b1))
    g, w2, pre = torch.randn(6, 8), torch.randn(8, 32), torch.randn(6, 32)
    torch.library.opcheck(linear_dgelu_bgrad, (g, w2, pre))
    d, db = linear_dgelu_bgrad(g, w2, pre)
    torch.testing.assert_close(db, d.sum(0))


def test_model_with_fusion_equals_model_without_compiled():
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100,
                    attention_dropout=0.0, hidden_dropout=0.0)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, 1)
    losses, grads = [], []
    for fuse in (False, True):
        model = GPT(cfg)
        model.init_weights(7)
        assert model.enable_bias_gelu_fusion() is not None  # no cuBLASLt on the CPU...
        if fuse:
            assert model.enable_bias_gelu_fusion(allow_reference=True) is None  # ...but the reference path
        assert all(b.mlp.fused == fuse for b in model.layers.values())
        # the fused model compiled: its custom ops must trace through their fake implementations
        loss = (torch.compile(model) if fuse else model)(tokens, labels)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)


def test_flag_and_fallback_reason():
    cfg, _ = parse_megatron_args(["--mock-data", "--train-iters", "1"])
    assert cfg.model.bias_gelu_fusion
    cfg, _ = parse_megatron_args(["--mock-data", "--train-iters", "1", "--no-bias-gelu-fusion"])
    assert not cfg.model.bias_gelu_fusion
    model = GPT(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=50))
    assert "cpu" in model.enable_bias_gelu_fusion()
