"""An all-reduce between the two GPUs of one host made of copy-engine transfers, so that it leaves the SMs to
the kernels beside it: each rank writes the half the other owns into the other's memory (PyTorch's symmetric
memory maps it), adds what it received to its own half, writes that half back to the other's memory and
takes the other's half from its own. Only the add and two one-block barrier kernels run on the SMs; NCCL's
all-reduce runs on SMs itself and, beside a matmul, slows it (benchmarks/comm_overlap.py; RESULTS.md s29).
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist


def unavailable_reason(group, device: torch.device) -> str | None:
    """Why the copy-engine all-reduce cannot run over ``group`` here (None: it can). A collective over
    ``group``: every rank calls it."""
    if device.type != "cuda":
        return f"it needs CUDA GPUs (the device is {device.type})"
    size = dist.get_world_size(group)
    if size != 2:
        return f"it joins two GPUs of one host (this group has {size} ranks)"
    hosts = [None] * size
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if hosts[0] != hosts[1]:
        return f"it joins two GPUs of one host (this group's are on {hosts[0]} and {hosts[1]})"
    return None


class _Started:
    """An all-reduce running on the side stream: ``wait()`` makes the current stream wait for it."""

    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class CopyEngineAllReduce:
    """Sums over the group's two ranks, in place, tensors of ``dtype`` of up to ``max_numel`` elements. Every
    rank must call it with the same sizes in the same order (as with NCCL)."""

    def __init__(self, group, max_numel: int, dtype: torch.dtype, device: torch.device, timeout_s: float = 600.0):
        """``timeout_s``: how long a barrier waits for the other rank before the kernel gives up (a dead or
        desynchronised peer must not leave the GPU spinning)."""
        import torch.distributed._symmetric_memory as symm_mem

        self.slot = (max_numel + 1) // 2  # the larger half: what a rank owns, and what it sends back
        try:
            self.buf = symm_mem.empty(2 * self.slot, dtype=dtype, device=device)
            self.handle = symm_mem.rendezvous(self.buf, group.group_name)
        except Exception as e:  # noqa: BLE001 - no peer mappings here (driver, container, GPUs): one line
            raise ValueError(f"the copy-engine all-reduce could not map the other GPU's memory: "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        self.rank = self.handle.rank  # the peer's index in the mapping the handle holds
        self.peer = self.handle.get_buffer(1 - self.rank, (2 * self.slot,), dtype)
        self.max_numel, self.dtype = max_numel, dtype
        self.timeout_ms = int(timeout_s * 1000)
        self.side = torch.cuda.Stream(device)

    def __call__(self, x: torch.Tensor) -> None:
        """``x`` summed over the two ranks, on the current stream (not while a ``start()`` is pending: the two
        share the buffers)."""
        n = x.numel()
        if n > self.max_numel or x.dtype != self.dtype or not x.is_contiguous():
            raise ValueError(f"copy-engine all-reduce of {n} {x.dtype} elements: set up for up to {self.max_numel} "
                             f"contiguous {self.dtype}")
        flat, h, slot = x.view(-1), n // 2, self.slot
        mine, theirs = (flat[:h], flat[h:]) if self.rank == 0 else (flat[h:], flat[:h])
        self.peer[:theirs.numel()].copy_(theirs)  # the other's half, into its receiving slot
        self.handle.barrier(channel=0, timeout_ms=self.timeout_ms)
        mine.add_(self.buf[:mine.numel()])
        self.peer[slot:slot + mine.numel()].copy_(mine)  # this rank's summed half, into its returning slot
        self.handle.barrier(channel=1, timeout_ms=self.timeout_ms)
        theirs.copy_(self.buf[slot:slot + theirs.numel()])

    def start(self, x: torch.Tensor) -> _Started:
        """The same on a side stream, after what the current stream has queued; ``wait()`` on the result
        before using ``x`` on the current stream again. Started ones run one after another (one side stream,
        at normal priority: --high-priority-stream-groups and the dp group's NCCL options do not reach it)."""
        self.side.wait_stream(torch.cuda.current_stream())
        x.record_stream(self.side)
        with torch.cuda.stream(self.side):
            self(x)
            event = torch.cuda.Event()
            event.record()
        return _Started(event)
