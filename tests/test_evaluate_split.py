"""`gptrain evaluate --data-path` with `--split` / `--split-name`: only the documents training's
--split gives that split are scored (the same numbers as those documents alone), with Megatron's
progress lines on stderr; its flag errors are one line, a typo answered with the closest flag."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from gptrain.cli import main
from gptrain.data.indexed import IndexedDatasetWriter, token_dtype
from gptrain.tokenizer import GPT2Tokenizer
from serve_util import save_hf_folder, tiny_gpt

pytest.importorskip("transformers")
TOK = GPT2Tokenizer()
DOCS = [f"Document number {i} says something about the number {i * 7}." for i in range(10)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalsplit")
    folder = save_hf_folder(tiny_gpt(positions=32, std=0.05), root / "tiny")
    writer = IndexedDatasetWriter(root / "docs", token_dtype(TOK.vocab_size))
    for d in DOCS:
        writer.add_document(np.asarray(TOK.encode(d) + [TOK.eod]))
    writer.finalize()
    return folder, root


def _result(line: str) -> str:
    return line.split(": ", 1)[1]


@pytest.mark.parametrize("name, docs", [("valid", DOCS[6:8]), ("test", DOCS[8:10]), ("train", DOCS[:6])])
def test_split_scores_only_that_splits_documents(data, capsys, name, docs):
    folder, root = data
    jsonl = root / f"{name}.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert main(["evaluate", "--load", str(folder), "--jsonl", str(jsonl), "--seq-length", "32"]) == 0
    alone = capsys.readouterr().out.strip()
    assert main(["evaluate", "--load", str(folder), "--data-path", str(root / "docs"), "--seq-length", "32",
                 "--split", "6,2,2", "--split-name", name]) == 0
    captured = capsys.readouterr()
    out = captured.out.strip()
    assert out.startswith(f"perplexity on {root / 'docs'} ({name} split of --split 6,2,2): ")
    assert _result(out) == _result(alone)
    tokens = sum(len(TOK.encode(d)) + 1 for d in docs)
    assert captured.err.splitlines()[0] == f"Evaluating on {tokens} tokens"
    assert re.fullmatch(r"Evaluating iter (\d+)/\1", captured.err.splitlines()[-1])


def test_split_name_alone_takes_megatrons_default_split(data, capsys):
    folder, root = data
    # 969,30,1 of 10 documents: valid is [10, 10), empty
    assert main(["evaluate", "--load", str(folder), "--data-path", str(root / "docs"), "--split-name", "valid"]) == 2
    err = capsys.readouterr().err
    assert err == "gptrain evaluate: error: --split 969,30,1 leaves no valid documents (of 10)\n"


@pytest.mark.parametrize("argv, message", [
    (["--split-nme", "valid"], "unknown flag --split-nme: did you mean --split-name?"),
    (["--split-name", "dev"], "argument --split-name: invalid choice: 'dev'"),
    (["--seq-length", "x"], "argument --seq-length: invalid int value: 'x'"),
    (["--split", "1,x"], "--split '1,x': expected up to three non-negative numbers"),
])
def test_flag_errors_are_one_line(data, capsys, argv, message):
    folder, root = data
    assert main(["evaluate", "--load", str(folder), "--data-path", str(root / "docs"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"gptrain evaluate: error: {message}"), err


def test_split_needs_data_path(data, capsys):
    folder, root = data
    jsonl = root / "any.jsonl"
    jsonl.write_text(json.dumps({"text": "x y"}) + "\n")
    assert main(["evaluate", "--load", str(folder), "--jsonl", str(jsonl), "--split", "1,1,1"]) == 2
    assert capsys.readouterr().err == ("gptrain evaluate: error: --split and --split-name choose documents of a "
                                       "--data-path dataset\n")
    assert main(["evaluate", "--load", str(folder)]) == 2  # the required source, one line too
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "one of the arguments --data-path --jsonl --cloze is required" in err
