"""A rank lost mid-run and the group restarted: ``torchrun --max-restarts 1`` over ``gptrain train`` with
one folder for ``--save`` and ``--load``; once the checkpoint at ``--save-interval`` is published and a few
more iterations are logged, one worker is killed with SIGKILL. Prints the time from the kill to the
restarted run's load line and to its first iteration line, its load time, and whether the iterations
run twice (after the checkpoint, before the kill; again after the restart) logged the same losses.

    python3 benchmarks/rank_restart.py --nproc 2 [--kill-after 25] -- TRAIN_FLAGS...

Exit status 0 when the run resumed at the checkpoint's iteration and finished.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+)")


def workers(agent_pid: int) -> list[int]:
    """The agent's child processes (torchrun's workers)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(agent_pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--save-interval", type=int, default=20)
    p.add_argument("--kill-after", type=int, default=25, help="kill a worker once this iteration is logged")
    p.add_argument("--train-iters", type=int, default=30)
    p.add_argument("--workdir", default=None)
    p.add_argument("train_flags", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    flags = [f for f in args.train_flags if f != "--"]
    folder = os.path.join(args.workdir or tempfile.mkdtemp(prefix="gptrain_restart_"), "ckpt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", "1",
           "--nproc-per-node", str(args.nproc), "-m", "gptrain", "train", *flags, "--log-interval", "1",
           "--train-iters", str(args.train_iters), "--save", folder, "--load", folder,
           "--save-interval", str(args.save_interval)]
    print("+", " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    losses: dict[int, list[str]] = {}
    killed_at = loaded_at = first_after = None
    load_line = ""
    saved = False

    def kill_one() -> None:
        nonlocal killed_at
        victims = workers(proc.pid)
        if not victims:
            return
        os.kill(victims[-1], signal.SIGKILL)
        killed_at = time.perf_counter()
        print(f"[rank_restart] SIGKILL to worker pid {victims[-1]} at {killed_at - start:.1f} s", flush=True)

    watchdog = threading.Timer(560, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    for line in proc.stdout:
        sys.stdout.write(line)
        if "successfully saved checkpoint" in line or "saved checkpoint" in line:
            saved = True
        if killed_at is not None and loaded_at is None and "loaded checkpoint" in line:
            loaded_at, load_line = time.perf_counter(), line.strip()
        if killed_at is not None and "resumed from" in line:
            load_line += " | " + line.strip()
        m = ITERATION.search(line)
        if not m:
            continue
        it = int(m.group(1))
        losses.setdefault(it, []).append(m.group(2))
        if killed_at is None and saved and it >= args.kill_after:
            kill_one()
        elif loaded_at is not None and first_after is None:
            first_after = time.perf_counter()
            print(f"[rank_restart] first iteration after the restart: {it}", flush=True)
    rc = proc.wait()
    watchdog.cancel()
    twice = {it: v for it, v in losses.items() if len(v) > 1}
    same = all(len(set(v)) == 1 for v in twice.values())
    print("== rank restart")
    print(f"exit status {rc}; worker killed: {killed_at is not None}")
    if killed_at is not None:
        print(f"kill -> load line: {'-' if loaded_at is None else f'{loaded_at - killed_at:.1f} s'}; "
              f"kill -> first iteration line: {'-' if first_after is None else f'{first_after - killed_at:.1f} s'}")
        print(f"load: {load_line}")
    print(f"iterations logged twice: {sorted(twice)}; same losses both times: {same}")
    for it in sorted(twice):
        print(f"  iteration {it}: {' / '.join(twice[it])}")
    resumed = bool(twice) and min(twice) == args.save_interval + 1
    return 0 if rc == 0 and killed_at is not None and first_after is not None and resumed else 1


if __name__ == "__main__":
    sys.exit(main())
