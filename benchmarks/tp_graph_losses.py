"""Tensor parallelism under CUDA graphs (``--compile-mode reduce-overhead``) against the same run
without them (``--compile-mode default``): ``gptrain train`` under torchrun on the built-in corpus (``gptrain demo``'s,
preprocessed here) with dropout on and evaluations in between, the logged training and validation losses
compared line by line.

    python3 benchmarks/tp_graph_losses.py [--nproc 2] [--sequence-parallel] [-- extra train flags]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

MODEL = ("--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024 "
         "--micro-batch-size 8 --global-batch-size 8 --train-iters 30 --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 5 "
         "--bf16 --compile --log-interval 5 --eval-interval 15 --eval-iters 2 --split 98,1,1").split()
LOSS = re.compile(r"(iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+))|(validation loss at iteration (\d+).*?lm loss value: ([0-9.E+-]+))")


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (from /proc), children first."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_quietly(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        os.kill(pid, sig)


def losses(argv: list[str], log: Path, timeout: float) -> tuple[dict[str, float], float, str]:
    """Runs ``argv`` with its output in ``log`` (read even when it runs past ``timeout`` and is killed)."""
    start = time.perf_counter()
    with log.open("w") as f:
        # PYTHONFAULTHANDLER: a run past its time gets SIGABRT first, so each process prints where it is
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONFAULTHANDLER": "1"})
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            tree = descendants(proc.pid)  # torchrun's workers may sit in sessions of their own
            for pid in tree:
                signal_quietly(pid, signal.SIGABRT)
            time.sleep(5)
            for pid in [proc.pid, *tree]:
                signal_quietly(pid, signal.SIGKILL)
            proc.wait()
            code = f"stopped after {timeout:.0f} s (stacks in {log})"
    seconds = time.perf_counter() - start
    text = log.read_text(errors="replace")
    found = {}
    for m in LOSS.finditer(text):
        if m.group(1):
            found[f"train {m.group(2)}"] = float(m.group(3))
        else:
            found[f"valid {m.group(5)}"] = float(m.group(6))
    tail = "" if code == 0 else f"exit {code}: {text[-2000:]}"
    return found, seconds, tail


def builtin_data(folder: Path) -> str:
    """The built-in corpus preprocessed with GPT-2's tokenizer; returns the --data-path prefix."""
    from gptrain.data.preprocess import PreprocessConfig, preprocess
    from gptrain.demo import write_demo_corpus

    folder.mkdir(parents=True, exist_ok=True)
    write_demo_corpus(folder / "builtin.jsonl")
    preprocess(PreprocessConfig(inputs=[str(folder / "builtin.jsonl")], output_prefix=str(folder / "builtin"),
                                append_eod=True, workers=2, progress=False))
    return str(folder / "builtin_text_document")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--workdir", default="/tmp/gptrain_tp_graph_losses")
    p.add_argument("--logdir", default=None, help="each run's output (default: --workdir)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a run may take before it is killed")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
            "-m", "gptrain", "train", *MODEL, "--data-path", builtin_data(Path(args.workdir)),
            "--tensor-model-parallel-size", str(args.nproc),
            *(["--sequence-parallel"] if args.sequence_parallel else []), *extra]
    logs = Path(args.logdir or args.workdir)
    logs.mkdir(parents=True, exist_ok=True)
    # without graphs first: a hang there is the TP training CLI's, not the graphs'
    plain, t_plain, err_plain = losses(base + ["--compile-mode", "default"], logs / "tp_default.log", args.timeout)
    print(f"--compile-mode default: {len(plain)} logged losses in {t_plain:.0f} s", flush=True)
    graphs, t_graphs, err_graphs = losses(base + ["--compile-mode", "reduce-overhead"], logs / "tp_graphs.log",
                                          args.timeout)
    print(f"with CUDA graphs: {len(graphs)} logged losses in {t_graphs:.0f} s", flush=True)
    what = f"TP{args.nproc}{' + SP' if args.sequence_parallel else ''}"
    for name, err in (("CUDA graphs", err_graphs), ("--compile-mode default", err_plain)):
        if err:
            print(f"{what}, {name}: {err}")
    keys = sorted(set(graphs) & set(plain), key=lambda k: (k.split()[0], int(k.split()[1])))
    if not keys or err_graphs or err_plain:
        print(f"{what}: no losses to compare")
        return 1
    worst = max(abs(graphs[k] - plain[k]) for k in keys)
    for k in keys:
        print(f"{what} {k}: graphs {graphs[k]:.6f}  default {plain[k]:.6f}")
    print(f"{what}: {len(keys)} logged losses, max |difference| {worst:.2e}; wall {t_graphs:.0f} s with graphs, "
          f"{t_plain:.0f} s without (compilation included)")
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
