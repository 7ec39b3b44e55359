"""Two ranks trade tensors: each gets the other's. On two GPUs of one host the trade is a copy-engine transfer into
the other GPU's memory (PyTorch's symmetric memory maps it) on a side stream, so it leaves the SMs to the matmuls
queued beside it; off CUDA (the CPU tests) it is the group's point-to-point send and receive. Sequence
parallelism's all-gather and reduce-scatter between a tensor-parallel pair are each one trade
(parallel/sequence_parallel_ce.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from gptrain.parallel.copy_engine import one_line, paired_setup


GATHER, SCATTER = 0, 1  # the two receiving slots: a region's entry trades in one, its exit in the other


class _Arriving:
    """A trade under way: ``wait()`` makes the current stream wait for it and returns what the other rank sent;
    ``on_side(fn)`` runs ``fn(received)`` beside the current stream once it has landed (copies that only a later
    pass needs), and ``join()`` makes the current stream wait for those."""

    def __init__(self, received: torch.Tensor, side: torch.cuda.Stream | None = None,
                 landed: torch.cuda.Event | None = None, works=(), sent=None):
        self._received, self._side, self._landed, self._works = received, side, landed, works
        self._sent = sent  # kept alive until the wait: the side stream reads it
        self._done = None

    def wait(self) -> torch.Tensor:
        if self._landed is not None:
            torch.cuda.current_stream().wait_event(self._landed)
        for work in self._works:
            work.wait()
        self._works = ()
        return self._received

    def on_side(self, fn) -> None:
        if self._side is None:
            fn(self.wait())
            return
        with torch.cuda.stream(self._side):
            fn(self._received)
            self._done = torch.cuda.Event()
            self._done.record()

    def join(self) -> None:
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
        self._sent = None


class PeerSwap:
    """Trades tensors of ``dtype`` of up to ``max_numel`` elements between a group's two GPUs by the copy engines.
    Both ranks must trade the same sizes in the same order (as with NCCL). What a trade receives lands in one of
    two slots of this rank's buffer; read it (on the current stream, or through ``on_side``) before the next trade
    starts.

    One barrier a trade, after the transfers: a trade writes into the slot the other rank received in two trades
    earlier, and the other rank read that before its side of the trade between (its reads are queued before the
    next trade starts, and the side stream waits for them). A trade into the same slot as the one before it also
    waits, first, for the other rank to have read that slot.

    Whether a trade repeats the slot is decided in Python when the trade is queued: for a CUDA graph, when it is
    captured. That holds at replay because every trade follows the same kind of trade at capture as at replay:
    within a pass (a forward or a backward, whole or cut into several graphs) the order is fixed, and every pass
    starts with an entry and ends with an exit, whichever pass ran before it. Sequence parallelism alternates
    entries and exits; two in a row (SwiGLU's gate and up: two entries forward, two exits backward) take the
    second barrier."""

    def __init__(self, group, max_numel: int, dtype: torch.dtype, device: torch.device, timeout_s: float = 600.0):
        import torch.distributed._symmetric_memory as symm_mem

        try:
            self.buf = symm_mem.empty(2 * max_numel, dtype=dtype, device=device)
            self.handle = symm_mem.rendezvous(self.buf, group.group_name)
            self.rank = self.handle.rank
            self.peer = self.handle.get_buffer(1 - self.rank, (2 * max_numel,), dtype)
            self.side = torch.cuda.Stream(device)
        except Exception as e:  # noqa: BLE001 - no peer mappings here (driver, container, GPUs): one line
            raise ValueError(f"the copy-engine trade could not map the other GPU's memory: {one_line(e)}") from None
        self.max_numel, self.dtype = max_numel, dtype
        self.timeout_ms = int(timeout_s * 1000)
        self.last_slot = None

    def start(self, t: torch.Tensor, slot: int) -> _Arriving:
        """Send ``t`` (contiguous) into the other rank's receiving ``slot``, after what the current stream has
        queued, on the side stream."""
        n = t.numel()
        if n > self.max_numel or t.dtype != self.dtype or not t.is_contiguous():
            raise ValueError(f"copy-engine trade of {n} {t.dtype} elements: set up for up to {self.max_numel} "
                             f"contiguous {self.dtype}")
        at = slot * self.max_numel
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            if slot == self.last_slot:  # the other rank has read what this slot received last
                self.handle.barrier(channel=0, timeout_ms=self.timeout_ms)
            self.peer[at:at + n].copy_(t.view(-1))
            self.handle.barrier(channel=1, timeout_ms=self.timeout_ms)  # both transfers have landed
            landed = torch.cuda.Event()
            landed.record()
        self.last_slot = slot
        return _Arriving(self.buf[at:at + n].view(t.shape), side=self.side, landed=landed, sent=t)


def start_trade(t: torch.Tensor, group: str, slot: int) -> _Arriving:
    """Send ``t`` to the other rank of the two-rank ``group`` and receive its tensor of the same shape, into
    ``slot`` (GATHER or SCATTER): by the copy engines on CUDA (the trade set up by ``set_up_swap``), by
    point-to-point messages elsewhere."""
    t = t.contiguous()
    if t.is_cuda:
        swap = _SWAPS.get((group, t.dtype))
        if swap is None:
            raise ValueError(f"--tp-comm-copy-engine: no trade was set up for group {group} and {t.dtype} "
                             "(train/build.py sets it up before compiling)")
        return swap.start(t, slot)
    pg = dist.distributed_c10d._resolve_process_group(group)
    peer = dist.get_global_rank(pg, 1 - dist.get_rank(pg))
    received = torch.empty_like(t)
    works = (dist.isend(t, peer, group=pg), dist.irecv(received, peer, group=pg))
    return _Arriving(received, works=works, sent=t)


def rank_in(group: str) -> int:
    """This process's index in the two-rank ``group``: rank 0's tokens come first."""
    return dist.get_rank(dist.distributed_c10d._resolve_process_group(group))


_SWAPS: dict[tuple[str, torch.dtype], PeerSwap] = {}


def set_up_swap(group, max_numel: int, dtype: torch.dtype, device: torch.device, timeout_s: float,
                flag: str = "--tp-comm-copy-engine") -> None:
    """The tensor-parallel pair's trade for activations of ``dtype`` up to ``max_numel`` elements, made on both ranks
    or on neither, before anything is compiled (its symmetric memory must not be allocated inside a compiled step's
    first run, whose allocations CUDA graphs take into their pool)."""
    _SWAPS[(group.group_name, dtype)] = paired_setup(
        group, device, flag, lambda: PeerSwap(group, max_numel, dtype, device, timeout_s))


def release_swaps() -> None:
    """Forget the trades (before their process groups end: a later group may reuse a name)."""
    _SWAPS.clear()
