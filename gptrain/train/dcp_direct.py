"""Whole tensors out of a DCP checkpoint folder without importing ``torch.distributed.checkpoint``.

Importing DCP imports DTensor and sympy with it (most of a second), which one process that only
reads weights (``gptrain generate``, ``gptrain serve``) does not need. DCP's files are plain: a
pickled ``.metadata`` that maps each tensor's chunks to byte ranges of the shard files, each range a
``torch.save`` of the chunk. Here the metadata is unpickled into inert records (the names
``safe_dcp`` allows, nothing else: no code runs, no state set on what it names; guarded_unpickler.py),
the shard names are checked as plain strings, the chunks must tile each tensor exactly, and each range
is read into its region of the destination: straight from the file where the saved tensor is the
plain, contiguous, uncompressed kind ``torch.save`` writes for DCP (its header unpickled into a
description, checked against the region), else with ``torch.load(weights_only=True)`` and a copy. Anything
this reader does not know (transforms such as compression, a chunk missing, a shape that differs) makes
``read_tensors`` return False and the caller goes through DCP itself, with its checks and messages.
"""
from __future__ import annotations

import collections
import io
import math
import os
import pathlib
import struct
import zipfile

import torch

from gptrain.guarded_unpickler import GuardedUnpickler

# the records DCP pickles into .metadata (and megatron-core's save plans), by module
METADATA_RECORDS = {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                    "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING", "BytesStorageMetadata"}
PLAN_RECORDS = {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"}
ALLOWED = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("collections", "OrderedDict"): collections.OrderedDict,
}
# a checkpoint_id saved as a path object (older gptrain saves); Python 3.13 names it pathlib._local.*
for _module in ("pathlib", "pathlib._local"):
    for _name in ("Path", "PosixPath", "PurePath", "PurePosixPath"):
        ALLOWED[(_module, _name)] = pathlib.PurePosixPath
    for _name in ("WindowsPath", "PureWindowsPath"):
        ALLOWED[(_module, _name)] = pathlib.PureWindowsPath


class UnsafeDCPMetadata(ValueError):
    """The checkpoint's metadata names something other than DCP's own records."""


def allowed_global(module: str, name: str, path, dcp_class):
    """What an unpickler of DCP metadata may build for ``module.name``: ``dcp_class(module, name)``
    for DCP's records, torch.Size, dtypes, sets and paths; anything else is refused."""
    if (module == "torch.distributed.checkpoint.metadata" and name in METADATA_RECORDS) \
            or (module == "torch.distributed.checkpoint.planner" and name in PLAN_RECORDS) \
            or (module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo"):
        return dcp_class(module, name)
    if (module, name) in ALLOWED:
        return ALLOWED[(module, name)]
    if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
        return vars(torch)[name]
    raise UnsafeDCPMetadata(f"{path}: refuses to load {module}.{name}: a DCP checkpoint's metadata may "
                            "only name DCP's metadata records, torch.Size, dtypes and paths")


class _Record:
    """A DCP record as pickle left it: its dataclass fields as attributes (an enum keeps its value)."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


_RECORD_NAMES = METADATA_RECORDS | PLAN_RECORDS | {"_StorageInfo"}


class DCPMetadataUnpickler(GuardedUnpickler):
    """DCP metadata: refusals are UnsafeDCPMetadata."""

    error = UnsafeDCPMetadata


class _RecordUnpickler(DCPMetadataUnpickler):
    def __init__(self, file, path):
        super().__init__(file, path)
        # fresh stand-in classes for each file: nothing one metadata does to them outlives it
        self._records = {name: type(name, (_Record,), {}) for name in _RECORD_NAMES}

    def find_class(self, module, name):
        return allowed_global(module, name, self._path, lambda _module, record: self._records[record])


def _metadata(folder: pathlib.Path):
    meta_path = folder / ".metadata"
    if meta_path.is_symlink():
        raise UnsafeDCPMetadata(f"{meta_path} is a symbolic link; a checkpoint's files are its own")
    with open(meta_path, "rb") as f:
        return _RecordUnpickler(f, meta_path).load()


def _ints(values, n: int) -> tuple[int, ...] | None:
    values = tuple(values) if isinstance(values, (tuple, list, torch.Size)) else ()
    return values if len(values) == n and all(type(v) is int and v >= 0 for v in values) else None


def _boxes(chunks, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """Each chunk's (offsets, sizes), or None unless they tile ``shape`` exactly: inside it, none
    overlapping another, their elements adding up to the whole."""
    boxes = []
    for chunk in chunks:
        offsets = _ints(getattr(chunk, "offsets", ()), len(shape))
        sizes = _ints(getattr(chunk, "sizes", ()), len(shape))
        if offsets is None or sizes is None or any(o + n > d for o, n, d in zip(offsets, sizes, shape)):
            return None
        boxes.append((offsets, sizes))
    if sum(math.prod(n) for _, n in boxes) != math.prod(shape):
        return None
    for i, (a, m) in enumerate(boxes):
        for b, n in boxes[:i]:
            if all(x < y + k and y < x + j for x, j, y, k in zip(a, m, b, n)) and math.prod(m) and math.prod(n):
                return None
    return boxes


def _region(target: torch.Tensor, offsets, sizes) -> torch.Tensor:
    for dim, (begin, length) in enumerate(zip(offsets, sizes)):
        target = target.narrow(dim, begin, length)
    return target


def shard_file(folder: pathlib.Path, name) -> str:
    """``name`` if it is a plain file name inside ``folder`` (string tests only), else refused."""
    if type(name) is not str or not name or "/" in name or "\\" in name or name in (".", "..") \
            or os.path.islink(os.path.join(folder, name)):
        raise UnsafeDCPMetadata(f"{folder / '.metadata'}: names shard file {name!r:.80} outside the checkpoint "
                                "folder (or a symbolic link)")
    return name


def read_tensors(folder, targets: dict[str, torch.Tensor]) -> bool:
    """Fills each ``targets[key]`` (a tensor of the stored shape: on the CPU, or on one GPU in any
    floating dtype, cast there) with the checkpoint's entry ``key``; False, with nothing promised
    about the targets, where this reader cannot (the caller then reads through DCP). Raises
    UnsafeDCPMetadata as ``safe_dcp`` would."""
    folder = pathlib.Path(folder)
    devices = {t.device for t in targets.values()}
    device = next(iter(devices), torch.device("cpu"))
    if len(devices) > 1 or device.type not in ("cpu", "cuda"):
        return False
    meta = _metadata(folder)
    if type(meta).__name__ != "Metadata":
        raise UnsafeDCPMetadata(f"{folder / '.metadata'}: holds a {type(meta).__name__}, not DCP metadata")
    entries = getattr(meta, "state_dict_metadata", None)
    storage = getattr(meta, "storage_data", None)
    if type(entries) is not dict or type(storage) is not dict:
        return False
    where = {}  # (fqn, chunk offsets) -> (file name, byte offset, length)
    for index, info in storage.items():
        fqn, offset = getattr(index, "fqn", None), getattr(index, "offset", None)
        start, length = getattr(info, "offset", None), getattr(info, "length", None)
        if type(fqn) is not str or type(start) is not int or type(length) is not int or start < 0 or length < 0:
            return False
        if getattr(info, "transform_descriptors", None):
            continue  # compressed or otherwise transformed: left to DCP if asked for
        where[(fqn, tuple(offset or ()))] = (shard_file(folder, getattr(info, "relative_path", None)), start, length)
    reads = []  # (file name, byte offset, length, destination region)
    for key, target in targets.items():
        entry = entries.get(key)
        if type(entry).__name__ != "TensorStorageMetadata" \
                or _ints(getattr(entry, "size", ()), target.dim()) != tuple(target.shape):
            return False
        boxes = _boxes(getattr(entry, "chunks", None) or [], tuple(target.shape))
        if boxes is None:
            return False
        for offsets, sizes in boxes:
            found = where.get((key, offsets))
            if found is None:
                return False
            reads.append((*found, _region(target, offsets, sizes)))
    reads.sort(key=lambda r: (r[0], r[1]))  # each file front to back
    files = {}
    to_device = DeviceStaging(device) if device.type == "cuda" and reads else None
    try:
        for name, offset, length, region in reads:
            f = files.get(name) or files.setdefault(name, open(folder / name, "rb"))
            if _read_saved_tensor(f, offset, length, region, to_device):
                continue
            f.seek(offset)
            data = f.read(length)
            if len(data) != length:
                return False
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(region.shape):
                return False
            region.copy_(tensor)
    finally:
        for f in files.values():
            f.close()
    return True


# ---- one torch.save'd tensor read straight into its destination

_STORAGE_DTYPES = {"FloatStorage": torch.float32, "BFloat16Storage": torch.bfloat16, "HalfStorage": torch.float16,
                   "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32,
                   "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
                   "BoolStorage": torch.bool}


class _StorageKind(str):
    """A storage class a saved tensor's header names (its name; nothing is built from it)."""


def _saved_tensor(storage, storage_offset, size, stride, requires_grad, hooks, metadata=None):
    """What ``torch._utils._rebuild_tensor_v2`` would rebuild, as a description."""
    return {"storage": storage, "offset": storage_offset, "size": size, "stride": stride}


class _SavedTensorUnpickler(GuardedUnpickler):
    """A ``torch.save``'d tensor's ``data.pkl``: the one call that rebuilds it, into a description."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _saved_tensor
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageKind(name)
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise self.error(f"{self._path}: a saved tensor's header names {module}.{name}")

    def persistent_load(self, pid):
        return pid


class _Window(io.RawIOBase):
    """Bytes ``start .. start + length`` of an open file, as a file of their own (zipfile reads it)."""

    def __init__(self, f, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, pos, whence=0):
        pos = (0, self.pos, self.length)[whence] + pos
        if not 0 <= pos <= self.length:  # never outside the record (a crafted offset is refused, not clamped)
            raise ValueError(f"seek to {pos} outside a record of {self.length} bytes")
        self.pos = pos
        return self.pos

    def readinto(self, buffer):
        view = memoryview(buffer).cast("B")[: self.length - self.pos]
        self.f.seek(self.start + self.pos)
        n = self.f.readinto(view)
        self.pos += n
        return n


def _contiguous_strides(size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _locate_saved_tensor(f, offset: int, length: int) -> tuple[int, torch.dtype, tuple[int, ...]] | None:
    """Where the raw bytes of the tensor ``torch.save`` wrote at ``offset`` of ``f`` start in ``f``,
    with its dtype and shape: only for the plain kind (a whole contiguous storage, little endian,
    stored uncompressed); None otherwise."""
    try:
        window = _Window(f, offset, length)
        archive = zipfile.ZipFile(io.BufferedReader(window, buffer_size=1 << 16))
        prefix = archive.namelist()[0].split("/")[0]
        if _small_member(archive, f"{prefix}/byteorder") != b"little":
            return None
        header = _SavedTensorUnpickler(io.BytesIO(_small_member(archive, f"{prefix}/data.pkl")), f.name).load()
        pid = header.get("storage") if isinstance(header, dict) else None
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and type(pid[2]) is str):
            return None
        dtype, numel = _STORAGE_DTYPES.get(str(pid[1])), pid[4]
        size = _ints(header["size"], len(header["size"])) if isinstance(header["size"], (tuple, list)) else None
        if dtype is None or size is None or header["offset"] != 0 or numel != math.prod(size) \
                or tuple(header["stride"]) != _contiguous_strides(size):
            return None
        info = archive.getinfo(f"{prefix}/data/{pid[2]}")
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != numel * dtype.itemsize:
            return None
        window.seek(info.header_offset)
        local = window.read(30)
        if len(local) != 30 or local[:4] != b"PK\x03\x04" or struct.unpack("<H", local[8:10])[0] != zipfile.ZIP_STORED:
            return None
        name_length, extra_length = struct.unpack("<HH", local[26:30])
        if window.read(name_length) != info.filename.encode():
            return None
        start = info.header_offset + 30 + name_length + extra_length
        if start + info.file_size > length:  # the data must lie inside the record
            return None
        return offset + start, dtype, size
    except Exception:  # noqa: BLE001 - anything unexpected in a record: torch.load reads it, with its own checks
        return None


def _small_member(archive: zipfile.ZipFile, name: str) -> bytes:
    """A short member of a saved tensor's archive (its header, its byte order), stored uncompressed."""
    info = archive.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED or info.file_size > 1 << 20:
        raise ValueError(f"{name}: not a plain saved tensor's {name.rsplit('/', 1)[-1]}")
    return archive.read(name)


def _read_saved_tensor(f, offset: int, length: int, region: torch.Tensor, to_device=None) -> bool:
    """The tensor ``torch.save`` wrote at ``offset`` of ``f`` read straight into ``region``: on the
    CPU with one copy from the file, where it is exactly the region's dtype; on a GPU through
    ``to_device`` (a ``DeviceStaging``), cast there from a stored floating dtype. Only the plain kind
    (``_locate_saved_tensor``) of the region's shape; False, with ``region`` untouched, otherwise."""
    if not region.is_contiguous() or region.numel() == 0:
        return False
    found = _locate_saved_tensor(f, offset, length)
    if found is None or found[2] != tuple(region.shape):
        return False
    start, dtype, _ = found
    if region.device.type == "cpu":
        if dtype != region.dtype:
            return False
        f.seek(start)
        view = memoryview(region.detach().reshape(-1).view(torch.uint8).numpy())
        return f.readinto(view) == len(view)
    if to_device is None or not (dtype.is_floating_point and region.dtype.is_floating_point):
        return False
    return to_device.read(f, start, dtype, region)


class DeviceStaging:
    """File bytes into GPU tensors: read into one of two pinned host buffers (the other's copy to the
    device meanwhile in flight), copied to a device buffer and cast into the destination there. Read
    into pinned pages, the file's bytes are copied once on the host, and the destination is never
    made on the CPU."""

    PIECE = 32 << 20  # bytes a piece

    def __init__(self, device: torch.device):
        self.host = [torch.empty(self.PIECE, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.free = [torch.cuda.Event(), torch.cuda.Event()]
        self.staged = torch.empty(self.PIECE, dtype=torch.uint8, device=device)
        self.turn = 0

    def read(self, f, start: int, dtype: torch.dtype, region: torch.Tensor) -> bool:
        with torch.cuda.device(self.staged.device):  # the events on the stream the copies run on
            return self._read(f, start, dtype, region)

    def _read(self, f, start: int, dtype: torch.dtype, region: torch.Tensor) -> bool:
        flat = region.detach().view(-1)
        total, item = region.numel() * dtype.itemsize, dtype.itemsize
        piece = self.PIECE // item * item
        f.seek(start)
        done = 0
        while done < total:
            n, i = min(piece, total - done), self.turn
            self.turn ^= 1
            self.free[i].synchronize()  # the buffer's last piece has left for the device
            if f.readinto(memoryview(self.host[i].numpy())[:n]) != n:
                return False
            staged = self.staged[:n]
            staged.copy_(self.host[i][:n], non_blocking=True)
            flat[done // item:(done + n) // item].copy_(staged.view(dtype))
            self.free[i].record()
            done += n
        return True
