"""FlashAttention-4 on packed QKV (gptrain/kernels/flash4.py) against SDPA's kernels on one GPU:
numerics against an fp32 reference, then forward and forward+backward time per layer for the 345M
shape (16 heads of 64, seq 1024, causal, bf16), and the host cost of one call.

    python benchmarks/check_flash4.py [--batches 16,64]
"""
import argparse
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuda_timing import cuda_ms  # benchmarks/cuda_timing.py
from gptrain.kernels import flash4


def sdpa(backend):
    def run(qkv):
        with sdpa_kernel([backend]):
            return flash4.sdpa_causal_attention(qkv)
    return run


CANDIDATES = {"cuDNN (SDPA)": sdpa(SDPBackend.CUDNN_ATTENTION), "FA2 (SDPA)": sdpa(SDPBackend.FLASH_ATTENTION),
              "FA4 packed": lambda qkv: flash4.causal_attention(qkv, cudnn_forward=False),
              "cuDNN fwd + FA4 bwd, packed": flash4.causal_attention}


def check_numerics(b=2, s=1024, h=16, d=64):
    torch.manual_seed(0)
    qkv = torch.randn(b, s, h, 3, d, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    ref_in = qkv.float().requires_grad_()
    with sdpa_kernel([SDPBackend.MATH]):
        ref = flash4.sdpa_causal_attention(ref_in)
    ref.backward(grad.float())
    rel = lambda a, r: ((a.float() - r).norm() / r.norm()).item()  # noqa: E731
    scale = d ** -0.5
    with torch.no_grad():
        (out_fa4, lse_fa4), (out_cudnn, lse_cudnn) = (flash4.flash4_fwd(qkv, scale, c) for c in (False, True))
    print(f"cuDNN vs FA4 forward: log-sum-exp max diff {(lse_fa4 - lse_cudnn).abs().max().item():.2e}, "
          f"output max diff {(out_fa4.float() - out_cudnn.float()).abs().max().item():.2e}")
    for name, fn in CANDIDATES.items():
        x = qkv.clone().requires_grad_()
        y = fn(x)
        y.backward(grad)
        print(f"{name}: out rel err {rel(y, ref):.2e}; grad q/k/v "
              + " / ".join(f"{rel(x.grad[:, :, :, i], ref_in.grad[:, :, :, i]):.2e}" for i in range(3)), flush=True)



def bench(b, s=1024, h=16, d=64):
    qkv = torch.randn(b, s, h, 3, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    fwd_flops = 2 * b * h * s * s * d  # causal: half of 4 b h s^2 d
    print(f"\nbatch {b}, seq {s}, {h} heads x {d}, causal bf16 (one layer; backward includes building dqkv)")
    print("| kernel | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |")
    print("| --- | --- | --- | --- | --- |")
    for name, fn in CANDIDATES.items():
        with torch.no_grad():
            t_fwd = cuda_ms(lambda: fn(qkv))

        def step():
            fn(qkv).backward(grad)
            qkv.grad = None
        t_all = cuda_ms(step)
        print(f"| {name} | {t_fwd:.3f} | {fwd_flops / t_fwd / 1e9:.0f} | {t_all:.3f} | "
              f"{3.5 * fwd_flops / t_all / 1e9:.0f} |", flush=True)


def host_cost(calls=200):
    qkv = torch.randn(1, 128, 16, 3, 64, device="cuda", dtype=torch.bfloat16)
    for name, fn in CANDIDATES.items():
        with torch.no_grad():
            fn(qkv)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(calls):
                fn(qkv)
            host = (time.perf_counter() - t) / calls
        torch.cuda.synchronize()
        print(f"host time per forward call, {name}: {host * 1e6:.0f} us")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="16,64")
    args = p.parse_args()
    reason = flash4.unavailable_reason(torch.device("cuda"), torch.bfloat16, 64, 0.0)
    if reason:
        raise SystemExit(f"FlashAttention-4 cannot run: {reason}")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    t = time.perf_counter()
    check_numerics()
    print(f"(first calls, including FA4's kernel compilation: {time.perf_counter() - t:.1f} s)")
    for b in map(int, args.batches.split(",")):
        bench(b)
    host_cost()


if __name__ == "__main__":
    main()
