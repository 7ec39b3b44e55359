"""Two ranks trade tensors: each gets the other's. On two GPUs of one host the trade is a copy-engine transfer into
the other GPU's memory (PyTorch's symmetric memory maps it) on a side stream, so it leaves the SMs to the matmuls
queued beside it; off CUDA (the CPU tests) it is the group's point-to-point send and receive. Sequence
parallelism's all-gather and reduce-scatter between a tensor-parallel pair are each one trade
(parallel/sequence_parallel_ce.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from gptrain.parallel.copy_engine import paired_setup


class _Arriving:
    """A trade under way: ``wait()`` makes the current stream wait for it and returns what the other rank sent."""

    def __init__(self, received: torch.Tensor, event: torch.cuda.Event | None = None, works=(), sent=None):
        self._received, self._event, self._works = received, event, works
        self._sent = sent  # kept alive until the wait: the side stream reads it

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        for work in self._works:
            work.wait()
        self._sent = None
        return self._received


class PeerSwap:
    """Trades tensors of ``dtype`` of up to ``max_numel`` elements between a group's two GPUs by the copy engines.
    Both ranks must trade the same sizes in the same order (as with NCCL). What ``wait()`` returns is this rank's
    receiving buffer: read it on the current stream (or copy it out) before the next trade starts."""

    def __init__(self, group, max_numel: int, dtype: torch.dtype, device: torch.device, timeout_s: float = 600.0):
        import torch.distributed._symmetric_memory as symm_mem

        try:
            self.buf = symm_mem.empty(max_numel, dtype=dtype, device=device)
            self.handle = symm_mem.rendezvous(self.buf, group.group_name)
        except Exception as e:  # noqa: BLE001 - no peer mappings here (driver, container, GPUs): one line
            raise ValueError(f"the copy-engine trade could not map the other GPU's memory: "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        self.rank = self.handle.rank
        self.peer = self.handle.get_buffer(1 - self.rank, (max_numel,), dtype)
        self.max_numel, self.dtype = max_numel, dtype
        self.timeout_ms = int(timeout_s * 1000)
        self.side = torch.cuda.Stream(device)

    def start(self, t: torch.Tensor) -> _Arriving:
        """Send ``t`` (contiguous) into the other rank's receiving buffer, after what the current stream has queued,
        on the side stream. The first barrier waits until the other rank has queued its side of the trade, which
        comes after it read its receiving buffer (the reads of the last trade are on its current stream, which its
        side stream waited for); the second until both transfers have landed."""
        n = t.numel()
        if n > self.max_numel or t.dtype != self.dtype or not t.is_contiguous():
            raise ValueError(f"copy-engine trade of {n} {t.dtype} elements: set up for up to {self.max_numel} "
                             f"contiguous {self.dtype}")
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            self.handle.barrier(channel=0, timeout_ms=self.timeout_ms)
            self.peer[:n].copy_(t.view(-1))
            self.handle.barrier(channel=1, timeout_ms=self.timeout_ms)
            event = torch.cuda.Event()
            event.record()
        return _Arriving(self.buf[:n].view(t.shape), event=event, sent=t)


def start_trade(t: torch.Tensor, group: str) -> _Arriving:
    """Send ``t`` to the other rank of the two-rank ``group`` and receive its tensor of the same shape: by the
    copy engines on CUDA (the trade set up by ``set_up_swap``), by point-to-point messages elsewhere."""
    t = t.contiguous()
    if t.is_cuda:
        swap = _SWAPS.get((group, t.dtype))
        if swap is None:
            raise ValueError(f"--tp-comm-copy-engine: no trade was set up for group {group} and {t.dtype} "
                             "(train/build.py sets it up before compiling)")
        return swap.start(t)
    pg = dist.distributed_c10d._resolve_process_group(group)
    peer = dist.get_global_rank(pg, 1 - dist.get_rank(pg))
    received = torch.empty_like(t)
    works = (dist.isend(t, peer, group=pg), dist.irecv(received, peer, group=pg))
    return _Arriving(received, works=works, sent=t)


def rank_in(group: str) -> int:
    """This process's index in the two-rank ``group``: rank 0's tokens come first."""
    return dist.get_rank(dist.distributed_c10d._resolve_process_group(group))


_SWAPS: dict[tuple[str, torch.dtype], PeerSwap] = {}


def set_up_swap(group, max_numel: int, dtype: torch.dtype, device: torch.device, timeout_s: float) -> None:
    """The tensor-parallel pair's trade for activations of ``dtype`` up to ``max_numel`` elements, made on both ranks
    or on neither, before anything is compiled (its symmetric memory must not be allocated inside a compiled step's
    first run, whose allocations CUDA graphs take into their pool)."""
    _SWAPS[(group.group_name, dtype)] = paired_setup(
        group, device, "--tp-comm-copy-engine", lambda: PeerSwap(group, max_numel, dtype, device, timeout_s))


def release_swaps() -> None:
    """Forget the trades (before their process groups end: a later group may reuse a name)."""
    _SWAPS.clear()
