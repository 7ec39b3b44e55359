"""DeepSpeed's ZeRO-Offload on the model `run.sh offload` trains, as the reference beside gptrain's rows in
the same call: a GPT-2-shaped model (plain PyTorch: nn.Linear, LayerNorm, SDPA, tied head; gptrain bench's
baseline module) with each block's activations recomputed (torch.utils.checkpoint), bf16, ZeRO-2 (or 3) with
``offload_optimizer: cpu`` (DeepSpeed's own CPU Adam, which it builds on first use), gradient clipping 1.0.
Needs deepspeed installed (`pip install deepspeed`); without it, says so and exits 0.

    torchrun --standalone --nproc-per-node 1 benchmarks/deepspeed_offload.py --num-layers 32 --hidden-size 2560 \
        --num-attention-heads 32 --micro-batch-size 8
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gptrain.bench_models import BaselineGPT  # noqa: E402  (recompute=True: every block recomputed)

VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 128, as gptrain's and Megatron's runs pad it


def ds_config(args) -> dict:
    offload = {"device": "cpu", "pin_memory": True}
    if args.offload_ratio != 1.0:  # ZeRO-Offload++'s share of the optimizer state on the CPU (ZeRO-3 only)
        offload["ratio"] = args.offload_ratio
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.micro_batches,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "zero_optimization": {"stage": args.zero_stage, "offload_optimizer": offload,
                              "contiguous_gradients": True, "overlap_comm": True},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--hidden-size", type=int, default=2560)
    p.add_argument("--num-attention-heads", type=int, default=32)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step")
    p.add_argument("--zero-stage", type=int, default=2, choices=(2, 3))
    p.add_argument("--offload-ratio", type=float, default=1.0,
                   help="the share of the optimizer state on the CPU (ZeRO-3 only, as DeepSpeed takes it)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    if args.offload_ratio != 1.0 and args.zero_stage != 3:
        p.error("--offload-ratio: DeepSpeed offloads part of the optimizer state at ZeRO-3 only")
    try:
        import deepspeed
    except ImportError as err:
        print(f"deepspeed_offload: deepspeed is not installed ({err}); nothing run")
        return 0
    import psutil

    torch.manual_seed(1234)
    with torch.device("cuda"):
        model = BaselineGPT(VOCAB, args.seq_length, args.hidden_size, args.num_attention_heads, args.num_layers,
                            recompute=True)
    n_params = sum(t.numel() for t in model.parameters())
    started = time.monotonic()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(args))
    torch.cuda.reset_peak_memory_stats()  # the fp32 model built on the GPU before the set-up is not the step's
    print(f"deepspeed {deepspeed.__version__}: initialized in {time.monotonic() - started:.1f} s "
          f"(its CPU Adam built or loaded), {n_params / 1e9:.2f} B parameters", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    times = []
    for step in range(args.warmup + args.iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.micro_batches):
            ids = torch.randint(0, 50257, (args.micro_batch_size, args.seq_length + 1), device="cuda", generator=gen)
            loss = engine(ids[:, :-1], ids[:, 1:])
            engine.backward(loss)
            engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        print(f"step {step + 1}: {1e3 * times[-1]:.1f} ms, loss {loss.item():.4f}", flush=True)
    step_s = statistics.median(times[args.warmup:])
    tokens = args.micro_batch_size * args.micro_batches * args.seq_length / step_s
    flops = 6 * n_params + 12 * args.num_layers * args.hidden_size * args.seq_length  # per token, as gptrain counts
    host_gib = psutil.Process(os.getpid()).memory_info().rss / 2 ** 30
    print("| run | micro-batches a step | ms/step | tokens/s | model TFLOP/s | GPU GiB (max allocated in the steps) "
          "| host RSS GiB |")
    ratio = f" ratio {args.offload_ratio:g}" if args.offload_ratio != 1.0 else ""
    print(f"| DeepSpeed {deepspeed.__version__} ZeRO-{args.zero_stage} offload_optimizer cpu{ratio} | {args.micro_batches} | "
          f"{1e3 * step_s:.1f} | {tokens:,.0f} | {tokens * flops / 1e12:.1f} | "
          f"{torch.cuda.max_memory_allocated() / 2 ** 30:.2f} | {host_gib:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
