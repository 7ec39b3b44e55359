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
document has none). The writer streams tokens to a temporary ``.bin`` and renames the files into
place only in ``finalize``, so an interrupted run never leaves a pair that looks complete; a
killed writer's temporary files are removed by the next writer of the prefix.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from gptrain.file_hash import file_sha256

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 when every id fits with margin, else int32. Pass the largest id + 1
    where it exceeds the vocabulary's length (an out-of-range eod id)."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def data_file(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.bin")


def index_file(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.idx")


def sidecar_file(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.json")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_files(prefix: str | os.PathLike) -> list[Path]:
    """Delete ``{prefix}.*.tmp-PID`` files left by killed writers (their PID no longer runs)."""
    removed = []
    for path in glob.glob(glob.escape(str(prefix)) + ".*.tmp-*"):
        pid = path.rsplit(".tmp-", 1)[1].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            Path(path).unlink(missing_ok=True)
            removed.append(Path(path))
    return removed


_INDEX_HASHES: dict[tuple, str] = {}


def index_sha256(prefix: str | os.PathLike) -> str:
    """sha256 of ``{prefix}.idx`` (memoised per file version): the data's identity. The index maps
    depend only on the document lengths, which the ``.idx`` holds, and ``.bin``'s size is checked
    against it on open."""
    path = index_file(prefix)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _INDEX_HASHES:
        _INDEX_HASHES[key] = file_sha256(path)
    return _INDEX_HASHES[key]


BIN_SAMPLE_BLOCK = 1 << 20
BIN_SAMPLES = 16


def bin_fingerprint(path: str | os.PathLike) -> str:
    """What identifies a ``.bin`` cheaply but surely enough to tell another run's from its own: sha256
    over its size and 16 blocks of 1 MiB (the first, the last and 14 evenly spaced between; the
    whole file up to 16 MiB), at most 16 MiB read whatever the size. Two runs' token streams differ
    in their first MiB already. Not the full sha256, which every start would pay per GB of data:
    measured on a 1 GB file in the page cache (2-core CI machine), 0.9-1.1 s for the full sha256 against
    0.012 s for this (a terabyte corpus read cold from disk would take many minutes)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(b"gptrain-bin-sample/1 %d\n" % size)
    if size <= BIN_SAMPLES * BIN_SAMPLE_BLOCK:
        offsets = range(0, size, BIN_SAMPLE_BLOCK)
    else:
        last = size - BIN_SAMPLE_BLOCK
        offsets = [i * last // (BIN_SAMPLES - 1) for i in range(BIN_SAMPLES)]
    with open(path, "rb") as f:
        for offset in offsets:
            f.seek(offset)
            h.update(f.read(BIN_SAMPLE_BLOCK))
    return h.hexdigest()


INT32_MAX = int(np.iinfo(np.int32).max)


class IndexedDatasetWriter:
    """Streams documents into ``{prefix}.bin/.idx``: ``add_documents`` repeatedly, then ``finalize``.

    Sequence lengths and document ends stream to temporary files too, so memory does not grow
    with the number of documents; ``finalize`` assembles the ``.idx`` from them."""

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"token dtype {self.dtype} has no MMIDIDX code")
        remove_stale_temp_files(self.prefix)
        pid = os.getpid()
        self._tmp = {kind: Path(f"{self.prefix}.{kind}.tmp-{pid}") for kind in ("bin", "idx", "json", "sizes", "docs")}
        self._bin = open(self._tmp["bin"], "wb")
        self._sizes = open(self._tmp["sizes"], "wb")
        self._docs = open(self._tmp["docs"], "wb")
        self._documents = 0
        self._sequences = 0
        self.tokens = 0

    def add_document(self, tokens: np.ndarray) -> None:
        """Append one document (one sequence; an empty array adds an empty document)."""
        tokens = np.asarray(tokens)
        self.add_documents(tokens.reshape(-1), np.array([tokens.size], dtype=np.int64))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append many documents at once: ``tokens`` concatenated, ``lengths`` one per document."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if len(lengths) and int(lengths.max()) > INT32_MAX:
            raise ValueError(f"{self.prefix}: a document of {int(lengths.max())} tokens does not fit the index's "
                             f"int32 sequence length (at most {INT32_MAX}): split it")
        if int(lengths.sum()) != len(tokens):
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {len(tokens)} tokens were given")
        self._bin.write(np.asarray(tokens).astype(self.dtype, copy=False).tobytes(order="C"))
        nonempty = lengths > 0
        self._sizes.write(lengths[nonempty].astype(np.int32).tobytes())
        # documents with no tokens add no sequence, only a document-index entry (as Megatron does)
        ends = self._sequences + np.cumsum(nonempty, dtype=np.int64)
        self._docs.write(ends.tobytes())
        self._sequences = int(ends[-1]) if len(ends) else self._sequences
        self._documents += len(lengths)
        self.tokens += len(tokens)

    def add_index(self, other: "IndexedDataset") -> None:
        """Append a whole existing dataset (used by merge): copies its token bytes and index."""
        if other.dtype != self.dtype:
            raise ValueError(f"cannot merge {other.prefix} (dtype {other.dtype}) into a {self.dtype} dataset")
        with open(data_file(other.prefix), "rb") as src:
            while chunk := src.read(1 << 24):
                self._bin.write(chunk)
        for lo in range(0, len(other.sizes), 1 << 22):
            self._sizes.write(np.asarray(other.sizes[lo: lo + (1 << 22)], dtype=np.int32).tobytes())
        for lo in range(1, len(other.doc_idx), 1 << 22):
            self._docs.write((np.asarray(other.doc_idx[lo: lo + (1 << 22)]) + self._sequences).astype(np.int64).tobytes())
        self._sequences += len(other.sizes)
        self._documents += len(other.doc_idx) - 1
        self.tokens += int(other.sizes.sum(dtype=np.int64))

    def _write_index(self) -> str:
        """The ``.idx`` from the streamed lengths and document ends, a bounded chunk at a time; returns
        its sha256."""
        h = hashlib.sha256()
        chunk = 1 << 18
        with open(self._tmp["idx"], "wb") as f:
            def put(data: bytes) -> None:
                f.write(data)
                h.update(data)

            put(MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", CODE_OF_DTYPE[self.dtype])
                + struct.pack("<Q", self._sequences) + struct.pack("<Q", self._documents + 1))
            with open(self._tmp["sizes"], "rb") as sizes:
                while data := sizes.read(chunk * 4):
                    put(data)
                sizes.seek(0)
                offset = 0  # byte offset of each sequence in .bin, carried from chunk to chunk
                while data := sizes.read(chunk * 4):
                    part = np.frombuffer(data, dtype=np.int32).astype(np.int64) * self.dtype.itemsize
                    pointers = np.empty(len(part), dtype=np.int64)
                    pointers[0] = offset
                    np.cumsum(part[:-1], out=pointers[1:])
                    pointers[1:] += offset
                    offset += int(part.sum())
                    put(pointers.tobytes())
            put(np.zeros(1, np.int64).tobytes())
            with open(self._tmp["docs"], "rb") as docs:
                while data := docs.read(chunk * 8):
                    put(data)
            f.flush()
            os.fsync(f.fileno())
        return h.hexdigest()

    def finalize(self, sidecar: dict | None = None) -> None:
        """Publish ``.bin``, ``.idx`` and the ``.json`` sidecar as one unit: everything is written and
        synced under temporary names first; the sidecar records the ``.idx``'s size and sha256, so a
        crash between the renames leaves a sidecar that reads as stale, never one that is trusted; it
        records the ``.bin``'s size and ``bin_fingerprint`` too, so another run's ``.bin`` is refused."""
        for f in (self._bin, self._sizes, self._docs):
            f.flush()
        os.fsync(self._bin.fileno())
        for f in (self._bin, self._sizes, self._docs):
            f.close()
        idx_sha256 = self._write_index()
        if sidecar is not None:
            record = {**sidecar, "index": {"idx_bytes": self._tmp["idx"].stat().st_size, "idx_sha256": idx_sha256,
                                           "bin_bytes": self._tmp["bin"].stat().st_size,
                                           "bin_sample_sha256": bin_fingerprint(self._tmp["bin"])}}
            with open(self._tmp["json"], "w") as f:
                f.write(json.dumps(record, indent=2) + "\n")
                f.flush()
                os.fsync(f.fileno())
        else:
            sidecar_file(self.prefix).unlink(missing_ok=True)  # it would describe other data
        # .bin first: a reader looks for the .idx, which appears only when both are whole
        os.replace(self._tmp["bin"], data_file(self.prefix))
        os.replace(self._tmp["idx"], index_file(self.prefix))
        if sidecar is not None:
            os.replace(self._tmp["json"], sidecar_file(self.prefix))
        for kind in ("sizes", "docs"):
            self._tmp[kind].unlink(missing_ok=True)

    def abort(self) -> None:
        """Drop the temporary files (after an error or an interrupt)."""
        for f in (self._bin, self._sizes, self._docs):
            if not f.closed:
                f.close()
        for path in self._tmp.values():
            path.unlink(missing_ok=True)


def missing_dataset_message(prefix: str, path: Path) -> str:
    """'does not exist', pointing at ``{prefix}_{key}_document`` beside it where one is there
    (preprocess appends that suffix; --data-path needs it)."""
    message = f"indexed dataset {prefix}: {path} does not exist"
    found = sorted(glob.glob(glob.escape(prefix) + "_*_document.idx"))
    if found:
        names = " or ".join(p[: -len(".idx")] for p in found[:3])
        message += f"; did you mean {names}? (preprocess names its output PREFIX_KEY_document)"
    return message


class IndexedDataset:
    """Memory-mapped reader: ``len`` is the document count; ``ds[i]`` a document's tokens."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        idx_path, bin_path = index_file(prefix), data_file(prefix)
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise FileNotFoundError(missing_dataset_message(self.prefix, path))
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if header[: len(MAGIC)] != MAGIC:
            raise ValueError(f"{idx_path} is not an MMIDIDX index (bad magic {header[:9]!r})")
        if len(header) < HEADER_SIZE:
            raise ValueError(f"{idx_path} is truncated: {len(header)} bytes, shorter than the {HEADER_SIZE}-byte header")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[len(MAGIC):])
        if version != VERSION:
            raise ValueError(f"{idx_path}: index version {version}, only {VERSION} is known")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path}: unknown token dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        size, wanted = idx_path.stat().st_size, HEADER_SIZE + 12 * n_seq + 8 * n_doc
        if size < wanted:
            raise ValueError(f"{idx_path} is truncated or damaged: {size} bytes, its header describes {n_seq} "
                             f"sequences and {n_doc - 1} documents ({wanted} bytes)")
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
        self._check_offsets(idx_path)
        self._bin = (
            np.memmap(bin_path, mode="r", dtype=self.dtype) if actual_bytes else np.zeros(0, dtype=self.dtype)
        )
        self._one_sequence_per_document = n_doc == n_seq + 1 and bool(
            np.array_equal(self.doc_idx, np.arange(n_doc))
        )

    def _check_offsets(self, idx_path: Path) -> None:
        """Each sequence's byte offset must be where the lengths before it end, and the document
        index must run from 0 to the sequence count without going back: a damaged ``.idx`` would
        shift samples silently (chunked: memory stays bounded for any number of sequences)."""
        offset, step = 0, 1 << 22
        for lo in range(0, len(self.sizes), step):
            lengths = self.sizes[lo: lo + step].astype(np.int64) * self.dtype.itemsize
            expected = offset + np.concatenate(([0], np.cumsum(lengths[:-1])))
            bad = np.flatnonzero(self.pointers[lo: lo + step] != expected)
            if len(bad) or (self.sizes[lo: lo + step] < 0).any():
                at = lo + int(bad[0]) if len(bad) else lo
                raise ValueError(f"{idx_path} is damaged: sequence {at} starts at byte {int(self.pointers[at])} of "
                                 f"the .bin, the lengths before it end at {int(expected[at - lo])}")
            offset += int(lengths.sum())
        docs = self.doc_idx
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(self.sizes) or any(
                (np.diff(docs[lo: lo + step + 1]) < 0).any() for lo in range(0, len(docs) - 1, step)):
            raise ValueError(f"{idx_path} is damaged: its document index does not run from 0 to the "
                             f"{len(self.sizes)} sequences")

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    @property
    def num_sequences(self) -> int:
        """Non-empty documents (without sentence splitting): what Megatron's GPT datasets split and index."""
        return len(self.sizes)

    def get_sequence(self, seq: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``seq`` (megatron-core's ``IndexedDataset.get``)."""
        total = int(self.sizes[seq])
        if length is None:
            length = total - offset
        if offset < 0 or length < 0 or offset + length > total:
            raise IndexError(f"slice [{offset}, {offset + length}) outside sequence {seq} of {total} tokens")
        start = int(self.pointers[seq]) // self.dtype.itemsize + offset
        return self._bin[start: start + length]

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
