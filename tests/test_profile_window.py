"""Megatron-LM's --profile window with --use-pytorch-profiler: torch's profiler records iterations
--profile-step-start to --profile-step-end - 1 (Megatron's schedule) and writes one Chrome trace per rank beside
--tensorboard-dir; the nsys form is refused off a GPU, and a window that ends before it starts in one line."""
from __future__ import annotations

import gzip
import json
import re

import pytest

from distributed import TINY
from gptrain.config import parse_megatron_args
from gptrain.train.run import train_main

RUN = TINY + ["--train-iters", "5"]


def test_torchs_profiler_records_the_window_and_writes_the_trace(tmp_path):
    flags = RUN + ["--profile", "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "4",
                   "--tensorboard-dir", str(tmp_path / "tb")]
    assert train_main(flags, log=lambda s: None).exit_code == 0
    trace = tmp_path / "torch_profile" / "rank-0.json.gz"
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    steps = sorted({int(m.group(1)) for e in events if (m := re.fullmatch(r"ProfilerStep#(\d+)", e.get("name", "")))})
    assert len(steps) == 2, steps  # iterations 2 and 3
    # the optimizer's update ran inside them: a training step, not only the loop's bookkeeping
    assert any("AdamW" in e.get("name", "") or "adamw" in e.get("name", "") for e in events)


def test_other_ranks_than_the_listed_ones_do_not_profile(tmp_path):
    flags = RUN + ["--profile", "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "2",
                   "--profile-ranks", "1", "--tensorboard-dir", str(tmp_path / "tb")]
    assert train_main(flags, log=lambda s: None).exit_code == 0
    assert not (tmp_path / "torch_profile").exists()


def test_nsys_capture_off_a_gpu_and_an_empty_window_are_refused(capsys):
    assert train_main(RUN + ["--profile"], log=print).exit_code == 2
    said = capsys.readouterr()
    assert "--profile starts and stops nsys's capture through CUDA: this run is on cpu" in said.out + said.err
    with pytest.raises(ValueError, match="--profile-step-end 3 must be above --profile-step-start 3"):
        parse_megatron_args(RUN + ["--profile", "--profile-step-start", "3", "--profile-step-end", "3"], world_size=1)
    with pytest.raises(ValueError, match="give --tensorboard-dir"):
        parse_megatron_args(RUN + ["--profile", "--use-pytorch-profiler"], world_size=1)
