"""The linear layers and MLP on custom matmul ops: their autograd (saved tensors, transposes, bias
gradients) against plain autograd, on the CPU reference path of the same ops; the cuBLASLt
kernels behind them are checked against these references on the GPU
(benchmarks/check_cublaslt.py)."""
import pytest
import torch
import torch.nn.functional as F

from gptrain.config import KernelConfig, parse_megatron_args
from gptrain.kernels.ops import gelu_tanh_derivative, linear_bias_gelu, linear_dgelu, linear_dgrad, linear_fwd, linear_wgrad
from gptrain.model.gpt import GPT
from gptrain.kernels.convert import linear_choice, use_cublaslt
from gptrain.model.gpt import MLP
from gptrain.model.linear import FusedBiasGeluMLP, TunedLinear, linear_weight
from model_parity import assert_ops_change_nothing


def _layers(seed=0, h=16, f=64):
    torch.manual_seed(seed)
    fc1, fc2 = torch.nn.Linear(h, f).double(), torch.nn.Linear(f, h).double()
    with torch.no_grad():
        fc1.bias.normal_()
        fc2.bias.normal_()
    return fc1, fc2


def _grads(fn, x, params, g):
    out = fn()
    return out, torch.autograd.grad(out, [x, *params], g)


@pytest.mark.parametrize("fuse", [False, True])
def test_mlp_matches_plain_forward_and_all_gradients(fuse):
    fc1, fc2 = _layers()
    params = [fc1.weight, fc1.bias, fc2.weight, fc2.bias]
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, 16, dtype=torch.float64)
    plain, plain_grads = _grads(lambda: fc2(F.gelu(fc1(x), approximate="tanh")), x, params, g)
    mlp = MLP.__new__(FusedBiasGeluMLP if fuse else MLP)
    torch.nn.Module.__init__(mlp)
    mlp.fc1, mlp.fc2 = fc1, fc2
    if not fuse:
        for layer in (fc1, fc2):
            layer.__class__ = TunedLinear
    ours, our_grads = _grads(lambda: mlp(x), x, params, g)
    torch.testing.assert_close(ours, plain, rtol=0, atol=1e-12)
    for name, a, b in zip(["x", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"], our_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_linear_and_bias_free_linear_match_plain():
    fc1, _ = _layers()
    x = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 7, 64, dtype=torch.float64)
    tuned = TunedLinear(16, 64, dtype=torch.float64)
    tuned.load_state_dict(fc1.state_dict())
    tuned.weight, tuned.bias = fc1.weight, fc1.bias
    for fn, ref, params in [(lambda: tuned(x), lambda: F.linear(x, fc1.weight, fc1.bias), [fc1.weight, fc1.bias]),
                            (lambda: linear_weight(x, fc1.weight, True), lambda: F.linear(x, fc1.weight), [fc1.weight])]:
        ours, our_grads = _grads(fn, x, params, g)
        plain, plain_grads = _grads(ref, x, params, g)
        torch.testing.assert_close(ours, plain)
        for a, b in zip(our_grads, plain_grads):
            torch.testing.assert_close(a, b)


def test_ops_pass_opcheck_and_references_agree():
    x, w1, b1 = torch.randn(6, 8), torch.randn(32, 8), torch.randn(32)
    g, w2, pre = torch.randn(6, 8), torch.randn(8, 32), torch.randn(6, 32)
    for op, args in [(linear_fwd, (x, w1, b1)), (linear_fwd, (x, w1, None)), (linear_dgrad, (g, w2)),
                     (linear_wgrad, (pre, x)), (linear_bias_gelu, (x, w1, b1)),
                     (linear_dgelu, (g, w2, pre))]:
        torch.library.opcheck(op, args)
    # the tanh-GELU derivative the DGELU epilogue applies equals autograd's
    t = torch.linspace(-6, 6, 101, dtype=torch.float64, requires_grad=True)
    (auto,) = torch.autograd.grad(F.gelu(t, approximate="tanh").sum(), t)
    torch.testing.assert_close(gelu_tanh_derivative(t.detach()), auto)


def test_model_on_cublaslt_ops_equals_plain_model_compiled():
    def switch_on(model, loss):
        cpu = torch.device("cpu")
        assert "cpu" in use_cublaslt(model, loss, cpu, torch.float32)  # no cuBLASLt on the CPU...
        assert use_cublaslt(model, loss, cpu, torch.float32, allow_reference=True) is None  # ...but the reference ops
        assert all(isinstance(b.mlp, FusedBiasGeluMLP) and isinstance(b.attn.qkv, TunedLinear)
                   for b in model.layers.values()) and loss.tuned
    assert_ops_change_nothing(switch_on)


def test_flags():
    base = ["--mock-data", "--train-iters", "1"]
    cfg, _ = parse_megatron_args(base)
    assert cfg.kernels.bias_gelu_fusion and cfg.kernels.linear_impl == "auto"
    cfg, _ = parse_megatron_args(base + ["--no-bias-gelu-fusion", "--linear-impl", "torch"])
    assert not cfg.kernels.bias_gelu_fusion and cfg.kernels.linear_impl == "torch"
    with pytest.raises(ValueError, match="linear-impl"):
        KernelConfig(linear_impl="cutlass")


def test_auto_picks_torch_for_small_micro_batches():
    base = ["--mock-data", "--train-iters", "1", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "1024", "--bf16"]
    for mbs, impl, expect in [(8, "auto", "auto: 8192 tokens"), (16, "auto", "cuBLASLt not usable: cpu"),
                              (8, "cublaslt", "cuBLASLt not usable: cpu"), (16, "torch", "--linear-impl torch")]:
        cfg, _ = parse_megatron_args(base + ["--micro-batch-size", str(mbs), "--linear-impl", impl])
        tokens = cfg.train.micro_batch_size * cfg.model.seq_length
        choice = linear_choice(GPT(cfg.model), None, cfg.kernels, torch.device("cpu"), torch.bfloat16, tokens, False)
        assert choice.impl == "torch" and choice.reason.startswith(expect), choice


def test_auto_picks_torch_under_compiled_full_recompute():
    """Compiled with full recompute, the cuBLASLt layers' outputs were kept across the recomputed
    blocks (a 2.7B at micro-batch 16 held 20 GiB of fc1 outputs on an H100): auto leaves them out
    there, and only there."""
    base = ["--mock-data", "--train-iters", "1", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "1024", "--bf16", "--micro-batch-size", "16"]
    for extra, compiled, expect in [(["--recompute-granularity", "full"], True, "auto: full recompute"),
                                    (["--recompute-granularity", "full"], False, "cuBLASLt not usable: cpu"),
                                    (["--recompute-activations"], True, "cuBLASLt not usable: cpu"),
                                    (["--recompute-granularity", "full", "--linear-impl", "cublaslt"], True,
                                     "cuBLASLt not usable: cpu")]:
        cfg, _ = parse_megatron_args(base + extra)
        choice = linear_choice(GPT(cfg.model), None, cfg.kernels, torch.device("cpu"), torch.bfloat16, 16 * 1024,
                               False, compiled=compiled)
        assert choice.impl == "torch" and choice.reason.startswith(expect), (extra, compiled, choice)


def test_auto_needs_twice_the_tokens_under_every_zero_stage():
    """FSDP2's per-block hooks and gathers add host work at every ZeRO stage, so auto leaves the
    cuBLASLt ops (host calls of their own) out below 32,768 tokens there: at ZeRO-2 on two H200s
    they were 29% slower than torch's linears at 16,384 (RESULTS.md, s24)."""
    from gptrain.kernels.convert import apply_kernels
    from gptrain.model.loss import LMLoss

    base = ["--mock-data", "--train-iters", "1", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "1024", "--bf16", "--micro-batch-size", "16"]
    cfg, _ = parse_megatron_args(base)
    for sharded, tokens, expect in [(True, 16 * 1024, "auto: 16384 tokens"), (False, 16 * 1024, "cuBLASLt not usable"),
                                    (True, 32 * 1024, "cuBLASLt not usable")]:  # from 32,768 it tries cuBLASLt
        impls = apply_kernels(GPT(cfg.model), LMLoss(cfg.model.padded_vocab_size), cfg.kernels, torch.device("cpu"),
                              torch.bfloat16, tokens, sharded=sharded)
        choice = impls["linear layers"]
        assert choice.impl == "torch" and choice.reason.startswith(expect), (sharded, tokens, choice)
        assert ("under ZeRO" in choice.reason) == (expect.startswith("auto")), choice
