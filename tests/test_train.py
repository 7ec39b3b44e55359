import re

import numpy as np
import pytest
import torch

from conftest import random_text, write_jsonl
from tiny import TINY_FLAGS
from gptrain.config import OptimConfig, TrainConfig, parse_megatron_args
from gptrain.data.preprocess import PreprocessConfig, preprocess
from gptrain.train.checkpoint_files import read_tracker
from gptrain.train.precision import LossScaler
from gptrain.train.run import train_main
from gptrain.train.schedule import LRSchedule

# seeds/000: examples/pretrain_gpt.sh, flags unchanged
SEED_000_FLAGS = """--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
 --max-position-embeddings 1024 --micro-batch-size 1 --global-batch-size 2 --lr 0.00015 --train-iters 5000
 --lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01
 --clip-grad 1.0 --fp16 --data-path PREFIX --vocab-file V --merge-file M --data-impl mmap --split 700,200,100
 --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save CK --load CK""".split()

TINY = TINY_FLAGS + ("--seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --lr-decay-style cosine --lr-warmup-iters 2 "
        "--min-lr 1e-4 --weight-decay 0.01 --clip-grad 1.0 --split 90,8,2 --log-interval 1 --seed 7").split()


def test_seed_script_flags_parse_unchanged():
    cfg, _ = parse_megatron_args(SEED_000_FLAGS)
    assert cfg.model.num_parameters() == 354_871_296 and cfg.model.padded_vocab_size == 50304
    assert cfg.train.micro_batches_per_step(1) == 2 and cfg.train.micro_batches_per_step(2) == 1 and cfg.precision.fp16
    cfg001, _ = parse_megatron_args("--mock-data --train-iters 10 --attention-softmax-in-fp32 --use-flash-attn "
                                    "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1".split())
    assert cfg001.train.train_iters == 10


def test_unimplemented_flags_are_refused_by_name():
    # ramp-up is built, for sample-based training only (Megatron's rule and message)
    with pytest.raises(ValueError, match="--rampup-batch-size needs sample-based training.*'expected no batch-size "
                                         "rampup for iteration-based training'"):
        parse_megatron_args(["--mock-data", "--train-iters", "1", "--rampup-batch-size", "16", "16", "1000"])
    with pytest.raises(ValueError, match="--rotary-interleaved"):
        parse_megatron_args(["--mock-data", "--train-iters", "1", "--rotary-interleaved"])
    with pytest.raises(ValueError, match="unknown flag.*--no-such-flag"):
        parse_megatron_args(["--mock-data", "--train-iters", "1", "--no-such-flag"])
    with pytest.raises(ValueError, match="--data-path"):
        parse_megatron_args(["--train-iters", "1"])


def test_lr_schedule_matches_seed_log():
    cfg, _ = parse_megatron_args(SEED_000_FLAGS)
    s = LRSchedule.from_config(cfg.optim, cfg.train)
    # seeds/004: 84 successful steps of batch 8, warmup 1% of 320000 iterations -> 3.937E-06
    t8 = TrainConfig(global_batch_size=8, micro_batch_size=1, train_iters=5000)
    s8 = LRSchedule.from_config(cfg.optim, t8)
    s8.num_steps = 84 * 8
    assert f"{s8.lr():.3E}" == "3.937E-06"
    s8.num_steps = 1000 * 8 - 0
    assert f"{s8.lr():.3E}" == "4.688E-05"
    assert s.lr() == 0.0
    s.num_steps = 320000 * 2 + 2
    assert s.lr() == pytest.approx(1e-5)
    lin = LRSchedule.from_config(OptimConfig(lr=1.0, min_lr=0.0, lr_decay_style="linear", lr_warmup_iters=10),
                                 TrainConfig(train_iters=110))
    lin.num_steps = 60
    assert lin.lr() == pytest.approx(0.5)
    isr = LRSchedule.from_config(OptimConfig(lr=1.0, lr_decay_style="inverse-square-root", lr_warmup_iters=4),
                                 TrainConfig(train_iters=100))
    isr.num_steps = 16
    assert isr.lr() == pytest.approx(0.5)


def test_loss_scaler_hysteresis_and_growth():
    s = LossScaler(scale=2.0 ** 32, window=3, hysteresis=2, hysteresis_tracker=2)
    s.update(True)
    assert s.scale == 2.0 ** 32  # first overflow only spends hysteresis
    for _ in range(15):
        s.update(True)
    assert s.scale == 2.0 ** 17  # seeds/004: 16 skipped iterations -> loss scale 131072
    for _ in range(3):
        s.update(False)
    assert s.scale == 2.0 ** 18 and s.hysteresis_tracker == 2
    s.update(True)
    assert s.scale == 2.0 ** 18
    floor = LossScaler(scale=2.0, min_scale=1.0, hysteresis=1, hysteresis_tracker=1)
    for _ in range(5):
        floor.update(True)
    assert floor.scale == 1.0


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    import random

    tmp = tmp_path_factory.mktemp("data")
    rng = random.Random(3)
    write_jsonl(tmp / "c.jsonl", [random_text(rng, rng.randint(20, 200)) for _ in range(300)])
    preprocess(PreprocessConfig(inputs=[str(tmp / "c.jsonl")], output_prefix=str(tmp / "c"), append_eod=True,
                                progress=False))
    return str(tmp / "c_text_document")


def run_train(args, lines):
    rc = train_main(args, log=lines.append).exit_code
    return rc


def losses(lines):
    out = {}
    for line in lines:
        m = re.match(r" iteration +(\d+)/ +\d+ \|.* lm loss: (\S+) \|", line)
        if m:
            out[int(m.group(1))] = m.group(2)
    return out


@pytest.mark.slow  # the fast loop (-m "not slow") stays under 3 minutes; CI runs it
@pytest.mark.parametrize("precision", [[], ["--bf16"], ["--fp16", "--initial-loss-scale", "1024"]],
                         ids=["fp32", "bf16-main-params", "fp16-main-params"])
def test_exact_resume_with_dropout(tmp_path, data_prefix, precision):
    base = TINY + precision + ["--data-path", data_prefix, "--data-cache-path", str(tmp_path / "cache"), "--train-iters", "20",
                   "--eval-interval", "5", "--eval-iters", "1", "--device", "cpu"]
    full = []
    assert run_train(base, full) == 0
    first = []
    assert run_train(base + ["--save", str(tmp_path / "ck"), "--exit-interval", "10"], first) == 0
    assert read_tracker(tmp_path / "ck") == 10 and "exiting program at iteration 10" in first
    resumed = []
    assert run_train(base + ["--load", str(tmp_path / "ck")], resumed) == 0
    a, b = losses(full), losses(resumed)
    assert sorted(b) == list(range(11, 21))
    assert all(a[i] == b[i] for i in range(11, 21)), (a, b)
    assert losses(first) == {i: a[i] for i in range(1, 11)}
    val = [line for line in full if "validation loss at iteration 15" in line]
    assert val and val == [line for line in resumed if "validation loss at iteration 15" in line]


def test_thirty_iterations_loss_falls_and_logs(tmp_path, data_prefix):
    lines = []
    result = train_main(TINY + ["--data-path", data_prefix, "--data-cache-path", str(tmp_path / "cache"),
                                "--train-iters", "30", "--eval-interval", "30", "--eval-iters", "2",
                                "--tensorboard-dir", str(tmp_path / "tb"), "--device", "cpu"], log=lines.append)
    assert result.exit_code == 0 and result.iteration == 30 and result.exit_reason is None
    values = dict(result.train_losses)
    assert sorted(values) == list(range(1, 31)) and result.last_train_loss == values[30]
    assert {k: f"{v:.6E}" for k, v in values.items()} == losses(lines)  # the values the log shows
    assert values[1] > 10.0 and np.mean([values[i] for i in range(26, 31)]) < values[1] - 1.0
    # validation at iteration 30 (--eval-interval) and at the end of training, then the test split
    assert [it for it, _ in result.validation_losses] == [30, 30] and result.test_loss is not None
    assert any(line.startswith(" > padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)")
               for line in lines)
    assert any("validation loss at the end of training for test data" in line for line in lines)
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    line = next(line for line in lines if line.startswith(" iteration       30/"))
    assert re.match(r" iteration       30/      30 \| consumed samples:          120 \| elapsed time per iteration "
                    r"\(ms\): [\d.]+ \| learning rate: \S+ \| global batch size:     4 \| lm loss: \S+ \| loss scale:"
                    r" 1\.0 \| grad norm: [\d.]+ \| number of skipped iterations:   0 \| number of nan iterations:"
                    r"   0 \| tokens per GPU per second: \d+ \|", line)


def test_nan_iterations_stop_the_run_with_last_good_state(tmp_path, data_prefix, monkeypatch):
    from gptrain.model.gpt import GPT

    original = GPT.forward
    monkeypatch.setattr(GPT, "forward", lambda self, t: original(self, t) * float("nan")
                        if self.training else original(self, t))
    lines = []
    rc = run_train(TINY + ["--data-path", data_prefix, "--data-cache-path", str(tmp_path / "cache"),
                           "--train-iters", "20", "--max-nan-iterations", "3", "--eval-interval", "100",
                           "--eval-iters", "1", "--save", str(tmp_path / "ck"), "--device", "cpu"], lines)
    assert rc == 1
    values = [line for line in lines if line.startswith(" iteration")]
    assert len(values) == 3 and "number of nan iterations:   1 |" in values[0] and "lm loss" not in values[0]
    from gptrain.config import parse_megatron_args as parse
    from gptrain.model.gpt import GPT as Model
    from gptrain.train.checkpoint import load_checkpoint

    cfg, _ = parse(TINY + ["--mock-data", "--train-iters", "1"])
    fresh, saved = Model(cfg.model), Model(cfg.model)
    fresh.init_weights(7)
    load_checkpoint(tmp_path / "ck", dict(saved.named_parameters()), None, cfg.model.vocab_size)
    assert all(torch.equal(p, fresh.get_parameter(k)) for k, p in saved.named_parameters())  # never updated by NaNs
