"""What a newcomer reads at start-up: one summary line per kernel choice and for the index cache
(details behind --verbose), a warning for --fp16 on a CPU, no TFLOP/s or MFU on a CPU."""
from __future__ import annotations

import re

import pytest

from tiny import TINY_FLAGS

from gptrain.data.preprocess import PreprocessConfig, preprocess
from gptrain.train import metrics
from gptrain.train.run import train_main

TINY = TINY_FLAGS + ("--seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --train-iters 2 --log-interval 1 --eval-iters 1 --eval-interval 1000 "
        "--split 80,10,10 --device cpu --attention-dropout 0.1").split()


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    import random

    from tests.conftest import random_text, write_jsonl

    tmp = tmp_path_factory.mktemp("out")
    rng = random.Random(0)
    jsonl = write_jsonl(tmp / "c.jsonl", [random_text(rng, 200) for _ in range(60)])
    preprocess(PreprocessConfig(inputs=[str(jsonl)], output_prefix=str(tmp / "c"), append_eod=True, workers=1,
                                progress=False))
    return str(tmp / "c_text_document")


def _run(prefix, extra):
    lines: list[str] = []
    assert train_main(TINY + ["--data-path", prefix] + extra, log=lines.append).exit_code == 0
    return lines


def test_start_up_lines_are_summaries_and_fp16_on_cpu_warns(prefix):
    lines = _run(prefix, ["--fp16"])
    warnings = [line for line in lines if line.startswith("WARNING: --fp16 on a CPU")]
    assert len(warnings) == 1 and "--bf16" in warnings[0]
    assert not any("-idx mapping from" in line for line in lines)
    cache = [line for line in lines if line.startswith(" > index cache:")]
    assert len(cache) == 1
    assert re.match(r" > index cache: 9 files in \S+index-cache \(--verbose lists them\)$", cache[0])
    assert " > linear layers: torch (--verbose: why)" in lines
    assert " > attention: SDPA, PyTorch's pick (--verbose: why)" in lines
    iteration = [line for line in lines if line.startswith(" iteration ")]
    assert iteration and all("TFLOP/s" not in line and "MFU" not in line for line in iteration)
    assert all(re.search(r"\| tokens per GPU per second: \d+ \| ETA: ", line) for line in iteration)


def test_verbose_keeps_the_details(prefix):
    lines = _run(prefix, ["--verbose"])
    assert not any(line.startswith("WARNING: --fp16") for line in lines)
    assert sum(bool(re.match(r" > loading (doc|sample|shuffle)-idx mapping from \S+\.npy$", line))
               for line in lines) == 9
    assert any(re.match(r" > index cache: 9 files in \S+$", line) for line in lines)
    assert any(line.startswith(" > linear layers: torch (auto: 64 tokens per micro-batch") for line in lines)
    assert " > attention: SDPA, PyTorch's pick (FlashAttention-4 not usable: cpu device (FlashAttention-4 needs " \
           "CUDA))" in lines or any("FlashAttention-4 not usable: " in line for line in lines)


def test_throughput_suffix_by_device():
    gpu = metrics.throughput_suffix(100000.0, 123.4, 989.0, 61.0, "cuda")
    assert gpu == " tokens per GPU per second: 100000 | TFLOP/s per GPU: 123.4 | MFU: 12.5% | ETA: 0:01:01 |"
    assert metrics.throughput_suffix(1000.0, 0.01, None, None, "cpu") == " tokens per GPU per second: 1000 |"


@pytest.mark.slow
def test_torchrun_error_after_the_process_group_is_one_line_from_rank_0(tmp_path):
    """An error found once every rank has joined the process group (a missing dataset): one line,
    from rank 0 only, and a non-zero exit (test_parallel.py covers errors found before it)."""
    import subprocess
    import sys

    from tests.distributed import TINY as PARALLEL_TINY, _env

    flags = [f for f in PARALLEL_TINY if f != "--mock-data"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "gptrain",
           "train", *flags, "--train-iters", "1", "--data-path", str(tmp_path / "missing")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_env())
    assert done.returncode != 0
    assert "using world size: 2" in done.stdout  # the group existed when the error was found
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "gptrain: error:" in line]
    assert len(errors) == 1 and errors[0].startswith("gptrain: error: ") and "missing" in errors[0], errors
