"""On a GPU: the cuBLASLt epilogue ops against fp32 references, the fused MLP's gradients against
plain autograd, and the MLP's forward+backward time fused vs plain compiled (345M shapes).

Usage: python3 benchmarks/check_fused_mlp.py [--tokens 16384]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from gptrain.model.fused_mlp import _gelu_tanh_derivative, fused_mlp, linear_bias_gelu, linear_dgelu_bgrad


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


def check_ops(m: int, h: int, f: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, h, device="cuda", dtype=dtype, generator=gen)
    w1 = (0.02 * torch.randn(f, h, device="cuda", generator=gen)).to(dtype)
    b1 = (0.1 * torch.randn(f, device="cuda", generator=gen)).to(dtype)
    out, pre = linear_bias_gelu(x, w1, b1)
    pre_ref = x.float() @ w1.float().t() + b1.float()
    print(f"linear_bias_gelu {dtype}: pre rel err {rel_err(pre, pre_ref):.2e}, "
          f"out rel err {rel_err(out, F.gelu(pre_ref, approximate='tanh')):.2e}")
    g = torch.randn(m, h, device="cuda", dtype=dtype, generator=gen)
    w2 = (0.02 * torch.randn(h, f, device="cuda", generator=gen)).to(dtype)
    d, db = linear_dgelu_bgrad(g, w2, pre)
    d_ref = (g.float() @ w2.float()) * _gelu_tanh_derivative(pre.float())
    print(f"linear_dgelu_bgrad {dtype}: grad rel err {rel_err(d, d_ref):.2e}, "
          f"bias grad rel err {rel_err(db, d_ref.sum(0)):.2e}")


def check_grads(m: int, h: int, f: int) -> None:
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(h, f).cuda(), torch.nn.Linear(f, h).cuda()
    with torch.no_grad():
        fc1.bias.normal_(0, 0.1)
        fc2.bias.normal_(0, 0.1)
    x = torch.randn(m // 1024, 1024, h, device="cuda", requires_grad=True)
    g = torch.randn(m // 1024, 1024, h, device="cuda")
    params = [x, fc1.weight, fc1.bias, fc2.weight, fc2.bias]
    ref = fc2(F.gelu(fc1(x), approximate="tanh"))  # fp32 reference
    ref_grads = torch.autograd.grad(ref, params, g)
    fc1.bfloat16(), fc2.bfloat16()
    xb = x.detach().bfloat16().requires_grad_()
    for name, fn in (("fused bf16", lambda: fused_mlp(xb, fc1, fc2)),
                     ("plain bf16", lambda: fc2(F.gelu(fc1(xb), approximate="tanh")))):
        y = fn()
        grads = torch.autograd.grad(y, [xb, fc1.weight, fc1.bias, fc2.weight, fc2.bias], g.bfloat16())
        errs = ", ".join(f"{n} {rel_err(a, r):.2e}" for n, a, r in
                         zip(["x", "w1", "b1", "w2", "b2"], grads, ref_grads))
        print(f"{name} vs fp32: out {rel_err(y, ref):.2e}; grads {errs}")


def time_mlp(m: int, h: int, f: int) -> None:
    fc1 = torch.nn.Linear(h, f).cuda().bfloat16()
    fc2 = torch.nn.Linear(f, h).cuda().bfloat16()
    x = torch.randn(m // 1024, 1024, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    plain = torch.compile(lambda t: fc2(F.gelu(fc1(t), approximate="tanh")))
    fused = torch.compile(lambda t: fused_mlp(t, fc1, fc2))
    for name, fn in (("plain compiled", plain), ("fused compiled", fused), ("plain compiled", plain),
                     ("fused compiled", fused)):
        for _ in range(3):
            fn(x).backward(g)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(20):
            fn(x).backward(g)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 20
        print(f"MLP fwd+bwd {name}: {ms:.3f} ms per layer at {m} tokens ({6 * 2 * m * h * f / ms / 1e9:.0f} TFLOP/s)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    args = p.parse_args()
    h, f = 1024, 4096
    for dtype in (torch.bfloat16, torch.float16):
        check_ops(args.tokens, h, f, dtype)
    check_grads(8192, h, f)
    time_mlp(args.tokens, h, f)


if __name__ == "__main__":
    main()
