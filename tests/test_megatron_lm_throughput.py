"""benchmarks/megatron_lm_throughput.py reads the step times and memory Megatron-LM prints (lines of its own
log, written by pretrain_gpt.py at commit d98e8a6 for ../shared's checkpoint fixtures, kept in tests/fixtures),
and runs a checkout's pretrain_gpt.py under torchrun with the 345M's flags."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench_script import load

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "megatron_lm_throughput.py"
MEGATRON_LOG = ROOT / "tests" / "fixtures" / "megatron_lm_iterations.log"


def _module():
    return load("megatron_lm_throughput")


def test_megatron_log_read():
    steps, tflops, peak = _module().read_log(MEGATRON_LOG.read_text())
    assert sorted(steps) == list(range(1, 21))
    assert steps[1] == 2302.7 and steps[2] == 1182.7
    assert tflops == []  # that run had no --log-throughput
    mib = [float(line.split("max allocated: ")[1].split(" |")[0])
           for line in MEGATRON_LOG.read_text().splitlines() if "memory (MB)" in line]
    assert mib and peak == max(mib) / 1024


def test_a_checkout_run_under_torchrun(tmp_path):
    """A stand-in pretrain_gpt.py that checks the flags it is given and prints Megatron's own lines."""
    lines = [line for line in MEGATRON_LOG.read_text().splitlines()
             if "elapsed time per iteration" in line or "memory (MB)" in line]
    (tmp_path / "log.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "pretrain_gpt.py").write_text(
        "import os, sys\n"
        "a = sys.argv[1:]\n"
        "assert a[a.index('--transformer-impl') + 1] == 'local' and '--mock-data' in a, a\n"
        "assert a[a.index('--hidden-size') + 1] == '1024' and a[a.index('--train-iters') + 1] == '15', a\n"
        "assert a[-2:] == ['--tensor-model-parallel-size', '1'], a\n"
        "assert os.environ['CUDA_DEVICE_MAX_CONNECTIONS'] == '1'\n"
        "print(open('log.txt').read())\n")
    out = subprocess.run([sys.executable, str(SCRIPT), "--megatron-lm", str(tmp_path), "--micro-batch-size", "4",
                          "--global-batch-size", "8", "--", "--tensor-model-parallel-size", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    row = [line for line in out.stdout.splitlines() if line.startswith("| Megatron-LM local")][0].split("|")
    # the median of iterations 6-15 (5 warm-up, 10 timed), read here from the log's text
    timed = sorted(float(line.split("elapsed time per iteration (ms): ")[1].split(" ")[0])
                   for line in lines if "elapsed" in line and int(line.split("iteration")[1].split("/")[0]) in
                   range(6, 16))
    assert len(timed) == 10
    median = (timed[4] + timed[5]) / 2
    # the row's columns: label, GPUs, micro-batch (global), ms, tokens/s per GPU (seq 1024), TFLOP/s, GiB
    assert row[4].strip() == f"{median:.1f}" and row[5].strip() == f"{8 * 1024 / (median / 1e3):,.0f}"


def _stand_in(folder: Path, body: str) -> list[str]:
    (folder / "pretrain_gpt.py").write_text(body)
    return [sys.executable, str(SCRIPT), "--megatron-lm", str(folder)]


def test_a_layout_megatron_refuses_is_said(tmp_path):
    cmd = _stand_in(tmp_path, "raise AssertionError('sequence parallel not supported by torch LayerNorm when "
                              "instantiating TransformerLayer')\n")
    out = subprocess.run(cmd + ["--", "--sequence-parallel"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "refused by Megatron-LM: sequence parallel not supported by torch LayerNorm" in out.stdout


def test_a_run_past_its_time_is_stopped_with_its_workers(tmp_path):
    cmd = _stand_in(tmp_path, "import os, time\nopen('pid', 'w').write(str(os.getpid()))\ntime.sleep(300)\n")
    out = subprocess.run(cmd + ["--timeout", "5"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "stopped after 5 s" in out.stdout, out.stdout + out.stderr
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_no_checkout_runs_nothing():
    out = subprocess.run([sys.executable, str(SCRIPT), "--megatron-lm", "/nonexistent"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "nothing run" in out.stdout
