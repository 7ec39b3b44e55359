"""What is live at a training step's memory peak: one real ``Trainer.train_step`` (after warm-up
steps that compile) recorded by the CUDA caching allocator's history, replayed to the moment the
allocated bytes peak, and the blocks live then grouped by where they were allocated (the first
gptrain or compiled-graph frame of each block's stack). Beside it `gptrain plan --evaluate`'s
memory terms for the same flags, so a gap between the planner and a measurement has a name.

    python3 benchmarks/memory_peak.py [--warmup 2] [--top 25] [--no-stacks] <gptrain train flags>

--no-stacks records the allocations without their Python stacks and groups the live blocks by size: the
stacks are what failed under FSDP2's CPU offload (``SystemError: ... returned NULL without setting an
exception`` inside an autograd Function while the recording took a stack), and a block's size alone often
names it (the word embeddings' fp32 gradient is vocabulary x hidden x 4 bytes).
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 1024 ** 3


def site(frames: list[dict]) -> str:
    """Where a block was allocated: its first frames in gptrain or in inductor's generated code
    (a compiled graph's buffers), else the innermost Python frame."""
    picked = []
    for f in frames:
        name = f.get("filename", "")
        if "/gptrain/" in name or "torchinductor" in name or "/benchmarks/" in name:
            short = name.split("/gptrain/")[-1] if "/gptrain/" in name else Path(name).name
            picked.append(f"{short}:{f.get('line')} {f.get('name')}")
            if len(picked) == 2:
                break
    if picked:
        return " < ".join(picked)
    for f in frames:
        if f.get("filename", "").endswith(".py"):
            return f"{Path(f['filename']).name}:{f.get('line')} {f.get('name')}"
    return "(no Python frame)"


def peak_blocks(trace: list[dict], base: int) -> tuple[int, int, dict[int, tuple[int, str]]]:
    """Replay the allocator's events: the peak of allocated bytes (``base`` live before the
    recording), the event index where it happens, and the blocks allocated in the recording that
    are live then (address -> (bytes, site))."""
    live: dict[int, tuple[int, list]] = {}
    total = peak = base
    at, snapshot = -1, {}
    for i, event in enumerate(trace):
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
            total += event["size"]
            if total > peak:
                peak, at, snapshot = total, i, dict(live)
        elif action == "free_requested":
            block = live.pop(event["addr"], None)
            if block is not None:
                total -= block[0]
    return peak, at, {addr: (size, site(frames)) for addr, (size, frames) in snapshot.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--no-stacks", action="store_true", help="no Python stacks; blocks grouped by size")
    args, flags = p.parse_known_args()
    from gptrain.bench import synthetic_trainer

    trainer, loader = synthetic_trainer(flags, args.warmup + 2)
    assert trainer.device.type == "cuda", "needs a GPU (the caching allocator's history)"
    for _ in range(args.warmup):
        trainer.train_step(loader)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if args.no_stacks:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, context=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    trainer.train_step(loader)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    loader.close()
    measured = torch.cuda.max_memory_allocated()
    trace = snap["device_traces"][torch.cuda.current_device()]
    peak, at, blocks = peak_blocks(trace, base)
    print(f"flags: {' '.join(flags)}")
    print(f"live before the step (weights, main copies, gradients, optimizer state, buffers): {base / GIB:.2f} GiB")
    print(f"peak of the step: {measured / GIB:.2f} GiB (torch.cuda.max_memory_allocated); replayed {peak / GIB:.2f} "
          f"GiB at event {at:,} of {len(trace):,}")
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, where in blocks.values():
        where = f"a block of {size:,} bytes ({size / 2 ** 20:.1f} MiB)" if args.no_stacks else where
        groups[where][0] += size
        groups[where][1] += 1
    print("| allocated at (first gptrain / compiled-graph frames) | GiB live at the peak | blocks |")
    print("| --- | --- | --- |")
    for where, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"| {where[:150]} | {size / GIB:.3f} | {count} |")
    print(f"step allocations live at the peak: {sum(s for s, _ in blocks.values()) / GIB:.2f} GiB in {len(blocks)} blocks")
    print(plan_terms(flags))


def plan_terms(flags: list[str]) -> str:
    """The planner's memory terms for the same flags (the first visible GPU's kind)."""
    import subprocess

    name = torch.cuda.get_device_name().lower()
    gpu = "h200" if "h200" in name else "h100"
    out = subprocess.run([sys.executable, "-m", "gptrain", "plan", *flags, "--mock-data", "--train-iters", "1",
                          "--evaluate", "--gpu", gpu, "--world-size", "1"], capture_output=True, text=True)
    return f"gptrain plan --evaluate --gpu {gpu}:\n{out.stdout[-3000:]}{out.stderr[-1000:]}"


if __name__ == "__main__":
    main()
