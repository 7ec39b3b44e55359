"""`gptrain evaluate`: strided perplexity and bits per byte against transformers' GPT-2 loss on the
same weights, the indexed dataset and JSONL inputs agreeing, and strict LAMBADA-style cloze accuracy
against transformers' argmax."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

from gptrain.cli import main
from gptrain.tokenizer import GPT2Tokenizer
from serve_util import save_hf_folder, tiny_gpt

transformers = pytest.importorskip("transformers")
TOK = GPT2Tokenizer()
DOCS = ["The quick brown fox jumps over the lazy dog. " * 3, "Perplexity is the exponential of the mean loss.",
        "Bits per byte divide by the bytes of UTF-8 text: naïve café ☕ " * 2, "Short."]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    return save_hf_folder(tiny_gpt(positions=32, std=0.05), root / "tiny")


def hf_reference(folder, tokens: list[int], seq: int, stride: int) -> tuple[float, int]:
    """Summed NLL and count with transformers' own loss: HF's strided-perplexity recipe, each
    window's labels masked (-100) where the previous window scored them."""
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    total, count, prev_end, begin = 0.0, 0, 1, 0
    while prev_end < len(tokens):
        end = min(begin + seq, len(tokens))
        ids = torch.tensor([tokens[begin:end]])
        labels = ids.clone()
        labels[0, : prev_end - begin] = -100
        with torch.no_grad():
            loss = hf(ids, labels=labels).loss.item()
        n = end - prev_end
        total, count = total + loss * n, count + n
        prev_end, begin = end, min(begin + stride, end - 1)
    return total, count


def run(capsys, *argv) -> str:
    assert main(["evaluate", *argv]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("stride", [None, 8])
def test_perplexity_equals_transformers(folder, tmp_path, capsys, stride):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    tokens = [t for d in DOCS for t in TOK.encode(d) + [TOK.eod]]
    out = run(capsys, "--load", str(folder), "--jsonl", str(data), "--seq-length", "32",
              *(["--stride", str(stride)] if stride else []))
    m = re.search(r"(\d+) tokens scored .* loss (\S+) \| PPL (\S+) \| bits per byte (\S+) \((\d+) bytes\)", out)
    assert m, out
    total, count = hf_reference(folder, tokens, 32, stride or 31)
    assert int(m.group(1)) == count == len(tokens) - 1
    assert float(m.group(2)) == pytest.approx(total / count, rel=1e-4)
    assert float(m.group(3)) == pytest.approx(math.exp(total / count), rel=1e-4)
    text_bytes = sum(len(d.encode()) for d in DOCS) - len(TOK.decode(tokens[:1]).encode())
    assert int(m.group(5)) == text_bytes
    assert float(m.group(4)) == pytest.approx(total / math.log(2) / text_bytes, rel=1e-4)
    if stride:  # the indexed dataset of the same documents gives the same numbers
        import numpy as np

        from gptrain.data.indexed import IndexedDatasetWriter, token_dtype

        writer = IndexedDatasetWriter(tmp_path / "docs", token_dtype(TOK.vocab_size))
        for d in DOCS:
            writer.add_document(np.asarray(TOK.encode(d) + [TOK.eod]))
        writer.finalize()
        indexed = run(capsys, "--load", str(folder), "--data-path", str(tmp_path / "docs"),
                      "--seq-length", "32", "--stride", "8")
        assert indexed.split(": ", 1)[1] == out.split(": ", 1)[1]


def test_cloze_accuracy_equals_transformers_argmax(folder, tmp_path, capsys):
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    gen = torch.Generator().manual_seed(0)
    words = ["alpha", "river", "stone", "music", "garden", "yellow", "market", "window"]
    passages = []
    for i in range(40):  # contexts whose greedy next token is a whole word make some passages right
        context = " ".join(words[j] for j in torch.randint(0, len(words), (6,), generator=gen).tolist())
        with torch.no_grad():
            nxt = hf(torch.tensor([TOK.encode(context)])).logits[0, -1].argmax().item()
        piece = TOK.decode([nxt])
        if piece.startswith(" ") and piece[1:].isalpha() and TOK.encode(piece) == [nxt] and i % 2 == 0:
            passages.append(context + piece)
        else:
            passages.append(context + " " + words[i % len(words)])
    data = tmp_path / "cloze.jsonl"
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in passages))
    expected = 0
    for text in passages:
        cut = text.rfind(" ")
        ctx, tgt = TOK.encode(text[:cut]), TOK.encode(text[cut:])
        with torch.no_grad():
            logits = hf(torch.tensor([ctx + tgt])).logits[0]
        expected += logits[len(ctx) - 1:len(ctx) + len(tgt) - 1].argmax(-1).tolist() == tgt
    assert expected > 0
    out = run(capsys, "--load", str(folder), "--cloze", str(data))
    assert f"{expected} / {len(passages)} correct" in out


def test_bad_input_is_one_line(folder, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"nope": 1}\n')
    assert main(["evaluate", "--load", str(folder), "--jsonl", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.jsonl:2" in err
    assert main(["evaluate", "--load", str(folder), "--jsonl", str(bad), "--seq-length", "64"]) == 2
    assert "--seq-length 64" in capsys.readouterr().err
