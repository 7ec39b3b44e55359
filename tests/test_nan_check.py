"""--check-for-nan-in-loss-and-grad: a NaN injected on one rank (GPTRAIN_NAN_AT=RANK@ITERATION) is skipped on
every rank and counted, the rank that produced it names itself in one line, and the stop after
--max-nan-iterations advises what is true for the precision in use."""
import re

import pytest
import torch

from distributed import TINY, torchrun
from gptrain.config import PrecisionConfig, parse_megatron_args
from gptrain.train.nan_check import NAN_ENV, stop_advice
from gptrain.train.run import train_main

ARGS = TINY + ["--micro-batch-size", "2", "--global-batch-size", "4"]


def _run(tmp_path, name, iters, extra=(), nan_at=None, monkeypatch=None):
    if nan_at:
        monkeypatch.setenv(NAN_ENV, nan_at)
    elif monkeypatch is not None:
        monkeypatch.delenv(NAN_ENV, raising=False)
    lines = []
    result = train_main(ARGS + ["--train-iters", str(iters), "--save", str(tmp_path / name), *extra],
                        log=lines.append)
    return result, [line for line in lines if line.startswith(" iteration")]


def _weights(path):
    from gptrain.model.gpt import GPT
    from gptrain.train.checkpoint import load_checkpoint

    cfg, _ = parse_megatron_args(ARGS + ["--train-iters", "1"])
    model = GPT(cfg.model)
    load_checkpoint(path, dict(model.named_parameters()), None, cfg.model.vocab_size)
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def test_nan_at_one_iteration_is_skipped_counted_and_named(tmp_path, monkeypatch, capsys):
    clean, _ = _run(tmp_path, "clean", 2, monkeypatch=monkeypatch)
    result, lines = _run(tmp_path, "nan", 3, nan_at="0@3", monkeypatch=monkeypatch)
    assert clean.exit_code == result.exit_code == 0
    out = capsys.readouterr().out
    assert re.search(r"NaN check: rank 0, host \S+, iteration 3: non-finite loss and grad on this rank", out), out
    assert result.train_losses == clean.train_losses  # the same losses before it, none at iteration 3
    third = lines[2]
    assert "number of nan iterations:   1 |" in third and "lm loss" not in third
    a, b = _weights(tmp_path / "clean"), _weights(tmp_path / "nan")
    assert all(torch.equal(a[k], b[k]) for k in a)  # iteration 3 left the weights as iteration 2 did
    # training goes on with the next iteration
    result, lines = _run(tmp_path, "goes-on", 5, nan_at="0@3", monkeypatch=monkeypatch)
    assert result.exit_code == 0 and result.iteration == 5
    assert all("lm loss" in line and "number of nan iterations:   0 |" in line for line in lines[3:])


def test_flag_on_off_and_clean_losses_unchanged(tmp_path, monkeypatch, capsys):
    on, _ = _run(tmp_path, "on", 3, ["--check-for-nan-in-loss-and-grad"], monkeypatch=monkeypatch)
    off, _ = _run(tmp_path, "off", 3, ["--no-check-for-nan-in-loss-and-grad"], monkeypatch=monkeypatch)
    assert on.train_losses == off.train_losses  # bit for bit
    assert parse_megatron_args(ARGS + ["--train-iters", "1"])[0].train.check_for_nan_in_loss_and_grad  # Megatron-LM's default: on
    capsys.readouterr()
    result, lines = _run(tmp_path, "nan-off", 3, ["--no-check-for-nan-in-loss-and-grad"], nan_at="0@2",
                         monkeypatch=monkeypatch)
    assert "NaN check" not in capsys.readouterr().out  # not named, but skipped and counted all the same
    assert result.exit_code == 0 and "number of nan iterations:   1 |" in lines[1]


@pytest.mark.parametrize("precision,expect", [
    ([], "the run is fp32 already"),
    (["--bf16"], "bf16 has fp32's range"),
    (["--fp16"], "fp16 with dynamic loss scaling"),
])
def test_stop_message_is_true_for_the_precision(tmp_path, monkeypatch, capsys, precision, expect):
    result, _ = _run(tmp_path, "stop", 6, ["--max-nan-iterations", "2", *precision], nan_at="0@1,0@2",
                     monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert result.exit_code == 1 and "2 NaN/inf iterations in a row at iteration 2" in err and expect in err, err
    if precision != ["--fp16"]:
        assert "--bf16" not in err.split("stopping;")[1]  # no advice to switch from a precision not in use


def test_stop_advice_per_precision():
    assert "lower --loss-scale" not in stop_advice(PrecisionConfig(fp16=True), 1024.0)
    assert "scale now 1024" in stop_advice(PrecisionConfig(fp16=True), 1024.0)
    assert "static --loss-scale 128" in stop_advice(PrecisionConfig(fp16=True, loss_scale=128.0), 128.0)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--overlap-grad-reduce"], ["--use-distributed-optimizer"]],
                         ids=["after-backward", "overlapped", "distributed-optimizer"])
def test_nan_on_one_rank_of_two_is_skipped_on_both_and_named(tmp_path, extra):
    """Overlapped, the gradients are reduced during the backward: the buckets note them before."""
    import os

    os.environ[NAN_ENV] = "1@3"
    try:
        out = torchrun(2, TINY + ["--train-iters", "4", *extra])
    finally:
        del os.environ[NAN_ENV]
    # the two ranks write to one stream: rank 1's line may land inside one of rank 0's, so records are
    # found in the whole output, not line by line
    records = {int(m.group(1)): m.group(2) for m in re.finditer(
        r" iteration +(\d+)/ +4 \|(.*?number of nan iterations: +\d+ \|)", out, flags=re.S)}
    assert sorted(records) == [1, 2, 3, 4], out[-3000:]
    assert "number of nan iterations:   1 |" in records[3] and "lm loss:" not in records[3]
    assert "lm loss:" in records[4]
    named = re.findall(r"NaN check: rank (\d+), host \S+, iteration (\d+): non-finite loss and grad", out)
    assert named == [("1", "3")], out[-3000:]
