"""Overlapped data-parallel gradient reduction (Megatron's ``--overlap-grad-reduce``): the gradients
live in one flat buffer cut into buckets of about ``--ddp-bucket-size`` elements, in the order the
backward pass produces them (last layer first); during the step's last micro-batch each bucket is
averaged over the data-parallel group (an asynchronous all-reduce) as soon as all its gradients
have arrived, while the backward pass goes on with the layers before it. The step waits for the
last ones before the gradient norm.

Gradients arrive through post-accumulate-grad hooks, so the compiled step is cut into graphs where
the buckets end (parallel/bucketed_compile.py): one graph for the whole model would hand autograd
every gradient at its end, with nothing left to overlap.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from gptrain.parallel.grad_hooks import on_grad_accumulated

DEFAULT_BUCKET_SIZE = 40_000_000  # elements, Megatron's default


class GradBuckets:
    """``views[i]``: where gradient ``i`` accumulates (a view of ``flat``); ``arrived(i)`` is called
    when it holds the micro-batch's contribution (in backward order, any order works)."""

    def __init__(self, flat: torch.Tensor, views: list[torch.Tensor], group, size: int,
                 bucket_size: int | None = None, reduce_dtype: torch.dtype | None = None, take=None,
                 copy_engine: bool = False, timeout_s: float = 600.0):
        """``take(indices, first)``: called with a bucket's gradients once they have all arrived, in
        every micro-batch, before the bucket is reduced; ``first``: in the step's first micro-batch
        (MainParams copies them into the zeroed fp32 main gradients then, one multi-tensor cast, and
        adds them after). ``copy_engine``: the buckets all-reduced by copy-engine transfers between the
        group's two GPUs (parallel/copy_engine.py) instead of NCCL, its waits limited to ``timeout_s``."""
        self.flat, self.group, self.size = flat, group, size
        self.reduce_dtype = reduce_dtype
        self.take = take
        limit = bucket_size or DEFAULT_BUCKET_SIZE
        offsets = [v.data_ptr() - flat.data_ptr() for v in views]
        # buckets over the flat buffer from its end (the last layers, whose gradients come first)
        order = sorted(range(len(views)), key=lambda i: -offsets[i])
        self.bucket_of: list[int] = [0] * len(views)
        self.spans: list[tuple[int, int]] = []
        self.members: list[int] = []
        start = end = None
        count = 0
        itemsize = flat.element_size()
        for i in order:
            first = offsets[i] // itemsize
            last = first + views[i].numel()
            if end is None:
                start, end, count = first, last, 0
            elif end - first > limit:  # close the bucket before this gradient
                self.spans.append((start, end))
                self.members.append(count)
                start, end, count = first, last, 0
            start = min(start, first)
            self.bucket_of[i] = len(self.spans)
            count += 1
        if end is not None:
            self.spans.append((start, end))
            self.members.append(count)
        self.copy_engine = None
        if copy_engine:
            from gptrain.parallel.copy_engine import paired_exchange

            self.copy_engine = paired_exchange(group, max(end - start for start, end in self.spans),
                                               reduce_dtype or flat.dtype, flat.device, timeout_s,
                                               "--grad-reduce-copy-engine")
        self.armed = False
        self._got: list[list[int]] = [[] for _ in self.spans]  # this micro-batch's arrivals, by bucket
        self._launched = [False] * len(self.spans)
        self._micro = 0  # micro-batches armed since the last wait()
        self._first = True  # the micro-batch running is the step's first
        self._pending: list[tuple] = []
        self.nonfinite: torch.Tensor | None = None  # set by check_finite()

    def check_finite(self) -> None:
        """Note on the device whether a bucket held a NaN/Inf before its reduction (Megatron checks its
        buckets the same way), for --check-for-nan-in-loss-and-grad: this rank's own gradients."""
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=self.flat.device)

    def take_nonfinite(self) -> torch.Tensor | None:
        """The step's flag (a device tensor; no sync), reset for the next step."""
        if self.nonfinite is None:
            return None
        flag, self.nonfinite = self.nonfinite, torch.zeros_like(self.nonfinite)
        return flag

    def arm(self, last_micro_batch: bool) -> None:
        """Reduce during this micro-batch's backward only if it is the step's last."""
        self._take_partial(launch=False)  # a bucket the micro-batch before did not complete (unused weights)
        self._first = self._micro == 0
        self._micro += 1
        self.armed = last_micro_batch

    def arrived(self, i: int) -> None:
        if self.take is None and not self.armed:  # autograd accumulated it in place: nothing to do yet
            return
        b = self.bucket_of[i]
        got = self._got[b]
        got.append(i)
        if len(got) == self.members[b]:
            if self.take is not None:
                self.take(got, self._first)
            self._got[b] = []
            if self.armed:
                self._launch(b)

    def _take_partial(self, launch: bool) -> None:
        for b, got in enumerate(self._got):
            if got and self.take is not None:
                self.take(got, self._first)
            self._got[b] = []
            if launch and not self._launched[b]:
                self._launch(b)

    def _launch(self, b: int) -> None:
        start, end = self.spans[b]
        part = self.flat[start:end]
        if self.nonfinite is not None:
            self.nonfinite |= ~torch.isfinite(part).all()
        if self.reduce_dtype is not None and self.reduce_dtype != part.dtype:  # --grad-reduce-in-bf16
            low = part.to(self.reduce_dtype).div_(self.size)
            self._pending.append((self._start(low), part, low))
        else:
            part.div_(self.size)
            self._pending.append((self._start(part), None, None))
        self._launched[b] = True

    def _start(self, t: torch.Tensor):
        """``t``'s sum over the group begun; the result's ``wait()`` orders the current stream after it."""
        if self.copy_engine is not None:
            return self.copy_engine.start(t)
        return dist.all_reduce(t, group=self.group, async_op=True)

    @torch.no_grad()
    def wait(self) -> None:
        """Every bucket reduced (one whose gradients did not all arrive, e.g. unused parameters, is
        launched now), and the counts reset for the next step."""
        self._take_partial(launch=True)
        for work, part, low in self._pending:
            work.wait()
            if part is not None:
                part.copy_(low)
        self._pending.clear()
        self._launched = [False] * len(self.spans)
        self._micro = 0
        self.armed = False


def flat_grads(params: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """fp32 parameters' gradients as views of one zeroed flat buffer (autograd accumulates into a
    gradient that exists in place, so they stay views; the optimizer must zero them, not drop them)."""
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    views, offset = [], 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view(p.shape)
        views.append(p.grad)
        offset += p.numel()
    return flat, views


def overlap_reduction(params: list[torch.Tensor], main, group, size: int, bucket_size: int | None,
                      reduce_dtype: torch.dtype | None, copy_engine: bool = False,
                      timeout_s: float = 600.0) -> GradBuckets:
    """Buckets over the step's gradients (``main``'s fp32 main gradients, or ``params``' own for fp32
    parameters) and the hooks that report each one's arrival."""
    if main is not None:
        views = main.keep_flat_grads()
        buckets = GradBuckets(main.grad_flat, views, group, size, bucket_size, reduce_dtype, take=main.take_grads,
                              copy_engine=copy_engine, timeout_s=timeout_s)
        main.report_arrivals(buckets.arrived)
        return buckets
    flat, views = flat_grads(params)
    buckets = GradBuckets(flat, views, group, size, bucket_size, reduce_dtype, copy_engine=copy_engine,
                          timeout_s=timeout_s)
    on_grad_accumulated(params, buckets.arrived)
    return buckets
