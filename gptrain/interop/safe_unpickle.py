"""A restricted unpickler for torch checkpoint files (``torch.save``'s zip archive and the pre-1.6
sequential format): it loads what a Megatron-LM ``model_optim_rng.pt`` (or a torch_dist checkpoint's
``common_state``) holds without importing Megatron or numpy and without running code the pickle names.

``torch.load(weights_only=False)`` would import Megatron (and run anything the file names);
``weights_only=True`` refuses the Megatron enums, and allow-listing them means importing the real
classes, which differ between Megatron versions (an older megatron-core lacks
``InferenceCudaGraphScope``). So the unpickler's ``find_class`` is overridden, with the same
``persistent_load`` protocol as ``torch.serialization``, and allows only:

* torch's tensor rebuilders (wrapped so that serialized backward hooks are dropped and parameter
  state may only set plain attribute names), the storage classes, dtypes, ``torch.Size`` and
  ``torch.device``;
* ``collections.OrderedDict``, ``argparse.Namespace``, ``signal.Signals`` and a few harmless
  builtins (``set``, ``frozenset``, ``complex``, ``slice``, ``range``, ``bytes``, ``bytearray``,
  and ``_codecs.encode`` restricted to ``str -> latin-1`` as protocol 2 writes ``bytes``);
* any global of a ``megatron.*`` module (the enums in ``args``), and numpy's array/scalar
  reconstructors (``np.random.get_state()`` in Megatron's ``rng_state``), each as an *inert*
  placeholder (:class:`InertGlobal`) that records what it was built with and does nothing else.
* tensors pickled with attributes, rebuilt plain (:mod:`gptrain.interop.safe_tensor_state`).

Anything else raises :class:`UnsafeCheckpointError` naming ``module.name`` before it is called
(``torch.storage._load_from_bytes`` is refused too: it runs an unrestricted ``torch.load``).
Nothing is written next to the checkpoint. :func:`load_pickle_safely` gives the tensors on the CPU;
:func:`load_pickle_lazily` on the meta device, a tensor's bytes read only when asked.
"""
from __future__ import annotations

import _compat_pickle
import argparse
import builtins
import collections
import io
import os
import pickle
import re
import signal
import struct
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch

from gptrain.guarded_unpickler import GuardedUnpickler
from gptrain.interop.safe_tensor_state import TENSOR_STATE_GLOBALS

__all__ = ["UnsafeCheckpointError", "InertGlobal", "LazyStorages", "load_pickle_safely", "load_pickle_lazily",
           "load_pickle_bytes"]

class UnsafeCheckpointError(ValueError):
    """The pickle names a global outside the allow-list (it could run code when loaded)."""


class InertGlobal:
    """Stands in for a global that is recorded but never imported (Megatron enums, numpy arrays).

    Each allowed ``module.name`` gets its own subclass (so the pickle's ``REDUCE``, ``NEWOBJ`` and
    ``BUILD`` opcodes work on it); an instance records the arguments it was built with and the
    state set on it, nothing more. ``value`` is the single constructor argument of an enum member
    (``AttnBackend(5)`` -> 5).
    """

    inert_module = ""
    inert_name = ""

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "kwargs", kwargs)
        object.__setattr__(self, "state", None)
        return self

    def __init__(self, *args, **kwargs):  # noqa: D401 - recorded in __new__
        pass

    def __setstate__(self, state):
        object.__setattr__(self, "state", state)

    @property
    def value(self):
        return self.args[0] if len(self.args) == 1 else self.args

    @property
    def qualified_name(self) -> str:
        return f"{self.inert_module}.{self.inert_name}"

    def __eq__(self, other):
        if not isinstance(other, InertGlobal):
            return NotImplemented
        return (self.qualified_name, self.args, self.kwargs) == (other.qualified_name, other.args, other.kwargs)

    def __hash__(self):
        return hash(self.qualified_name)

    def __repr__(self):
        args = ", ".join(repr(a) for a in self.args)
        return f"<inert {self.qualified_name}({args})>"


_INERT_CLASSES: dict[tuple[str, str], type] = {}


def _inert_class(module: str, name: str) -> type:
    key = (module, name)
    if key not in _INERT_CLASSES:
        _INERT_CLASSES[key] = type(name.replace(".", "_"), (InertGlobal,),
                                   {"inert_module": module, "inert_name": name,
                                    "__module__": __name__})
    return _INERT_CLASSES[key]


def _signal_or_inert(value):
    """``signal.Signals(value)``; a value this platform lacks becomes an inert record."""
    try:
        return signal.Signals(value)
    except (ValueError, TypeError):
        return _inert_class("signal", "Signals")(value)


# allowed callables (wrappers over torch's rebuilders that ignore serialized hooks)


def _check_storage(storage) -> None:
    if not isinstance(storage, torch.storage.TypedStorage):
        raise UnsafeCheckpointError(f"a tensor rebuilder got {type(storage).__name__}, not a storage")


def _rebuild_tensor(storage, storage_offset, size, stride):
    _check_storage(storage)
    return torch._utils._rebuild_tensor(storage, storage_offset, tuple(size), tuple(stride))


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
    _check_storage(storage)
    t = torch._utils._rebuild_tensor(storage, storage_offset, tuple(size), tuple(stride))
    t.requires_grad = bool(requires_grad) and (t.is_floating_point() or t.is_complex())
    if isinstance(metadata, dict) and metadata:
        torch._utils.set_tensor_metadata(t, metadata)
    return t


def _rebuild_parameter(data, requires_grad, backward_hooks=None):
    if not isinstance(data, torch.Tensor):
        raise UnsafeCheckpointError(f"a parameter rebuilder got {type(data).__name__}, not a tensor")
    return torch.nn.Parameter(data, bool(requires_grad))


_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _rebuild_parameter_with_state(data, requires_grad, backward_hooks, state):
    param = _rebuild_parameter(data, requires_grad)
    parts = state if isinstance(state, tuple) else (state,)
    for part in parts:
        for k, v in (part or {}).items():
            if not (isinstance(k, str) and _IDENTIFIER.match(k) and not k.startswith("_")):
                raise UnsafeCheckpointError(f"refuses to set attribute {k!r} on a parameter")
            setattr(param, k, v)
    return param


def _latin1_encode(obj, encoding="latin1"):
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1"):
        raise UnsafeCheckpointError("refuses _codecs.encode other than str -> latin-1")
    return obj.encode("latin1")


_SAFE_GLOBALS = {  # (module, name) -> what the pickle gets
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter_with_state,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("argparse", "Namespace"): argparse.Namespace,
    ("signal", "Signals"): _signal_or_inert,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("_codecs", "encode"): _latin1_encode,
    **TENSOR_STATE_GLOBALS,  # tensors with attributes (megatron-core's fp32 main copies)
    **{("builtins", n): getattr(builtins, n)
       for n in ("set", "frozenset", "complex", "slice", "range", "bytes", "bytearray")},
}
_INERT_NUMPY = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
}


def _storage_dtype(storage_type) -> torch.dtype:
    if storage_type is torch.UntypedStorage:
        return torch.uint8
    if isinstance(storage_type, type) and issubclass(storage_type, torch.storage.TypedStorage):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return storage_type.dtype
    raise UnsafeCheckpointError(f"persistent id names {storage_type!r}, not a storage class")


def _decode(s):
    return s.decode("ascii") if isinstance(s, bytes) else s


# the restricted unpickler


class _RestrictedUnpickler(GuardedUnpickler):
    """``find_class`` from the allow-list only; storages come from ``load_storage``; no state set on an
    allowed class or function (GuardedUnpickler)."""

    error = UnsafeCheckpointError

    def __init__(self, file, path, load_storage: Callable[[str, torch.dtype, int, Any], torch.storage.TypedStorage]):
        super().__init__(file, path)
        self._load_storage = load_storage

    def find_class(self, module, name):
        # Python 2 names, as protocol 2 writes some globals (pickle's fix_imports)
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        key = (module, name)
        if key in _SAFE_GLOBALS:
            return _SAFE_GLOBALS[key]
        if module == "torch":
            obj = vars(torch).get(name)  # no getattr: torch's module __getattr__ imports submodules
            if isinstance(obj, torch.dtype):
                return obj
            if name.endswith("Storage") and (obj is torch.UntypedStorage or (
                    isinstance(obj, type) and issubclass(obj, torch.storage.TypedStorage))):
                return obj
        if (module == "megatron" or module.startswith("megatron.")) and re.match(r"^[\w.]+$", name):
            return _inert_class(module, name)
        if key in _INERT_NUMPY or (module == "numpy.dtypes" and _IDENTIFIER.match(name)):
            return _inert_class(module, name)
        raise UnsafeCheckpointError(
            f"{self._path}: refuses to load {module}.{name}: a checkpoint may only name tensors, "
            f"storages, dtypes, OrderedDict, argparse.Namespace, signal.Signals and Megatron enums")

    def persistent_load(self, pid):
        if not isinstance(pid, tuple) or not pid or _decode(pid[0]) != "storage":
            raise UnsafeCheckpointError(f"{self._path}: refuses persistent id {pid!r:.80} (only storages)")
        return self._load_storage(*pid[1:])


class LazyStorages:
    """Storages rebuilt on the meta device; ``materialize(t)`` reads one tensor's bytes when asked.

    ``open_reader()`` gives ``(read_bytes(key, nbytes), close())``; it is opened on first use and
    closed by ``close()``.
    """

    def __init__(self, open_reader, swap: bool):
        self._open_reader = open_reader
        self._reader = None
        self._swap = swap
        # meta storage _cdata -> (root key, dtype, root nbytes, byte offset of this view)
        self._meta: dict[int, tuple[str, torch.dtype, int, int]] = {}
        self._keep: list = []  # the meta storages, so that their _cdata stay unique
        self._real: dict[str, torch.UntypedStorage] = {}

    def meta_storage(self, key, dtype, nbytes):
        storage = torch.UntypedStorage(nbytes, device="meta")
        self.register(storage, key, dtype, nbytes, 0)
        return storage

    def register(self, storage, key, dtype, nbytes, byte_offset):
        self._keep.append(storage)
        self._meta[storage._cdata] = (key, dtype, nbytes, byte_offset)

    def _real_storage(self, key, dtype, nbytes) -> torch.UntypedStorage:
        if key not in self._real:
            if self._reader is None:
                self._reader = self._open_reader()
            self._real[key] = _bytes_to_storage(self._reader[0](key, nbytes), dtype, self._swap)
        return self._real[key]

    def materialize(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            return t
        key, dtype, nbytes, byte_offset = self._meta[t.untyped_storage()._cdata]
        real = self._real_storage(key, dtype, nbytes)
        if byte_offset or real.nbytes() != t.untyped_storage().nbytes():
            real = real[byte_offset: byte_offset + t.untyped_storage().nbytes()]
        out = torch.empty((0,), dtype=t.dtype)
        out.set_(real, t.storage_offset(), t.shape, t.stride())
        return out

    def close(self):
        if self._reader is not None:
            self._reader[1]()
            self._reader = None
        self._real.clear()


def _bytes_to_storage(data: bytes, dtype: torch.dtype, swap: bool) -> torch.UntypedStorage:
    if not data:
        return torch.UntypedStorage(0)
    storage = torch.UntypedStorage.from_buffer(data, dtype=torch.uint8)
    itemsize = dtype.itemsize // (2 if dtype.is_complex else 1)
    if swap and itemsize > 1:
        flipped = torch.empty(0, dtype=torch.uint8).set_(storage).view(-1, itemsize).flip(1).contiguous()
        storage = flipped.untyped_storage()
    return storage


class _FormatError(ValueError):
    """A file that is not a readable torch checkpoint (message already names the path)."""


def _open_error(path: Path, what: str) -> ValueError:
    return _FormatError(f"{path}: {what}")


def _unpickle(path, lazy: bool, source=None):
    """(object, LazyStorages) for a torch checkpoint file (or ``source``, its bytes as a file object);
    the LazyStorages is None when not lazy."""
    path = Path(path)
    if source is None and not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    try:
        if zipfile.is_zipfile(path if source is None else source):
            return _unpickle_zip(path, lazy, source)
        if source is not None:
            raise _open_error(path, "not a torch.save archive")
        return _unpickle_legacy(path, lazy)
    except (UnsafeCheckpointError, FileNotFoundError, _FormatError):
        raise
    except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, struct.error, KeyError, IndexError,
            AttributeError, TypeError, RuntimeError, ValueError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _open_error(path, f"not a readable torch checkpoint ({type(e).__name__}: {msg})") from e


def _unpickle_zip(path: Path, lazy: bool, source=None):
    """``source``: the archive's bytes as a file object (a pickle held inside another file); ``path``
    then only names it in messages."""
    with zipfile.ZipFile(source if source is not None else path) as zf:
        names = zf.namelist()
        pickles = [n for n in names if n.endswith("data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise _open_error(path, f"a zip without exactly one <archive>/data.pkl (found {len(pickles)})")
        prefix = pickles[0][: -len("data.pkl")]
        byteorder = zf.read(prefix + "byteorder").decode() if prefix + "byteorder" in names else "little"
        if byteorder not in ("little", "big"):
            raise _open_error(path, f"unknown byte order {byteorder!r}")
        swap = byteorder != sys.byteorder

        read_bytes = _zip_reader(path, zf, prefix)
        cache: dict[str, torch.storage.TypedStorage] = {}
        lazy_state = LazyStorages(lambda: _open_zip_reader(path, prefix), swap) if lazy else None

        def load_storage(storage_type, key, location, numel, *rest):
            dtype = _storage_dtype(storage_type)
            key = _decode(key)
            if not isinstance(key, str) or not re.match(r"^\w+$", key) or not isinstance(numel, int):
                raise UnsafeCheckpointError(f"{path}: malformed storage id {key!r}")
            if key not in cache:
                nbytes = numel * dtype.itemsize
                untyped = (lazy_state.meta_storage(key, dtype, nbytes) if lazy
                           else _bytes_to_storage(read_bytes(key, nbytes), dtype, swap))
                cache[key] = torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
            return cache[key]

        obj = _RestrictedUnpickler(io.BytesIO(zf.read(pickles[0])), path, load_storage).load()
    return obj, lazy_state


def _zip_reader(path: Path, zf: zipfile.ZipFile, prefix: str):
    def read_bytes(key: str, nbytes: int) -> bytes:
        name = f"{prefix}data/{key}"
        try:
            info = zf.getinfo(name)
        except KeyError:
            raise _open_error(path, f"the pickle names storage {key!r} but the zip has no {name}") from None
        if info.file_size < nbytes:
            raise _open_error(path, f"{name} holds {info.file_size} bytes, the pickle wants {nbytes}")
        return zf.read(info)[:nbytes]
    return read_bytes


def _open_zip_reader(path: Path, prefix: str):
    zf = zipfile.ZipFile(path)
    return _zip_reader(path, zf, prefix), zf.close


_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def _unpickle_legacy(path: Path, lazy: bool):
    """torch's pre-1.6 format: magic, protocol, sys info, the object, storage keys, raw storages."""
    with open(path, "rb") as f:
        head = f.read(512)
        f.seek(0)
        if len(head) >= 262 and head[257:262] == b"ustar":
            raise _open_error(path, "a tar-format torch checkpoint (torch < 0.4) is not supported")

        def no_storage(*_):
            raise UnsafeCheckpointError(f"{path}: a storage in a header pickle")

        def plain():
            return _RestrictedUnpickler(f, path, no_storage).load()

        if plain() != _LEGACY_MAGIC:
            raise _open_error(path, "neither a zip nor a legacy torch checkpoint (bad magic number)")
        if plain() != 1001:
            raise _open_error(path, "unsupported legacy torch protocol version")
        sys_info = plain()
        little = not isinstance(sys_info, dict) or sys_info.get("little_endian", True)

        roots: dict[str, tuple[torch.dtype, int]] = {}  # key -> (dtype, numel)
        typed: dict[str, torch.storage.TypedStorage] = {}
        views: dict[str, torch.storage.TypedStorage] = {}
        swap = not little and sys.byteorder == "little"
        offsets: dict[str, tuple[int, int]] = {}
        lazy_state = LazyStorages(lambda: _open_file_reader(path, offsets), swap) if lazy else None
        pending: dict[str, torch.UntypedStorage] = {}

        def load_storage(storage_type, root_key, location, numel, view_metadata=None, *rest):
            dtype = _storage_dtype(storage_type)
            root_key = _decode(root_key)
            if not isinstance(numel, int) or not isinstance(root_key, str):
                raise UnsafeCheckpointError(f"{path}: malformed storage id {root_key!r}")
            if root_key not in typed:
                nbytes = numel * dtype.itemsize
                roots[root_key] = (dtype, numel)
                untyped = (lazy_state.meta_storage(root_key, dtype, nbytes) if lazy
                           else torch.UntypedStorage(nbytes))
                pending[root_key] = untyped
                typed[root_key] = torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
            storage = typed[root_key]
            if view_metadata is None:
                return storage
            view_key, offset, size = view_metadata
            if view_key not in views:
                item = dtype.itemsize
                untyped = storage._untyped_storage[offset * item: (offset + size) * item]
                if lazy:
                    lazy_state.register(untyped, root_key, dtype, storage._untyped_storage.nbytes(), offset * item)
                views[view_key] = torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
            return views[view_key]

        obj = _RestrictedUnpickler(f, path, load_storage).load()
        keys = plain()
        for key in keys:
            key = _decode(key)
            if key not in roots:
                raise _open_error(path, f"storage key {key!r} listed but never used")
            dtype, numel = roots[key]
            (count,) = struct.unpack("<q", f.read(8))
            nbytes = count * dtype.itemsize
            if count != numel:
                raise _open_error(path, f"storage {key!r} holds {count} elements, the pickle wants {numel}")
            offsets[key] = (f.tell(), nbytes)
            if lazy:
                f.seek(nbytes, os.SEEK_CUR)
            else:
                data = f.read(nbytes)
                if len(data) != nbytes:
                    raise _open_error(path, f"truncated storage {key!r}")
                pending[key].copy_(_bytes_to_storage(data, dtype, swap))
    return obj, lazy_state


def _open_file_reader(path: Path, offsets: dict[str, tuple[int, int]]):
    fh = open(path, "rb")

    def read_bytes(key: str, nbytes: int) -> bytes:
        start, size = offsets[key]
        fh.seek(start)
        data = fh.read(size)
        if len(data) != size:
            raise _open_error(path, f"truncated storage {key!r}")
        return data
    return read_bytes, fh.close


def load_pickle_safely(path) -> dict:
    """``torch.load(path, map_location="cpu")`` for a checkpoint file, through the restricted
    unpickler: allowed globals only (the module docstring lists them), tensors on the CPU, Megatron
    enums and numpy arrays as inert :class:`InertGlobal` records. Raises
    :class:`UnsafeCheckpointError` naming the first refused ``module.name``."""
    obj, _ = _unpickle(path, lazy=False)
    return obj


def load_pickle_lazily(path) -> tuple[Any, LazyStorages]:
    """As :func:`load_pickle_safely`, but the tensors' storages are rebuilt on the meta device:
    ``(object, lazy)``, where ``lazy.materialize(t)`` reads one tensor's bytes (a CPU tensor) and
    ``lazy.close()`` closes the file and drops what was read."""
    return _unpickle(path, lazy=True)


def load_pickle_bytes(data: bytes, where) -> Any:
    """As :func:`load_pickle_safely`, for a ``torch.save`` archive held in memory (a byte entry of a
    DCP checkpoint, e.g. Megatron's ``common_state``); ``where`` names it in messages."""
    return _unpickle(where, False, source=io.BytesIO(data))[0]
