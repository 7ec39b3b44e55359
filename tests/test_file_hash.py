"""known_sha256: the sums of files already verified come from the user's cache, and any change to
a file (or a file too fresh to trust its timestamps) means hashing it again; a checkpoint damaged
after its files were verified is still caught."""
from __future__ import annotations

import hashlib
import json
import os
import time

import pytest

from gptrain import file_hash


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # a file's change time is always now after a test writes it: settled at once here, except where
    # a test says otherwise
    monkeypatch.setattr(file_hash, "SETTLE_S", 0.0)
    file_hash._known.cache_clear()
    yield tmp_path / "cache" / "gptrain" / "file-sha256.json"
    file_hash._known.cache_clear()


def _hashing_fails(monkeypatch):
    def refuse(path):
        raise AssertionError(f"{path} was hashed again")
    monkeypatch.setattr(file_hash, "file_sha256", refuse)


def test_a_verified_file_is_not_read_again(tmp_path, cache, monkeypatch):
    f = tmp_path / "shard.bin"
    f.write_bytes(b"x" * 100_000)
    assert file_hash.known_sha256(f) == hashlib.sha256(b"x" * 100_000).hexdigest()
    assert cache.is_file()
    file_hash._known.cache_clear()  # a new process: the sum comes from the file in the cache folder
    _hashing_fails(monkeypatch)
    assert file_hash.known_sha256(f) == hashlib.sha256(b"x" * 100_000).hexdigest()


def test_a_changed_file_is_hashed_again(tmp_path, cache):
    f = tmp_path / "shard.bin"
    f.write_bytes(b"a" * 1000)
    assert file_hash.known_sha256(f) == hashlib.sha256(b"a" * 1000).hexdigest()
    st = f.stat()
    with open(f, "r+b") as out:  # same size, and the modification time put back as tools do (cp -p)
        out.write(b"b")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_mtime_ns == st.st_mtime_ns
    assert file_hash.known_sha256(f) == hashlib.sha256(b"b" + b"a" * 999).hexdigest()  # its change time moved
    other = tmp_path / "other.bin"
    other.write_bytes(b"c" * 1000)
    os.replace(other, f)  # another inode
    assert file_hash.known_sha256(f) == hashlib.sha256(b"c" * 1000).hexdigest()


def test_a_fresh_file_is_not_remembered(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(file_hash, "SETTLE_S", 60.0)
    f = tmp_path / "new.bin"
    f.write_bytes(b"just written")
    assert file_hash.known_sha256(f) == hashlib.sha256(b"just written").hexdigest()
    assert not cache.exists()


def test_an_unreadable_cache_is_ignored_and_rewritten(tmp_path, cache):
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    f = tmp_path / "shard.bin"
    f.write_bytes(b"z" * 10)
    assert file_hash.known_sha256(f) == hashlib.sha256(b"z" * 10).hexdigest()
    assert str(f.resolve()) in cache.read_text()


def test_other_processes_sums_are_kept(tmp_path, cache):
    """Each rank hashes its share of a checkpoint and writes the cache: none drops the others'."""
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"1")
    b.write_bytes(b"2")
    file_hash.known_sha256(a)
    file_hash._known.cache_clear()
    kept = json.loads(cache.read_text())
    file_hash._known()  # another process read the cache before the first wrote ...
    cache.write_text(json.dumps({**kept, "/elsewhere": [1, 2, 3, 4, 5, "f" * 64]}))  # ... and one more came
    file_hash.known_sha256(b)
    assert {str(a.resolve()), str(b.resolve()), "/elsewhere"} <= set(json.loads(cache.read_text()))


def test_a_checkpoint_damaged_after_it_was_verified_is_caught(tmp_path, cache):
    """The load's check (checkpoint_files._first_bad_file) goes through the cache: a file of a verified
    checkpoint overwritten in place, same size and modification time, is still found."""
    from gptrain.train.checkpoint_files import _first_bad_file

    folder = tmp_path / "iter_0000002"
    folder.mkdir()
    data = folder / "__0_0.distcp"
    data.write_bytes(bytes(range(256)) * 40)
    (folder / "state.json").write_text(json.dumps({"checksums": {data.name: file_hash.file_sha256(data)}}))
    assert _first_bad_file(folder) is None
    assert str(data.resolve()) in cache.read_text()
    st = data.stat()
    time.sleep(0.01)
    with open(data, "r+b") as out:
        out.seek(100)
        out.write(b"\xff")
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    file_hash._known.cache_clear()
    assert _first_bad_file(folder) == data.name


def test_a_cache_write_that_fails_keeps_the_old_file_and_leaves_nothing_beside_it(tmp_path, monkeypatch):
    import os

    from gptrain.user_cache import keep

    target = tmp_path / "cache" / "table.json"
    keep(target, b"old")
    assert target.read_bytes() == b"old"

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    keep(target, b"new")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in target.parent.iterdir()) == ["table.json"]
