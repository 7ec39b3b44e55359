"""NVIDIA Megatron-LM's own training step on the same 345M, as an anchor beside gptrain's rows.

Runs Megatron-LM's ``pretrain_gpt.py`` from a source checkout (``--megatron-lm``) under torchrun with
its local path (``--transformer-impl local``: no TransformerEngine, no apex; attention is Megatron's
unfused ``DotProductAttention``) on ``--mock-data``, and reads the step time Megatron prints itself
("elapsed time per iteration (ms)") and its memory report. Extra arguments go to Megatron, e.g.
``--tensor-model-parallel-size 2 --sequence-parallel``.

    python benchmarks/megatron_lm_throughput.py --megatron-lm ~/Megatron-LM --nproc 2 \
        --micro-batch-size 16 --global-batch-size 16 -- --tensor-model-parallel-size 2
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time

# the seeds' 345M, as train_throughput.py's defaults: seq 1024, bf16, no dropout
MODEL = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
         "--max-position-embeddings", "1024", "--attention-dropout", "0", "--hidden-dropout", "0", "--bf16"]
# the local path: the fusions that need apex or compiled extensions off
LOCAL = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
         "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50256", "--mock-data",
         "--lr", "1.5e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--weight-decay", "0.01",
         "--clip-grad", "1.0", "--init-method-std", "0.02", "--seed", "1234", "--log-interval", "1",
         "--eval-interval", "100000", "--eval-iters", "0", "--num-workers", "1", "--distributed-backend", "nccl",
         "--log-throughput"]

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([\d.]+)")
THROUGHPUT = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+)")
MEMORY = re.compile(r"max allocated: ([\d.]+)")
REFUSAL = re.compile(r"AssertionError: ([^\n]*not supported[^\n]*)")


def read_log(out: str) -> tuple[dict[int, float], list[float], float]:
    """Megatron's printed step times (ms, by iteration), its TFLOP/s per GPU, and the largest "max
    allocated" of its memory reports in GiB (each data-parallel rank 0 prints one; nan without any)."""
    steps = {int(m.group(1)): float(m.group(2)) for m in ITERATION.finditer(out)}
    tflops = [float(x) for x in THROUGHPUT.findall(out)]
    peak = max((float(x) for x in MEMORY.findall(out)), default=float("nan")) / 1024
    return steps, tflops, peak


def run_torchrun(cmd: list[str], cwd: str, env: dict, timeout: float) -> tuple[int, str]:
    """(exit status, output) of ``cmd``; past ``timeout`` seconds torchrun gets SIGTERM, which it passes to
    its workers (they run in sessions of their own, so killing torchrun alone would leave them on the GPUs)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        return 124, out + f"\nmegatron_lm_throughput: stopped after {timeout:.0f} s\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM"),
                   help="a Megatron-LM source checkout (holds pretrain_gpt.py); default $MEGATRON_LM")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--warmup", type=int, default=5, help="iterations left out of the timing")
    p.add_argument("--iters", type=int, default=10, help="timed iterations")
    p.add_argument("--label", default="Megatron-LM local")
    p.add_argument("--timeout", type=int, default=200)
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if not args.megatron_lm or not os.path.isfile(os.path.join(args.megatron_lm, "pretrain_gpt.py")):
        print(f"megatron_lm_throughput: no pretrain_gpt.py under --megatron-lm {args.megatron_lm!r}; nothing run")
        return 0
    total = args.warmup + args.iters
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           "pretrain_gpt.py", *MODEL, *LOCAL, "--micro-batch-size", str(args.micro_batch_size),
           "--global-batch-size", str(args.global_batch_size), "--train-iters", str(total),
           "--lr-warmup-iters", "1", *extra]
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1",
               PYTHONPATH=args.megatron_lm + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print("+ (cd", args.megatron_lm, "&&", " ".join(cmd), ")", flush=True)
    started = time.monotonic()
    returncode, out = run_torchrun(cmd, args.megatron_lm, env, args.timeout)
    steps, tflops, peak = read_log(out)
    refusal = REFUSAL.search(out)
    if returncode != 0 and refusal and not steps:  # Megatron declines the layout itself: a result, not a failure
        print(f"| {args.label} {' '.join(extra)} | {args.nproc} | refused by Megatron-LM: {refusal.group(1)} |")
        return 0
    if returncode != 0 or len(steps) < total:
        print(out[-6000:])
        print(f"megatron_lm_throughput: exit {returncode}, {len(steps)} of {total} iterations logged")
        return 1
    timed = [steps[i] for i in range(args.warmup + 1, total + 1)]
    ms = statistics.median(timed)
    tokens = args.global_batch_size * 1024 / (ms / 1e3) / args.nproc
    tflops = tflops[args.warmup:]
    for line in out.splitlines():  # Megatron's own lines behind the row: its memory report, the last iteration
        if "memory (MB)" in line:
            print(line.strip())
    print([line for line in out.splitlines() if ITERATION.search(line)][-1].strip())
    print(f"Megatron-LM: {len(timed)} timed iterations, ms {min(timed):.1f}-{max(timed):.1f}, "
          f"{time.monotonic() - started:.0f} s wall with its start-up")
    print("| run | GPUs | micro-batch (global) | ms/iter | tokens/s per GPU | TFLOP/s per GPU (Megatron's) "
          "| peak GiB (the largest rank's report) |")
    print(f"| {args.label} {' '.join(extra)} | {args.nproc} | {args.micro_batch_size} ({args.global_batch_size}) "
          f"| {ms:.1f} | {tokens:,.0f} | {statistics.median(tflops) if tflops else float('nan'):.1f} | {peak:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
