"""The rank simulator: one rank of any layout run alone on this machine through PyTorch's fake process
group, where every collective returns at once. What remains is that rank's own work: its compute,
its host time, its kernel launches and its memory, the per-rank cost of a layout with the network
taken out (``gptrain bench --simulate-world-size N [--simulate-rank R]``, and the same flags on
``gptrain train`` for a few iterations). Numbers it computes from collectives (the loss, the
gradient norm) are meaningless; its speed and memory are the rank's.
"""
from __future__ import annotations

import argparse
import os
from contextlib import contextmanager

import torch.distributed as dist


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--simulate-world-size", type=int, default=None, metavar="N",
                        help="run one rank of a world of N processes alone, through a fake process group "
                             "(collectives return at once): the rank's own time, launches and memory")
    parser.add_argument("--simulate-rank", type=int, default=0, metavar="R",
                        help="which rank of the simulated world to run (default 0)")


def split_flags(argv: list[str]) -> tuple[int | None, int, list[str]]:
    """(world size, rank, the other flags) from ``argv``; world size None without the flags."""
    parser = argparse.ArgumentParser(add_help=False)
    add_flags(parser)
    known, rest = parser.parse_known_args(argv)
    return known.simulate_world_size, known.simulate_rank, rest


@contextmanager
def simulated_world(world_size: int | None, rank: int = 0):
    """Within it, ``torch.distributed`` is a fake group of ``world_size`` in which this process is
    ``rank``, and torchrun's variables say so (local rank 0: this machine's first device). Does
    nothing when ``world_size`` is None."""
    if world_size is None:
        yield
        return
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"--simulate-rank {rank} is not a rank of --simulate-world-size {world_size}")
    if dist.is_initialized():
        raise ValueError("--simulate-world-size runs one process alone: do not launch it under torchrun")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    os.environ.update({"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1"})
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
