"""The GPU lane (``python3 -m pytest -m gpu``): each kernel of gptrain/kernels/ against its reference,
and a bf16 training step on the kernel path against the plain path. Skipped without CUDA (CI).

Tolerances are stated against references gptrain did not write: an fp32 computation of the same
half-precision inputs (``rel`` = relative Frobenius error), and PyTorch's own half-precision kernel
on the same inputs, whose error the kernel may exceed only by a small factor (``no_worse``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU lane)")]

CUDA = torch.device("cuda")
HALF_ABS = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # ceiling on any relative error, by dtype


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def no_worse(ours: float, torch_err: float, dtype: torch.dtype, factor: float = 1.5) -> bool:
    """Within ``factor`` of PyTorch's own half-precision error (plus a floor for exact ties) and
    under the dtype's ceiling."""
    return ours <= factor * torch_err + 1e-4 and ours <= HALF_ABS[dtype]


# ---- cuBLASLt ops (kernels/ops.py on kernels/cublaslt.py)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [4096, 3000])
def test_cublaslt_ops_match_fp32(dtype, m):
    from gptrain.kernels import ops
    from gptrain.kernels.cublaslt import unavailable_reason

    assert unavailable_reason(CUDA, dtype) is None  # the binding must load on the lane's GPU, not skip
    h, f = 1024, 4096
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *shape, s=1.0: (s * torch.randn(*shape, device="cuda", generator=gen)).to(dtype)  # noqa: E731
    x, w1, b1, gf, g, w2 = r(m, h), r(f, h, s=0.02), r(f, s=0.1), r(m, f), r(m, h), r(h, f, s=0.02)
    X, W1, B1, GF, G, W2 = (t.double() for t in (x, w1, b1, gf, g, w2))
    pre_ref = X @ W1.T + B1
    out, pre = ops.linear_bias_gelu(x, w1, b1)
    torch_pre = F.linear(x, w1, b1)
    cases = {  # name: (ours, fp64 reference, PyTorch in dtype)
        "fwd + bias": (ops.linear_fwd(x, w1, b1), pre_ref, torch_pre),
        "fwd": (ops.linear_fwd(x, w1, None), X @ W1.T, F.linear(x, w1)),
        "dgrad": (ops.linear_dgrad(gf, w1), GF @ W1, gf @ w1),
        "wgrad": (ops.linear_wgrad(gf, x), GF.T @ X, gf.t() @ x),
        "bias_gelu pre": (pre, pre_ref, torch_pre),
        "bias_gelu out": (out, F.gelu(pre_ref, approximate="tanh"), F.gelu(torch_pre, approximate="tanh")),
        "dgelu": (ops.linear_dgelu(g, w2, pre), (G @ W2) * ops.gelu_tanh_derivative(pre.double()),
                  ((g @ w2).float() * ops.gelu_tanh_derivative(pre.float())).to(dtype)),
    }
    for name, (ours, ref, plain) in cases.items():
        assert ours.dtype == dtype and ours.shape == ref.shape, name
        assert no_worse(rel(ours, ref), rel(plain, ref), dtype), \
            f"{name}: cuBLASLt {rel(ours, ref):.2e} vs PyTorch {rel(plain, ref):.2e} relative error"


def _mlp_grads(x, fc1, fc2, g, module_cls=None):
    """Output and gradients (x, fc1 w/b, fc2 w/b) of fc1 -> tanh GELU -> fc2."""
    from gptrain.model.linear import FusedBiasGeluMLP

    if module_cls is FusedBiasGeluMLP:
        module = FusedBiasGeluMLP()
        module.fc1, module.fc2 = fc1, fc2
        y = module(x)
    else:
        fc1.__class__ = fc2.__class__ = module_cls or torch.nn.Linear
        y = fc2(F.gelu(fc1(x), approximate="tanh"))
        fc1.__class__ = fc2.__class__ = torch.nn.Linear
    grads = torch.autograd.grad(y, [x, fc1.weight, fc1.bias, fc2.weight, fc2.bias], g)
    return [y, *grads]


def test_tuned_linear_and_fused_mlp_gradients_as_close_to_fp32_as_plain_bf16():
    from gptrain.model.linear import FusedBiasGeluMLP, TunedLinear

    torch.manual_seed(0)
    h, f = 1024, 4096
    fc1, fc2 = torch.nn.Linear(h, f).cuda(), torch.nn.Linear(f, h).cuda()
    with torch.no_grad():
        fc1.bias.normal_(0, 0.1)
        fc2.bias.normal_(0, 0.1)
    x = torch.randn(4, 1024, h, device="cuda")
    g = torch.randn(4, 1024, h, device="cuda")
    ref = _mlp_grads(x.double().requires_grad_(), fc1.double(), fc2.double(), g.double())
    fc1.bfloat16(), fc2.bfloat16()
    xb, gb = x.bfloat16().requires_grad_(), g.bfloat16()
    plain = _mlp_grads(xb, fc1, fc2, gb)
    names = ["out", "x", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    for cls in (TunedLinear, FusedBiasGeluMLP):
        ours = _mlp_grads(xb, fc1, fc2, gb, cls)
        for name, a, p, r in zip(names, ours, plain, ref):
            assert no_worse(rel(a, r), rel(p, r), torch.bfloat16, factor=1.25), \
                f"{cls.__name__} {name}: {rel(a, r):.2e} vs plain bf16 {rel(p, r):.2e}"


# ---- Triton cross-entropy (kernels/xent.py)
def test_softmax_xent_matches_fp64_reference():
    from gptrain.kernels import xent
    from gptrain.kernels.ops import linear_fwd

    rows, width, vocab = 4096, 50304, 50257
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (4 * torch.randn(rows, width, device="cuda", generator=gen)).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    labels[:2] = torch.tensor([0, vocab - 1])  # both ends of the real vocabulary
    loss, grad = xent.softmax_xent(logits, labels, vocab)
    x = logits.double().masked_fill(torch.arange(width, device="cuda") >= vocab, float("-inf"))
    ref_loss = F.cross_entropy(x, labels, reduction="none")  # PyTorch's cross-entropy, fp64
    ref_grad = torch.softmax(x, dim=1) - F.one_hot(labels, width).double()
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert (loss.double() - ref_loss).abs().max().item() < 1e-4  # fp32 accumulation
    assert (grad.double() - ref_grad).abs().max().item() <= 2.0 ** -8  # bf16 rounding of values within [-1, 1]
    assert grad[:, vocab:].abs().max().item() == 0.0  # the padding columns: no probability, no gradient
    # the gradient written over the logits equals a separate buffer, bit for bit
    h = torch.randn(2048, 1024, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(width, 1024, device="cuda", generator=gen) / 32).to(torch.bfloat16)
    in_place = xent.linear_softmax_xent(h, w, labels[:2048], vocab)
    apart = xent.softmax_xent(linear_fwd(h, w, None), labels[:2048], vocab)
    assert torch.equal(in_place[0], apart[0]) and torch.equal(in_place[1], apart[1])


# ---- attention (kernels/flash4.py): cuDNN's forward, FlashAttention-4's backward
def _qkv(b=2, s=1024, h=16, d=64):
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(b, s, h, 3, d, device="cuda", generator=gen).to(torch.bfloat16)
    grad = torch.randn(b, s, h, d, device="cuda", generator=gen).to(torch.bfloat16)
    return qkv, grad


def _sdpa_math_fp64(qkv: torch.Tensor, grad: torch.Tensor):
    """PyTorch's SDPA math in fp64: output (batch, seq, heads, dim), log-sum-exp, qkv gradient."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from gptrain.kernels import flash4

    leaf = qkv.double().requires_grad_()
    with sdpa_kernel([SDPBackend.MATH]):
        out = flash4.sdpa_causal_attention(leaf)
    out.backward(grad.double())
    q, k, _ = leaf.detach().permute(3, 0, 2, 1, 4)
    s = q.size(2)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1), float("-inf")).logsumexp(-1)
    return out.detach(), lse, leaf.grad


def _sdpa_flash_bf16(qkv: torch.Tensor, grad: torch.Tensor):
    """PyTorch's FlashAttention-2 in bf16 on the same inputs: the error a half-precision kernel makes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from gptrain.kernels import flash4

    leaf = qkv.clone().requires_grad_()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = flash4.sdpa_causal_attention(leaf)
    out.backward(grad)
    return out.detach(), leaf.grad


def test_cudnn_attention_forward_matches_reference():
    from gptrain.kernels import flash4

    qkv, grad = _qkv()
    ref_out, ref_lse, _ = _sdpa_math_fp64(qkv, grad)
    flash_out, _ = _sdpa_flash_bf16(qkv, grad)
    with torch.no_grad():
        out, lse = flash4.flash4_fwd(qkv, qkv.shape[-1] ** -0.5, True)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert no_worse(rel(out, ref_out), rel(flash_out, ref_out), torch.bfloat16), \
        f"cuDNN forward {rel(out, ref_out):.2e} vs SDPA flash {rel(flash_out, ref_out):.2e}"
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3  # natural-log LSE, what FA4's backward takes


@pytest.mark.parametrize("cudnn_forward", [True, False], ids=["cudnn-fwd+fa4-bwd", "fa4-fwd+fa4-bwd"])
def test_flash4_attention_matches_reference(cudnn_forward):
    from gptrain.kernels import flash4

    reason = flash4.unavailable_reason(CUDA, torch.bfloat16, 64, 0.0)
    if reason is not None:
        pytest.skip(f"FlashAttention-4 cannot run here: {reason}")
    qkv, grad = _qkv()
    ref_out, _, ref_grad = _sdpa_math_fp64(qkv, grad)
    flash_out, flash_grad = _sdpa_flash_bf16(qkv, grad)
    leaf = qkv.clone().requires_grad_()
    out = flash4.causal_attention(leaf, cudnn_forward=cudnn_forward)
    out.backward(grad)
    assert no_worse(rel(out, ref_out), rel(flash_out, ref_out), torch.bfloat16)
    for i, name in enumerate("qkv"):  # q, k, v gradients, each a view of the packed gradient
        ours, plain, ref = leaf.grad[:, :, :, i], flash_grad[:, :, :, i], ref_grad[:, :, :, i]
        assert no_worse(rel(ours, ref), rel(plain, ref), torch.bfloat16), \
            f"d{name}: {rel(ours, ref):.2e} vs SDPA flash {rel(plain, ref):.2e}"


# ---- a bf16 training step: kernel path against the plain path, same initial weights
MODEL = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
         "--micro-batch-size 32 --global-batch-size 32 --hidden-dropout 0 --attention-dropout 0 --lr 6e-4 "
         "--lr-warmup-iters 2 --lr-decay-style cosine --min-lr 6e-5 --seed 7 --device cuda").split()
KERNELS = ["--linear-impl", "cublaslt", "--attention-backend", "auto"]
PLAIN = ["--linear-impl", "torch", "--attention-backend", "fused", "--no-bias-gelu-fusion"]


def _parts(extra: list[str]):
    from gptrain.bench import synthetic_trainer

    trainer, loader = synthetic_trainer(MODEL + extra, 10)
    loader.close()
    return trainer.parts, trainer


def _loss_and_grads(parts, tokens, labels):
    loss = parts.forward(tokens, labels, None)
    loss.backward()
    grads = {n: p.grad.detach().double().flatten() for n, p in parts.model.named_parameters() if p.grad is not None}
    parts.optimizer.zero_grad(set_to_none=True)
    for p in parts.model.parameters():
        p.grad = None
    return loss.item(), grads


def test_kernel_path_step_as_close_to_fp32_as_the_plain_bf16_step():
    from gptrain.data.gpt_dataset import MockGPTDataset

    runs = {}
    for name, extra in (("fp32", ["--linear-impl", "torch", "--attention-backend", "unfused"]),
                        ("plain", ["--bf16"] + PLAIN), ("kernels", ["--bf16"] + KERNELS)):
        parts, trainer = _parts(extra)
        if name == "kernels":
            assert trainer.linear_impl.impl.startswith("cuBLASLt"), trainer.linear_impl
        data = MockGPTDataset("train", 64, 512, 50257, 7)
        batch = torch.from_numpy(__import__("numpy").stack([data[i] for i in range(32)])).to(CUDA)
        weights = {n: p.detach().float().clone() for n, p in parts.model.named_parameters()}
        runs[name] = (weights, *_loss_and_grads(parts, batch[:, :-1], batch[:, 1:]))
        del parts, trainer
        torch.cuda.empty_cache()
    ref_w, ref_loss, ref_g = runs["fp32"]
    for name in ("plain", "kernels"):  # the same initial weights (rounded to bf16)
        for n, w in runs[name][0].items():
            assert torch.equal(w, ref_w[n].bfloat16().float()), n
    plain_loss, plain_g = runs["plain"][1:]
    loss, grads = runs["kernels"][1:]
    assert abs(loss - ref_loss) <= 1.5 * abs(plain_loss - ref_loss) + 2e-3, (loss, plain_loss, ref_loss)
    everything = lambda g: torch.cat([g[n] for n in sorted(ref_g)])  # noqa: E731
    ours, plain, ref = everything(grads), everything(plain_g), everything(ref_g)
    assert rel(ours, ref) <= 1.25 * rel(plain, ref) + 1e-4, (rel(ours, ref), rel(plain, ref))
    for n in ref_g:  # each parameter, with more room: small tensors are noisier
        assert rel(grads[n], ref_g[n]) <= 2.0 * rel(plain_g[n], ref_g[n]) + 2e-3, n


def test_compiled_kernel_path_trains_like_the_plain_path(tmp_path):
    """``gptrain train`` itself on the built-in corpus: 8 bf16 steps compiled on the kernel path
    against eager plain steps."""
    import re

    from gptrain.data.builtin import write_builtin_corpus
    from gptrain.data.preprocess import PreprocessConfig, preprocess
    from gptrain.train.run import train_main

    write_builtin_corpus(tmp_path / "builtin.jsonl")
    preprocess(PreprocessConfig(inputs=[str(tmp_path / "builtin.jsonl")], output_prefix=str(tmp_path / "b"),
                                append_eod=True, workers=2, progress=False))
    base = MODEL + ["--bf16", "--data-path", str(tmp_path / "b_text_document"), "--split", "90,5,5",
                    "--train-iters", "8", "--log-interval", "1", "--eval-iters", "0", "--verbose"]
    losses = {}
    for name, extra in (("plain", PLAIN), ("kernels", KERNELS + ["--compile"])):
        lines: list[str] = []
        assert train_main(base + extra, log=lines.append).exit_code == 0
        losses[name] = [float(m.group(1)) for m in (re.search(r"\| lm loss: (\S+) \|", x) for x in lines) if m]
        if name == "kernels":
            assert " > linear layers: cuBLASLt, autotuned, bias-GELU fused" in lines
    assert len(losses["plain"]) == len(losses["kernels"]) == 8
    assert abs(losses["kernels"][0] - losses["plain"][0]) < 2e-2  # same weights, same batch, before any update
    for a, b in zip(losses["kernels"], losses["plain"]):
        assert abs(a - b) < 5e-2, (losses["kernels"], losses["plain"])
    assert losses["kernels"][-1] < losses["kernels"][0] - 0.2  # and it learns
