"""Megatron-LM's --manual-gc: Python's collector is off while training and collects at the start, every
--manual-gc-interval iterations and around each periodic evaluation (generation 0 after it), then is given back;
the run trains the same losses; a negative interval is refused in one line."""
from __future__ import annotations

import gc

import pytest

from distributed import TINY
from gptrain.config import parse_megatron_args
from gptrain.train import manual_gc
from gptrain.train.run import train_main

RUN = TINY + ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1"]  # the last --eval-interval holds


def test_the_collector_runs_only_at_the_loops_points_and_comes_back(monkeypatch):
    calls = []
    real_collect = gc.collect

    def collect(generation: int = 2) -> int:
        calls.append((generation, gc.isenabled()))
        return real_collect(generation)

    monkeypatch.setattr(manual_gc.gc, "collect", collect)
    lines = []
    plain = train_main(RUN, log=lambda s: None)
    assert calls == []  # without the flag the loop never collects
    managed = train_main(RUN + ["--manual-gc", "--manual-gc-interval", "2"], log=lines.append)
    assert managed.exit_code == plain.exit_code == 0
    # the start; at iterations 2 and 4: before and after the evaluation, then the interval's (Megatron's order)
    assert calls == [(2, False)] + [(2, False), (0, False), (2, False)] * 2
    assert gc.isenabled()
    assert managed.train_losses == plain.train_losses and len(plain.train_losses) == 4
    assert any("garbage collection: Python's collector off while training (--manual-gc); collections at the start, "
               "before and after each evaluation, every 2 iterations" in line for line in lines)


def test_no_collections_around_evaluation_with_no_manual_gc_eval(monkeypatch):
    calls = []
    monkeypatch.setattr(manual_gc.gc, "collect", lambda generation=2: calls.append(generation) or 0)
    assert train_main(RUN + ["--manual-gc", "--no-manual-gc-eval"], log=lambda s: None).exit_code == 0
    assert calls == [2]  # the start's only: no interval, no evaluation's


def test_the_collector_comes_back_when_a_step_fails(monkeypatch):
    from gptrain.train.loop import Trainer

    real_step = Trainer.train_step

    def failing_step(self, *args, **kwargs):
        if self.iteration == 1:
            assert not gc.isenabled()
            raise RuntimeError("a step failed")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", failing_step)
    with pytest.raises(RuntimeError, match="a step failed"):
        train_main(RUN + ["--manual-gc"], log=lambda s: None)
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    try:
        schedule = manual_gc.ManualGC(0, True)
        schedule.start()
        schedule.end()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_negative_interval_is_refused():
    with pytest.raises(ValueError, match="--manual-gc-interval -1: give 0"):
        parse_megatron_args(RUN + ["--manual-gc", "--manual-gc-interval", "-1"], world_size=1)
