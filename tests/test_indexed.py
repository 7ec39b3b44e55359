import struct

import numpy as np
import pytest

from gptrain.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype
from megatron_reference import IndexedDatasetBuilder, MegatronIndexedDataset

DOCS = [[1, 2, 3], [], [7], list(range(100, 160)), [], [65000, 0, 9]]


def write(prefix, docs, dtype=np.uint16, batched=False):
    w = IndexedDatasetWriter(prefix, dtype)
    if batched:
        w.add_documents(np.concatenate([np.asarray(d, np.int64) for d in docs]), [len(d) for d in docs])
    else:
        for d in docs:
            w.add_document(np.asarray(d))
    w.finalize()


@pytest.mark.parametrize("batched", [False, True])
def test_bytes_equal_megatron_builder(tmp_path, batched):
    write(tmp_path / "ours", DOCS, batched=batched)
    ref = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16)
    for d in DOCS:
        ref.add_document(d, [len(d)] if d else [])
    ref.finalize(str(tmp_path / "ref.idx"))
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()


def test_header_layout(tmp_path):
    write(tmp_path / "d", DOCS)
    raw = (tmp_path / "d.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", raw[9:34])
    assert (version, code, n_seq, n_doc) == (1, 8, 4, len(DOCS) + 1)
    assert token_dtype(50257) == np.uint16 and token_dtype(100000) == np.int32


def test_read_back_document_for_document(tmp_path):
    write(tmp_path / "d", DOCS)
    ds = IndexedDataset(tmp_path / "d")
    assert len(ds) == len(DOCS)
    assert ds.num_tokens == sum(map(len, DOCS))
    for i, d in enumerate(DOCS):
        assert ds[i].tolist() == d
    assert ds.get(3, offset=5, length=4).tolist() == list(range(105, 109))
    assert ds.document_lengths().tolist() == [len(d) for d in DOCS]
    with pytest.raises(IndexError):
        ds.get(3, offset=58, length=5)
    with pytest.raises(IndexError):
        ds[len(DOCS)]


def test_interoperates_with_megatron_reader(tmp_path):
    write(tmp_path / "d", DOCS)
    meg = MegatronIndexedDataset(str(tmp_path / "d"))
    nonempty = [d for d in DOCS if d]
    assert len(meg) == len(nonempty)
    for i, d in enumerate(nonempty):
        assert meg[i].tolist() == d
    assert meg.document_indices.tolist() == IndexedDataset(tmp_path / "d").doc_idx.tolist()


def test_truncated_bin_is_refused(tmp_path):
    write(tmp_path / "d", DOCS)
    data = (tmp_path / "d.bin").read_bytes()
    (tmp_path / "d.bin").write_bytes(data[:-2])
    with pytest.raises(ValueError, match="bytes"):
        IndexedDataset(tmp_path / "d")
    (tmp_path / "x.idx").write_bytes(b"NOTANIDX" + b"\0" * 40)
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="magic"):
        IndexedDataset(tmp_path / "x")


def test_abort_leaves_nothing(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    w.add_document(np.arange(10))
    w.abort()
    assert list(tmp_path.iterdir()) == []
