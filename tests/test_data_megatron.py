"""gptrain's training datasets against megatron-core's (BlendedMegatronDatasetBuilder, GPTDataset,
BlendedDataset, helpers.build_blending_indices): the same document order, sample boundaries, sample
order and tokens for train/valid/test, for one dataset and for blends, over seeds, splits and epoch
counts. gptrain's side is built the way `gptrain train` builds it (data/assemble.py's build_datasets)."""
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from gptrain.config import parse_megatron_args
from gptrain.data.blend import BlendedDataset, blending_indices, normalize, parse_data_path
from gptrain.data.indexed import IndexedDatasetWriter
from gptrain.data.assemble import build_datasets, target_samples

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets import helpers
    from megatron.core.datasets.blended_dataset import BlendedDataset as MegatronBlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig


def write_dataset(prefix, n_docs, seed, max_len=60):
    """Random documents (some empty), every token traceable: ids count up across the dataset."""
    rng = np.random.RandomState(seed)
    writer = IndexedDatasetWriter(prefix, np.uint16)
    lengths = rng.randint(0, max_len, size=n_docs)
    lengths[rng.randint(0, n_docs, n_docs // 20)] = 0
    tokens = (np.arange(int(lengths.sum())) + seed * 7919) % 50000
    writer.add_documents(tokens, lengths)
    writer.finalize()
    return str(prefix)


class _Tokenizer:
    vocab_size, eod, pad = 50257, 50256, -1
    unique_identifiers = {"class": "test tokenizer"}


def megatron_datasets(data_path, split, seq_length, seed, targets):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        weights, prefixes = (None, data_path) if len(data_path) % 2 else (
            [float(w) for w in data_path[0::2]], data_path[1::2])
        config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=(prefixes, weights),
                                  split=split, path_to_cache=None, tokenizer=_Tokenizer(),
                                  reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
        return BlendedMegatronDatasetBuilder(MegatronGPTDataset, list(targets), lambda: True, config).build()


def gptrain_datasets(tmp_path, data_path, split, seq_length, seed, iters, gbs, eval_interval, eval_iters):
    argv = ["--data-path", *data_path, "--split", split, "--seq-length", str(seq_length),
            "--max-position-embeddings", str(seq_length), "--num-layers", "1", "--hidden-size", "8",
            "--num-attention-heads", "1", "--micro-batch-size", str(gbs), "--global-batch-size", str(gbs),
            "--train-iters", str(iters), "--eval-interval", str(eval_interval), "--eval-iters", str(eval_iters),
            "--seed", str(seed), "--data-cache-path", str(tmp_path / "cache"), "--lr", "1e-4"]
    cfg, _ = parse_megatron_args(argv, world_size=1)
    tokenizer = SimpleNamespace(vocab_size=50257, eod=50256, fingerprint="-")
    return build_datasets(cfg, tokenizer, log=lambda _: None), target_samples(cfg)


def tokens(megatron_gpt, idx):
    return megatron_gpt._query_document_sample_shuffle_indices(idx)[0].astype(np.int64)


def assert_same_gpt(ours, theirs, check_every=1):
    assert np.array_equal(ours.maps.doc_idx, theirs.document_index)
    assert np.array_equal(ours.maps.sample_idx, theirs.sample_index)
    assert np.array_equal(ours.maps.shuffle_idx, theirs.shuffle_index)
    assert len(ours) == len(theirs)
    for i in range(0, len(ours), check_every):
        assert np.array_equal(ours[i], tokens(theirs, i)), i


# (documents, split, seq_length, seed, train iters, global batch, eval interval, eval iters): one epoch,
# two, many (with and without the separate last epoch), an empty test split
SINGLE = [
    (1200, "969,30,1", 16, 1234, 20, 8, 10, 2),
    (1200, "700,200,100", 7, 0, 60, 16, 20, 3),
    (1200, "98,2,0", 32, 5, 200, 8, 50, 5),
    (1200, "80,10,10", 64, 42, 40, 4, 10, 10),
    (300, "90,5,5", 16, 9, 300, 16, 25, 4),
]


@pytest.mark.parametrize("docs,split,seq,seed,iters,gbs,interval,eval_iters", SINGLE)
def test_one_dataset_equals_megatron(tmp_path, docs, split, seq, seed, iters, gbs, interval, eval_iters):
    prefix = write_dataset(tmp_path / "d", docs, seed)
    ours, targets = gptrain_datasets(tmp_path, [prefix], split, seq, seed, iters, gbs, interval, eval_iters)
    theirs = megatron_datasets([prefix], split, seq, seed, targets)
    for o, t in zip(ours, theirs):
        assert (o is None) == (t is None)
        if o is not None:
            assert_same_gpt(o, t)


def test_the_cases_cover_epochs_and_the_separate_last_epoch(tmp_path, monkeypatch):
    from gptrain.data import gpt_dataset

    separate = []
    original = gpt_dataset.build_doc_idx

    def recording(documents, num_epochs, rng, separate_last_epoch):
        separate.append(separate_last_epoch)
        return original(documents, num_epochs, rng, separate_last_epoch)

    monkeypatch.setattr(gpt_dataset, "build_doc_idx", recording)
    epochs = set()
    for k, (docs, *rest) in enumerate(SINGLE):
        prefix = write_dataset(tmp_path / f"d{k}", docs, rest[2])
        ours, _ = gptrain_datasets(tmp_path / f"c{k}", [prefix], *rest)
        epochs |= {d.maps.num_epochs for d in ours if d is not None}
    assert {1, 2, 4} <= epochs and max(epochs) > 20
    assert True in separate and False in separate


BLENDS = [
    (["0.35", "A", "0.65", "B"], "969,30,1", 16, 1234, 60, 8),
    (["30", "A", "70", "B"], "90,8,2", 8, 7, 100, 16),
    (["0.2", "A", "0.3", "B", "0.5", "C"], "949,50,1", 32, 3, 50, 8),
    (["1", "A", "1", "B"], "80,20,0", 12, 11, 40, 4),
    (["1.0", "A"], "90,8,2", 16, 2, 30, 8),  # one weighted prefix is a blend too, with the surplus
]


@pytest.mark.parametrize("data_path,split,seq,seed,iters,gbs", BLENDS)
def test_blend_equals_megatron(tmp_path, data_path, split, seq, seed, iters, gbs):
    for k, name in enumerate(("A", "B", "C")):
        write_dataset(tmp_path / name, 1500 + 50 * k, seed + k)
    data_path = [str(tmp_path / x) if x in ("A", "B", "C") else x for x in data_path]
    ours, targets = gptrain_datasets(tmp_path, data_path, split, seq, seed, iters, gbs, 10, 2)
    theirs = megatron_datasets(data_path, split, seq, seed, targets)
    for o, t in zip(ours, theirs):
        assert (o is None) == (t is None)
        if o is None:
            continue
        assert isinstance(o, BlendedDataset) and isinstance(t, MegatronBlendedDataset)
        assert len(o) == len(t)  # megatron-core's blend size: the sum of the per-dataset targets
        assert np.array_equal(o.dataset_index, t.dataset_index)
        assert np.array_equal(o.sample_index, t.dataset_sample_index)
        for ours_part, their_part in zip(o.datasets, t.datasets):  # per-dataset sample counts, with surplus
            assert ours_part.maps.shuffle_idx.shape == their_part.shuffle_index.shape
            assert_same_gpt(ours_part, their_part, check_every=7)
        for i in range(len(o)):
            d = int(t.dataset_index[i])
            assert np.array_equal(o[i], tokens(t.datasets[d], int(t.dataset_sample_index[i]))), i


@pytest.mark.parametrize("weights", [[0.35, 0.65], [0.5, 0.5], [1, 3], [1e-3, 1], [0.1, 0.2, 0.7],
                                     [3, 1, 4, 1, 5, 9, 2, 6]])
@pytest.mark.parametrize("size", [1, 2, 3, 480, 100_003])
def test_blending_indices_equal_megatrons_helper(weights, size):
    w = normalize(weights)
    dataset = np.zeros(size, np.int16)
    within = np.zeros(size, np.int64)
    helpers.build_blending_indices(dataset, within, np.array(w, np.float64), len(w), size, False)
    ours = blending_indices(w, size)
    assert np.array_equal(ours[0], dataset) and np.array_equal(ours[1], within)


def test_weights_normalised_like_megatron_and_zero_refused():
    weights, prefixes = parse_data_path(["0.35", "A", "0.65", "B"])
    assert prefixes == ["A", "B"] and weights == normalize([0.35, 0.65])
    with pytest.raises(ValueError, match="positive"):
        parse_data_path(["0", "A", "1", "B"])
