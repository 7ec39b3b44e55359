"""On a GPU: the cuBLASLt ops against fp32 references, the MLP's gradients against plain autograd,
and each GEMM of the 345M model (forward, input and weight gradient) timed through torch and
through the autotuned cuBLASLt path, with and without its epilogue.

Usage: python3 benchmarks/check_cublaslt.py [--tokens 16384]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from cuda_timing import cuda_ms  # benchmarks/cuda_timing.py
from gptrain.kernels import cublaslt as lt
from gptrain.kernels.ops import gelu_tanh_derivative, linear_bias_gelu, linear_dgelu, linear_fwd, linear_wgrad
from gptrain.model.linear import FusedBiasGeluMLP, TunedLinear


def mlp(x, fc1, fc2, tuned: bool, fuse: bool):
    """fc1 -> tanh GELU -> fc2, plain, on the cuBLASLt linears, or with bias + GELU fused (the
    converter's module swaps, applied to these two layers)."""
    if tuned and fuse:
        module = FusedBiasGeluMLP()
        module.fc1, module.fc2 = fc1, fc2
        return module(x)
    cls = TunedLinear if tuned else torch.nn.Linear
    fc1.__class__ = fc2.__class__ = cls
    return fc2(F.gelu(fc1(x), approximate="tanh"))


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


def check_ops(m: int, h: int, f: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *shape, s=1.0: (s * torch.randn(*shape, device="cuda", generator=gen)).to(dtype)  # noqa: E731
    x, w1, b1, g, w2 = r(m, h), r(f, h, s=0.02), r(f, s=0.1), r(m, h), r(h, f, s=0.02)
    out, pre = linear_bias_gelu(x, w1, b1)
    pre_ref = x.float() @ w1.float().t() + b1.float()
    d = linear_dgelu(g, w2, pre)
    d_ref = (g.float() @ w2.float()) * gelu_tanh_derivative(pre.float())
    y = linear_fwd(x, w1, b1)
    gw = linear_wgrad(d, x)
    print(f"{dtype}: bias_gelu pre {rel_err(pre, pre_ref):.1e} out {rel_err(out, F.gelu(pre_ref, approximate='tanh')):.1e}"
          f"; dgelu {rel_err(d, d_ref):.1e}; fwd {rel_err(y, pre_ref):.1e}; wgrad "
          f"{rel_err(gw, d.float().t() @ x.float()):.1e}")


def check_mlp_grads(m: int, h: int, f: int) -> None:
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(h, f).cuda(), torch.nn.Linear(f, h).cuda()
    with torch.no_grad():
        fc1.bias.normal_(0, 0.1)
        fc2.bias.normal_(0, 0.1)
    x = torch.randn(m // 1024, 1024, h, device="cuda", requires_grad=True)
    g = torch.randn(m // 1024, 1024, h, device="cuda")
    names = ["x", "w1", "b1", "w2", "b2"]
    ref = mlp(x, fc1, fc2, False, False)  # fp32
    ref_grads = torch.autograd.grad(ref, [x, fc1.weight, fc1.bias, fc2.weight, fc2.bias], g)
    fc1.bfloat16(), fc2.bfloat16()
    xb = x.detach().bfloat16().requires_grad_()
    for tuned, fuse in ((False, False), (True, False), (True, True)):
        y = mlp(xb, fc1, fc2, tuned, fuse)
        grads = torch.autograd.grad(y, [xb, fc1.weight, fc1.bias, fc2.weight, fc2.bias], g.bfloat16())
        errs = ", ".join(f"{n} {rel_err(a, r):.1e}" for n, a, r in zip(names, grads, ref_grads))
        print(f"MLP bf16 tuned={tuned} fused={fuse} vs fp32: out {rel_err(y, ref):.1e}; grads {errs}")



def time_gemms(m: int, h: int, f: int, vocab: int) -> None:
    ctx = lt.cublaslt(torch.cuda.current_device())
    bf = dict(device="cuda", dtype=torch.bfloat16)
    total_torch = total_lt = 0.0
    print("| GEMM | torch ms | cuBLASLt tuned ms | speedup | heuristic #1 ms |")
    print("| --- | --- | --- | --- | --- |")
    for name, n_out, n_in in (("qkv", 3 * h, h), ("proj", h, h), ("fc1", f, h), ("fc2", h, f), ("head", vocab, h)):
        x, w, g = torch.randn(m, n_in, **bf), torch.randn(n_out, n_in, **bf), torch.randn(m, n_out, **bf)
        bias, y, dx, dw, db = (torch.randn(n_out, **bf), torch.empty(m, n_out, **bf), torch.empty(m, n_in, **bf),
                               torch.empty(n_out, n_in, **bf), torch.empty(n_out, **bf))
        cases = [
            ("fwd", lambda: torch.mm(x, w.t()), lambda: ctx.gemm(x, w, y, trans_b=True)),
            ("dgrad", lambda: torch.mm(g, w), lambda: ctx.gemm(g, w, dx)),
            ("wgrad", lambda: torch.mm(g.t(), x), lambda: ctx.gemm(g, x, dw, trans_a=True)),
        ]
        if name != "head":
            cases += [("fwd+bias", lambda: torch.addmm(bias, x, w.t()),
                       lambda: ctx.gemm(x, w, y, trans_b=True, epilogue=lt.EPILOGUE_BIAS, bias=bias)),
                      ("wgrad+bgrad", lambda: (torch.mm(g.t(), x), g.sum(0)),
                       lambda: ctx.gemm(g, x, dw, trans_a=True, epilogue=lt.EPILOGUE_BGRADB, bias=db))]
        if name == "fc1":
            aux = torch.empty(m, n_out, **bf)
            cases.append(("fwd+bias+gelu", lambda: F.gelu(torch.addmm(bias, x, w.t()), approximate="tanh"),
                          lambda: ctx.gemm(x, w, y, trans_b=True, epilogue=lt.EPILOGUE_GELU_AUX_BIAS, bias=bias, aux=aux)))
        if name == "fc2":  # fc2's dgrad through GELU': g (m x h) @ w2 (h x f) * gelu'(aux (m x f))
            aux = torch.randn(m, n_in, **bf)
            cases.append(("dgrad*dgelu", lambda: torch.mm(g, w) * gelu_tanh_derivative(aux),
                          lambda: ctx.gemm(g, w, dx, epilogue=lt.EPILOGUE_DGELU, aux=aux)))
            cases.append(("dgrad*dgelu+bgrad", lambda: None,
                          lambda: ctx.gemm(g, w, dx, epilogue=lt.EPILOGUE_DGELU_BGRAD, aux=aux, bias=torch.empty(n_in, **bf))))
        for case, torch_fn, lt_fn in cases:
            t_lt = cuda_ms(lt_fn)
            plan = list(ctx._plans.values())[-1]
            t_torch = cuda_ms(torch_fn) if case != "dgrad*dgelu+bgrad" else float("nan")
            first = plan.times[0] if plan.times else float("nan")
            if case in ("fwd", "dgrad", "wgrad"):
                total_torch, total_lt = total_torch + t_torch, total_lt + t_lt
            print(f"| {name} {case} | {t_torch:.3f} | {t_lt:.3f} | {t_torch / t_lt:.3f}x | {first:.3f} |")
    print(f"sum of plain fwd/dgrad/wgrad GEMMs per layer+head: torch {total_torch:.3f} ms, cuBLASLt tuned "
          f"{total_lt:.3f} ms ({total_torch / total_lt:.3f}x)")
    x, w, b = torch.randn(64, h, **bf), torch.randn(f, h, **bf), torch.randn(f, **bf)
    linear_fwd(x, w, b)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        linear_fwd(x, w, b)
    host = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    print(f"host time per linear_fwd custom-op call (eager): {host:.1f} us")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    args = p.parse_args()
    h, f = 1024, 4096
    for dtype in (torch.bfloat16, torch.float16):
        check_ops(args.tokens, h, f, dtype)
    check_mlp_grads(8192, h, f)
    time_gemms(args.tokens, h, f, 50304)


if __name__ == "__main__":
    main()
