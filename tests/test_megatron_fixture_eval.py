"""The real Megatron-LM checkpoints in ../shared/fixtures/megatron-ckpt evaluate, with --skip-train
--softmax-over-padded-vocab, to the validation and test losses their own Megatron log printed
(within 2e-5 relative), on the data their README describes: the built-in corpus (the shipped
gptrain/data/builtin_corpus.jsonl.xz, 1139 documents), preprocessed with --append-eod."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from gptrain.data.builtin import SHIPPED, write_builtin_corpus
from gptrain.data.preprocess import PreprocessConfig, preprocess
from gptrain.train.run import train_main

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "megatron-ckpt"
pytestmark = [
    pytest.mark.skipif(not (FIXTURES / "dev_tp1").is_dir() or not (FIXTURES / "dev_pp2").is_dir(),
                       reason=f"Megatron checkpoint fixtures not found at {FIXTURES} (../shared)"),
    # the fixtures' data is the corpus as Python 3.12 on the H200 machines wrote it (docstrings differ
    # between Python versions); until that file ships, this check cannot run (issue 12 stays open)
    pytest.mark.skipif(not SHIPPED.is_file(), reason=f"{SHIPPED.name} (the fixtures' 1139-document corpus, "
                       "written on the machine kind the fixtures came from) is not shipped yet"),
]
FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
         "--micro-batch-size 4 --global-batch-size 8 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine "
         "--lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 --split 900,80,20 --seed 1234 --eval-iters 4 "
         "--eval-interval 1000 --train-iters 20 --attention-dropout 0 --hidden-dropout 0 --device cpu "
         "--skip-train --softmax-over-padded-vocab").split()


def megatron_losses(name: str) -> tuple[float, float]:
    """(validation, test) from the Megatron run's own log."""
    text = (FIXTURES / f"{name}.log").read_text()
    found = {m.group(1): float(m.group(2)) for m in re.finditer(
        r"validation loss at iteration 20 on (validation|test) set \| lm loss value: (\S+) \|", text)}
    return found["validation"], found["test"]


@pytest.fixture(scope="module")
def builtin_prefix(tmp_path_factory):
    root = tmp_path_factory.mktemp("builtin")
    docs, _ = write_builtin_corpus(root / "b.jsonl")
    assert docs == 1139  # the README's data (its Megatron log: "total number of documents: 1139")
    preprocess(PreprocessConfig(inputs=[str(root / "b.jsonl")], output_prefix=str(root / "builtin"),
                                append_eod=True, progress=False))
    return str(root / "builtin_text_document")


def _gptrain_losses(lines: list[str]) -> tuple[float, float]:
    values = [float(x.split("lm loss value: ")[1].split()[0]) for x in lines if "lm loss value" in x]
    assert len(values) == 2, lines[-10:]
    return values[0], values[1]


@pytest.mark.parametrize("name", ["dev_tp1", "dev_pp2", "dev_dist_tp1"])
def test_fixture_evaluates_to_megatrons_losses_in_one_process(name, builtin_prefix, tmp_path):
    lines: list[str] = []
    result = train_main(FLAGS + ["--data-path", builtin_prefix, "--data-cache-path", str(tmp_path),
                                 "--load", str(FIXTURES / name)], log=lines.append)
    assert result.exit_code == 0, lines[-5:]
    assert len(result.validation_losses) == 1, result
    valid, test = result.validation_losses[-1][1], result.test_loss
    ref_valid, ref_test = megatron_losses(name)
    assert valid == pytest.approx(ref_valid, rel=2e-5) and test == pytest.approx(ref_test, rel=2e-5), \
        (valid, test, ref_valid, ref_test)


@pytest.mark.slow
def test_pp2_fixture_evaluates_to_megatrons_losses_at_pipeline_2(builtin_prefix, tmp_path):
    from distributed import torchrun

    out = torchrun(2, FLAGS + ["--pipeline-model-parallel-size", "2", "--data-path", builtin_prefix,
                               "--data-cache-path", str(tmp_path), "--load", str(FIXTURES / "dev_pp2")])
    valid, test = _gptrain_losses(out.splitlines())
    ref_valid, ref_test = megatron_losses("dev_pp2")
    assert valid == pytest.approx(ref_valid, rel=2e-5) and test == pytest.approx(ref_test, rel=2e-5), \
        (valid, test, ref_valid, ref_test)


def test_fixture_evaluates_with_megatrons_own_tokenizer_flags(builtin_prefix, tmp_path, capsys):
    # the run's own --tokenizer-type NullTokenizer --vocab-size 50256 (token ids, eod 50256, 50257 tokens)
    lines: list[str] = []
    result = train_main(FLAGS + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50256", "--data-path",
                                 builtin_prefix, "--data-cache-path", str(tmp_path),
                                 "--load", str(FIXTURES / "dev_dist_tp1")], log=lines.append)
    assert result.exit_code == 0, lines[-5:]
    assert "> building NullTokenizer tokenizer ..." in lines
    ref_valid, ref_test = megatron_losses("dev_dist_tp1")
    assert result.validation_losses[-1][1] == pytest.approx(ref_valid, rel=2e-5)
    assert result.test_loss == pytest.approx(ref_test, rel=2e-5)
    # NullTokenizer needs --vocab-size; --vocab-size is NullTokenizer's
    for extra, message in ((["--tokenizer-type", "NullTokenizer"], "NullTokenizer needs --vocab-size"),
                           (["--vocab-size", "50256"], "--vocab-size is NullTokenizer's")):
        capsys.readouterr()
        failed = train_main(FLAGS + extra + ["--data-path", builtin_prefix], log=lambda line: None)
        assert failed.exit_code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_torch_dist_fixture_evaluates_to_megatrons_losses_at_tensor_parallel_2(builtin_prefix, tmp_path):
    # Megatron's torch_dist checkpoint saved at TP1, read by two tensor-parallel ranks (the padded
    # vocabulary grows to 50432 rows: Megatron's softmax over them would differ, so gptrain's own loss)
    from distributed import torchrun

    flags = [f for f in FLAGS if f != "--softmax-over-padded-vocab"]
    out = torchrun(2, flags + ["--tensor-model-parallel-size", "2", "--data-path", builtin_prefix,
                               "--data-cache-path", str(tmp_path), "--load", str(FIXTURES / "dev_dist_tp1")])
    valid, test = _gptrain_losses(out.splitlines())
    lines: list[str] = []
    one = train_main([f for f in flags] + ["--data-path", builtin_prefix, "--data-cache-path", str(tmp_path),
                                           "--load", str(FIXTURES / "dev_dist_tp1")], log=lines.append)
    assert one.exit_code == 0, lines[-5:]
    assert valid == pytest.approx(one.validation_losses[-1][1], rel=1e-5)
    assert test == pytest.approx(one.test_loss, rel=1e-5)
