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


def one_line(e: BaseException) -> str:
    """An exception as one line: its type and its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


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
            self.rank = self.handle.rank  # the peer's index in the mapping the handle holds
            self.peer = self.handle.get_buffer(1 - self.rank, (2 * self.slot,), dtype)
            self.side = torch.cuda.Stream(device)
        except Exception as e:  # noqa: BLE001 - no peer mappings here (driver, container, GPUs): one line
            raise ValueError(f"the copy-engine all-reduce could not map the other GPU's memory: {one_line(e)}") from None
        self.max_numel, self.dtype = max_numel, dtype
        self.timeout_ms = int(timeout_s * 1000)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> None:
        """``x`` summed over the two ranks, into ``out`` (default: ``x`` itself), on the current stream (not while
        a ``start()`` is pending: the two share the buffers)."""
        n = x.numel()
        out = x if out is None else out
        if n > self.max_numel or x.dtype != self.dtype or not (x.is_contiguous() and out.is_contiguous()) \
                or out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError(f"copy-engine all-reduce of {n} {x.dtype} elements: set up for up to {self.max_numel} "
                             f"contiguous {self.dtype}, into a tensor of the same shape")
        h, slot = n // 2, self.slot
        (x_mine, x_theirs), (o_mine, o_theirs) = (self._halves(t.view(-1), h) for t in (x, out))
        self.peer[:x_theirs.numel()].copy_(x_theirs)  # the other's half, into its receiving slot
        self.handle.barrier(channel=0, timeout_ms=self.timeout_ms)
        torch.add(x_mine, self.buf[:x_mine.numel()], out=o_mine)
        self.peer[slot:slot + o_mine.numel()].copy_(o_mine)  # this rank's summed half, into its returning slot
        self.handle.barrier(channel=1, timeout_ms=self.timeout_ms)
        o_theirs.copy_(self.buf[slot:slot + o_theirs.numel()])

    def _halves(self, flat: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's half, the other's): rank 0 owns the first ``h`` elements."""
        return (flat[:h], flat[h:]) if self.rank == 0 else (flat[h:], flat[:h])

    def start(self, x: torch.Tensor, out: torch.Tensor | None = None) -> _Started:
        """The same on a side stream, after what the current stream has queued; ``wait()`` on the result
        before using ``x`` or ``out`` on the current stream again, and keep both alive until then (their memory
        then goes back to the allocator in the current stream's order, after the side stream's work: no
        record_stream, which CUDA graph capture would have to defer). Started ones run one after another (one
        side stream, at normal priority: --high-priority-stream-groups and the dp group's NCCL options do not
        reach it)."""
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            self(x, out)
            event = torch.cuda.Event()
            event.record()
        return _Started(event)


# ---- tensor parallelism's backward: a column-parallel layer's input gradient summed beside its weight gradients

_EXCHANGES: dict[tuple[str, torch.dtype], CopyEngineAllReduce] = {}


def paired_setup(group, device: torch.device, flag: str, make):
    """``make()`` (a copy-engine object over ``group``) on both ranks or on neither: a reason it cannot run here, or
    a failed mapping (a ValueError from ``make``), on either rank stops both with one line naming ``flag`` (a
    collective)."""
    reason = unavailable_reason(group, device)
    made = error = None
    if reason is None:
        try:
            made = make()
        except Exception as e:  # noqa: BLE001 - whatever failed on one rank, both must learn it (else the other waits)
            error = str(e) if isinstance(e, ValueError) else one_line(e)
    errors = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, reason or error, group=group)
    if any(errors):
        raise ValueError(f"{flag}: {next(e for e in errors if e)}")
    return made


def paired_exchange(group, max_numel: int, dtype: torch.dtype, device: torch.device, timeout_s: float,
                    flag: str) -> CopyEngineAllReduce:
    """A ``CopyEngineAllReduce`` over ``group``, made on both ranks or on neither (``paired_setup``)."""
    return paired_setup(group, device, flag, lambda: CopyEngineAllReduce(group, max_numel, dtype, device, timeout_s))


def set_up_tp_exchange(group, max_numel: int, dtype: torch.dtype, device: torch.device, timeout_s: float,
                       flag: str = "--tp-comm-copy-engine") -> None:
    """The tensor-parallel pair's exchange for gradients of ``dtype`` up to ``max_numel`` elements, made before
    anything is compiled (its symmetric memory must not be allocated inside a compiled step's first run, whose
    allocations CUDA graphs take into their pool)."""
    _EXCHANGES[(group.group_name, dtype)] = paired_exchange(group, max_numel, dtype, device, timeout_s, flag)


def release_tp_exchanges() -> None:
    """Forget the exchanges (before their process groups end: a later group may reuse a name)."""
    _EXCHANGES.clear()


@torch.library.custom_op("gptrain::all_reduce_beside_wgrads", mutates_args=())
def all_reduce_beside_wgrads(t: torch.Tensor, grads: list[torch.Tensor], inputs: list[torch.Tensor], tuned: bool,
                             group: str) -> list[torch.Tensor]:
    """``[t summed over the group's two ranks, grads[i].T @ inputs[i] ...]``: on GPUs the sum by the copy engines on
    a side stream while the weight gradients' matmuls run, joined before it returns (one op, so that the compiler
    keeps the two side by side, and CUDA graphs, by design, capture the fork and join); on a CPU, or for a tensor
    larger than the exchange was set up for, gloo's or NCCL's asynchronous all-reduce beside them."""
    from gptrain.kernels.ops import linear_wgrad

    wgrad = linear_wgrad if tuned else (lambda g, x: g.t() @ x)
    out = torch.empty_like(t)
    exchange = _EXCHANGES.get((group, t.dtype)) if t.is_cuda else None
    if t.is_cuda and exchange is None:
        raise ValueError(f"--tp-comm-copy-engine: no exchange was set up for group {group} and {t.dtype} "
                         "(train/build.py sets it up before compiling)")
    if exchange is None or t.numel() > exchange.max_numel:  # a CPU (gloo), or a larger tensor than planned: NCCL
        out.copy_(t)
        started = dist.all_reduce(out, group=dist.distributed_c10d._resolve_process_group(group), async_op=True)
    else:
        started = exchange.start(t, out)
    weights = [wgrad(g, x) for g, x in zip(grads, inputs)]
    started.wait()
    return [out, *weights]


@all_reduce_beside_wgrads.register_fake
def _(t, grads, inputs, tuned, group):
    return [torch.empty_like(t), *(g.new_empty(g.shape[1], x.shape[1]) for g, x in zip(grads, inputs))]
