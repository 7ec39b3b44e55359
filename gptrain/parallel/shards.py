"""Where the tensor a rank holds sits in the full tensor: a tensor-parallel shard (a plain tensor,
its region given by the layout) and, on top, an FSDP2 shard (a DTensor over the data-parallel
ranks). Initialisation and loading of whole tensors write each rank's part through these."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from gptrain.parallel.collectives import local


def local_region(param: torch.Tensor, full_shape: tuple[int, ...],
                 tp_region: tuple[slice, ...] | None = None) -> tuple[slice, ...]:
    """The slices of the full tensor that ``param`` holds on this rank: ``tp_region`` (default: all
    of it), narrowed to the DTensor's local shard if ``param`` is one."""
    region = tp_region or tuple(slice(0, n) for n in full_shape)
    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        region = tuple(slice(r.start + o, r.start + o + n) for r, o, n in zip(region, offset, shape))
    return region


@torch.no_grad()
def copy_full_into(param: torch.Tensor, full: torch.Tensor, tp_region: tuple[slice, ...] | None = None) -> None:
    """Copy this rank's part of a full (CPU) tensor into ``param``: no communication, every rank
    holds the same full tensor and cuts its own part."""
    part = full[local_region(param, tuple(full.shape), tp_region)]
    local(param).copy_(part.to(param.dtype))
