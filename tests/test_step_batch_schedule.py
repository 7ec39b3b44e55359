"""Megatron-LM's --step-batch-size-schedule (megatron-core's StepBatchsizeNumMicroBatchesCalculator, which replaced
the ramp-up; the megatron-core the tests install predates it, so its parsing, its batch at each consumed count and
Megatron-LM's update_train_iters are re-stated below from Megatron-LM's source): the same thresholds, batches and
iteration count, the GPT-3 175B example's schedule included; a run logs each iteration's batch and consumed samples
as Megatron's loop would, with the learning rate in samples, and resumes where the schedule stands; the flags it
cannot go with are refused in one line."""
from __future__ import annotations

import re

import pytest

from gptrain.config import parse_megatron_args
from gptrain.train.rampup import StepSchedule, train_iters_for_samples
from gptrain.train.run import train_main
from gptrain.train.schedule import LRSchedule
from tiny import TINY_FLAGS

SCHEDULE_175B = "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"  # examples/gpt3/train_gpt3_175b_distributed.sh


def megatron_parse(schedule_str: str, seq_length: int) -> list[tuple[int, int]]:
    """megatron-core's StepBatchsizeNumMicroBatchesCalculator._parse_schedule (with _parse_numeric_value)."""
    def numeric(value_str):
        value_str = value_str.strip().upper()
        multiplier = 1
        for suffix, m in (("T", 1_000_000_000_000), ("B", 1_000_000_000), ("M", 1_000_000), ("K", 1_000)):
            if value_str.endswith(suffix):
                multiplier, value_str = m, value_str[:-1]
                break
        return int(float(value_str) * multiplier)

    schedule = []
    for entry in schedule_str.strip().replace(",", " ").split():
        threshold_str, batch_size_str = entry.split(":", 1)
        schedule.append((numeric(threshold_str) // seq_length, numeric(batch_size_str)))
    schedule.sort(key=lambda x: x[0])
    return schedule


def megatron_batch(schedule, consumed_samples: int) -> int:
    """_get_batch_size_for_samples."""
    batch_size = schedule[0][1]
    for threshold, bs in schedule:
        if consumed_samples >= threshold:
            batch_size = bs
        else:
            break
    return batch_size


def megatron_train_iters(schedule, train_samples: int) -> int:
    """Megatron-LM's update_train_iters with a step schedule."""
    iterations = consumed_samples = 0
    while consumed_samples < train_samples:
        consumed_samples += megatron_batch(schedule, consumed_samples)
        iterations += 1
    return iterations


@pytest.mark.parametrize("text, seq, samples", [(SCHEDULE_175B, 2048, 146_484_375), ("0:4 256:8 640:16", 32, 40),
                                                ("0:8, 1.5K:16 3k:32", 64, 1000), ("0:768 250B:1536 500B:3072", 4096, 10 ** 8)])
def test_thresholds_batches_and_iterations_are_megatrons(text, seq, samples):
    ours, theirs = StepSchedule.parse(text, seq), megatron_parse(text, seq)
    assert list(ours.steps) == theirs
    probes = sorted({0, 1, samples} | {t + d for t, _ in theirs for d in (-1, 0, 1) if t + d >= 0})
    assert [ours.global_batch_at(c) for c in probes] == [megatron_batch(theirs, c) for c in probes]
    assert train_iters_for_samples(samples, 1, ours) == megatron_train_iters(theirs, samples)


RUN = TINY_FLAGS + ("--seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --train-samples 40 "
                    "--step-batch-size-schedule 0:4,256:8,640:16 --lr 3e-3 --min-lr 1e-4 --lr-warmup-samples 4 "
                    "--lr-decay-style cosine --log-interval 1 --seed 7 --mock-data --tokenizer-type NullTokenizer "
                    "--vocab-size 1000 --device cpu --eval-iters 1 --eval-interval 1000").split()
LINE = re.compile(r"^ iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \|.*?\| learning rate: (\S+) \| "
                  r"global batch size: +(\d+) \|")


def _iterations(lines) -> dict[int, tuple]:
    return {int(m.group(1)): (int(m.group(2)), int(m.group(3)), m.group(4), int(m.group(5)))
            for m in map(LINE.match, lines) if m}


def test_a_run_follows_the_schedule_and_resumes_where_it_stands(tmp_path):
    cfg, _ = parse_megatron_args(RUN, world_size=1)
    schedule = megatron_parse("0:4 256:8 640:16", 32)
    expected, consumed, lr = [], 0, LRSchedule.from_config(cfg.optim, cfg.train)
    while consumed < 40:
        batch = megatron_batch(schedule, consumed)
        consumed += batch
        lr.step(batch)
        expected.append((5, consumed, f"{lr.lr():.3E}", batch))
    lines = []
    assert train_main(RUN + ["--save", str(tmp_path / "ck"), "--data-cache-path", str(tmp_path / "c")],
                      log=lines.append).exit_code == 0
    got = _iterations(lines)
    assert [got[i] for i in sorted(got)] == expected  # batches 4, 4, 8, 8, 16
    assert any(line.startswith("using step batch size schedule: >= 0 samples -> global batch 4, >= 8 samples -> "
                               "global batch 8, >= 20 samples -> global batch 16") for line in lines)
    # stopped after iteration 3, resumed: the schedule picks up from the consumed samples
    first = tmp_path / "first"
    assert train_main(RUN + ["--save", str(first), "--exit-interval", "3", "--data-cache-path", str(tmp_path / "c")],
                      log=lambda s: None).exit_code == 0
    resumed = []
    assert train_main(RUN + ["--save", str(first), "--load", str(first), "--data-cache-path", str(tmp_path / "c")],
                      log=resumed.append).exit_code == 0
    again = _iterations(resumed)
    assert sorted(again) == [4, 5] and [again[4], again[5]] == [got[4], got[5]]


@pytest.mark.parametrize("extra, message", [
    (["--global-batch-size", "16"], "--step-batch-size-schedule sets the global batch: leave out --global-batch-size"),
    (["--rampup-batch-size", "4", "4", "16"], "--step-batch-size-schedule replaces --rampup-batch-size"),
    (["--step-batch-size-schedule", "64:4 128:8"], "the first threshold must be 0"),
    (["--step-batch-size-schedule", "0:4 16:8"], "thresholds must increase (in samples of 32 tokens: 0 then 0)"),
    (["--step-batch-size-schedule", "0:4 8x:8"], "'8x' is not a number"),
])
def test_what_it_cannot_go_with_is_refused(extra, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_megatron_args(RUN + extra, world_size=1)


def test_iteration_based_training_with_a_schedule_is_refused():
    flags = list(RUN)
    for name in ("--train-samples", "--lr-warmup-samples"):
        i = flags.index(name)
        del flags[i:i + 2]
    with pytest.raises(ValueError, match="with --train-iters is not built"):
        parse_megatron_args(flags + ["--train-iters", "5"], world_size=1)
