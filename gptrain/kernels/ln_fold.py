"""The constants of a LayerNorm folded into the matrix product after it (``ln_linear``'s
``HAS_LN`` path in :mod:`gptrain.kernels.decode`): ``g @ w.T`` and ``b @ w.T`` in fp32, cached per
(weight, LayerNorm), recomputed into the same buffer when either changes in place, the weights held
weakly so that a model's constants go with the model.
"""
from __future__ import annotations

import weakref

import torch


# per (weight, LayerNorm): [the versions it was computed at, (2, n) fp32 g @ w.T and b @ w.T, weak references to
# (the weight or the tensor it views, g, b), the weight's (storage offset, shape, stride)]
_constants: dict[tuple, list] = {}
_retired: list[torch.Tensor] = []  # buffers of tensors gone: a graph captured with them may still hold them


def ln_constants(weight: torch.Tensor, ln: torch.nn.LayerNorm) -> torch.Tensor:
    """``ln.weight @ weight.T`` and ``ln.bias @ weight.T`` in fp32, (2, n): what the folded
    LayerNorm subtracts and adds. Computed once per weight and again when the weight or the
    LayerNorm changes in place (their version counters), into the same buffer, so a captured graph
    that holds it stays right once ``refresh_ln_constants`` has run. The weights are held weakly
    (a model's weights go when the model goes)."""
    key = (weight.data_ptr(), tuple(weight.shape), ln.weight.data_ptr(), ln.bias.data_ptr())
    entry = _constants.get(key)
    if entry is None or not _alive(entry):  # new, or its tensors are gone and the address reused
        _prune()
        owner = weight._base if weight._base is not None else weight
        entry = _constants[key] = [None, torch.empty(2, weight.shape[0], device=weight.device, dtype=torch.float32),
                                   tuple(weakref.ref(t) for t in (owner, ln.weight, ln.bias)),
                                   (weight.storage_offset(), tuple(weight.shape), weight.stride())]
    _refresh(entry)
    return entry[1]


def _alive(entry: list) -> bool:
    return all(ref() is not None for ref in entry[2])


def _prune() -> None:
    for key, entry in list(_constants.items()):
        if not _alive(entry):
            _retired.append(_constants.pop(key)[1])


def _refresh(entry: list, tensors: tuple | None = None) -> None:
    owner, g, b = tensors or tuple(ref() for ref in entry[2])
    versions = (owner._version, g._version, b._version)  # (a view shares its base's counter)
    if entry[0] == versions:
        return
    offset, shape, stride = entry[3]
    weight = owner.as_strided(shape, stride, offset)
    if weight.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a LayerNorm's folded constants changed during a graph capture")
    with torch.no_grad():  # elementwise in fp32 (no TF32), one row of weights at a time in chunks
        for lo in range(0, weight.shape[0], 8192):
            w = weight[lo:lo + 8192].float()
            entry[1][0, lo:lo + 8192] = (w * g.float()).sum(dim=1)
            entry[1][1, lo:lo + 8192] = (w * b.float()).sum(dim=1)
    entry[0] = versions


def refresh_ln_constants() -> None:
    """Brings every folded LayerNorm's constants up to date (before replaying captured steps): one
    pass over the entries, cheap when nothing changed (the in-flight server calls it per request)."""
    for key, entry in list(_constants.items()):
        tensors = tuple(ref() for ref in entry[2])
        if any(t is None for t in tensors):
            _retired.append(_constants.pop(key)[1])
        else:
            _refresh(entry, tensors)
