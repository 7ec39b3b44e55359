"""Launching gptrain on several gloo processes from a test: ``torchrun`` for the command line, and a
spawned pool for runs that patch the model first. A tiny fp32 model without dropout, so a layout
can be compared with one process number for number."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import torch
import torch.multiprocessing as mp

from tiny import TINY_FLAGS

TINY = TINY_FLAGS + ("--seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-decay-style cosine --lr-warmup-iters 1 "
        "--min-lr 1e-4 --weight-decay 0.01 --clip-grad 1.0 --log-interval 1 --seed 7 --mock-data --device cpu "
        "--attention-dropout 0 --hidden-dropout 0 --eval-iters 1 --eval-interval 1000").split()
ITERATION = re.compile(r"^ iteration +(\d+)/ *\d+ \|.*?lm loss: (\S+) \|")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("WORLD_SIZE", None)
    return env


def torchrun(nproc: int, argv: list[str], timeout: int = 300, extra: list[str] | None = None) -> str:
    """``torchrun --standalone --nproc-per-node N -m gptrain train ARGV``; its combined output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           *(extra or []), "-m", "gptrain", "train", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return out


def single(argv: list[str], timeout: int = 300) -> str:
    done = subprocess.run([sys.executable, "-m", "gptrain", "train", *argv], capture_output=True, text=True,
                          timeout=timeout, env=_env())
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return out


def losses(output: str) -> dict[int, float]:
    found = {}
    for line in output.splitlines():
        m = ITERATION.match(line)
        if m:
            found[int(m.group(1))] = float(m.group(2))
    return found


def _spawned(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    fn(rank, *args)


def spawn(world: int, fn, *args) -> None:
    """Run ``fn(rank, *args)`` in ``world`` fresh processes that torchrun's variables describe."""
    mp.start_processes(_spawned, args=(world, free_port(), fn, args), nprocs=world, join=True,
                       start_method="spawn")
