"""The few collectives the training loop needs, each a no-op in one process."""
from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor. None exists before ``torch.distributed.tensor`` is imported, and
    that import (about a second) is left to the layouts that use DTensors: loading a checkpoint for
    inference imports this module."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds (a DTensor's shard)."""
    return t.to_local() if is_dtensor(t) else t


def _replicas(t: torch.Tensor, pp: int, tp_split: bool, tp: int) -> int:
    """How many processes hold the same values as this one's. A pipeline stage's parameters live on
    world / pp ranks (its data- and tensor-parallel ranks): a plain tensor is the same on all of
    them, a tensor-parallel shard (``tp_split``) on 1/tp of them; a DTensor (an FSDP2 shard) on its
    own mesh's Replicate dimensions and on the stage's ranks outside that mesh."""
    stage_ranks = (dist.get_world_size() if distributed() else 1) // pp
    if is_dtensor(t):
        outside = stage_ranks // t.device_mesh.size()
        stage_ranks = outside * math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements)
                                          if p.is_replicate())
    return stage_ranks // tp if tp_split else stage_ranks


def global_norm_and_sum(grads: list[torch.Tensor], value: torch.Tensor, pp: int = 1,
                        tp_split: list[bool] | None = None, tp: int = 1,
                        squares: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2 norm of all gradients over every process, and ``value`` summed over every process,
    in one all-reduce over the world. Shards count once; replicated copies are divided by their
    number; each pipeline stage contributes its own parameters (a tied copy must be left out of
    ``grads`` by the caller on all but one stage). ``tp_split[i]``: ``grads[i]`` is a
    tensor-parallel shard. ``squares``: this process's sum of squares taken already (``grads`` then holds
    none of those gradients)."""
    # by device too: with --optimizer-offload-fraction some shards are in host memory and others on the GPU
    by_replicas: dict[tuple[int, torch.device], list[torch.Tensor]] = {}
    for g, split in zip(grads, tp_split or [False] * len(grads)):
        t = local(g)
        by_replicas.setdefault((_replicas(g, pp, split, tp), t.device), []).append(t)
    squares = torch.zeros((), device=value.device, dtype=torch.float32) if squares is None else squares
    for (replicas, _), tensors in by_replicas.items():
        norms = torch._foreach_norm(tensors)
        squares = squares + torch.stack(norms).float().square().sum().to(value.device) / replicas
    both = torch.stack([squares, value.float()])
    if distributed():
        dist.all_reduce(both)
    return both[0].sqrt(), both[1]


def all_reduce_(t: torch.Tensor, op=None) -> torch.Tensor:
    if distributed():
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def barrier() -> None:
    if distributed():
        dist.barrier()
