"""Training data's token ids against the tokenizer's vocabulary, before training: an id past the
padded vocabulary would end in an index error (a device-side assert on a GPU), one inside the
padding in NaN losses. The largest id of a ``.bin`` is found by a vectorised scan, once: it is
cached beside the index maps, keyed on the ``.idx``'s sha256 and the ``.bin``'s size and time.
"""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np

from gptrain.data.indexed import IndexedDataset, data_file, index_sha256

CHUNK = 1 << 26  # tokens per step of the scan
PROGRESS_EVERY_S = 10.0


def _cache_file(indexed: IndexedDataset, cache_dir) -> Path:
    st = data_file(indexed.prefix).stat()
    key = hashlib.sha256(f"{index_sha256(indexed.prefix)} {st.st_size} {st.st_mtime_ns}".encode()).hexdigest()
    folder = Path(cache_dir) if cache_dir is not None else Path(indexed.prefix).parent / "index-cache"
    return folder / f"{key[:32]}_max_token_id.txt"


def _scan(tokens: np.ndarray, log, name: str) -> int:
    """The largest id in ``tokens``, a chunk at a time, with a progress line every few seconds."""
    largest, last = -1, time.perf_counter()
    for lo in range(0, len(tokens), CHUNK):
        largest = max(largest, int(tokens[lo: lo + CHUNK].max()))
        if time.perf_counter() - last > PROGRESS_EVERY_S:
            log(f" > checking the token ids of {name}: {100 * (lo + CHUNK) / len(tokens):.0f}%")
            last = time.perf_counter()
    return largest


def max_token_id(indexed: IndexedDataset, cache_dir=None, log=print) -> int:
    """The largest token id in ``indexed`` (-1 for no tokens), from the cache where it is there."""
    cache = _cache_file(indexed, cache_dir)
    try:
        return int(cache.read_text())
    except (OSError, ValueError):
        pass
    largest = _scan(indexed._bin, log, str(data_file(indexed.prefix))) if indexed.num_tokens else -1
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(cache.name + ".tmp")
        tmp.write_text(str(largest))
        tmp.replace(cache)
    except OSError:
        pass  # an unwritable cache folder: the index maps' own line says so
    return largest


def _first_outside(indexed: IndexedDataset, vocab_size: int) -> tuple[int, int]:
    """The first token id at or past ``vocab_size`` and the document holding it."""
    tokens = indexed._bin
    for lo in range(0, len(tokens), CHUNK):
        hits = np.flatnonzero(tokens[lo: lo + CHUNK] >= vocab_size)
        if len(hits):
            position = lo + int(hits[0])
            sequence = int(np.searchsorted(indexed.pointers // indexed.dtype.itemsize, position, side="right")) - 1
            document = int(np.searchsorted(indexed.doc_idx, sequence, side="right")) - 1
            return int(tokens[position]), document
    raise AssertionError("no id outside the vocabulary")


def check_token_ids(indexed: IndexedDataset, vocab_size: int, cache_dir=None, log=print) -> None:
    """Raise ValueError naming the ``.bin``, the id and its document if any id is outside the vocabulary."""
    if max_token_id(indexed, cache_dir, log) < vocab_size:
        return
    token, document = _first_outside(indexed, vocab_size)
    raise ValueError(f"{data_file(indexed.prefix)}: token id {token} (document {document}) is outside the "
                     f"tokenizer's vocabulary of {vocab_size} ids: the data was made with another tokenizer, or is "
                     "damaged; preprocess it again with this run's --vocab-file/--merge-file")
