"""Megatron's sample-based training and batch-size ramp-up against megatron-core: the global batch of every
iteration (``RampupBatchsizeNumMicroBatchesCalculator``), the learning rate (``OptimizerParamScheduler``
stepped by each iteration's samples, as Megatron-LM's training loop steps it), the iteration count
(Megatron-LM's ``update_train_iters``), Megatron's flag rules; a tiny CPU run logging those numbers for every
iteration, its resume in the middle of the ramp-up (bit-exact), and DP2 and PP2 on gloo with the losses of one
process."""
from __future__ import annotations

import re
import types

import pytest

from gptrain.config import parse_megatron_args
from gptrain.train.rampup import BatchRampup, train_iters_for_samples
from gptrain.train.run import train_main
from gptrain.train.schedule import LRSchedule
from tiny import TINY_FLAGS

calculators = pytest.importorskip("megatron.core.num_microbatches_calculator")
schedulers = pytest.importorskip("megatron.core.optimizer_param_scheduler")

RAMPUP = "--rampup-batch-size 4 4 96 --global-batch-size 16 --micro-batch-size 2 --train-samples 400 " \
         "--lr-warmup-samples 40 --lr-decay-samples 300".split()
RUN = TINY_FLAGS + RAMPUP + ("--seq-length 32 --max-position-embeddings 32 --lr 3e-3 --min-lr 1e-4 "
                             "--lr-decay-style cosine --weight-decay 0.01 --clip-grad 1.0 --log-interval 1 "
                             "--seed 7 --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --device cpu "
                             "--eval-iters 1 --eval-interval 1000").split()
LINE = re.compile(r"^ iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \|.*?\| learning rate: (\S+) \| "
                  r"global batch size: +(\d+) \| lm loss: (\S+) \|")


def megatron_calculator(start, increment, samples, global_batch, micro_batch=2, dp=1):
    return calculators.RampupBatchsizeNumMicroBatchesCalculator(global_batch, micro_batch, dp, False, 0, start,
                                                                increment, samples)


def megatron_train_iters(calc, train_samples, rampup_samples, global_batch) -> int:
    """Megatron-LM's update_train_iters (training.py), on megatron-core's calculator."""
    iterations = consumed = 0
    while consumed <= rampup_samples:
        calc.update(consumed, consistency_check=False)
        consumed += calc.get_current_global_batch_size()
        iterations += 1
    return iterations + (train_samples - consumed) // global_batch


def megatron_iterations(cfg) -> list[tuple[int, int, float]]:
    """(consumed samples, global batch, learning rate) after each iteration, as Megatron-LM's loop gives them:
    the calculator updated from the consumed samples, then the scheduler stepped by that iteration's batch."""
    t, o = cfg.train, cfg.optim
    calc = megatron_calculator(*t.rampup_batch_size, t.global_batch_size, t.micro_batch_size)
    optimizer = types.SimpleNamespace(param_groups=[{}])
    decay = o.lr_decay_samples or t.train_samples
    scheduler = schedulers.OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.lr_warmup_samples,
        lr_decay_steps=decay, lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=t.train_samples, wd_incr_style="constant")
    out, consumed = [], 0
    for _ in range(megatron_train_iters(calc, t.train_samples, t.rampup_batch_size[2], t.global_batch_size)):
        calc.update(consumed, consistency_check=True)
        batch = calc.get_current_global_batch_size()
        consumed += batch
        scheduler.step(increment=batch)
        out.append((consumed, batch, optimizer.param_groups[0]["lr"]))
    return out


@pytest.mark.parametrize("start,increment,samples,global_batch",
                         [(4, 4, 96, 16), (16, 16, 433870, 1536), (2, 2, 100, 8), (8, 8, 1000, 64), (3, 1, 7, 9)])
def test_global_batch_and_iterations_are_megatron_cores(start, increment, samples, global_batch):
    ours = BatchRampup(start, increment, samples, global_batch)
    calc = megatron_calculator(start, increment, samples, global_batch, micro_batch=1)
    for consumed in [*range(0, min(samples, 5000) + 3 * global_batch), samples, samples + 1, 10 * samples]:
        calc.update(consumed, consistency_check=False)
        assert ours.global_batch_at(consumed) == calc.get_current_global_batch_size(), consumed
    for train_samples in (samples + global_batch, 2 * samples + 7, 10846761):
        assert train_iters_for_samples(train_samples, global_batch, ours) == \
            megatron_train_iters(calc, train_samples, samples, global_batch)


def test_schedule_in_samples_is_megatron_cores_at_every_iteration():
    cfg, _ = parse_megatron_args(RUN, world_size=1)
    expected = megatron_iterations(cfg)
    assert cfg.train.train_iters == len(expected) == 33  # 15 ramp-up iterations (4, 8, 12), then 18 of 16
    schedule, consumed = LRSchedule.from_config(cfg.optim, cfg.train), 0
    for want_consumed, want_batch, want_lr in expected:
        batch = cfg.train.global_batch_at(consumed)
        consumed += batch
        schedule.step(batch)
        assert (consumed, batch, schedule.lr()) == (want_consumed, want_batch, want_lr)
    # --lr-warmup-fraction over samples: a fraction of --lr-decay-samples, as Megatron's
    frac, _ = parse_megatron_args([x for x in RUN if x not in ("--lr-warmup-samples", "40")]
                                  + ["--lr-warmup-fraction", "0.1"], world_size=1)
    assert LRSchedule.from_config(frac.optim, frac.train).warmup_steps == pytest.approx(30.0)
    # without a ramp-up: --train-samples over the global batch, a partial last batch dropped
    plain, _ = parse_megatron_args(TINY_FLAGS + ["--mock-data", "--train-samples", "100", "--global-batch-size", "16"])
    assert plain.train.train_iters == 6 and plain.train.global_batch_at(0) == 16


def test_megatron_rules_on_sample_and_iteration_flags():
    base = TINY_FLAGS + ["--mock-data"]
    cases = [
        (["--train-iters", "10", "--rampup-batch-size", "4", "4", "96", "--global-batch-size", "16"],
         "expected no batch-size rampup for iteration-based training"),
        (["--train-iters", "10", "--lr-decay-samples", "100"], "expected iteration-based learning rate decay"),
        (["--train-iters", "10", "--lr-warmup-samples", "10"], "expected iteration-based learning rate warmup"),
        (["--train-samples", "100", "--lr-decay-iters", "10"], "expected sample-based learning rate decay"),
        (["--train-samples", "100", "--lr-warmup-iters", "10"], "expected sample-based learnig rate warmup"),
        (["--train-samples", "100", "--lr-warmup-samples", "10", "--lr-warmup-fraction", "0.1"],
         "can only specify one of lr-warmup-fraction and lr-warmup-samples"),
        (["--train-samples", "100", "--train-iters", "10"], "expected iteration-based training"),
        (["--train-samples", "100", "--rampup-batch-size", "5", "4", "96", "--global-batch-size", "16"],
         "minus the start batch size (11) is not divisible by the increment 4"),
        (["--train-samples", "100", "--rampup-batch-size", "16", "4", "96", "--global-batch-size", "16"],
         "the start batch size must be below --global-batch-size 16"),
    ]
    for flags, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_megatron_args(base + flags, world_size=1)
    # each global batch of the ramp-up must divide into micro-batches over the data-parallel ranks
    cfg, _ = parse_megatron_args(base + ["--train-samples", "100", "--rampup-batch-size", "2", "2", "96",
                                         "--global-batch-size", "8", "--micro-batch-size", "2"], world_size=1)
    with pytest.raises(ValueError, match="global batch 2 of the ramp-up is not divisible by --micro-batch-size 2 x "
                                         "data-parallel size 2"):
        cfg.train.micro_batches_per_step(2)


def _iterations(lines) -> dict[int, tuple]:
    found = {}
    for line in lines:
        m = LINE.match(line)
        if m:
            found[int(m.group(1))] = (int(m.group(2)), int(m.group(3)), m.group(4), int(m.group(5)), m.group(6))
    return found


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    lines = []
    assert train_main(RUN + ["--data-cache-path", str(tmp_path_factory.mktemp("cache"))],
                      log=lines.append).exit_code == 0
    return lines


def test_run_logs_megatron_cores_batch_consumed_samples_and_lr(straight):
    cfg, _ = parse_megatron_args(RUN, world_size=1)
    got = _iterations(straight)
    expected = megatron_iterations(cfg)
    assert sorted(got) == list(range(1, len(expected) + 1))
    for it, (consumed, batch, lr) in enumerate(expected, start=1):
        assert got[it][:4] == (len(expected), consumed, f"{lr:.3E}", batch), it
    assert any(line.startswith("will use batch size rampup starting from global batch size 4 to global batch "
                               "size 16 with batch size increments 4 over 96 samples.") for line in straight)
    assert any(re.search(r"^ +train: +400$", line, re.M) for line in straight)  # the dataset's target: --train-samples


def test_resume_in_the_ramp_up_is_exact(straight, tmp_path):
    flags = RUN + ["--data-cache-path", str(tmp_path / "cache")]
    first, resumed = [], []
    assert train_main(flags + ["--save", str(tmp_path / "ck"), "--exit-interval", "10"], log=first.append).exit_code == 0
    assert train_main(flags + ["--load", str(tmp_path / "ck"), "--save", str(tmp_path / "ck")],
                      log=resumed.append).exit_code == 0
    whole, a, b = _iterations(straight), _iterations(first), _iterations(resumed)
    assert a[10][1:4] == (48, whole[10][2], 8)  # stopped inside the ramp-up (8 batches of 4, 2 of 8)
    assert sorted(b) == list(range(11, 34))
    assert {**a, **b} == whole  # losses, learning rates, batch sizes, consumed samples: bit for bit
    # Megatron-LM saves a checkpoint before each iteration whose global batch differs from the last one's (4 -> 8
    # after iteration 8, 8 -> 12 after 12, 12 -> 16 after 15), besides --exit-interval's and the final one
    assert sorted(p.name for p in (tmp_path / "ck").glob("iter_*")) == \
        [f"iter_{i:07d}" for i in (8, 10, 12, 15, 33)]


@pytest.fixture(scope="module")
def one_process_ramp_up():
    from distributed import TINY, single

    flags = TINY + ["--lr-warmup-iters", "0", "--train-samples", "200", "--rampup-batch-size", "4", "4", "96",
                    "--global-batch-size", "16", "--lr-warmup-samples", "40", "--lr-decay-samples", "150"]
    return flags, single(flags)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["--pipeline-model-parallel-size", "2"], ["--use-distributed-optimizer"],
                                    ["--zero-stage", "2"], ["--tensor-model-parallel-size", "2"]],
                         ids=["dp2", "pp2", "zero1", "zero2", "tp2"])
def test_parallel_ramp_up_equals_one_process(one_process_ramp_up, layout):
    """DP2: each rank its slice of every ramp-up batch; PP2: the pipeline's micro-batch count changes per step;
    ZeRO-1/2: the gradients reduced after the last of a changing number of micro-batches; TP2."""
    from distributed import losses, torchrun

    flags, one = one_process_ramp_up
    two = torchrun(2, flags + layout)
    ref, got = losses(one), losses(two)
    assert sorted(got) == sorted(ref) == list(range(1, 22))  # 15 ramp-up iterations + (200 - 100) // 16
    for it, loss in ref.items():
        assert got[it] == pytest.approx(loss, rel=1e-5), it
    batches = [re.findall(r"global batch size: +(\d+) \|", out) for out in (one, two)]
    assert batches[0] == batches[1] and batches[0][:9] == ["4"] * 8 + ["8"]
