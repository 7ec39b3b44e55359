"""``gptrain plan --calibrate``: measure this GPU's table (matmul efficiency by smallest dimension,
attention by head size, memory-bound and optimizer efficiency) in well under two minutes, and write
it where ``hardware.load_gpu`` reads it before the shipped one."""
from __future__ import annotations

import json
import sys
import time

import torch

from gptrain.plan.hardware import GPUS, cache_path
from gptrain.plan.timing import OPTIMIZER_BYTES
from gptrain.train.metrics import PEAK_TFLOPS

HBM_GBPS = {"h100": 3350.0, "h200": 4800.0, "a100": 2039.0, "a800": 2039.0}
MIN_DIMS = (128, 256, 512, 1024, 2048, 8192)


def _seconds(fn, repeats: int = 10) -> float:
    """Device seconds per call of ``fn``, after a warm-up, timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def measure(peak_tflops: float, hbm_gbps: float) -> dict:
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    peak = peak_tflops * 1e12
    matmul = []
    for d in MIN_DIMS:  # (8192 x d) @ (d x 8192): the smallest dimension is d
        a, b = torch.randn(8192, d, **bf16), torch.randn(d, 8192, **bf16)
        matmul.append([d, round(2 * 8192 * d * 8192 / _seconds(lambda: a @ b) / peak, 3)])
    attention = []
    for head_dim in (64, 128):  # forward and backward, against the MFU formula's 12 h s FLOPs per token
        batch, heads, seq = 4, 2048 // head_dim, 2048
        # as the model calls it (model/gpt.py): q, k, v strided views of the packed QKV, and a dense
        # output gradient rather than .sum()'s broadcast one, which SDPA's kernels may not take as is
        qkv = torch.randn(batch, seq, heads, 3, head_dim, requires_grad=True, **bf16)
        grad = torch.randn(batch, heads, seq, head_dim, **bf16)

        def step():
            q, k, v = qkv.permute(3, 0, 2, 1, 4)
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        flops = 12.0 * heads * head_dim * seq * batch * seq
        attention.append([head_dim, round(flops / _seconds(step) / peak, 3)])
    x = torch.empty(256 * 2 ** 20, **bf16)  # 512 MB: read and written by one element-wise pass
    memory_bound = 2 * x.numel() * 2 / _seconds(lambda: x.mul_(1.0)) / (hbm_gbps * 1e9)
    params = [torch.zeros(2 ** 22, device="cuda", requires_grad=True) for _ in range(16)]
    for p in params:
        p.grad = torch.zeros_like(p)
    adam = torch.optim.AdamW(params, fused=True)
    optimizer = OPTIMIZER_BYTES * 16 * 2 ** 22 / _seconds(adam.step) / (hbm_gbps * 1e9)
    return {"source": f"measured by gptrain plan --calibrate on {torch.cuda.get_device_name()} "
                      f"({time.strftime('%Y-%m-%d')})",
            "matmul_efficiency_by_min_dim": matmul, "attention_efficiency_by_head_dim": attention,
            "memory_bound_efficiency": round(memory_bound, 3), "optimizer_efficiency": round(min(1.0, optimizer), 3)}


def calibrate_main() -> int:
    if not torch.cuda.is_available():
        print("gptrain: error: --calibrate measures a CUDA GPU and there is none here; plans use the shipped table",
              file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    gpu = next((g for g in GPUS if g.upper() in name.upper()), None)
    if gpu is None:
        print(f"gptrain: error: --calibrate knows {', '.join(GPUS)}; this GPU is {name}", file=sys.stderr)
        return 2
    table = measure(PEAK_TFLOPS[gpu.upper()], HBM_GBPS[gpu])
    path = cache_path(gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(json.dumps(table, indent=1))
    print(f"wrote {path}: gptrain plan --gpu {gpu} uses it from now on")
    return 0
