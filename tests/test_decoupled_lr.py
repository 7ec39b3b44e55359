"""Megatron-LM's --decoupled-lr / --decoupled-min-lr: the word embeddings and the output layer (Megatron's
``is_embedding_or_output_parameter``) get their own peak and final rates on the same warmup and decay, as
megatron-core's OptimizerParamScheduler gives a parameter group with ``max_lr``/``min_lr`` overrides; every other
parameter keeps --lr."""
from __future__ import annotations

import types

import pytest

from distributed import TINY
from gptrain.bench import synthetic_trainer
from gptrain.config import parse_megatron_args
from gptrain.train.schedule import LRSchedule

schedulers = pytest.importorskip("megatron.core.optimizer_param_scheduler")

FLAGS = TINY + ["--lr", "3e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
                "--lr-decay-iters", "10", "--train-iters", "12"]


@pytest.mark.parametrize("style", ["cosine", "linear", "inverse-square-root", "constant"])
@pytest.mark.parametrize("decoupled_min", [None, 5e-4])
def test_each_groups_rate_is_megatron_cores(style, decoupled_min):
    flags = FLAGS + ["--lr-decay-style", style, "--decoupled-lr", "1e-2"]
    if decoupled_min is not None:
        flags += ["--decoupled-min-lr", str(decoupled_min)]
    cfg, _ = parse_megatron_args(flags, world_size=1)
    o, t = cfg.optim, cfg.train
    decoupled = {"max_lr": o.decoupled_lr, **({"min_lr": o.decoupled_min_lr} if decoupled_min is not None else {})}
    optimizer = types.SimpleNamespace(param_groups=[{}, decoupled])
    gbs = t.global_batch_size
    megatron = schedulers.OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.lr_warmup_iters * gbs,
        lr_decay_steps=o.lr_decay_iters * gbs, lr_decay_style=style, start_wd=0.0, end_wd=0.0,
        wd_incr_steps=t.train_iters * gbs, wd_incr_style="constant")
    ours = LRSchedule.from_config(o, t)
    for _ in range(t.train_iters):
        assert ours.lr() == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12, abs=1e-15)
        assert ours.lr(o.decoupled_lr, o.decoupled_min_lr) == pytest.approx(optimizer.param_groups[1]["lr"],
                                                                            rel=1e-12, abs=1e-15)
        megatron.step(gbs)
        ours.step(gbs)
    if style != "constant":  # past the decay: each group at its own final rate
        assert optimizer.param_groups[1]["lr"] == pytest.approx(decoupled_min if decoupled_min else o.min_lr)


@pytest.mark.parametrize("untied", [False, True])
def test_the_trainer_steps_the_embeddings_and_output_layer_at_the_decoupled_rate(untied):
    flags = FLAGS + ["--decoupled-lr", "1e-2", "--decoupled-min-lr", "5e-4"]
    if untied:
        flags += ["--untie-embeddings-and-output-weights"]
    trainer, loader = synthetic_trainer(flags, 4)
    try:
        for _ in range(3):  # past the warmup's first step (rate 0)
            trainer.train_step(loader)
        names = {id(p): n for n, p in trainer.opt_params.items()}
        decoupled = {names[id(p)] for g in trainer.optimizer.param_groups if g["decoupled"] for p in g["params"]}
        assert decoupled == ({"word_embeddings.weight", "output_layer.weight"} if untied else
                             {"word_embeddings.weight"})  # tied: the one tensor both are
        schedule = LRSchedule.from_config(trainer.cfg.optim, trainer.cfg.train)
        schedule.step(2 * trainer.cfg.train.global_batch_size)  # the third update's count
        for group in trainer.optimizer.param_groups:
            want = schedule.lr(1e-2, 5e-4) if group["decoupled"] else schedule.lr()
            assert group["lr"] == pytest.approx(want) and want > 0
        assert schedule.lr(1e-2, 5e-4) > 3 * schedule.lr()
    finally:
        loader.close()


def test_without_the_flag_no_group_is_decoupled():
    trainer, loader = synthetic_trainer(FLAGS, 2)
    try:
        assert not any(g["decoupled"] for g in trainer.optimizer.param_groups)
    finally:
        loader.close()


def test_a_decoupled_final_rate_above_its_peak_is_refused():
    with pytest.raises(ValueError, match="--decoupled-min-lr 0.02 is above --decoupled-lr 0.01"):
        parse_megatron_args(FLAGS + ["--decoupled-lr", "1e-2", "--decoupled-min-lr", "2e-2"], world_size=1)
