"""Where one training step's device time goes: torch.profiler over a few real ``Trainer.train_step``
calls after warm-up, kernels grouped into matmul / attention / loss / optimizer / other.

    python benchmarks/profile_step.py --micro-batch-size 16 --bf16 --compile [model flags]
"""
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from gptrain.config import parse_megatron_args
from gptrain.data.gpt_dataset import MockGPTDataset
from gptrain.model.gpt import GPT
from gptrain.train.loop import MicroBatchLoader, Trainer

M345 = ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
        "--max-position-embeddings 1024 --hidden-dropout 0 --attention-dropout 0").split()


def category(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gemm", "cutlass", "sm90_xmma", "nvjet", "matmul", "_mm_", "cublas")):
        return "matmul"
    if any(k in n for k in ("flash", "fmha", "cudnn", "attention", "sdpa")):
        return "attention"
    if any(k in n for k in ("adam", "foreach", "multi_tensor", "norm_kernel", "lpnorm")):
        return "optimizer/grad norm"
    if "embedding" in n or "index" in n or "sort" in n or "scatter" in n:
        return "embedding/index"
    if n.startswith("triton"):
        return "triton (fused elementwise/LN/loss)"
    if "copy" in n or "elementwise" in n or "cast" in n or "fill" in n:
        return "copies/casts/fills"
    return "other"


def main(argv):
    steps = 3
    cfg, _ = parse_megatron_args(M345 + argv + ["--mock-data", "--train-iters", "100"])
    device = torch.device("cuda")
    model = GPT(cfg.model)
    model.init_weights(cfg.data.seed)
    model.to(device)
    data = MockGPTDataset("train", 10 ** 9, cfg.model.seq_length, cfg.model.vocab_size, cfg.data.seed)
    trainer = Trainer(cfg, model, data, None, None, device, log=lambda s: None)
    loader = MicroBatchLoader(data, 0, cfg.train.micro_batch_size, device)
    for _ in range(6):
        trainer.train_step(loader)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            trainer.train_step(loader)
        torch.cuda.synchronize()
    loader.close()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events)
    groups = defaultdict(float)
    for e in events:
        groups[category(e.key)] += e.self_device_time_total
    print(f"device time per step: {total / steps / 1000:.1f} ms ({len(events)} distinct kernels)")
    print("| group | ms/step | share |")
    print("| --- | --- | --- |")
    for g, t in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"| {g} | {t / steps / 1000:.2f} | {100 * t / total:.1f}% |")
    print("\ntop kernels:")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:30]:
        print(f"{e.self_device_time_total / steps / 1000:8.2f} ms/step {e.count // steps:5d}x  "
              f"[{category(e.key)}] {e.key[:110]}")


if __name__ == "__main__":
    main(sys.argv[1:])
