"""A rank lost mid-run: under ``torchrun --max-restarts 1`` the group restarts, resumes from the newest
checkpoint, says so in one line and goes on with the uninterrupted run's losses; each attempt keeps its
own keys in torchrun's store; a signal reaching a process stuck in a blocked call ends it promptly."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from distributed import TINY, _env, free_port, losses, torchrun
from gptrain.parallel import dims
from gptrain.train import restart_note, straggler

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("kill_after", [9])  # 20 of 20 at random points: RESULTS.md
def test_killed_worker_restarts_and_resumes_with_the_straight_runs_losses(tmp_path, kill_after):
    flags = [f for f in TINY if f not in ("--eval-interval", "1000")] + ["--eval-iters", "0"]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "rank_restart.py"), "--nproc", "2", "--save-interval", "6",
           "--kill-after", str(kill_after), "--train-iters", "12", "--workdir", str(tmp_path), "--", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    line = re.search(r"> restart 1 of this job: resumed from iteration 6, loaded in [0-9.]+ s; "
                     r"iterations lost since the last checkpoint: (\d+) \(last logged: (\d+)\)", out)
    assert line, out[-4000:]
    assert int(line.group(1)) == int(line.group(2)) - 6 and int(line.group(2)) >= kill_after
    assert "same losses both times: True" in out
    resumed = losses(out)  # the last value logged for each iteration: the restarted run's from 7 on
    straight = losses(torchrun(2, flags + ["--train-iters", "12"]))
    assert sorted(resumed) == list(range(1, 13))
    assert resumed == straight


def test_each_restart_attempt_has_its_own_store_keys(monkeypatch):
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert dims._attempt_store(None) is None  # not under torchrun's agent: torch's own rendezvous
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = dims._attempt_store(timedelta(seconds=10))
    first.set("rank_0", "address of a process that is gone")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = dims._attempt_store(timedelta(seconds=10))
    assert second.check(["rank_0"]) is False  # the restarted group does not read the dead rank's address
    second.set("rank_0", "new")
    assert first.get("rank_0") == b"address of a process that is gone"
    del server


def test_resume_line(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert restart_note.resume_line(str(tmp_path), None, None) is None  # a first start says nothing
    restart_note.record(str(tmp_path), 25)
    assert restart_note.last_logged(str(tmp_path)) == 25
    assert not list(tmp_path.glob("*.tmp"))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    line = restart_note.resume_line(str(tmp_path), 20, 3.25)
    assert line == (" > restart 2 of this job: resumed from iteration 20, loaded in 3.2 s; iterations lost since "
                    "the last checkpoint: 5 (last logged: 25)")
    assert "from scratch (no checkpoint)" in restart_note.resume_line(str(tmp_path / "none"), None, None)


_BLOCKED = """
import hashlib, os, signal, sys, threading, time
from gptrain.train import signals
signals.install({exit_handler})
threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
start = time.perf_counter()
hashlib.pbkdf2_hmac("sha256", b"x", b"y", {rounds})  # in C the whole time: no Python handler runs
print("returned", flush=True)
"""


def _blocked(exit_handler: bool, rounds: int) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _BLOCKED.format(exit_handler=exit_handler, rounds=rounds)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return done, time.perf_counter() - start


def test_signal_to_a_process_blocked_in_a_call_ends_it():
    # long enough to outlast the grace many times over (the pbkdf2 rounds take tens of seconds)
    done, seconds = _blocked(False, 40_000_000)
    assert done.returncode == 128 + 15, done.stdout + done.stderr
    assert "SIGTERM while this process was blocked" in done.stderr
    assert "returned" not in done.stdout
    assert seconds < 30


def test_exit_signal_handler_waits_for_the_iteration():
    # with --exit-signal-handler the signal only sets a flag: the blocked call finishes
    done, _ = _blocked(True, 2_000_000)
    assert done.returncode == 0 and "returned" in done.stdout, done.stdout + done.stderr


@pytest.mark.slow
def test_a_stopped_rank_is_named_and_the_run_exits_non_zero(tmp_path):
    """SIGSTOP to rank 1 mid-run: rank 0 names it (rank, host, iteration, what it was doing) within
    --distributed-timeout-minutes and exits non-zero, so the launcher can restart the group."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "gptrain",
           "train", *TINY, "--train-iters", "100000", "--eval-iters", "0", "--distributed-timeout-minutes", "0.5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                            start_new_session=True)
    out, stopped_at, victim, named_after = [], None, None, None
    try:
        for line in proc.stdout:
            out.append(line)
            if victim is None and line.startswith(" iteration        3/"):
                time.sleep(3)  # a heartbeat (every 2.5 s here) after training began
                victim = _worker_of_rank(proc.pid, 1)
                os.kill(victim, signal.SIGSTOP)
                stopped_at = time.monotonic()
            if "stopped progressing" in line:
                named_after = time.monotonic() - stopped_at
                os.kill(victim, signal.SIGKILL)  # torchrun would, 30 s after its SIGTERM
        proc.wait(timeout=120)
    finally:
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(out)
    assert victim is not None, text[-3000:]
    named = [line for line in out if "stopped progressing" in line]
    assert named and re.search(r"gptrain: error: rank 1 on \S+ stopped progressing: no heartbeat for 15 s, last at "
                               r"iteration \d+ \(training step\); rank 0 exits", named[0]), text[-3000:]
    assert proc.returncode != 0
    assert named_after < 30  # within --distributed-timeout-minutes


def _worker_of_rank(agent_pid: int, rank: int) -> int:
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(agent_pid)], capture_output=True,
                              text=True).stdout.split()
    for pid in map(int, children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise LookupError(f"no worker of rank {rank} under {agent_pid}")


@pytest.mark.slow
def test_log_straggler_names_the_slow_rank(monkeypatch):
    """--log-straggler: with rank 1 slowed by 0.2 s a step (GPTRAIN_SLOW_RANK), rank 0's line names it slowest."""
    monkeypatch.setenv(straggler.SLOW_ENV, "1:0.2")
    out = torchrun(2, TINY + ["--train-iters", "2", "--eval-iters", "0", "--log-straggler"])
    lines = [line for line in out.splitlines() if line.startswith(" > straggler:")]
    assert len(lines) == 2, out[-3000:]
    m = re.search(r"over 2 ranks: fastest rank 0 ([0-9.]+) \| median [0-9.]+ \| slowest rank 1 ([0-9.]+) \(", lines[1])
    assert m and float(m.group(2)) - float(m.group(1)) > 100, lines  # 200 ms injected; a loaded CPU narrows the gap
    assert lines[1].endswith(": rank 1 is a straggler"), lines
