"""Issue 17's data-pipeline defects, one test (or more) each: bad input, kills, full disks and huge
corpora never lose data, never leave stale or half-written output, and fail in one clear line."""
import bz2
import errno
import gzip
import json
import lzma
import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc

import numpy as np
import pytest
import zstandard

from conftest import write_jsonl
from gptrain.cli import main as cli
from gptrain.data.gpt_dataset import GPTDataset
from gptrain.data.indexed import IndexedDataset, IndexedDatasetWriter
from gptrain.data.preprocess import PreprocessConfig, PreprocessError, preprocess
from gptrain.data.provenance import StaleProvenance, check_tokenizer, read_provenance
from test_tokenizer import _tiny_bpe


def run(inputs, prefix, **kw):
    kw.setdefault("append_eod", True)
    kw.setdefault("progress", False)
    return preprocess(PreprocessConfig(inputs=[str(i) for i in inputs], output_prefix=str(prefix), **kw))


def names(folder):
    return sorted(p.name for p in folder.iterdir())


# 1 --------------------------------------------------------------------------------------------
def test_huge_integer_in_a_line_is_parsed_not_fatal(tmp_path, tokenizer):
    big = "9" * 5000  # beyond Python's 4300-digit int() limit
    src = tmp_path / "big.jsonl"
    src.write_text(f'{{"text": "first", "n": {big}}}\n{{"text": {big}}}\n{{"text": "last"}}\n')
    report = run([src], tmp_path / "o")
    assert report.documents == 2 and report.bad_counts == {"non_string": 1}
    assert report.bad_examples["non_string"] == [f"{src}:2"]
    ds = IndexedDataset(tmp_path / "o_text_document")
    assert [tokenizer.decode(ds[i][:-1].tolist()) for i in range(2)] == ["first", "last"]


# 2 --------------------------------------------------------------------------------------------
def _packed(tmp_path, payload, suffix):
    opener = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open, ".zst": zstandard.open}[suffix]
    path = tmp_path / f"in.jsonl{suffix}"
    with opener(path, "wb") as f:
        f.write(payload)
    return path


@pytest.mark.parametrize("suffix", [".zst", ".gz", ".xz", ".bz2"])
def test_truncated_compressed_input_is_one_line_naming_it(tmp_path, suffix):
    payload = b"".join(json.dumps({"text": f"document {i} " * 20}).encode() + b"\n" for i in range(3000))
    path = _packed(tmp_path, payload, suffix)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(PreprocessError) as err:
        run([path], tmp_path / "o")
    message = str(err.value)
    assert str(path) in message and "truncated" in message and "\n" not in message
    assert names(tmp_path) == [path.name]  # nothing written


@pytest.mark.parametrize("suffix", [".zst", ".gz"])
def test_corrupt_compressed_input_is_one_line_naming_it(tmp_path, suffix):
    payload = b"".join(json.dumps({"text": f"document {i}"}).encode() + b"\n" for i in range(2000))
    path = _packed(tmp_path, payload, suffix)
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    with pytest.raises(PreprocessError) as err:
        run([path], tmp_path / "o")
    message = str(err.value)
    assert str(path) in message and "corrupt" in message and str(tmp_path / "o") not in message
    assert names(tmp_path) == [path.name]


def test_multi_frame_zst_is_read_whole(tmp_path, tokenizer):
    frames = [zstandard.ZstdCompressor().compress(f'{{"text": "frame {i}"}}\n'.encode()) for i in range(3)]
    (tmp_path / "f.jsonl.zst").write_bytes(b"".join(frames))
    assert run([tmp_path / "f.jsonl.zst"], tmp_path / "o").documents == 3


# 3 --------------------------------------------------------------------------------------------
def test_byte_order_mark_keeps_the_first_document(tmp_path, tokenizer):
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + b'{"text": "first"}\n{"text": "second"}\n')
    report = run([src], tmp_path / "o")
    assert report.documents == 2 and report.skipped == 0
    assert tokenizer.decode(IndexedDataset(tmp_path / "o_text_document")[0][:-1].tolist()) == "first"


# 4 --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("factor", [0.5, 3])
def test_index_cache_follows_the_data_not_the_path(tmp_path, tokenizer, factor):
    texts = [f"document number {i} " * (1 + i % 7) for i in range(200)]
    write_jsonl(tmp_path / "a.jsonl", texts)
    write_jsonl(tmp_path / "b.jsonl", [t + " more words here" for t in texts][: int(200 * factor)] * max(1, int(factor)))
    run([tmp_path / "a.jsonl"], tmp_path / "d")
    prefix = tmp_path / "d_text_document"
    args = dict(num_samples=40, seq_length=16, seed=3, split="100,0,0", cache_dir=tmp_path / "cache", log=lambda _: None)
    first = GPTDataset("train", IndexedDataset(prefix), np.arange(0, 200, dtype=np.int32), **args)
    assert len(first) >= 40
    run([tmp_path / "b.jsonl"], tmp_path / "d", overwrite=True)  # same prefix, other data
    ds = IndexedDataset(prefix)
    again = GPTDataset("train", ds, np.arange(0, ds.num_documents, dtype=np.int32), **args)
    fresh = GPTDataset("train", ds, np.arange(0, ds.num_documents, dtype=np.int32),
                       **{**args, "cache_dir": tmp_path / "fresh"})
    assert len(again) == len(fresh)
    assert all(np.array_equal(again[i], fresh[i]) for i in range(len(fresh)))


# 5 --------------------------------------------------------------------------------------------
SLOW_RUN = textwrap.dedent("""
    import sys, time
    from gptrain.data import preprocess as module
    from gptrain.cli import main
    original = module._classify_and_encode
    def slow(*args):
        open(sys.argv[2], "a").close()  # tell the test we are inside
        time.sleep(0.3)
        return original(*args)
    module._classify_and_encode = slow
    module.TASK_MIN_BYTES = 0
    sys.exit(main(["preprocess", "--input", sys.argv[1], "--output-prefix", sys.argv[3], "--chunk-size", "1",
                   "--workers", "1", "--no-progress"]))
""")


def _start_slow_run(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [f"document {i}" for i in range(200)])
    marker = tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_RUN, str(src), str(marker), str(tmp_path / "o")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not marker.exists():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.5)
    return proc, marker


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_cleans_up_and_ends_with_one_line(tmp_path, sig):
    proc, marker = _start_slow_run(tmp_path)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig
    assert err.strip().count("\n") == 0 and "interrupted by" in err and "Traceback" not in err
    marker.unlink()
    assert names(tmp_path) == ["in.jsonl"]


def test_ctrl_c_during_start_up_is_one_line(tmp_path, capsys, monkeypatch):
    """Before preprocess installs its own handler (loading the tokenizer), Ctrl-C printed a traceback."""
    from gptrain import tokenizer as module  # build_tokenizer loads it before preprocess starts

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    src = write_jsonl(tmp_path / "in.jsonl", ["document"])
    monkeypatch.setattr(module, "GPT2Tokenizer", interrupted)
    assert cli(["preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "o"), "--no-progress"]) == 130
    assert capsys.readouterr().err == "gptrain: preprocess: interrupted by SIGINT during start-up; nothing was written\n"
    assert names(tmp_path) == ["in.jsonl"]


def test_killed_run_temp_files_are_removed_by_the_next_run(tmp_path):
    proc, marker = _start_slow_run(tmp_path)
    proc.kill()
    proc.communicate(timeout=60)
    marker.unlink()
    assert any(".tmp-" in n for n in names(tmp_path))  # SIGKILL cannot be caught
    run([tmp_path / "in.jsonl"], tmp_path / "o")
    assert names(tmp_path) == ["in.jsonl", "o_text_document.bin", "o_text_document.idx", "o_text_document.json"]


# 6 --------------------------------------------------------------------------------------------
def test_crash_before_the_sidecar_leaves_a_sidecar_that_reads_stale(tmp_path, tokenizer, monkeypatch):
    write_jsonl(tmp_path / "a.jsonl", ["old data"] * 5)
    write_jsonl(tmp_path / "b.jsonl", ["new data, other tokens"] * 9)
    run([tmp_path / "a.jsonl"], tmp_path / "o")
    prefix = tmp_path / "o_text_document"
    assert check_tokenizer(prefix, tokenizer) is None
    from gptrain.data import indexed

    real_replace = os.replace

    def crash_at_sidecar(src, dst):
        if str(dst).endswith(".json"):
            raise KeyboardInterrupt  # killed between publishing the pair and the sidecar
        return real_replace(src, dst)

    monkeypatch.setattr(indexed.os, "replace", crash_at_sidecar)
    with pytest.raises(KeyboardInterrupt):
        run([tmp_path / "b.jsonl"], tmp_path / "o", overwrite=True)
    monkeypatch.undo()
    assert IndexedDataset(prefix).num_documents == 9  # the new pair, with the old sidecar
    with pytest.raises(StaleProvenance, match="stale"):
        check_tokenizer(prefix, tokenizer)
    assert read_provenance(prefix, verify=False)["counts"]["documents"] == 5


def test_no_room_for_the_sidecar_is_one_error_and_no_pair(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "a.jsonl", ["some data"] * 5)
    from gptrain.data import indexed

    real_dumps = json.dumps

    def full(obj, **kw):
        if isinstance(obj, dict) and "index" in obj:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_dumps(obj, **kw)

    monkeypatch.setattr(indexed.json, "dumps", full)
    with pytest.raises(PreprocessError, match="no space left on device"):
        run([src], tmp_path / "o")
    assert names(tmp_path) == ["a.jsonl"]


def test_version_one_sidecar_checked_by_its_counts(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "a.jsonl", ["some data"] * 5)
    run([src], tmp_path / "o")
    prefix = tmp_path / "o_text_document"
    record = read_provenance(prefix)
    del record["index"]
    (tmp_path / "o_text_document.json").write_text(json.dumps(record))
    assert check_tokenizer(prefix, tokenizer) is None
    record["counts"]["documents"] = 4
    (tmp_path / "o_text_document.json").write_text(json.dumps(record))
    with pytest.raises(StaleProvenance):
        check_tokenizer(prefix, tokenizer)


# 7 --------------------------------------------------------------------------------------------
def test_writer_memory_does_not_grow_with_documents(tmp_path):
    writer = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    tokens, lengths = np.ones(100_000, np.uint16), np.ones(100_000, np.int64)
    tracemalloc.start()
    try:
        writer.add_documents(tokens, lengths)
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(30):  # 3 M documents
            writer.add_documents(tokens, lengths)
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert grown < 1_000_000, grown
    writer.finalize()
    ds = IndexedDataset(tmp_path / "d")
    assert ds.num_documents == 3_100_000 and ds.num_tokens == 3_100_000
    assert int(ds.pointers[-1]) == 2 * (3_100_000 - 1) and int(ds.doc_idx[-1]) == 3_100_000


def test_overlong_line_is_skipped_and_located(tmp_path, tokenizer):
    src = tmp_path / "long.jsonl"
    src.write_text('{"text": "short"}\n' + json.dumps({"text": "x" * 50_000}) + '\n{"text": "after"}\n')
    report = run([src], tmp_path / "o", max_line_bytes=10_000)
    assert report.documents == 2 and report.bad_examples == {"too_long": [f"{src}:2"]}
    ds = IndexedDataset(tmp_path / "o_text_document")
    assert tokenizer.decode(ds[1][:-1].tolist()) == "after"


def test_document_beyond_int32_tokens_is_refused(tmp_path):
    writer = IndexedDatasetWriter(tmp_path / "d", np.int32)
    with pytest.raises(ValueError, match="int32"):
        writer.add_documents(np.zeros(0, np.int32), np.array([2**31], np.int64))
    writer.abort()


# 8 --------------------------------------------------------------------------------------------
def test_token_dtype_follows_the_largest_id(tmp_path):
    vocab, merge = _tiny_bpe(tmp_path, "t", [("h", "e")])
    encoder = json.loads(vocab.read_text())
    encoder["<|endoftext|>"] = 70000
    vocab.write_text(json.dumps(encoder))
    src = write_jsonl(tmp_path / "a.jsonl", ["he he"])
    run([src], tmp_path / "o", vocab_file=str(vocab), merge_file=str(merge))
    ds = IndexedDataset(tmp_path / "o_text_document")
    assert ds.dtype == np.int32 and int(ds[0][-1]) == 70000


# 10 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content,expected", [(b"", "the input is empty"),
                                               (b'{"body": "a"}\n{"body": "b"}\n', "missing_key: 2")])
def test_no_documents_is_an_error_with_the_counts(tmp_path, capsys, content, expected):
    src = tmp_path / "in.jsonl"
    src.write_bytes(content)
    assert cli(["preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no documents" in err and expected in err
    assert names(tmp_path) == ["in.jsonl"]


# 11 -------------------------------------------------------------------------------------------
def test_forgotten_document_suffix_points_at_the_dataset(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", ["x"])
    run([src], tmp_path / "my-gpt2")
    with pytest.raises(FileNotFoundError, match=r"did you mean .*my-gpt2_text_document\?"):
        IndexedDataset(tmp_path / "my-gpt2")


# issue 33 -------------------------------------------------------------------------------------
def _tokens_dataset(prefix, docs, dtype=np.uint16):
    writer = IndexedDatasetWriter(prefix, dtype)
    for doc in docs:
        writer.add_document(np.asarray(doc))
    writer.finalize()
    return IndexedDataset(prefix)


@pytest.mark.parametrize("bad_id", [50300, 60000], ids=["in-the-padding", "past-the-padding"])
def test_token_ids_outside_the_vocabulary_stop_training_before_it_starts(tmp_path, capsys, monkeypatch, bad_id):
    """Ids past the padded vocabulary ended in an IndexError, ids inside the padding in NaN losses."""
    from gptrain.data import token_check
    from gptrain.train.run import train_main
    from tiny import TINY_FLAGS

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50257, 40) for _ in range(12)]
    docs[7][5] = bad_id
    prefix = tmp_path / "d"
    _tokens_dataset(prefix, docs)
    argv = TINY_FLAGS + ["--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
                         "--train-iters", "2", "--device", "cpu", "--data-path", str(prefix), "--split", "100,0,0",
                         "--eval-iters", "0", "--data-cache-path", str(tmp_path / "cache")]
    for _ in range(2):  # the second time from the cached largest id
        assert train_main(argv, log=lambda _: None).exit_code == 2
        assert capsys.readouterr().err.strip() == (
            f"gptrain: error: {prefix}.bin: token id {bad_id} (document 7) is outside the tokenizer's vocabulary of "
            "50257 ids: the data was made with another tokenizer, or is damaged; preprocess it again with this "
            "run's --vocab-file/--merge-file")
        monkeypatch.setattr(token_check, "_scan", lambda *a: pytest.fail("the largest id was not cached"))
    assert len(list((tmp_path / "cache").glob("*_max_token_id.txt"))) == 1


def _idx_damaged(prefix, how):
    idx = prefix.with_suffix(".idx")
    data = bytearray(idx.read_bytes())
    if how == "header-only":
        data = data[:34]
    elif how == "short":
        data = data[:12]
    elif how == "truncated":
        data = data[:-20]
    elif how == "shifted-pointer":  # sequence 3's offset moved by one token: Megatron's data has no sidecar
        at = 34 + 4 * 6 + 8 * 3
        data[at: at + 8] = (int.from_bytes(data[at: at + 8], "little") + 2).to_bytes(8, "little")
    idx.write_bytes(bytes(data))
    return idx


@pytest.mark.parametrize("how, says", [
    ("header-only", "is truncated or damaged: 34 bytes, its header describes 6 sequences and 6 documents"),
    ("short", "is truncated: 12 bytes, shorter than the 34-byte header"),
    ("truncated", "is truncated or damaged"),
    ("shifted-pointer", "is damaged: sequence 3 starts at byte 62 of the .bin, the lengths before it end at 60"),
])
def test_a_damaged_index_is_one_error_naming_it(tmp_path, how, says):
    prefix = tmp_path / "d"
    _tokens_dataset(prefix, [np.arange(10)] * 6)
    idx = _idx_damaged(prefix, how)
    with pytest.raises(ValueError) as err:
        IndexedDataset(prefix)
    assert str(err.value).startswith(f"{idx} {says}"), str(err.value)
