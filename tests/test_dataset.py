import warnings

import numpy as np
import pytest

from gptrain.data.blend import BlendedDataset, blending_indices, parse_data_path
from gptrain.data.gpt_dataset import (GPTDataset, MockGPTDataset, build_doc_idx, build_sample_idx,
                                      num_epochs_needed, parse_split)
from gptrain.data.indexed import IndexedDataset, IndexedDatasetWriter

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.helpers import build_sample_idx as megatron_build_sample_idx


def test_split_matches_seed_log():
    assert parse_split("700,200,100", 2456) == [(0, 1719), (1719, 2210), (2210, 2456)]
    assert parse_split("949,50,1", 1000)[2][1] == 1000
    with pytest.raises(ValueError, match="--split"):
        parse_split("a,b", 10)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sample_idx_equals_megatron_cpp(seed):
    rng = np.random.RandomState(seed)
    sizes = rng.randint(0, 40, size=200).astype(np.int32)
    sizes[rng.randint(0, 200, 20)] = 0  # empty documents too
    documents = np.arange(10, 180)
    tokens = int(sizes[documents].sum())
    for seq in (2, 7, 16, 64):
        epochs = num_epochs_needed(tokens, seq, 300)
        doc_idx = build_doc_idx(documents, epochs, np.random.RandomState(seed), False)
        ours = build_sample_idx(sizes, doc_idx, seq, epochs, tokens)
        ref = megatron_build_sample_idx(sizes, doc_idx, seq, epochs, tokens)
        assert np.array_equal(ours, ref), seq


def make_dataset(tmp_path, n_docs=60, seed=0):
    rng = np.random.RandomState(seed)
    w = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    docs = []
    start = 0
    for _ in range(n_docs):
        n = int(rng.randint(1, 30))
        doc = np.arange(start, start + n) % 60000  # every token id unique: traceable
        docs.append(doc)
        w.add_document(doc)
        start += n
    w.finalize()
    return IndexedDataset(tmp_path / "d"), docs


def test_samples_cover_split_and_cross_documents(tmp_path):
    ds, docs = make_dataset(tmp_path)
    seq = 16
    documents = np.arange(0, 40)
    logs = []
    g = GPTDataset("train", ds, documents, num_samples=50, seq_length=seq, seed=5, split="40,20,0",
                   cache_dir=tmp_path / "cache", log=logs.append)
    assert len(g) >= 50
    stream = np.concatenate([docs[int(d)] for d in g.maps.doc_idx])
    seen = set()
    for i in range(len(g)):
        s = g[i]
        assert len(s) == seq + 1
        j = int(g.maps.shuffle_idx[i])
        assert np.array_equal(s, stream[j * seq : j * seq + seq + 1])  # consecutive, across documents
        seen.update(s.tolist())
    split_tokens = set(np.concatenate(docs[:40]).tolist())
    assert seen <= split_tokens
    assert len(split_tokens - seen) <= seq  # every token of the split appears (but a tail)
    assert any("total number of epochs" in line for line in logs)


def test_cache_is_reused_and_seeds_differ(tmp_path):
    ds, _ = make_dataset(tmp_path)
    args = dict(documents=np.arange(0, 40), num_samples=30, seq_length=8, split="x", cache_dir=tmp_path / "c")
    logs = []
    a = GPTDataset("train", ds, seed=1, log=logs.append, **args)
    assert any("built" in line for line in logs)
    logs.clear()
    b = GPTDataset("train", ds, seed=1, log=logs.append, **args)
    assert not any("built" in line for line in logs)
    assert all(np.array_equal(a[i], b[i]) for i in range(len(a)))
    c = GPTDataset("train", ds, seed=2, log=lambda _: None, **args)
    assert any(not np.array_equal(a[i], c[i]) for i in range(len(a)))
    assert len(list((tmp_path / "c").glob("*.npy"))) == 6


def test_separate_last_epoch_rule(tmp_path):
    ds, _ = make_dataset(tmp_path)
    logs = []
    GPTDataset("valid", ds, np.arange(0, 60), num_samples=int(ds.num_tokens / 8 * 1.1), seq_length=8, seed=0,
               split="s", cache_dir=tmp_path / "c", log=logs.append)
    assert any("setting separate_last_epoch to True" in line for line in logs)


def test_blend_weights_tiny_and_many():
    weights, prefixes = parse_data_path(["0.35", "A", "0.65", "B"])
    assert prefixes == ["A", "B"] and weights == pytest.approx([0.35, 0.65])
    d, s = blending_indices(weights, 1000)
    assert abs((d == 0).sum() - 350) <= 1
    for k in range(2):  # sample indices within each dataset are consecutive from 0
        assert np.array_equal(s[d == k], np.arange((d == k).sum()))
    w = [1e-4] + [1.0] * 49
    w = [x / sum(w) for x in w]
    d, _ = blending_indices(w, 20_000)
    assert len(d) == 20_000 and np.abs(np.bincount(d, minlength=50)[1:] - 20_000 * w[1]).max() <= 1
    with pytest.raises(ValueError, match="pairs"):
        parse_data_path(["0.5", "A", "B"])


def test_blended_dataset_serves_from_components():
    a = MockGPTDataset("train", 100, 8, 50, seed=1)
    b = MockGPTDataset("train", 100, 8, 50, seed=2)
    blend = BlendedDataset([a, b], [0.5, 0.5], 20)
    assert np.array_equal(blend[0], a[0]) and np.array_equal(blend[1], b[0])
    assert np.array_equal(a[3], MockGPTDataset("train", 100, 8, 50, seed=1)[3])


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "pickled", "wrong-shape"])
def test_a_damaged_index_cache_file_is_rebuilt_with_one_line(damage, tmp_path):
    ds, _ = make_dataset(tmp_path)
    args = dict(documents=np.arange(0, 40), num_samples=30, seq_length=8, split="x", cache_dir=tmp_path / "c", seed=1)
    a = GPTDataset("train", ds, log=lambda _: None, **args)
    ref = [np.array(a[i]) for i in range(len(a))]
    del a  # its maps are memory-mapped from the file damaged below
    path = next((tmp_path / "c").glob("*_sample_idx.npy"))
    whole = path.read_bytes()
    path.unlink()  # a new file: the damage does not reach pages mapped earlier
    if damage == "truncated":
        path.write_bytes(whole[:-9])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 200)
    elif damage == "pickled":
        np.save(path, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    else:
        np.save(path, np.zeros(5, dtype=np.int32))
    logs = []
    b = GPTDataset("train", ds, log=logs.append, **args)
    assert [line for line in logs if line.startswith("WARNING")] == [
        f"WARNING: index cache file {path} is damaged: rebuilding the sample-idx maps"]
    assert len(b) == len(ref) and all(np.array_equal(r, b[i]) for i, r in enumerate(ref))
    logs.clear()
    GPTDataset("train", ds, log=logs.append, **args)  # rebuilt for good
    assert not any(line.startswith(("WARNING", " > built")) for line in logs)


def test_an_unwritable_index_cache_keeps_the_maps_in_memory(tmp_path, monkeypatch):
    """A read-only data mount (here a cache path under a plain file) and a full disk: one line
    naming the folder and --data-cache-path, the same samples, no temporary file left behind."""
    import gptrain.data.gpt_dataset as gpt_dataset

    ds, _ = make_dataset(tmp_path)
    args = dict(documents=np.arange(0, 40), num_samples=30, seq_length=8, split="x", seed=1)
    ref = GPTDataset("train", ds, cache_dir=tmp_path / "c", log=lambda _: None, **args)
    (tmp_path / "plain").write_text("")
    logs = []
    got = GPTDataset("train", ds, cache_dir=tmp_path / "plain" / "c", log=logs.append, **args)
    warned = [line for line in logs if line.startswith("WARNING")]
    assert len(warned) == 1 and warned[0].startswith(f"WARNING: cannot write the index cache to {tmp_path}/plain/c (")
    assert warned[0].endswith("pass --data-cache-path DIR (a writable folder) to cache them")
    assert all(np.array_equal(ref[i], got[i]) for i in range(len(ref)))

    def full_disk(file, array, allow_pickle):
        with open(file, "wb") as f:
            f.write(b"\x93NUMPY")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gpt_dataset.np, "save", full_disk)
    logs.clear()
    got = GPTDataset("train", ds, cache_dir=tmp_path / "full", log=logs.append, **args)
    assert [line for line in logs if line.startswith("WARNING")] == [
        f"WARNING: cannot write the index cache to {tmp_path}/full (No space left on device): the maps are kept in "
        "memory for this run; pass --data-cache-path DIR (a writable folder) to cache them"]
    assert not [p.name for p in (tmp_path / "full").iterdir() if ".tmp" in p.name]
    assert all(np.array_equal(ref[i], got[i]) for i in range(len(ref)))
