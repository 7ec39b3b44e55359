"""A file's sha256, read in large chunks: the identity of a data index and the checksums of a
checkpoint's manifest; ``known_sha256`` remembers it per file version across runs.

Loading a checkpoint verifies every file against its manifest (a save killed half-way, a copy cut
short), and hashing the 345M's training state reads 4.5 GB: seconds on every ``gptrain generate``.
The sums already computed are kept in the user's cache folder keyed by the file's version (resolved
path, size, modification time in ns, inode), as git's index does: a file written or replaced since
has another version and is hashed again. As in git, a file modified within ``SETTLE_S`` of being
hashed is not remembered (its timestamp may not have moved yet on a second write)."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from pathlib import Path

SETTLE_S = 2.0
KEEP = 4096  # entries kept in the cache file (the newest)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _store() -> Path:
    from gptrain.user_cache import cache_dir

    return cache_dir() / "file-sha256.json"


@functools.cache
def _known() -> dict[str, list]:
    """The remembered sums of this user ({path: [size, mtime_ns, inode, sha256]}), read once."""
    try:
        known = json.loads(_store().read_text())
        return known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: everything is hashed (and the file rewritten)


def _remember(key: str, entry: list) -> None:
    known = _known()
    known.pop(key, None)
    known[key] = entry
    for old in list(known)[: max(0, len(known) - KEEP)]:
        del known[old]
    store = _store()
    try:  # another process may write it too: whole files replace each other, never half of one
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_name(f".{store.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, store)
    except OSError:
        pass  # a read-only home: nothing remembered, nothing lost


def known_sha256(path: Path) -> str:
    """``file_sha256(path)``, from the cache where this version of the file was hashed before."""
    path = Path(path).resolve()
    st = path.stat()
    version = [st.st_size, st.st_mtime_ns, st.st_ino]
    entry = _known().get(str(path))
    if isinstance(entry, list) and len(entry) == 4 and entry[:3] == version:
        return entry[3]
    digest = file_sha256(path)
    if time.time_ns() - st.st_mtime_ns > SETTLE_S * 1e9 and path.stat().st_mtime_ns == st.st_mtime_ns:
        _remember(str(path), version + [digest])
    return digest
