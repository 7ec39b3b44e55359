"""Megatron's ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR_OR_FILE`` on the ``tokenizers``
library: ``tokenizer.json`` read offline (a folder holding it, or the file itself), nothing downloaded
and no ``transformers`` needed.

Text is encoded as megatron-core's HuggingFaceTokenizer does by default (``--tokenizer-hf-include-special-
tokens`` off): the tokenizer's template (a Llama BOS, say) is not added, special tokens written in the
text are recognised. The end-of-document id is the eos token of the folder's ``tokenizer_config.json``
or ``special_tokens_map.json``, else the first of the usual end-of-text tokens the vocabulary holds.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")


def tokenizer_json(model: str | os.PathLike | None) -> Path:
    """``tokenizer.json`` of ``--tokenizer-model`` (a folder or the file), or a one-line error."""
    if not model:
        raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a folder holding "
                         "tokenizer.json, or the file)")
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"--tokenizer-model {model}: no such file or folder")
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"--tokenizer-model {model}: the folder holds no tokenizer.json (gptrain reads "
                                    "the tokenizers library's tokenizer.json only, offline)")
        return path / "tokenizer.json"
    return path


def _named_token(folder: Path, key: str) -> str | None:
    """``key`` (``eos_token``, ``bos_token``) from the folder's transformers files, where present."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            value = json.loads((folder / name).read_text(encoding="utf-8")).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, dict):  # an AddedToken written out: {"content": ..., ...}
            value = value.get("content")
        if isinstance(value, str) and value:
            return value
    return None


class HuggingFaceTokenizer:
    """A ``tokenizer.json``; ``eod`` is its end-of-text id (None where it has none), ``vocab_size`` the
    ids it can produce (with added tokens: Megatron's ``len(tokenizer)``)."""

    def __init__(self, model: str | os.PathLike | None, include_special_tokens: bool = False):
        from tokenizers import Tokenizer

        self.path = tokenizer_json(model)
        raw = self.path.read_bytes()  # read once: the tokenizer and its fingerprint come from the same bytes
        try:
            self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as err:  # the Rust parser raises plain Exceptions
            raise ValueError(f"{self.path}: not a tokenizers tokenizer.json ({str(err).splitlines()[0]})") from None
        self.include_special_tokens = include_special_tokens
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.max_id = max(vocab.values())
        # an id past the count (a hole before an added token) still needs its embedding row
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), self.max_id + 1)
        self.eod = self._special(vocab, "eos_token", EOS_NAMES)
        self.bos = self._special(vocab, "bos_token", BOS_NAMES)
        self.fingerprint = hashlib.sha256(raw + b"\0eod=%d" % (-1 if self.eod is None else self.eod)).hexdigest()
        self.files = None  # GPT-2's vocab/merges pair (convert and Megatron's args look for it)

    def _special(self, vocab: dict, key: str, names: tuple[str, ...]) -> int | None:
        named = _named_token(self.path.parent, key)
        if named is not None:
            if named not in vocab:
                raise ValueError(f"{self.path.parent}: its {key} {named!r} is not in {self.path.name}'s vocabulary")
            return vocab[named]
        return next((vocab[n] for n in names if n in vocab), None)

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of ``text`` (special tokens in it are recognised, as transformers does)."""
        try:
            return self._tok.encode(text, add_special_tokens=self.include_special_tokens).ids
        except TypeError:  # a lone surrogate: the binding's error, made the one preprocess counts
            text.encode("utf-8")  # raises UnicodeEncodeError
            raise

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.uint32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_texts(self, ids) -> list[str]:
        """Each id's own text (``decode([id])`` of each)."""
        return [self.decode([i]) for i in ids]

    def token_byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes of text each id stands for (0 for special tokens): bits per byte in evaluate."""
        from gptrain.tokenizer import _byte_decoder

        byte_level = "ByteLevel" in json.dumps(json.loads(self._tok.to_str()).get("decoder"))
        table = _byte_decoder()
        special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if i in special:
                continue
            if byte_level and all(ch in table for ch in token):
                out[i] = len(token)  # one stand-in character per byte
            elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                out[i] = 1  # sentencepiece's byte fallback
            else:
                out[i] = len(token.replace("\u2581", " ").encode("utf-8"))
        return out

    def describe(self) -> dict:
        return {"type": "HuggingFaceTokenizer", "sha256": self.fingerprint, "vocab_size": self.vocab_size,
                "eod": self.eod, "bos": self.bos, "max_id": self.max_id, "model": str(self.path),
                "include_special_tokens": self.include_special_tokens}
