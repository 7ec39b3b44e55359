"""Reading JSONL inputs: plain or compressed files, several files or globs, line by line as bytes."""
from __future__ import annotations

import bz2
import glob
import gzip
import io
import lzma
import os
from pathlib import Path
from typing import BinaryIO, Iterator


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Files named by ``patterns`` (paths or globs), in the order given, globs sorted; each must exist."""
    files: list[Path] = []
    for pattern in patterns:
        if any(ch in pattern for ch in "*?["):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise FileNotFoundError(f"--input {pattern}: the pattern matches no file")
            files.extend(Path(m) for m in matches if Path(m).is_file())
        else:
            path = Path(pattern)
            if not path.exists():
                raise FileNotFoundError(f"--input {pattern}: no such file")
            if not path.is_file():
                raise IsADirectoryError(f"--input {pattern}: not a file (give files or a glob such as DIR/*.jsonl)")
            if not os.access(path, os.R_OK):
                raise PermissionError(f"--input {pattern}: not readable")
            files.append(path)
    return files


class CountingReader(io.RawIOBase):
    """Wraps a raw file and counts bytes read, so progress can be shown for compressed inputs."""

    def __init__(self, raw: BinaryIO):
        self.raw = raw
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.raw.readinto(buffer)
        self.bytes_read += n or 0
        return n

    def close(self) -> None:
        self.raw.close()
        super().close()


def open_decompressed(path: Path, counter: CountingReader) -> BinaryIO:
    """A binary stream of ``path``'s content, decompressed by its suffix (.gz .xz .bz2 .zst)."""
    suffix = path.suffix.lower()
    if suffix == ".gz":
        return gzip.GzipFile(fileobj=counter, mode="rb")
    if suffix in (".xz", ".lzma"):
        return lzma.LZMAFile(counter, mode="rb")
    if suffix == ".bz2":
        return bz2.BZ2File(counter, mode="rb")
    if suffix in (".zst", ".zstd"):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(counter, read_across_frames=True)
    return io.BufferedReader(counter, buffer_size=1 << 20)


def iter_lines(path: Path, counter_sink: list) -> Iterator[bytes]:
    """Lines of ``path`` as bytes, newline kept. ``counter_sink`` receives the byte counter first."""
    counter = CountingReader(open(path, "rb", buffering=0))
    counter_sink.append(counter)
    stream = open_decompressed(path, counter)
    try:
        reader = stream if isinstance(stream, io.BufferedIOBase) and hasattr(stream, "readline") else io.BufferedReader(stream)
        yield from reader
    finally:
        stream.close()
        counter.close()
