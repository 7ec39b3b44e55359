"""A ``.bin`` from another run, of the same size, beside a preprocessed ``.idx``: the provenance
sidecar records the ``.bin``'s size and sampled sha256, checked at train time with the ``.idx``
(issue 33, defect 9); data without a sidecar (Megatron's) keeps its warning."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from gptrain.data.indexed import IndexedDatasetWriter, bin_fingerprint
from gptrain.data.provenance import StaleProvenance, check_tokenizer, provenance_record, read_provenance
from tiny import TINY_FLAGS


def _dataset(prefix, seed: int, tokenizer, sidecar: bool = True) -> None:
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(12):
        writer.add_document(rng.integers(0, 50257, 40))
    writer.finalize(provenance_record(tokenizer.describe(), inputs=[], counts={"documents": 12}) if sidecar else None)


def _train(prefix, tmp_path):
    from gptrain.train.run import train_main

    argv = TINY_FLAGS + ["--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
                         "--train-iters", "1", "--device", "cpu", "--data-path", str(prefix), "--split", "100,0,0",
                         "--eval-iters", "0", "--data-cache-path", str(tmp_path / "cache")]
    return train_main(argv, log=lambda _: None).exit_code


def test_a_bin_of_another_run_is_refused_in_one_line_naming_both_files(tmp_path, tokenizer, capsys):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    _dataset(ours, 0, tokenizer)
    _dataset(theirs, 1, tokenizer)
    record = read_provenance(ours)["index"]
    assert record["bin_bytes"] == 12 * 40 * 2 and record["bin_sample_sha256"] == bin_fingerprint(f"{ours}.bin")
    assert check_tokenizer(ours, tokenizer) is None
    shutil.copy(f"{theirs}.bin", f"{ours}.bin")  # same size, same .idx: only the tokens differ
    with pytest.raises(StaleProvenance, match="a .bin from another run"):
        check_tokenizer(ours, tokenizer)
    assert _train(ours, tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"gptrain: error: {ours}.bin does not belong with {ours}.idx: "
                                              f"{ours}.json records a ours.bin of 960 bytes")


def test_megatron_data_without_a_sidecar_keeps_todays_warning(tmp_path, tokenizer):
    ours, theirs = tmp_path / "m", tmp_path / "other"
    _dataset(ours, 0, tokenizer, sidecar=False)
    _dataset(theirs, 1, tokenizer, sidecar=False)
    shutil.copy(f"{theirs}.bin", f"{ours}.bin")
    assert "no provenance sidecar" in check_tokenizer(ours, tokenizer)


def test_the_fingerprint_reads_samples_of_a_large_bin(tmp_path):
    path = tmp_path / "big.bin"
    block = 1 << 20
    data = bytearray(np.random.default_rng(0).integers(0, 256, 40 * block, dtype=np.uint8).tobytes())
    path.write_bytes(bytes(data))
    before = bin_fingerprint(path)
    for at in (0, len(data) - 1):  # the first and the last MiB are always read
        changed = bytearray(data)
        changed[at] ^= 1
        path.write_bytes(bytes(changed))
        assert bin_fingerprint(path) != before
    path.write_bytes(bytes(data))
    assert bin_fingerprint(path) == before
