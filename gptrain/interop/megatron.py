"""Read Megatron-LM checkpoints (``--ckpt-format torch``: ``model_optim_rng.pt`` per rank) into full
gptrain tensors, without importing Megatron and without running code named by the pickle.

Loading
-------
A ``model_optim_rng.pt`` is a pickle that names ``argparse.Namespace``, ``signal.Signals``, a few
Megatron enums and torch's tensor rebuilders. ``torch.load(weights_only=False)`` would import
Megatron (and run anything the file names); ``torch.load(weights_only=True)`` refuses the Megatron
enums, and allow-listing them there means importing the real classes, which differ between
Megatron versions (an older megatron-core lacks ``InferenceCudaGraphScope``, so even the full
``torch.load`` fails on these fixtures). So this module has its own restricted unpickler
(``pickle.Unpickler`` with ``find_class`` overridden), reading the zip archive torch writes (and the
pre-1.6 sequential format of older releases) with the same ``persistent_load`` protocol as
``torch.serialization``. ``find_class`` allows only:

* torch's tensor rebuilders (``torch._utils._rebuild_tensor``, ``_rebuild_tensor_v2``,
  ``_rebuild_parameter``, ``_rebuild_parameter_with_state``; wrapped so that serialized backward
  hooks are dropped and parameter state may only set plain attribute names), the storage classes
  (``torch.FloatStorage``, ``torch.BFloat16Storage``, ..., ``torch.UntypedStorage``), dtypes
  (``torch.float32``, ...), ``torch.Size`` and ``torch.device``;
* ``collections.OrderedDict``, ``argparse.Namespace``, ``signal.Signals`` and a few harmless
  builtins (``set``, ``frozenset``, ``complex``, ``slice``, ``range``, ``bytes``, ``bytearray``,
  and ``_codecs.encode`` restricted to ``str -> latin-1`` as protocol 2 writes ``bytes``);
* any global of a ``megatron.*`` module (the enums in ``args``), and numpy's array/scalar
  reconstructors (``np.random.get_state()`` in Megatron's ``rng_state``), each as an *inert*
  placeholder (:class:`InertGlobal`): a class made here that records the module, the name, the
  arguments and the state it was built with, and does nothing else. Megatron and numpy are never
  imported.

Anything else raises :class:`UnsafeCheckpointError` naming ``module.name`` before it is called
(``torch.storage._load_from_bytes`` is refused too: it runs an unrestricted ``torch.load``).
The loader only reads: nothing is written next to the checkpoint.

Reading a Megatron checkpoint only materializes the model's tensors: storages are first rebuilt on
the meta device, and only the bytes of the tensors that become gptrain parameters are read, so
the optimizer state a checkpoint may also hold costs no memory.

Layouts
-------
megatron-core's ``GPTModel`` (``embedding.*``, ``decoder.layers.N.*``, ``output_layer.weight``;
local and Transformer Engine layer specs) and the legacy GPT model of Megatron-LM,
Megatron-DeepSpeed and the 345M release (``language_model.{embedding,encoder|transformer}.*``,
``word_embeddings_for_head`` on the last pipeline stage). Tensor-parallel shards are concatenated
(QKV and fc1 on dim 0, proj and fc2 weights on dim 1, the vocabulary-parallel embeddings on dim 0,
LayerNorms and row-parallel biases from rank 0), pipeline stages (and virtual-pipeline chunks,
``model0``, ``model1``, ...) merged with stage-local layer numbers made global. The legacy fused QKV
is reordered per tensor-parallel shard to the per-head ``[heads, 3, head_dim]`` rows gptrain uses,
according to ``checkpoint_version`` (0: ``[3, heads, dim]``, 1.0: ``[heads, dim, 3]``, >= 2.0 and
megatron-core: already per head).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILENAME = "model_optim_rng.pt"

__all__ = [
    "UnsafeCheckpointError", "InertGlobal", "MegatronCheckpoint", "load_pickle_safely",
    "find_checkpoint", "read_megatron_checkpoint",
]


class UnsafeCheckpointError(ValueError):
    """The pickle names a global outside the allow-list (it could run code when loaded)."""


# ----------------------------------------------------------------------------------------------
# inert placeholders


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


# ----------------------------------------------------------------------------------------------
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


_TORCH_FUNCTIONS = {
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter_with_state,
}
_SAFE_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("argparse", "Namespace"): argparse.Namespace,
    ("signal", "Signals"): _signal_or_inert,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("_codecs", "encode"): _latin1_encode,
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


# ----------------------------------------------------------------------------------------------
# the restricted unpickler


class _RestrictedUnpickler(pickle.Unpickler):
    """``find_class`` from the allow-list only; storages come from ``load_storage``."""

    def __init__(self, file, path, load_storage: Callable[[str, torch.dtype, int, Any], torch.storage.TypedStorage]):
        super().__init__(file)
        self._path = path
        self._load_storage = load_storage

    def find_class(self, module, name):
        # Python 2 names, as protocol 2 writes some globals (pickle's fix_imports)
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        key = (module, name)
        if key in _TORCH_FUNCTIONS:
            return _TORCH_FUNCTIONS[key]
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


class _Lazy:
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


def _unpickle(path, lazy: bool):
    """(object, _Lazy) for a torch checkpoint file; the _Lazy is None when not lazy."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    try:
        if zipfile.is_zipfile(path):
            return _unpickle_zip(path, lazy)
        return _unpickle_legacy(path, lazy)
    except (UnsafeCheckpointError, FileNotFoundError, _FormatError):
        raise
    except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, struct.error, KeyError,
            AttributeError, TypeError, RuntimeError, ValueError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _open_error(path, f"not a readable torch checkpoint ({type(e).__name__}: {msg})") from e


def _unpickle_zip(path: Path, lazy: bool):
    with zipfile.ZipFile(path) as zf:
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
        lazy_state = _Lazy(lambda: _open_zip_reader(path, prefix), swap) if lazy else None

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
        lazy_state = _Lazy(lambda: _open_file_reader(path, offsets), swap) if lazy else None
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


# ----------------------------------------------------------------------------------------------
# locating a checkpoint


_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


def _iteration_dir(root: Path, iteration) -> Path:
    return root / ("release" if iteration == "release" else f"iter_{int(iteration):07d}")


def _available(root: Path) -> str:
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and (_ITER_DIR.match(p.name) or p.name == "release"))
    return ", ".join(found) if found else "none"


def _normalize_iteration(iteration, where) -> int | str:
    if isinstance(iteration, bool):
        raise ValueError(f"{where}: iteration must be a number or 'release', got {iteration!r}")
    if isinstance(iteration, int):
        if iteration < 0:
            raise ValueError(f"{where}: iteration must be >= 0, got {iteration}")
        return iteration
    text = str(iteration).strip()
    if text == "release":
        return "release"
    if text.isdigit():
        return int(text)
    raise ValueError(f"{where}: iteration must be a number or 'release', got {iteration!r}")


def find_checkpoint(root, iteration: int | str | None = None) -> tuple[Path, int | str]:
    """The folder holding one iteration's ``mp_rank_*`` folders, and that iteration.

    ``root`` is what Megatron's ``--load`` names: the iteration comes from ``iteration`` (like
    ``--ckpt-step``: a number or ``'release'``), else from ``latest_checkpointed_iteration.txt``
    (a number or ``release``), else (no tracker) the latest ``iter_XXXXXXX`` folder or ``release``.
    ``root`` may also be an iteration folder itself (``.../iter_0000020``).
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such checkpoint directory")
    if any(p.name.startswith("mp_rank_") for p in root.iterdir()):  # an iteration folder itself
        m = _ITER_DIR.match(root.name)
        found = int(m.group(1)) if m else ("release" if root.name == "release" else root.name)
        if iteration is not None and _normalize_iteration(iteration, root) != found:
            raise ValueError(f"{root}: is the folder of iteration {found}, not {iteration!r}")
        return root, found
    if iteration is not None:
        it = _normalize_iteration(iteration, root)
        folder = _iteration_dir(root, it)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: no checkpoint of iteration {it} (available: {_available(root)})")
        return folder, it
    tracker = root / TRACKER_FILENAME
    if tracker.is_file():
        text = tracker.read_text().strip()
        try:
            it = _normalize_iteration(text, tracker)
        except ValueError:
            raise ValueError(f"{tracker}: expected an iteration number or 'release', got {text!r}") from None
        folder = _iteration_dir(root, it)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: missing, though {tracker} names iteration {it}")
        return folder, it
    iters = sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _ITER_DIR.match(p.name)))
    if iters:
        return _iteration_dir(root, iters[-1]), iters[-1]
    if (root / "release").is_dir():
        return root / "release", "release"
    raise FileNotFoundError(f"{root}: no {TRACKER_FILENAME}, iter_XXXXXXX/ or release/ folder: "
                            f"not a Megatron checkpoint")


# ----------------------------------------------------------------------------------------------
# key layouts

# rule: "cat0" / "cat1" concatenate the tensor-parallel shards on that dim, "rank0" takes rank 0's
_CORE_LAYER = {
    "input_layernorm.weight": ("ln1.weight", "rank0"),
    "input_layernorm.bias": ("ln1.bias", "rank0"),
    "self_attention.linear_qkv.layer_norm_weight": ("ln1.weight", "rank0"),  # Transformer Engine
    "self_attention.linear_qkv.layer_norm_bias": ("ln1.bias", "rank0"),
    "self_attention.linear_qkv.weight": ("attn.qkv.weight", "cat0"),
    "self_attention.linear_qkv.bias": ("attn.qkv.bias", "cat0"),
    "self_attention.linear_proj.weight": ("attn.proj.weight", "cat1"),
    "self_attention.linear_proj.bias": ("attn.proj.bias", "rank0"),
    "pre_mlp_layernorm.weight": ("ln2.weight", "rank0"),
    "pre_mlp_layernorm.bias": ("ln2.bias", "rank0"),
    "mlp.linear_fc1.layer_norm_weight": ("ln2.weight", "rank0"),  # Transformer Engine
    "mlp.linear_fc1.layer_norm_bias": ("ln2.bias", "rank0"),
    "mlp.linear_fc1.weight": ("mlp.fc1.weight", "cat0"),
    "mlp.linear_fc1.bias": ("mlp.fc1.bias", "cat0"),
    "mlp.linear_fc2.weight": ("mlp.fc2.weight", "cat1"),
    "mlp.linear_fc2.bias": ("mlp.fc2.bias", "rank0"),
}
_CORE_GLOBAL = {
    "embedding.word_embeddings.weight": ("word_embeddings.weight", "cat0"),
    "embedding.position_embeddings.weight": ("position_embeddings.weight", "rank0"),
    "decoder.final_layernorm.weight": ("final_layernorm.weight", "rank0"),
    "decoder.final_layernorm.bias": ("final_layernorm.bias", "rank0"),
    "output_layer.weight": ("output_layer.weight", "cat0"),
}
_LEGACY_LAYER = {
    "input_layernorm.weight": ("ln1.weight", "rank0"),
    "input_layernorm.bias": ("ln1.bias", "rank0"),
    "query_key_value.weight": ("attn.qkv.weight", "qkv"),
    "query_key_value.bias": ("attn.qkv.bias", "qkv"),
    "dense.weight": ("attn.proj.weight", "cat1"),
    "dense.bias": ("attn.proj.bias", "rank0"),
    "post_attention_layernorm.weight": ("ln2.weight", "rank0"),
    "post_attention_layernorm.bias": ("ln2.bias", "rank0"),
    "mlp.dense_h_to_4h.weight": ("mlp.fc1.weight", "cat0"),
    "mlp.dense_h_to_4h.bias": ("mlp.fc1.bias", "cat0"),
    "mlp.dense_4h_to_h.weight": ("mlp.fc2.weight", "cat1"),
    "mlp.dense_4h_to_h.bias": ("mlp.fc2.bias", "rank0"),
}
_LEGACY_GLOBAL = {
    "language_model.embedding.word_embeddings.weight": ("word_embeddings.weight", "cat0"),
    "language_model.embedding.position_embeddings.weight": ("position_embeddings.weight", "rank0"),
    "word_embeddings_for_head.weight": ("output_layer.weight", "cat0"),
    "language_model.output_layer.weight": ("untied_output_layer.weight", "cat0"),
}
_CORE_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LEGACY_LAYER_KEY = re.compile(r"^language_model\.(?:encoder|transformer)\.layers\.(\d+)\.(.+)$")
_LEGACY_FINAL = re.compile(r"^language_model\.(?:encoder|transformer)\.final_layernorm\.(weight|bias)$")
_IGNORED = re.compile(r"(\._extra_state|\.inv_freq|^_extra_state)$")


def _flatten(tree, prefix="") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


def _layout(keys) -> str:
    if any(k.startswith("language_model.") for k in keys):
        return "legacy"
    if any(k.startswith(("decoder.", "embedding.")) for k in keys):
        return "megatron-core"
    raise ValueError("neither megatron-core GPTModel keys (embedding.*, decoder.*) nor legacy GPT keys "
                     f"(language_model.*): first keys {sorted(keys)[:3]}")


def _map_key(key: str, layout: str):
    """(gptrain name with a local layer index or None, local layer index or None, rule); None if ignored."""
    if _IGNORED.search(key):
        return None
    if layout == "megatron-core":
        if key in _CORE_GLOBAL:
            name, rule = _CORE_GLOBAL[key]
            return name, None, rule
        m = _CORE_LAYER_KEY.match(key)
        if m and m.group(2) in _CORE_LAYER:
            name, rule = _CORE_LAYER[m.group(2)]
            return name, int(m.group(1)), rule
    else:
        if key in _LEGACY_GLOBAL:
            name, rule = _LEGACY_GLOBAL[key]
            return name, None, rule
        m = _LEGACY_FINAL.match(key)
        if m:
            return f"final_layernorm.{m.group(1)}", None, "rank0"
        m = _LEGACY_LAYER_KEY.match(key)
        if m:
            sub = re.sub(r"^(?:self_attention|attention)\.", "", m.group(2))
            if sub in _LEGACY_LAYER and (sub.startswith(("input_", "post_", "mlp.")) or sub != m.group(2)):
                name, rule = _LEGACY_LAYER[sub]
                return name, int(m.group(1)), rule
    raise KeyError(key)


def _legacy_qkv_to_per_head(t: torch.Tensor, version: float, local_heads: int) -> torch.Tensor:
    """One tensor-parallel shard's fused QKV rows (Megatron's ``fix_query_key_value_ordering``)."""
    if version >= 2.0:
        return t
    rest = t.shape[1:]
    if version == 0:
        t = t.reshape(3, local_heads, -1, *rest).transpose(0, 1)  # [3, np, hn] -> [np, 3, hn]
    elif version == 1.0:
        t = t.reshape(local_heads, -1, 3, *rest).transpose(1, 2)  # [np, hn, 3] -> [np, 3, hn]
    else:
        raise ValueError(f"checkpoint_version {version} has no known QKV order (0, 1.0 or >= 2.0)")
    return t.reshape(-1, *rest).contiguous()


# ----------------------------------------------------------------------------------------------
# reading a whole checkpoint


@dataclass
class MegatronCheckpoint:
    args: dict
    iteration: int | str
    state: dict[str, torch.Tensor]
    checkpoint_version: float | None
    layout: str
    tp: int
    pp: int
    output_layer_matches_embeddings: bool | None

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """``state`` plus the tied ``output_layer.weight``, for ``GPT.load_state_dict(strict=True)``."""
        return {**self.state, "output_layer.weight": self.state["word_embeddings.weight"]}

    def gpt_config(self, vocab_size: int | None = None, **overrides):
        """A ``GPTConfig`` describing this checkpoint. ``vocab_size`` (the unpadded vocabulary) comes
        from ``args`` for Megatron's NullTokenizer (``--vocab-size`` + 1) and GPT2BPETokenizer (50257);
        give it for other tokenizers. Its padding must give the checkpoint's embedding rows."""
        from gptrain.model.gpt import GPTConfig

        a = self.args
        if vocab_size is None:
            tok = a.get("tokenizer_type")
            if tok == "NullTokenizer" and isinstance(a.get("vocab_size"), int):
                vocab_size = a["vocab_size"] + 1
            elif tok in ("GPT2BPETokenizer", None):
                vocab_size = 50257
            else:
                raise ValueError(f"give vocab_size: the checkpoint's tokenizer {tok!r} does not say it")
        hidden = self.state["word_embeddings.weight"].shape[1]
        cfg = dict(
            num_layers=a["num_layers"], hidden_size=hidden, num_attention_heads=a["num_attention_heads"],
            ffn_hidden_size=self.state["layers.0.mlp.fc1.weight"].shape[0],
            seq_length=a.get("seq_length") or self.state["position_embeddings.weight"].shape[0],
            max_position_embeddings=self.state["position_embeddings.weight"].shape[0],
            vocab_size=vocab_size, make_vocab_size_divisible_by=a.get("make_vocab_size_divisible_by") or 128,
            tensor_parallel_size=self.tp,
            layernorm_epsilon=a.get("norm_epsilon") or a.get("layernorm_epsilon") or 1e-5,
        )
        for name in ("init_method_std", "attention_dropout", "hidden_dropout"):
            if isinstance(a.get(name), float):
                cfg[name] = a[name]
        cfg.update(overrides)
        config = GPTConfig(**cfg)
        rows = self.state["word_embeddings.weight"].shape[0]
        if config.padded_vocab_size != rows:
            raise ValueError(f"vocab_size {vocab_size} pads to {config.padded_vocab_size}, but the "
                             f"checkpoint's word embeddings have {rows} rows")
        return config


def _args_dict(obj) -> dict:
    if isinstance(obj, argparse.Namespace):
        return dict(vars(obj))
    if isinstance(obj, dict):
        return dict(obj)
    return {}


def _check_supported(args: dict, where) -> None:
    """Refuse architectures gptrain's GPT cannot represent (one line naming the option)."""
    problems = []
    if args.get("swiglu"):
        problems.append("--swiglu")
    if args.get("normalization") not in (None, "LayerNorm"):
        problems.append(f"--normalization {args['normalization']}")
    if args.get("position_embedding_type") not in (None, "learned_absolute"):
        problems.append(f"--position-embedding-type {args['position_embedding_type']}")
    heads, groups = args.get("num_attention_heads"), args.get("num_query_groups")
    if args.get("group_query_attention") and groups not in (None, heads):
        problems.append(f"--group-query-attention (--num-query-groups {groups})")
    if args.get("untie_embeddings_and_output_weights"):
        problems.append("--untie-embeddings-and-output-weights")
    if args.get("num_experts"):
        problems.append(f"--num-experts {args['num_experts']}")
    if args.get("multi_latent_attention"):
        problems.append("--multi-latent-attention")
    if args.get("qk_layernorm"):
        problems.append("--qk-layernorm")
    if args.get("apply_layernorm_1p"):
        problems.append("--apply-layernorm-1p")
    if args.get("squared_relu"):
        problems.append("--squared-relu")
    kv = args.get("kv_channels")
    if kv is not None and heads and args.get("hidden_size") and kv * heads != args["hidden_size"]:
        problems.append(f"--kv-channels {kv}")
    if problems:
        raise ValueError(f"{where}: gptrain's GPT does not support {', '.join(problems)}")


def _rank_file(folder: Path, tp_rank: int, pp_rank: int, pp: int) -> Path:
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return folder / name / CHECKPOINT_FILENAME


_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(_\d{3})?$")


def read_megatron_checkpoint(root, iteration=None, *, overrides: dict | None = None) -> MegatronCheckpoint:
    """Read every rank of one Megatron checkpoint into full tensors in gptrain's names.

    ``overrides`` fill or replace ``args`` entries (a release checkpoint without ``args`` needs at
    least ``num_attention_heads`` for a legacy QKV reorder; tensor/pipeline sizes are otherwise
    taken from the ``mp_rank_*`` folders).
    """
    folder, it = find_checkpoint(root, iteration)
    entries = [p.name for p in folder.iterdir() if p.is_dir()]
    if not any(n.startswith("mp_rank_") for n in entries):
        if any(n.endswith(".distcp") for n in entries + [p.name for p in folder.iterdir()]) or \
                (folder / "metadata.json").is_file():
            raise ValueError(f"{folder}: a distributed (--ckpt-format torch_dist) checkpoint; only "
                             f"--ckpt-format torch (mp_rank_XX/{CHECKPOINT_FILENAME}) can be read")
        raise FileNotFoundError(f"{folder}: no mp_rank_XX folders")
    ranks = [m for n in entries if (m := _RANK_DIR.match(n))]
    if any(m.group(3) for m in ranks):
        raise ValueError(f"{folder}: expert-parallel (mp_rank_XX_YYY_ZZZ) checkpoints are not supported")
    staged = any(m.group(2) is not None for m in ranks)

    first_path = folder / ("mp_rank_00_000" if staged else "mp_rank_00") / CHECKPOINT_FILENAME
    if not first_path.is_file():
        raise FileNotFoundError(f"{first_path}: missing (the first rank's checkpoint file)")
    first, first_lazy = _unpickle(first_path, lazy=True)
    if not isinstance(first, dict):
        raise ValueError(f"{first_path}: holds a {type(first).__name__}, not Megatron's checkpoint dict")
    args = _args_dict(first.get("args"))
    args.update(overrides or {})
    tp = int(args.get("tensor_model_parallel_size") or 1 + max(int(m.group(1)) for m in ranks))
    pp = int(args.get("pipeline_model_parallel_size")
             or (1 + max(int(m.group(2)) for m in ranks if m.group(2)) if staged else 1))
    if staged != (pp > 1):
        raise FileNotFoundError(f"{_rank_file(folder, 0, 0, pp)}: missing: args say tensor parallel "
                                f"{tp} x pipeline {pp}, the folder has {', '.join(sorted(entries))}")
    _check_supported(args, first_path)
    version = first.get("checkpoint_version")
    heads = args.get("num_attention_heads")

    # per (chunk, stage): {gptrain name with local layer index: [tensor per tp rank]}
    chunks: dict[tuple[int, int], dict[tuple[str, int | None], list]] = {}
    rules: dict[str, str] = {}
    layout = None
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            path = _rank_file(folder, tp_rank, pp_rank, pp)
            if path == first_path:
                sd, lazy = first, first_lazy
            else:
                if not path.is_file():
                    raise FileNotFoundError(f"{path}: missing: the checkpoint's args say tensor parallel "
                                            f"{tp} x pipeline {pp}")
                sd, lazy = _unpickle(path, lazy=True)
                if not isinstance(sd, dict):
                    raise ValueError(f"{path}: holds a {type(sd).__name__}, not Megatron's checkpoint dict")
            models = {k: v for k, v in sd.items() if isinstance(k, str) and re.fullmatch(r"model\d*", k)}
            if not models:
                raise ValueError(f"{path}: no 'model' entry (keys: {sorted(map(str, sd))[:8]})")
            for model_key, model in models.items():
                chunk = int(model_key[5:] or 0)
                flat = _flatten(model)
                try:
                    this_layout = _layout(flat)
                except ValueError as e:
                    raise ValueError(f"{path}: {e}") from None
                if layout is None:
                    layout = this_layout
                elif this_layout != layout:
                    raise ValueError(f"{path}: {this_layout} keys, but other ranks are {layout}")
                if layout == "legacy" and version is not None and version < 2.0 and not heads:
                    raise ValueError(f"{path}: checkpoint_version {version} needs num_attention_heads "
                                     f"to reorder QKV; pass overrides={{'num_attention_heads': N}}")
                bucket = chunks.setdefault((chunk, pp_rank), {})
                for key, value in flat.items():
                    try:
                        mapped = _map_key(key, layout)
                    except KeyError:
                        raise ValueError(f"{path}: unsupported model key {key!r} (gptrain's GPT has no "
                                         f"such parameter)") from None
                    if mapped is None or not isinstance(value, torch.Tensor):
                        continue
                    name, layer, rule = mapped
                    if name == "untied_output_layer.weight":
                        raise ValueError(f"{path}: an untied output layer ({key}); gptrain ties it to the "
                                         f"word embeddings")
                    shards = bucket.setdefault((name, layer), [None] * tp)
                    if shards[tp_rank] is not None:
                        raise ValueError(f"{path}: two keys map to {name} (layer {layer})")
                    t = lazy.materialize(value)
                    if rule == "qkv" and (version is None or version < 2.0):
                        t = _legacy_qkv_to_per_head(t, 0.0 if version is None else float(version), heads // tp)
                    shards[tp_rank] = t
                    rules[name] = rule
            lazy.close()
            del sd, lazy
    del first
    state: dict[str, torch.Tensor] = {}
    output_copy = None
    offset = 0
    vp = max(c for c, _ in chunks) + 1
    for chunk in range(vp):
        for pp_rank in range(pp):
            bucket = chunks.get((chunk, pp_rank), {})
            local = sorted({layer for _, layer in bucket if layer is not None})
            if local and local != list(range(local[0], local[0] + len(local))):
                raise ValueError(f"{folder}: stage {pp_rank} holds non-contiguous layers {local}")
            if local and local[0] not in (0, offset):
                raise ValueError(f"{folder}: stage {pp_rank} starts at layer {local[0]}, expected 0 "
                                 f"(stage-local) or {offset} (global)")
            shift = offset if local and local[0] == 0 else 0
            for (name, layer), shards in bucket.items():
                missing = [r for r, s in enumerate(shards) if s is None]
                if missing:
                    raise FileNotFoundError(
                        f"{_rank_file(folder, missing[0], pp_rank, pp)}: lacks {name} that rank 0 of the "
                        f"same stage has")
                full = _merge(shards, rules[name], name, folder)
                if name == "output_layer.weight":
                    output_copy = full
                    continue
                gname = f"layers.{layer + shift}.{name}" if layer is not None else name
                if gname in state:
                    if name.startswith(("word_embeddings", "position_embeddings")):
                        continue  # a later chunk's copy (embeddings live on the first stage)
                    raise ValueError(f"{folder}: {gname} appears on two pipeline stages")
                state[gname] = full
            offset += len(local)

    num_layers = args.get("num_layers")
    if num_layers is None:
        args["num_layers"] = num_layers = offset
    if offset != num_layers:
        raise ValueError(f"{folder}: the stages hold {offset} layers, args say num_layers {num_layers}")
    required = ["word_embeddings.weight", "position_embeddings.weight", "final_layernorm.weight",
                "final_layernorm.bias"] + [
        f"layers.{i}.{n}" for i in range(num_layers) for n in
        ("ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
         "ln2.weight", "ln2.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias")]
    missing = [n for n in required if n not in state]
    if missing:
        raise ValueError(f"{folder}: no tensor for {missing[0]}" +
                         (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    emb = state["word_embeddings.weight"]
    for key, value in (("hidden_size", emb.shape[1]), ("padded_vocab_size", emb.shape[0]),
                       ("ffn_hidden_size", state["layers.0.mlp.fc1.weight"].shape[0]),
                       ("max_position_embeddings", state["position_embeddings.weight"].shape[0])):
        if args.get(key) is None:
            args[key] = value
        elif args[key] != value:
            raise ValueError(f"{folder}: args say {key} {args[key]}, the tensors say {value}")
    args.setdefault("tensor_model_parallel_size", tp)
    args.setdefault("pipeline_model_parallel_size", pp)
    if heads and (emb.shape[1] % heads or state["layers.0.attn.qkv.weight"].shape[0] != 3 * emb.shape[1]):
        raise ValueError(f"{folder}: fused QKV has {state['layers.0.attn.qkv.weight'].shape[0]} rows, "
                         f"expected 3 x hidden {emb.shape[1]} for {heads} heads")

    matches = None
    if output_copy is not None:
        matches = bool(output_copy.shape == emb.shape and torch.equal(output_copy, emb))
    return MegatronCheckpoint(args=args, iteration=it, state=state,
                              checkpoint_version=None if version is None else float(version),
                              layout=layout, tp=tp, pp=pp, output_layer_matches_embeddings=matches)


def _merge(shards: list[torch.Tensor], rule: str, name: str, folder: Path) -> torch.Tensor:
    if len(shards) == 1 or rule == "rank0":
        t = shards[0]
        own = t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.is_contiguous()
        return t if own else t.contiguous().clone()
    dim = 1 if rule == "cat1" else 0
    shapes = {tuple(s.shape[:dim] + s.shape[dim + 1:]) for s in shards}
    if len(shapes) != 1:
        raise ValueError(f"{folder}: tensor-parallel shards of {name} disagree in shape "
                         f"{[tuple(s.shape) for s in shards]}")
    return torch.cat(shards, dim=dim)
