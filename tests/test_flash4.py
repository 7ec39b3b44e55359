"""Attention on packed QKV through the FlashAttention-4 custom ops (kernels/flash4.py): the ops'
CPU path (the reference the GPU kernels are checked against in benchmarks/check_flash4.py)
against SDPA, their registration for torch.compile, the model on them, and when they are chosen."""
import pytest
import torch

from gptrain.config import parse_megatron_args
from gptrain.kernels import flash4
from gptrain.model.gpt import GPT
from gptrain.kernels.convert import Flash4Attention, attention_choice, use_flash4
from model_parity import assert_ops_change_nothing
from tiny import tiny_config


@pytest.mark.parametrize("shape", [(2, 16, 4, 8), (1, 33, 3, 16)])
def test_packed_attention_matches_sdpa_forward_and_gradient(shape):
    b, s, h, d = shape
    torch.manual_seed(0)
    qkv = torch.randn(b, s, h, 3, d, dtype=torch.float64, requires_grad=True)
    g = torch.randn(b, s, h, d, dtype=torch.float64)
    ours = flash4.causal_attention(qkv)
    (ours_grad,) = torch.autograd.grad(ours, qkv, g)
    ref = flash4.sdpa_causal_attention(qkv)
    (ref_grad,) = torch.autograd.grad(ref, qkv, g)
    assert ours.shape == (b, s, h, d) and ours.is_contiguous()
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours_grad, ref_grad, rtol=1e-9, atol=1e-12)
    # causal: the first token attends only to itself, so its output is its own value
    torch.testing.assert_close(ours[:, 0], qkv[:, 0, :, 2].detach())


def test_ops_pass_opcheck():
    qkv = torch.randn(2, 16, 4, 3, 8)
    for cudnn_forward in (False, True):
        torch.library.opcheck(flash4.flash4_fwd, (qkv.clone().requires_grad_(), 0.3, cudnn_forward))
    out, lse = flash4.flash4_fwd(qkv, 0.3, True)
    assert lse.shape == (2, 4, 16) and lse.dtype == torch.float32
    torch.library.opcheck(flash4.flash4_bwd, (torch.randn_like(out), qkv, out, lse, 0.3))


def test_model_on_flash4_ops_equals_sdpa_model_compiled():
    def switch_on(model, loss):
        cpu = torch.device("cpu")
        assert "cpu device" in use_flash4(model, cpu, torch.float32)  # no FlashAttention-4 on the CPU...
        assert use_flash4(model, cpu, torch.float32, allow_reference=True) is None  # ...but the reference ops
        assert all(isinstance(b.attn.core, Flash4Attention) for b in model.layers.values())
    assert_ops_change_nothing(switch_on)


def test_unavailable_reasons():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert "cpu device" in flash4.unavailable_reason(cpu, torch.bfloat16, 64, 0.0)
    assert "float32" in flash4.unavailable_reason(cuda, torch.float32, 64, 0.0)
    assert "dropout 0.1" in flash4.unavailable_reason(cuda, torch.bfloat16, 64, 0.1)
    model = GPT(tiny_config(num_layers=1, seq_length=16, vocab_size=100, attention_dropout=0.1))
    # no dropout in the kernels: SDPA keeps it
    assert "dropout" in use_flash4(model, cpu, torch.float32, allow_reference=True)


def test_trainer_choice_and_flag():
    base = ["--mock-data", "--train-iters", "1", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2", "--bf16",
            "--attention-dropout", "0"]
    cpu = torch.device("cpu")
    for backend, impl, reason in [("auto", "SDPA, PyTorch's pick", "FlashAttention-4 not usable: cpu device"),
                                  ("fused", "SDPA", "--attention-backend fused")]:
        cfg, _ = parse_megatron_args(base + ["--attention-backend", backend])
        choice = attention_choice(GPT(cfg.model), cfg.kernels, cpu, torch.bfloat16)
        assert choice.impl == impl and choice.reason.startswith(reason), choice
    cfg, _ = parse_megatron_args(base + ["--attention-backend", "flash4"])
    with pytest.raises(ValueError, match="flash4 cannot run: cpu device"):  # asked for by name: no silent fallback
        attention_choice(GPT(cfg.model), cfg.kernels, cpu, torch.bfloat16)
