"""The tables a GPT-2 tokenizer builds from its vocabulary and merges files, kept in the user's cache
under the files' sha256: building them decodes every token's text in Python and checks the two files
against each other (most of a tokenizer's start-up); reading them back is one numpy file. A cache file
that is missing or unreadable is rebuilt, never trusted half-way."""
from __future__ import annotations

import io

import numpy as np

from gptrain.user_cache import cache_dir, keep


FORMAT = 1  # how the tables are derived from the files (tokenizer._load_bpe) and laid out here


def _path(fingerprint: str):
    return cache_dir() / f"gpt2-bpe-v{FORMAT}-{fingerprint[:32]}.npz"


def load(fingerprint: str) -> tuple[dict[bytes, int], tuple[int, int, int]] | None:
    """(tiktoken's mergeable ranks, (eod id, vocabulary size, largest id)) of the files with this
    fingerprint, or None where they were not kept."""
    try:
        with np.load(_path(fingerprint), allow_pickle=False) as z:
            blob, ends, numbers = z["blob"].tobytes(), z["ends"].astype(np.int64), z["numbers"].tolist()
    except Exception:  # noqa: BLE001 - missing, cut short, not a zip: rebuilt, never fatal
        return None
    if len(numbers) != 3 or not len(ends) or ends[-1] != len(blob) or (np.diff(ends) <= 0).any() or ends[0] <= 0:
        return None
    bounds = ends.tolist()
    tokens = [blob[a:b] for a, b in zip([0] + bounds[:-1], bounds)]
    return dict(zip(tokens, range(len(tokens)))), tuple(int(n) for n in numbers)


def store(fingerprint: str, ranks: dict[bytes, int], numbers: tuple[int, int, int]) -> None:
    """Keeps ``ranks`` (ids 0 .. n-1, as the merges give them) and ``numbers`` for the next start;
    tables whose ids are not exactly 0 .. n-1 are not kept (``load`` numbers them in order)."""
    tokens = sorted(ranks, key=ranks.__getitem__)
    if [ranks[t] for t in tokens] != list(range(len(tokens))):
        return
    buffer = io.BytesIO()
    np.savez(buffer, blob=np.frombuffer(b"".join(tokens), dtype=np.uint8),
             ends=np.cumsum([len(t) for t in tokens], dtype=np.int64), numbers=np.array(numbers, dtype=np.int64))
    keep(_path(fingerprint), buffer.getvalue())
