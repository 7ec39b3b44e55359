"""GPT training samples from an indexed dataset, with Megatron-LM's index maps.

Per split (a contiguous document range from ``--split``):
  doc_idx     documents shuffled, repeated for as many epochs as the target sample count needs;
              the last epoch shuffled separately when it would be less than 80% used
  sample_idx  (position in doc_idx, offset) where each sample of seq_length + 1 tokens starts;
              samples run across document boundaries
  shuffle_idx the order samples are served in
Built with numpy (no Python loop over tokens or samples), cached as ``.npy`` named by an md5 of
their description (Megatron's scheme), written atomically. A cache file that does not read back
as the map it names is rebuilt (one line names it); a cache folder that cannot be written (a
read-only data mount, a full disk) keeps the maps in memory for the run and says so, leaving no
temporary file behind.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from gptrain.data.indexed import IndexedDataset, index_sha256

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str, num_documents: int) -> list[tuple[int, int]]:
    """megatron-core's split (``parse_and_normalize_split``, ``convert_split_vector_to_split_matrix``,
    the builder's rounding): document ranges for train/valid/test; an empty split is (lo, lo)."""
    import re

    numbers = re.findall(r"[.0-9]+", split)
    try:
        weights = [float(s) for s in numbers]
    except ValueError:
        weights = []
    if not weights or len(weights) > 3 or sum(weights) <= 0 or re.sub(r"[.0-9,/ ]", "", split):
        raise ValueError(f"--split {split!r}: expected up to three non-negative numbers such as 949,50,1")
    weights = (weights + [0.0] * 3)[:3]
    w = np.array(weights, dtype=np.float64)
    weights = (w / np.sum(w)).tolist()
    bounds = [0.0]
    for x in weights:
        bounds.append(bounds[-1] + x)
    ranges = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        begin = int(round(lo * float(num_documents)))
        ranges.append((begin, int(round(hi * float(num_documents)))) if hi > lo else (begin, begin))
    return ranges


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    if tokens_per_epoch <= 1:
        raise ValueError("the split holds fewer than 2 tokens: nothing to train on")
    # smallest E with (E * tokens - 1) // seq_length >= num_samples
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                  separate_last_epoch: bool) -> np.ndarray:
    """Megatron's ``_build_doc_idx`` (same RNG calls, same result for a seed)."""
    if not separate_last_epoch or num_epochs == 1:
        doc_idx = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(doc_idx)
        return doc_idx
    first = build_doc_idx(documents, num_epochs - 1, rng, False)
    last = build_doc_idx(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int,
                     tokens_per_epoch: int) -> np.ndarray:
    """Megatron's ``build_sample_idx`` vectorised: sample i starts at token i * seq_length of the
    doc_idx stream, at (the document holding that token, the offset in it)."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    doc_lengths = sizes[doc_idx].astype(np.int64)
    starts = np.zeros(len(doc_lengths) + 1, dtype=np.int64)
    np.cumsum(doc_lengths, out=starts[1:])
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # the last document whose start is <= position (skips empty documents, as the C++ loop does)
    which = np.searchsorted(starts, positions, side="right") - 1
    which = np.minimum(which, len(doc_lengths) - 1)
    dtype = np.int32 if max(len(doc_idx), int(sizes.max(initial=0))) <= np.iinfo(np.int32).max else np.int64
    out = np.empty((num_samples + 1, 2), dtype=dtype)
    out[:, 0] = which
    out[:, 1] = positions - starts[which]
    out[0] = 0  # Megatron starts at (0, 0) even when the first documents are empty
    return out


def build_shuffle_idx(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


@dataclass
class IndexMaps:
    doc_idx: np.ndarray
    sample_idx: np.ndarray
    shuffle_idx: np.ndarray
    num_epochs: int


def _atomic_save(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}.npy")
    try:
        np.save(tmp, array, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_MAP_SHAPES = {"doc_idx": 1, "sample_idx": 2, "shuffle_idx": 1}


def _load_cached(paths: dict[str, Path], log) -> IndexMaps | None:
    """The cached maps, or None (after one line naming the file) where one does not read back as the
    map it names: truncated, overwritten, or not a plain numeric ``.npy``."""
    arrays = []
    for kind, path in paths.items():
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
            ok = array.ndim == _MAP_SHAPES[kind] and array.dtype.kind in "iu" and (kind != "sample_idx" or
                                                                                   array.shape[1] == 2)
        except (OSError, ValueError, EOFError):
            ok = False
        if not ok:
            log(f"WARNING: index cache file {path} is damaged: rebuilding the {kind.replace('_idx', '-idx')} maps")
            return None
        arrays.append(array)
    return IndexMaps(*arrays, num_epochs=0)


def _write_cache(cache: Path, desc_hash: str, desc: str, paths: dict[str, Path], arrays: dict, log) -> bool:
    try:
        cache.mkdir(parents=True, exist_ok=True)
        (cache / f"{desc_hash}_description.txt").write_text(desc)
        for kind, array in arrays.items():
            _atomic_save(paths[kind], array)
    except OSError as err:
        log(f"WARNING: cannot write the index cache to {cache} ({err.strerror or err}): the maps are kept in memory "
            "for this run; pass --data-cache-path DIR (a writable folder) to cache them")
        return False
    return True


def build_index_maps(name: str, data_prefix: str, documents: np.ndarray, sizes: np.ndarray, split: str,
                     num_samples: int, seq_length: int, seed: int, cache_dir: str | os.PathLike | None,
                     log: Callable[[str], None] = print, data_identity: str | None = None) -> IndexMaps:
    """Load the split's maps from the cache, or build and cache them (Megatron's _build_index_mappings).

    The cache is keyed on ``data_identity`` too (the ``.idx``'s sha256: the maps depend only on the
    document lengths it holds), so data rewritten at the same prefix never reuses stale maps."""
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    if data_identity is None:
        data_identity = hashlib.sha256(np.ascontiguousarray(sizes, dtype=np.int64).tobytes()).hexdigest()
    desc = (f"GPT Dataset\n\nData prefix {data_prefix}\nData identity {data_identity}\nDataset name {name}\n"
            f"Number of samples {num_samples}\nSequence length {seq_length}\nRandom seed {seed}\nSplit {split}\n"
            f"Documents [{int(documents[0]) if len(documents) else 0}, "
            f"{int(documents[-1]) + 1 if len(documents) else 0})\n")
    desc_hash = hashlib.md5(desc.encode("utf-8")).hexdigest()
    cache = Path(cache_dir) if cache_dir is not None else Path(data_prefix).parent / "index-cache"
    paths = {kind: cache / f"{desc_hash}_{kind}.npy" for kind in ("doc_idx", "sample_idx", "shuffle_idx")}
    start = time.perf_counter()
    maps = _load_cached(paths, log) if all(p.is_file() for p in paths.values()) else None
    if maps is None:
        rng = np.random.RandomState(seed=seed)
        separate_last_epoch = False
        if num_epochs > 1:
            from_first_epochs = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
            last_epoch_samples = num_samples - from_first_epochs
            per_epoch = (tokens_per_epoch - 1) // seq_length
            separate_last_epoch = last_epoch_samples < int(0.80 * per_epoch)
            if separate_last_epoch:
                log(f" > last epoch number of samples ({last_epoch_samples}) is smaller than 80% of number of "
                    f"samples per epoch ({per_epoch}), setting separate_last_epoch to True")
        doc_idx = build_doc_idx(documents, num_epochs, rng, separate_last_epoch)
        sample_idx = build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
        n = from_first_epochs if separate_last_epoch else sample_idx.shape[0] - 1
        shuffle_idx = build_shuffle_idx(n, sample_idx.shape[0] - 1, rng)
        arrays = {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}
        log(f" > built {name} index maps in {time.perf_counter() - start:.3f} seconds")
        maps = IndexMaps(doc_idx, sample_idx, shuffle_idx, num_epochs)
        if _write_cache(cache, desc_hash, desc, paths, arrays, log):
            maps = _load_cached(paths, log) or maps
        else:
            paths = {}  # in memory only
    maps.num_epochs = num_epochs
    for kind in paths:
        log(f" > loading {kind.replace('_idx', '-idx')} mapping from {paths[kind]}")
    log(f"    loaded indexed file in {time.perf_counter() - start:.3f} seconds")
    log(f"    total number of samples: {maps.sample_idx.shape[0]}")
    log(f"    total number of epochs: {num_epochs}")
    return maps


class GPTDataset:
    """Samples of ``seq_length + 1`` token ids (int64) from one split of one indexed dataset.

    ``documents`` are sequence indices, as in megatron-core (which splits a GPT dataset by
    sequence): without sentence splitting a sequence is a non-empty document."""

    def __init__(self, name: str, indexed: IndexedDataset, documents: np.ndarray, num_samples: int,
                 seq_length: int, seed: int, split: str, cache_dir=None, log=print):
        if len(documents) == 0:
            raise ValueError(f"the {name} split of {indexed.prefix} has no documents: adjust --split")
        self.name, self.indexed, self.seq_length = name, indexed, seq_length
        self.maps = build_index_maps(name, indexed.prefix, documents, indexed.sizes, split,
                                     num_samples, seq_length, seed, cache_dir, log, index_sha256(indexed.prefix))

    def __len__(self) -> int:
        return self.maps.shuffle_idx.shape[0]

    def __getitem__(self, idx: int) -> np.ndarray:
        i = int(self.maps.shuffle_idx[idx])
        (doc_f, off_f), (doc_l, off_l) = self.maps.sample_idx[i], self.maps.sample_idx[i + 1]
        doc_idx = self.maps.doc_idx
        get = self.indexed.get_sequence
        if doc_f == doc_l:
            sample = get(int(doc_idx[doc_f]), int(off_f), int(off_l - off_f + 1))
        else:
            parts = [get(int(doc_idx[doc_f]), int(off_f))]
            parts += [get(int(doc_idx[d])) for d in range(doc_f + 1, doc_l)]
            parts.append(get(int(doc_idx[doc_l]), 0, int(off_l + 1)))
            sample = np.concatenate(parts)
        return sample.astype(np.int64)


class MockGPTDataset:
    """``--mock-data``: deterministic random tokens, so any config runs without a dataset."""

    def __init__(self, name: str, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.name, self.num_samples, self.seq_length, self.vocab_size = name, num_samples, seq_length, vocab_size
        self.seed = seed + SPLIT_NAMES.index(name) * 1_000_003

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, idx))
        return rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)
