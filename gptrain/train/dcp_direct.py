"""Whole tensors out of a DCP checkpoint folder without importing ``torch.distributed.checkpoint``.

Importing DCP imports DTensor and sympy with it (most of a second), which one process that only
reads weights (``gptrain generate``, ``gptrain serve``) does not need. DCP's files are plain: a
pickled ``.metadata`` that maps each tensor's chunks to byte ranges of the shard files, each range a
``torch.save`` of the chunk. Here the metadata is unpickled into inert records (the names
``safe_dcp`` allows, nothing else: no code runs), each range is read with
``torch.load(weights_only=True)`` and copied into its region of the destination. Anything this
reader does not know (transforms such as compression, a chunk missing, a shape that differs) makes
``read_tensors`` return False and the caller goes through DCP itself, with its checks and messages.
"""
from __future__ import annotations

import collections
import io
import math
import pathlib
import pickle

import torch

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
    """A DCP record as pickle left it: its dataclass fields as attributes (an enum keeps its value).
    Equal and hashed by (fqn, offset), as DCP's ``MetadataIndex`` keys are."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    def _key(self):
        return type(self).__name__, self.__dict__.get("fqn"), tuple(self.__dict__.get("offset") or ())

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, _Record) and self._key() == other._key()


_RECORDS = {name: type(name, (_Record,), {}) for name in METADATA_RECORDS | PLAN_RECORDS | {"_StorageInfo"}}


class _RecordUnpickler(pickle.Unpickler):
    def __init__(self, file, path):
        super().__init__(file)
        self._path = path

    def find_class(self, module, name):
        return allowed_global(module, name, self._path, lambda _module, record: _RECORDS[record])

    def persistent_load(self, pid):
        raise UnsafeDCPMetadata(f"{self._path}: refuses persistent id {pid!r:.80} in DCP metadata")


def _metadata(folder: pathlib.Path):
    meta_path = folder / ".metadata"
    if meta_path.is_symlink():
        raise UnsafeDCPMetadata(f"{meta_path} is a symbolic link; a checkpoint's files are its own")
    with open(meta_path, "rb") as f:
        return _RecordUnpickler(f, meta_path).load()


def _region(target: torch.Tensor, offsets, sizes) -> torch.Tensor:
    for dim, (begin, length) in enumerate(zip(offsets, sizes)):
        target = target.narrow(dim, begin, length)
    return target


def read_tensors(folder, targets: dict[str, torch.Tensor]) -> bool:
    """Fills each ``targets[key]`` (a CPU tensor of the stored shape) with the checkpoint's entry
    ``key``; False, with nothing promised about the targets, where this reader cannot (the caller
    then reads through DCP). Raises UnsafeDCPMetadata as ``safe_dcp`` would."""
    folder = pathlib.Path(folder)
    meta = _metadata(folder)
    if type(meta).__name__ != "Metadata":
        raise UnsafeDCPMetadata(f"{folder / '.metadata'}: holds a {type(meta).__name__}, not DCP metadata")
    entries = getattr(meta, "state_dict_metadata", None) or {}
    storage = getattr(meta, "storage_data", None) or {}
    reads = []  # (file name, byte offset, length, destination region)
    for key, target in targets.items():
        entry = entries.get(key)
        if type(entry).__name__ != "TensorStorageMetadata" or tuple(entry.size) != tuple(target.shape) \
                or target.device.type != "cpu":
            return False
        chunks = getattr(entry, "chunks", None) or []
        if sum(math.prod(c.sizes) for c in chunks) != target.numel():
            return False
        for chunk in chunks:
            info = storage.get(_lookup(key, chunk.offsets))
            if info is None or getattr(info, "transform_descriptors", None):
                return False
            name = str(getattr(info, "relative_path", ""))
            if not name or name != pathlib.PurePath(name).name or name in (".", "..") \
                    or (folder / name).is_symlink():
                raise UnsafeDCPMetadata(f"{folder / '.metadata'}: names shard file {name!r} outside the "
                                        "checkpoint folder (or a symbolic link)")
            reads.append((name, info.offset, info.length, _region(target, chunk.offsets, chunk.sizes)))
    reads.sort(key=lambda r: (r[0], r[1]))  # each file front to back
    files = {}
    try:
        for name, offset, length, region in reads:
            f = files.get(name) or files.setdefault(name, open(folder / name, "rb"))
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


def _lookup(fqn: str, offsets) -> _Record:
    key = _RECORDS["MetadataIndex"]()
    key.__dict__.update(fqn=fqn, offset=torch.Size(offsets))
    return key
