"""A file's sha256, read in large chunks: the identity of a data index and the checksums of a
checkpoint's manifest; ``known_sha256`` remembers it per file version across runs.

Loading a checkpoint verifies every file against its manifest (a save killed half-way, a copy cut
short), and hashing the 345M's training state reads 4.5 GB: seconds on every ``gptrain generate``.
The sums already computed are kept in the user's cache folder keyed by the file's version (resolved
path, size, modification and change times in ns, inode, device), as git's index does: a file written,
replaced or touched since has another version (its change time moves with any write, and no tool can
set it back) and is hashed again. As in git, a file changed within ``SETTLE_S`` before its hashing
began is not remembered (a timestamp may not move on a second write that soon)."""
from __future__ import annotations

import functools
import hashlib
import json
import time
from pathlib import Path

from gptrain.user_cache import cache_dir, keep

SETTLE_S = 2.0
KEEP = 4096  # entries kept in the cache file (the newest)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _store() -> Path:
    return cache_dir() / "file-sha256.json"


@functools.cache
def _known() -> dict[str, list]:
    """The remembered sums of this user ({path: [*version, sha256]}), read once."""
    try:
        known = json.loads(_store().read_text())
        return known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: everything is hashed (and the file rewritten)


def _version(st) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _remember(key: str, entry: list) -> None:
    """Adds ``entry`` to the cache file, merged with what other processes (the other ranks of a load)
    wrote there meanwhile; a whole file replaces the old one, never half of one."""
    known = _known()
    known.pop(key, None)
    known[key] = entry
    store = _store()
    try:
        latest = json.loads(store.read_text())
        if isinstance(latest, dict):
            known.update({k: v for k, v in latest.items() if k != key and k not in known})
    except (OSError, ValueError):
        pass
    for old in list(known)[: max(0, len(known) - KEEP)]:
        del known[old]
    keep(store, json.dumps(known).encode())


def known_sha256(path: Path) -> str:
    """``file_sha256(path)``, from the cache where this version of the file was hashed before."""
    path = Path(path).resolve()
    version = _version(path.stat())
    entry = _known().get(str(path))
    if isinstance(entry, list) and len(entry) == len(version) + 1 and entry[:-1] == version:
        return entry[-1]
    began = time.time_ns()
    digest = file_sha256(path)
    settled = began - max(version[1], version[2]) > SETTLE_S * 1e9
    if settled and _version(path.stat()) == version:  # unchanged while it was read
        _remember(str(path), version + [digest])
    return digest
