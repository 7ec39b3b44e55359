"""Reading a DCP checkpoint without running code from it.

``torch.distributed.checkpoint``'s ``FileSystemReader`` reads ``.metadata`` with plain ``pickle``,
and its default load planner reads any entry the metadata marks as bytes with
``torch.load(weights_only=False)``: a crafted checkpoint folder would run code on ``--load``,
``serve`` or ``generate``. Here the metadata goes through an unpickler that builds DCP's own
metadata records, ``torch.Size``, dtypes and paths only, every entry must be a tensor's, and each
shard file must be a plain file name inside the checkpoint folder. The tensors themselves are read
by DCP with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import importlib
import pathlib
import warnings

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

from gptrain.train.dcp_direct import DCPMetadataUnpickler, UnsafeDCPMetadata, allowed_global, shard_file

__all__ = ["UnsafeDCPMetadata", "read_metadata_safely", "SafeFileSystemReader", "TensorsOnlyLoadPlanner",
           "load_safely"]


def _dcp_class(module: str, name: str):
    """DCP's own record class (megatron-core keeps each rank's save plan in the metadata, to reuse it:
    inert dataclasses of ``torch.distributed.checkpoint.planner``)."""
    return getattr(importlib.import_module(module), name)


class _MetadataUnpickler(DCPMetadataUnpickler):
    def find_class(self, module, name):
        return allowed_global(module, name, self._path, _dcp_class)


def read_metadata_safely(path, allow_bytes: bool = False) -> Metadata:
    """The ``.metadata`` of the DCP checkpoint folder ``path``, checked: tensor entries only (with
    ``allow_bytes``, byte entries too, which the caller reads through its own restricted unpickler:
    Megatron's torch_dist checkpoints hold their common state so), shard files named inside the folder."""
    folder = pathlib.Path(path)
    meta_path = folder / ".metadata"
    if meta_path.is_symlink():
        raise UnsafeDCPMetadata(f"{meta_path} is a symbolic link; a checkpoint's files are its own")
    with open(meta_path, "rb") as f:
        metadata = _MetadataUnpickler(f, meta_path).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeDCPMetadata(f"{meta_path}: holds a {type(metadata).__name__}, not DCP metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata) and allow_bytes:
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeDCPMetadata(f"{meta_path}: entry {key!r} is a {type(entry).__name__}; gptrain checkpoints "
                                    "hold tensors only")
    for info in (metadata.storage_data or {}).values():
        if getattr(info, "transform_descriptors", None):
            raise UnsafeDCPMetadata(f"{meta_path}: entries stored through transforms {info.transform_descriptors} "
                                    "(compression or an extension) are not read")
        shard_file(folder, getattr(info, "relative_path", None))
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with :func:`read_metadata_safely` in place of ``pickle.load`` (byte entries
    are allowed in the metadata with ``allow_bytes``; :class:`TensorsOnlyLoadPlanner` still refuses to
    read one)."""

    def __init__(self, path, allow_bytes: bool = False):
        super().__init__(path)
        self._allow_bytes = allow_bytes

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeDCPMetadata(f"{self.path}: per-rank metadata files are not part of gptrain checkpoints")
        metadata = read_metadata_safely(self.path, self._allow_bytes)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, refusing byte entries (which it would unpickle with code allowed)."""

    def load_bytes(self, read_item, value):
        raise UnsafeDCPMetadata(f"refuses the byte entry {read_item.dest_index.fqn!r}: gptrain checkpoints hold "
                                "tensors only")


def load_safely(state_dict: dict, path, allow_bytes: bool = False, no_dist: bool = False) -> None:
    """``dcp.load(state_dict, checkpoint_id=path)`` through the checked reader and planner (``no_dist``:
    this process reads alone, even inside a process group)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # reading alone is the intent
        dcp.load(state_dict, storage_reader=SafeFileSystemReader(path, allow_bytes), planner=TensorsOnlyLoadPlanner(),
                 no_dist=no_dist)
