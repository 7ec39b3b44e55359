"""Reading JSONL inputs: plain or compressed files, several files or globs, line by line as bytes."""
from __future__ import annotations

import bz2
import glob
import gzip
import io
import lzma
import os
import zlib
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


class InputError(ValueError):
    """An input file that cannot be read to its end (truncated or corrupt); names the file."""


class ZstdReader(io.RawIOBase):
    """Zstandard frames, one after another, that notices a truncated last frame (zstandard's
    ``stream_reader`` ends silently there)."""

    def __init__(self, raw: BinaryIO):
        import zstandard

        self.raw, self._zstd = raw, zstandard
        self._obj = zstandard.ZstdDecompressor().decompressobj()
        self._pending = b""
        self._started = False  # a frame has begun and not ended

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            data = self.raw.read(1 << 20)
            if not data:
                if self._started:
                    raise EOFError("the last zstd frame ends early")
                return 0
            while data:
                self._started = True
                self._pending += self._obj.decompress(data)
                if not self._obj.eof:
                    break
                data = self._obj.unused_data  # the next frame starts here
                self._obj = self._zstd.ZstdDecompressor().decompressobj()
                self._started = False
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


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
        return io.BufferedReader(ZstdReader(counter), buffer_size=1 << 20)
    return io.BufferedReader(counter, buffer_size=1 << 20)


BOM = b"\xef\xbb\xbf"
FORMATS = {".gz": "gzip", ".xz": "xz", ".lzma": "lzma", ".bz2": "bzip2", ".zst": "zstd", ".zstd": "zstd"}


def _decompression_errors() -> tuple:
    errors = [EOFError, OSError, lzma.LZMAError, zlib.error]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


def iter_lines(path: Path, counter_sink: list, max_line_bytes: int | None = None) -> Iterator[bytes | None]:
    """Lines of ``path`` as bytes, newline kept, a UTF-8 byte-order mark at the start dropped.
    A line longer than ``max_line_bytes`` is read past in pieces and yielded as None (memory stays
    bounded). ``counter_sink`` receives the byte counter first. A truncated or corrupt compressed
    file raises ``InputError`` naming it."""
    counter = CountingReader(open(path, "rb", buffering=0))
    counter_sink.append(counter)
    stream = open_decompressed(path, counter)
    limit = max_line_bytes + 1 if max_line_bytes else -1
    try:
        first = True
        while True:
            try:
                line = stream.readline(limit)
                if first and line.startswith(BOM):
                    line = line[len(BOM):]
                first = False
                if limit > 0 and len(line) >= limit and not line.endswith(b"\n"):
                    while (rest := stream.readline(1 << 20)) and not rest.endswith(b"\n"):
                        pass
                    yield None
                    continue
            except _decompression_errors() as err:
                kind = FORMATS.get(path.suffix.lower(), "input")
                if kind == "input":
                    raise InputError(f"{path}: cannot be read ({err})") from None
                what = "ends early (truncated)" if isinstance(err, EOFError) else f"is corrupt ({err})"
                raise InputError(f"{path}: the {kind} data {what}") from None
            if not line:
                return
            yield line
    finally:
        stream.close()
        counter.close()
