"""Checkpoint save/load time of the 345M training state on one GPU (random init): fp32 weights and
AdamW's two moments (what the trainer saves: the fp32 main copies), synchronous and --async-save.

    python3 benchmarks/ckpt_save.py --dir /tmp/ckpt_bench [--repeats 3]

For async saves it prints the time training is blocked (staging into pinned host memory) and the
time until the checkpoint is published (written, fsynced, renamed, tracker replaced). The first
async save also allocates and pins the staging buffers; the later ones reuse them.
"""
from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

from gptrain.model.gpt import GPT, GPTConfig
from gptrain.train.checkpoint import Checkpointer, init_optimizer_state, load_checkpoint


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True, help="a folder on the disk to measure (emptied first)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-layers", type=int, default=24, help="fewer for a smoke test")
    args = p.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    cfg = GPTConfig(num_layers=args.num_layers, hidden_size=1024, num_attention_heads=16, seq_length=1024)
    model = GPT(cfg)
    model.init_weights(1234)
    model.to(args.device)
    params = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(params.values(), fused=args.device.startswith("cuda"))
    init_optimizer_state(params, optimizer)
    for state in optimizer.state.values():  # non-zero moments, like a trained state
        state["exp_avg"].normal_()
        state["exp_avg_sq"].uniform_()
    size = sum(p.numel() * 4 * 3 for p in params.values())
    print(f"GPT state ({args.num_layers} layers; 24 = 345M): {sum(p.numel() for p in params.values()):,} parameters, {size / 1e9:.2f} GB "
          f"(fp32 weights + AdamW moments) on {torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}")
    sync = lambda: torch.cuda.synchronize() if args.device.startswith("cuda") else None  # noqa: E731
    logs: list[str] = []
    for mode in ("sync", "async"):
        saver = Checkpointer(mode == "async", log=logs.append)
        for i in range(1, args.repeats + 1):
            sync()
            start = time.perf_counter()
            saver.save(root, i if mode == "sync" else 100 + i, params, optimizer, {"config": {}}, cfg.vocab_size)
            blocked = time.perf_counter() - start
            saver.finish()
            total = time.perf_counter() - start
            print(f"{mode:5} save {i}: training blocked {blocked:6.2f} s, published after {total:6.2f} s "
                  f"({size / total / 1e9:.2f} GB/s)")
            for older in root.glob("iter_*"):  # keep one checkpoint on the disk (4 GB each)
                if older.name != f"iter_{(i if mode == 'sync' else 100 + i):07d}":
                    shutil.rmtree(older)
        saver.close()
    for i in range(1, args.repeats + 1):
        sync()
        start = time.perf_counter()
        load_checkpoint(root, params, optimizer, cfg.vocab_size, load_rng=False)
        sync()
        took = time.perf_counter() - start
        print(f"load {i}: {took:6.2f} s ({size / took / 1e9:.2f} GB/s)")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
