"""known_sha256: the sums of files already verified come from the user's cache, and any change to
a file (or a file too fresh to trust its timestamp) means hashing it again."""
from __future__ import annotations

import hashlib
import os
import time

import pytest

from gptrain import file_hash


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    file_hash._known.cache_clear()
    yield tmp_path / "cache" / "gptrain" / "file-sha256.json"
    file_hash._known.cache_clear()


def _old_file(path, data: bytes, age_s: float = 60.0):
    path.write_bytes(data)
    past = time.time() - age_s
    os.utime(path, (past, past))
    return path


def _hashing_fails(monkeypatch):
    def refuse(path):
        raise AssertionError(f"{path} was hashed again")
    monkeypatch.setattr(file_hash, "file_sha256", refuse)


def test_a_verified_file_is_not_read_again(tmp_path, cache, monkeypatch):
    f = _old_file(tmp_path / "shard.bin", b"x" * 100_000)
    assert file_hash.known_sha256(f) == hashlib.sha256(b"x" * 100_000).hexdigest()
    assert cache.is_file()
    file_hash._known.cache_clear()  # a new process: the sum comes from the file in the cache folder
    _hashing_fails(monkeypatch)
    assert file_hash.known_sha256(f) == hashlib.sha256(b"x" * 100_000).hexdigest()


def test_a_changed_file_is_hashed_again(tmp_path, cache):
    f = _old_file(tmp_path / "shard.bin", b"a" * 1000)
    assert file_hash.known_sha256(f) == hashlib.sha256(b"a" * 1000).hexdigest()
    _old_file(f, b"b" * 1000, age_s=30.0)  # same size, another modification time
    assert file_hash.known_sha256(f) == hashlib.sha256(b"b" * 1000).hexdigest()
    os.replace(_old_file(tmp_path / "other.bin", b"c" * 1000, age_s=30.0), f)  # same size and time, another inode
    assert file_hash.known_sha256(f) == hashlib.sha256(b"c" * 1000).hexdigest()


def test_a_fresh_file_is_not_remembered(tmp_path, cache):
    f = tmp_path / "new.bin"
    f.write_bytes(b"just written")
    assert file_hash.known_sha256(f) == hashlib.sha256(b"just written").hexdigest()
    assert not cache.exists()


def test_an_unreadable_cache_is_ignored_and_rewritten(tmp_path, cache):
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    f = _old_file(tmp_path / "shard.bin", b"z" * 10)
    assert file_hash.known_sha256(f) == hashlib.sha256(b"z" * 10).hexdigest()
    assert str(f.resolve()) in cache.read_text()


def test_the_bpe_tables_come_back_from_the_cache(tmp_path, monkeypatch):
    """A second tokenizer of the same files reads the tables kept by the first (no BPE rebuild) and
    encodes alike; a damaged cache file is rebuilt."""
    from gptrain import tokenizer as tk

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = tk.GPT2Tokenizer()
    text = "Hello world, naïve café 東京 😀 — it's"

    def refuse(*args):
        raise AssertionError("the BPE tables were built again")

    with monkeypatch.context() as m:
        m.setattr(tk, "_load_bpe", refuse)
        again = tk.GPT2Tokenizer()
    assert again.encode(text) == first.encode(text)
    assert (again.eod, again.vocab_size, again.max_id) == (first.eod, first.vocab_size, first.max_id) == (50256, 50257, 50256)
    (kept,) = (tmp_path / "cache" / "gptrain").glob("gpt2-bpe-*.npz")
    kept.write_bytes(kept.read_bytes()[:1000])  # cut short
    assert tk.GPT2Tokenizer().encode(text) == first.encode(text)
