"""Megatron's ``MMIDIDX`` indexed dataset: ``{prefix}.bin`` holds tokens, ``{prefix}.idx`` the index.

``.idx`` layout, little-endian, byte for byte as Megatron-LM writes and reads it:

    9 bytes   magic ``MMIDIDX\\x00\\x00``
    <Q        version, 1
    <B        token dtype code (see ``DTYPE_CODES``)
    <Q        sequence count S
    <Q        document-index count D (documents + 1: the list starts with 0)
    S x int32 sequence lengths in tokens
    S x int64 byte offset of each sequence in ``.bin``
    D x int64 document indices: document i is sequences [doc[i], doc[i+1])

Without sentence splitting, as in GPT pretraining, every document is one sequence (an empty
document has none). The writer streams tokens to a temporary ``.bin`` and renames both files into
place only in ``finalize``, so an interrupted run never leaves a pair that looks complete.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 when every id fits with margin, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def data_file(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.bin")


def index_file(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.idx")


class IndexedDatasetWriter:
    """Streams documents into ``{prefix}.bin/.idx``: ``add_document`` repeatedly, then ``finalize``."""

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"token dtype {self.dtype} has no MMIDIDX code")
        self._tmp_bin = Path(f"{self.prefix}.bin.tmp-{os.getpid()}")
        self._tmp_idx = Path(f"{self.prefix}.idx.tmp-{os.getpid()}")
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[np.ndarray] = []
        self._doc_ends: list[int] = [0]
        self._sequences = 0
        self.tokens = 0

    def add_document(self, tokens: np.ndarray) -> None:
        """Append one document (one sequence; an empty array adds an empty document)."""
        tokens = np.asarray(tokens)
        if tokens.size:
            self._bin.write(tokens.astype(self.dtype, copy=False).tobytes(order="C"))
            self._lengths.append(np.array([tokens.size], dtype=np.int32))
            self._sequences += 1
            self.tokens += int(tokens.size)
        self._doc_ends.append(self._sequences)

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append many documents at once: ``tokens`` concatenated, ``lengths`` one per document."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != len(tokens):
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {len(tokens)} tokens were given")
        self._bin.write(np.asarray(tokens).astype(self.dtype, copy=False).tobytes(order="C"))
        nonempty = lengths > 0
        self._lengths.append(lengths[nonempty].astype(np.int32))
        # documents with no tokens add no sequence, only a document-index entry (as Megatron does)
        ends = self._sequences + np.cumsum(nonempty)
        self._doc_ends.extend(ends.tolist())
        self._sequences = int(ends[-1]) if len(ends) else self._sequences
        self.tokens += len(tokens)

    def add_index(self, other: "IndexedDataset") -> None:
        """Append a whole existing dataset (used by merge): copies its token bytes and index."""
        if other.dtype != self.dtype:
            raise ValueError(f"cannot merge {other.prefix} (dtype {other.dtype}) into a {self.dtype} dataset")
        with open(data_file(other.prefix), "rb") as src:
            while chunk := src.read(1 << 24):
                self._bin.write(chunk)
        self._lengths.append(other.sizes.astype(np.int32))
        self._doc_ends.extend((other.doc_idx[1:] + self._sequences).tolist())
        self._sequences += len(other.sizes)
        self.tokens += int(other.sizes.sum())

    def finalize(self) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths):
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.asarray(self._doc_ends, dtype=np.int64)
        with open(self._tmp_idx, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(doc_idx)))
            f.write(lengths.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_idx.tobytes(order="C"))
            f.flush()
            os.fsync(f.fileno())
        # .bin first: a reader looks for the .idx, which appears last and only when both are whole
        os.replace(self._tmp_bin, data_file(self.prefix))
        os.replace(self._tmp_idx, index_file(self.prefix))

    def abort(self) -> None:
        """Drop the temporary files (after an error or an interrupt)."""
        if not self._bin.closed:
            self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            path.unlink(missing_ok=True)


class IndexedDataset:
    """Memory-mapped reader: ``len`` is the document count; ``ds[i]`` a document's tokens."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        idx_path, bin_path = index_file(prefix), data_file(prefix)
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise FileNotFoundError(f"indexed dataset {self.prefix}: {path} does not exist")
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if header[: len(MAGIC)] != MAGIC:
            raise ValueError(f"{idx_path} is not an MMIDIDX index (bad magic {header[:9]!r})")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[len(MAGIC):])
        if version != VERSION:
            raise ValueError(f"{idx_path}: index version {version}, only {VERSION} is known")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path}: unknown token dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        self._idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        offset = HEADER_SIZE
        self.sizes = np.frombuffer(self._idx, dtype=np.int32, count=n_seq, offset=offset)
        offset += self.sizes.nbytes
        self.pointers = np.frombuffer(self._idx, dtype=np.int64, count=n_seq, offset=offset)
        offset += self.pointers.nbytes
        self.doc_idx = np.frombuffer(self._idx, dtype=np.int64, count=n_doc, offset=offset)
        expected_bytes = int(self.sizes.sum(dtype=np.int64)) * self.dtype.itemsize
        actual_bytes = bin_path.stat().st_size
        if actual_bytes != expected_bytes:
            raise ValueError(f"{bin_path}: {actual_bytes} bytes, the index describes {expected_bytes}")
        self._bin = (
            np.memmap(bin_path, mode="r", dtype=self.dtype) if actual_bytes else np.zeros(0, dtype=self.dtype)
        )
        self._one_sequence_per_document = n_doc == n_seq + 1 and bool(
            np.array_equal(self.doc_idx, np.arange(n_doc))
        )

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def document_lengths(self) -> np.ndarray:
        """Tokens per document (the sum of its sequences' lengths), int64."""
        if self._one_sequence_per_document:
            return self.sizes.astype(np.int64)
        cum = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])
        return cum[self.doc_idx[1:]] - cum[self.doc_idx[:-1]]

    def __len__(self) -> int:
        return self.num_documents

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``doc``, read lazily from the map."""
        if not -self.num_documents <= doc < self.num_documents:
            raise IndexError(f"document {doc} out of range for {self.num_documents} documents")
        doc = doc % self.num_documents
        first, last = int(self.doc_idx[doc]), int(self.doc_idx[doc + 1])
        if first == last:
            start, total = 0, 0
        else:
            start = int(self.pointers[first]) // self.dtype.itemsize
            total = int(self.sizes[first:last].sum(dtype=np.int64))
        if length is None:
            length = total - offset
        if offset < 0 or length < 0 or offset + length > total:
            raise IndexError(f"slice [{offset}, {offset + length}) outside document {doc} of {total} tokens")
        return self._bin[start + offset : start + offset + length]
