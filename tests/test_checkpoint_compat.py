"""Checkpoints written by older gptrain code load and resume (issue 28's check for the move from
DTensor to plain-tensor tensor parallelism in 547df1e): fixtures/dtensor_era_checkpoint holds a
one-process and a TP2 checkpoint of iteration 4 that gptrain 2161700 (547df1e's parent, TP on
DTensor) wrote, with its data and tokenizer; today's code resumes them to iteration 8 with the
losses that the old code printed when it resumed them (fp32, CPU, gloo), the TP2 one also at one
process (DCP reshards). Its README says how the fixture was written. About 13 s with the two-process
run, in the fast lane: this is the check that a layout change keeps old checkpoints resumable."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from distributed import losses, torchrun
from gptrain.train.run import train_main

FIXTURE = Path(__file__).parent / "fixtures" / "dtensor_era_checkpoint"
FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-decay-style cosine "
         "--lr-warmup-iters 1 --min-lr 1e-4 --weight-decay 0.01 --clip-grad 1.0 --log-interval 1 --seed 7 "
         "--device cpu --attention-dropout 0 --hidden-dropout 0 --eval-iters 1 --eval-interval 1000 "
         "--train-iters 8").split()
# what 2161700 printed resuming each checkpoint at its own layout (README), and the validation loss at the end
OLD_TP1 = {5: 5.309568, 6: 5.241981, 7: 5.190844, 8: 5.166644}, 5.147482
OLD_TP2 = {5: 5.309568, 6: 5.241981, 7: 5.190843, 8: 5.166644}, 5.147481
OLD_TP2_AT_TP1 = OLD_TP1  # 2161700 resuming the TP2 checkpoint in one process
PRINTED = 3e-6  # the log's 7 digits: the old and new last digit may round apart


@pytest.fixture(scope="module")
def fixture_copy(tmp_path_factory) -> Path:
    """The fixture copied, so that nothing a load does can touch the committed files."""
    root = tmp_path_factory.mktemp("compat") / "fx"
    shutil.copytree(FIXTURE, root)
    return root


def _argv(fx: Path, checkpoint: str, save: Path) -> list[str]:
    return FLAGS + ["--data-path", str(fx / "data_text_document"), "--data-cache-path", str(save.parent / "cache"),
                    "--vocab-file", str(fx / "vocab.json"), "--merge-file", str(fx / "merges.txt"),
                    "--load", str(fx / checkpoint), "--save", str(save)]


def _check(out: str, fx: Path, checkpoint: str, save: Path, expected) -> None:
    old_losses, old_valid = expected
    assert f"successfully loaded checkpoint from {fx / checkpoint} at iteration 4" in out, out[-3000:]
    assert "consumed samples:           40 |" in out  # iteration 5 continues from the saved 32 samples
    resumed = losses(out)
    assert sorted(resumed) == [5, 6, 7, 8], resumed
    for it, loss in old_losses.items():
        assert resumed[it] == pytest.approx(loss, abs=PRINTED), (it, resumed, old_losses)
    valid = float(out.split("validation loss at the end of training for val data | lm loss value: ")[1].split()[0])
    assert valid == pytest.approx(old_valid, abs=PRINTED)
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "8"


@pytest.mark.parametrize("checkpoint,expected", [("tp1", OLD_TP1), ("tp2", OLD_TP2_AT_TP1)],
                         ids=["tp1", "tp2-at-one-process"])
def test_old_checkpoint_resumes_in_one_process(checkpoint, expected, fixture_copy, tmp_path):
    lines: list[str] = []
    save = tmp_path / "resumed"
    assert train_main(_argv(fixture_copy, checkpoint, save), log=lines.append).exit_code == 0
    _check("\n".join(lines), fixture_copy, checkpoint, save, expected)


def test_old_tp2_checkpoint_resumes_at_tp2(fixture_copy, tmp_path):
    save = tmp_path / "resumed"
    out = torchrun(2, _argv(fixture_copy, "tp2", save) + ["--tensor-model-parallel-size", "2"])
    _check(out, fixture_copy, "tp2", save, OLD_TP2)
