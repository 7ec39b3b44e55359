import bz2
import errno
import gzip
import json
import lzma
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import zstandard

from conftest import random_text, write_jsonl
from gptrain.cli import main as cli
from gptrain.data.indexed import IndexedDataset
from gptrain.data.preprocess import PreprocessConfig, PreprocessError, preprocess
from gptrain.data.provenance import check_tokenizer, read_provenance
from megatron_reference import megatron_preprocess


def run(inputs, prefix, **kw):
    kw.setdefault("append_eod", True)
    kw.setdefault("progress", False)
    return preprocess(PreprocessConfig(inputs=[str(i) for i in inputs], output_prefix=str(prefix), **kw))


def pair_bytes(prefix):
    return open(f"{prefix}.bin", "rb").read(), open(f"{prefix}.idx", "rb").read()


def test_bytes_identical_to_megatron_at_any_workers_and_chunk_size(tmp_path, corpus, hf_reference_tokenizer,
                                                                  monkeypatch):
    from gptrain.data import preprocess as module

    monkeypatch.setattr(module, "TASK_MIN_BYTES", 0)  # tasks of exactly --chunk-size lines
    path, texts = corpus
    megatron_preprocess(path, tmp_path / "ref", hf_reference_tokenizer)
    expected = pair_bytes(tmp_path / "ref")
    for workers, chunk in [(1, 1), (2, 7), (3, 64), (2, 1000)]:
        out = tmp_path / f"w{workers}c{chunk}"
        report = run([path], out, workers=workers, chunk_size=chunk)
        assert report.documents == len(texts) and report.skipped == 0
        assert pair_bytes(f"{out}_text_document") == expected, (workers, chunk)


def test_read_back_document_for_document(tmp_path, corpus, tokenizer):
    path, texts = corpus
    run([path], tmp_path / "o")
    ds = IndexedDataset(tmp_path / "o_text_document")
    assert len(ds) == len(texts)
    for i, text in enumerate(texts):
        expected = tokenizer.encode(text) + ([tokenizer.eod] if text else [])
        assert ds[i].tolist() == expected
        if text:
            assert tokenizer.decode(ds[i][:-1].tolist()) == text


@pytest.mark.parametrize("suffix,opener", [
    (".gz", gzip.open), (".xz", lzma.open), (".bz2", bz2.open),
    (".zst", lambda p, m: zstandard.open(p, m)),
])
def test_compressed_inputs_give_same_bytes(tmp_path, corpus, suffix, opener):
    path, _ = corpus
    run([path], tmp_path / "plain")
    packed = tmp_path / f"corpus.jsonl{suffix}"
    with opener(packed, "wb") as f:
        f.write(path.read_bytes())
    run([packed], tmp_path / "packed")
    assert pair_bytes(tmp_path / "plain_text_document") == pair_bytes(tmp_path / "packed_text_document")


def test_several_files_and_globs_concatenate_in_order(tmp_path, tokenizer):
    write_jsonl(tmp_path / "a1.jsonl", ["first file"])
    write_jsonl(tmp_path / "a2.jsonl", ["second file", "more"])
    run([tmp_path / "a*.jsonl"], tmp_path / "g")
    ds = IndexedDataset(tmp_path / "g_text_document")
    assert [tokenizer.decode(ds[i][:-1].tolist()) for i in range(3)] == ["first file", "second file", "more"]
    with pytest.raises(PreprocessError, match="matches no file"):
        run([tmp_path / "zz*.jsonl"], tmp_path / "none")


def test_bad_lines_skipped_counted_and_located(tmp_path, tokenizer):
    lines = [
        b'{"text": "good one"}\n',
        b"\n",
        b'{"text": "unterminated\n',
        b'{"other": "x"}\n',
        b'{"text": 42}\n',
        b'{"text": "bad \xff\xfe utf8"}\n',
        b'["not", "an", "object"]\n',
        b'{"text": "lone \\ud800 surrogate"}\n',
        b'{"text": "good two"}\n',
        b"   \n",
    ]
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b"".join(lines))
    report = run([src], tmp_path / "b")
    assert report.documents == 2
    assert report.bad_counts == {"blank": 2, "malformed_json": 1, "missing_key": 1, "non_string": 1,
                                 "invalid_utf8": 1, "lone_surrogate": 1, "not_an_object": 1}
    assert report.bad_examples["blank"] == [f"{src}:2", f"{src}:10"]
    # the bytes of line 8 are valid UTF-8: its JSON escape is a lone surrogate
    assert report.bad_examples["invalid_utf8"] == [f"{src}:6"]
    assert report.bad_examples["lone_surrogate"] == [f"{src}:8"]
    assert "skipped 8 lines" in report.summary() and f"{src}:3" in report.summary()
    ds = IndexedDataset(tmp_path / "b_text_document")
    assert [tokenizer.decode(ds[i][:-1].tolist()) for i in range(2)] == ["good one", "good two"]
    with pytest.raises(PreprocessError, match=rf"{src}:2: blank"):
        run([src], tmp_path / "strict", strict=True)
    assert not list(tmp_path.glob("strict*"))


def test_existing_output_needs_overwrite(tmp_path, corpus):
    path, _ = corpus
    run([path], tmp_path / "o")
    with pytest.raises(PreprocessError, match="already exists.*--overwrite"):
        run([path], tmp_path / "o")
    run([path], tmp_path / "o", overwrite=True)


def test_full_disk_is_one_clear_error_and_leaves_nothing(tmp_path, corpus, monkeypatch):
    path, _ = corpus
    from gptrain.data import indexed

    def full(self, tokens, lengths):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(indexed.IndexedDatasetWriter, "add_documents", full)
    with pytest.raises(PreprocessError, match="no space left on device"):
        run([path], tmp_path / "o")
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.jsonl"]


def test_interrupted_run_leaves_no_pair(tmp_path, corpus, monkeypatch):
    path, _ = corpus
    from gptrain.data import preprocess as module

    calls = {"n": 0}
    original = module._classify_and_encode

    def interrupted(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(module, "_classify_and_encode", interrupted)
    monkeypatch.setattr(module, "TASK_MIN_BYTES", 0)  # one document per task
    with pytest.raises(KeyboardInterrupt):
        run([path], tmp_path / "o", chunk_size=1, workers=1)
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.jsonl"]


def test_provenance_sidecar_and_tokenizer_check(tmp_path, corpus, tokenizer):
    path, texts = corpus
    run([path], tmp_path / "o")
    record = read_provenance(tmp_path / "o_text_document")
    assert record["tokenizer"]["sha256"] == tokenizer.fingerprint
    assert record["tokenizer"]["eod"] == 50256 and record["counts"]["documents"] == len(texts)
    assert check_tokenizer(tmp_path / "o_text_document", tokenizer) is None
    record["tokenizer"]["sha256"] = "0" * 64
    (tmp_path / "o_text_document.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="another vocabulary"):
        check_tokenizer(tmp_path / "o_text_document", tokenizer)


def test_several_json_keys(tmp_path, tokenizer):
    src = tmp_path / "kv.jsonl"
    src.write_text('{"text": "body one", "title": "T1"}\n{"text": "body two", "title": "T2"}\n')
    run([src], tmp_path / "k", json_keys=["text", "title"])
    assert tokenizer.decode(IndexedDataset(tmp_path / "k_title_document")[1][:-1].tolist()) == "T2"
    assert tokenizer.decode(IndexedDataset(tmp_path / "k_text_document")[0][:-1].tolist()) == "body one"


def test_merge_and_inspect_cli(tmp_path, corpus, capsys):
    path, texts = corpus
    write_jsonl(tmp_path / "b.jsonl", ["tail document"])
    assert cli(["preprocess", "--input", str(path), "--output-prefix", str(tmp_path / "a"), "--append-eod",
                "--workers", "2", "--no-progress"]) == 0
    assert cli(["preprocess", "--input", str(tmp_path / "b.jsonl"), "--output-prefix", str(tmp_path / "b"),
                "--append-eod", "--no-progress"]) == 0
    assert cli(["merge-datasets", "--input", str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document"),
                "--output-prefix", str(tmp_path / "m")]) == 0
    merged, a = IndexedDataset(tmp_path / "m"), IndexedDataset(tmp_path / "a_text_document")
    assert len(merged) == len(texts) + 1
    assert all(np.array_equal(merged[i], a[i]) for i in range(len(a)))
    capsys.readouterr()
    assert cli(["data", "inspect", str(tmp_path / "m"), "--document", str(len(texts))]) == 0
    out = capsys.readouterr().out
    assert f"documents:  {len(texts) + 1}" in out and "tail document<|endoftext|>" in out
    assert cli(["preprocess", "--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(tmp_path / "x")]) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err
    # merging a folder into itself, twice: its own previous output is not an input (it counted: 8 -> 16 -> 24)
    for _ in range(2):
        assert cli(["merge-datasets", "--input", str(tmp_path), "--output-prefix", str(tmp_path / "all"),
                    "--overwrite"]) == 0
        assert len(IndexedDataset(tmp_path / "all")) == 2 * (len(texts) + 1)  # a, b and m
    assert cli(["merge-datasets", "--input", str(tmp_path / "m"), "--output-prefix", str(tmp_path / "m"),
                "--overwrite"]) == 2
    assert "--input " + str(tmp_path / "m") + " is the --output-prefix itself" in capsys.readouterr().err


def _peak_rss_kb(src, prefix):
    # VmHWM, not ru_maxrss: the latter survives exec and would report this test process's peak
    code = ("import sys; from gptrain.cli import main; "
            f"rc = main(['preprocess', '--input', {str(src)!r}, '--output-prefix', {str(prefix)!r}, "
            "'--append-eod', '--workers', '2', '--no-progress']); "
            "print([int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')][0]); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1])


def test_memory_stays_flat_for_ten_times_the_input(tmp_path):
    rng = random.Random(1)
    texts = [random_text(rng, 300) for _ in range(200)]
    small = write_jsonl(tmp_path / "small.jsonl", texts)
    with open(tmp_path / "large.jsonl", "w") as f:
        for _ in range(10):
            f.write(small.read_text())
    rss_small = _peak_rss_kb(small, tmp_path / "s")
    rss_large = _peak_rss_kb(tmp_path / "large.jsonl", tmp_path / "l")
    assert os.path.getsize(tmp_path / "large.jsonl") > 2_000_000
    # a 10x larger input may cost at most a small margin more peak memory
    assert rss_large < rss_small * 1.15 + 16_000, (rss_small, rss_large)
