"""Megatron's distributed optimizer (``--use-distributed-optimizer``, ZeRO-1) on whole replicas.

Every data-parallel rank keeps the whole model in its dtype, compiled as one graph as under plain data
parallelism, and owns 1/dp of each parameter's rows: for those it holds the fp32 main weights and AdamW's
state. After the step's backward the gradients are reduce-scattered (each rank receives the average of
its own rows), each rank updates its rows, and the new weights are all-gathered in the parameters' dtype.
That is the traffic of one all-reduce (its second half in bf16) and 1/dp of the optimizer's memory and
time. FSDP2 (parallel/parallelize.py) keeps ZeRO-1 where this does not reach (pipelines, --cpu-offload)
and ZeRO-2/3: its per-block hooks cut the compiled step into blocks and cost the host time at every
block, which at small micro-batches left ZeRO-1 far behind plain data parallelism (benchmarks/RESULTS.md).

With fp32 parameters (--fp32, --autocast) the model's own rows are the main weights (no copy).

Layout. Rank r owns rows [r*c, min((r+1)*c, n)) of a parameter of n rows (c = ceil(n / dp); a 1-D
tensor's rows are its elements): DTensor's Shard(0) split, so the main weights and the optimizer's state
are DTensors of the (tensor-parallel rank's) whole parameter and a checkpoint reads the same at any
layout. One fp32 buffer holds the whole gradient rank-major: rank r's region is every parameter's r-th row
block back to back (each padded to c rows), so one reduce-scatter leaves each rank its rows contiguous.
The all-gather lands in the same memory, viewed in the parameters' dtype (the gradients are dead by
then). Between the all-gather and the next step's first micro-batch the buffer holds no memory (its
storage resized to nothing and back, as FSDP2 frees its gathered parameters, so the views stay valid),
nor does the reduced rows' buffer between the update and the next reduction: the forward's activations
take that memory.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from gptrain.train.main_params import cast_parameters


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    # torch 2.13 renames the tensor forms; the GPU machines' 2.11 has only the old names
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


class ShardedMainParams:
    """The fp32 main weights of this rank's rows, the whole-gradient buffer and the collectives between
    them. The Trainer calls it where it calls train/main_params.MainParams: ``accumulate_grads`` after
    each micro-batch, ``reduce_scatter`` after the backward, ``copy_to_model`` after the update."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, dp_mesh: DeviceMesh):
        self.group, self.dp, self.rank = dp_mesh.get_group(), dp_mesh.size(), dp_mesh.get_local_rank()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.dtype = dtype
        # per parameter: its offset in a rank's region, rows, rows per rank, elements per row
        self._spans, offset = [], 0
        for _, p in named:
            rows = p.shape[0] if p.dim() else 1
            per_rank = -(-rows // self.dp)
            self._spans.append((offset, rows, per_rank, p.numel() // max(rows, 1)))
            offset += per_rank * (p.numel() // max(rows, 1))
        self.region = offset  # elements a rank owns, padding included
        device = named[0][1].device
        # fp32 parameters (--fp32, --autocast) are their own main weights: the rows are views of the model's
        self.in_place = dtype == torch.float32 and all(p.dtype == torch.float32 for _, p in named)
        self.main_flat = None if self.in_place else torch.zeros(self.region, device=device)
        self.grad_flat = torch.empty(self.dp * self.region, device=device)  # the whole gradient, rank-major
        self.shard_grad = torch.zeros(self.region, device=device)  # this rank's rows of it, reduced
        self.main, self._grads = [], []
        self._pieces: list[list[tuple[int, int, torch.Tensor]]] = []  # per parameter: (lo, hi, its rows' view)
        padding = []
        with torch.no_grad():
            for (_, p), span in zip(named, self._spans):
                lo, hi = self._rows(span, self.rank)
                if self.in_place:
                    mine = p.detach()[lo:hi]
                else:  # the fp32 copies are taken before the cast, so the main weights are the exact initialisation
                    mine = self._view(self.main_flat, span, self.rank, p.shape)
                    mine.copy_(p.detach()[lo:hi])
                self.main.append(self._dtensor(mine, p.shape, dp_mesh))
                self._grads.append(self._dtensor(self._view(self.shard_grad, span, self.rank, p.shape), p.shape,
                                                 dp_mesh))
                pieces = []
                for r in range(self.dp):
                    r_lo, r_hi = self._rows(span, r)
                    pieces.append((r_lo, r_hi, self._view(self.grad_flat, span, r, p.shape, r * self.region)))
                    offset, _, per_rank, row = span
                    if r_hi - r_lo < per_rank:
                        start = r * self.region + offset + (r_hi - r_lo) * row
                        padding.append(self.grad_flat[start: r * self.region + offset + per_rank * row])
                self._pieces.append(pieces)
        self._padding = padding
        cast_parameters(model, dtype)
        params = dict(model.named_parameters())
        self.model_params = [params[n] for n in self.names]
        self._gather_views()
        self._free(self.grad_flat)
        self._free(self.shard_grad)
        self._first = True  # the next micro-batch's gradients are copied into the buffer, not added

    def _gather_views(self) -> None:
        """The all-gather's buffer (the gradient buffer's memory in the parameters' dtype) and the copies between
        it and the model's rows, made once: this rank's rows in (from the main weights, or the model's own rows
        with fp32 parameters), every rank's rows out (but the model's own)."""
        self._gathered = self.grad_flat.view(self.dtype)[:self.dp * self.region]
        self._mine = self._gathered[self.rank * self.region: (self.rank + 1) * self.region]
        self._own_in: tuple[list, list] = ([], [])  # (gathered, model rows), with fp32 parameters
        self._out: tuple[list, list] = ([], [])  # (model rows, gathered)
        with torch.no_grad():
            for p, pieces, span in zip(self.model_params, self._pieces, self._spans):
                for r, (lo, hi, _) in enumerate(pieces):
                    if hi == lo:
                        continue
                    rows, part = p.detach()[lo:hi], self._view(self._gathered, span, r, p.shape, r * self.region)
                    if self.in_place and r == self.rank:
                        self._own_in[0].append(part)
                        self._own_in[1].append(rows)
                    else:
                        self._out[0].append(rows)
                        self._out[1].append(part)

    @staticmethod
    def _free(t: torch.Tensor) -> None:
        t.untyped_storage().resize_(0)

    @staticmethod
    def _hold(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(t.numel() * t.element_size())

    def _rows(self, span, r: int) -> tuple[int, int]:
        _, rows, per_rank, _ = span
        return min(r * per_rank, rows), min((r + 1) * per_rank, rows)

    def _view(self, flat: torch.Tensor, span, r: int, shape, base: int = 0) -> torch.Tensor:
        offset, _, _, row = span
        lo, hi = self._rows(span, r)
        return flat[base + offset: base + offset + (hi - lo) * row].view(hi - lo, *shape[1:])

    @staticmethod
    def _dtensor(t: torch.Tensor, shape, mesh: DeviceMesh) -> DTensor:
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)

    def named(self) -> dict[str, torch.Tensor]:
        """What the optimizer updates and checkpoints hold: this rank's rows as DTensors of the whole."""
        return dict(zip(self.names, self.main))

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """The model's gradients into the whole-gradient buffer, each parameter's row blocks into their
        ranks' regions (copied in a step's first micro-batch, added after), then dropped."""
        if self._first:
            self._hold(self.grad_flat)
        dst, src, absent = [], [], []
        for p, pieces in zip(self.model_params, self._pieces):
            for lo, hi, view in pieces:
                if hi == lo:
                    continue
                if p.grad is None:
                    absent.append(view)
                else:
                    dst.append(view)
                    src.append(p.grad[lo:hi])
            p.grad = None
        if self._first:
            absent += self._padding
            if absent:
                torch._foreach_zero_(absent)
        if dst:
            (torch._foreach_copy_ if self._first else torch._foreach_add_)(dst, src)
        self._first = False

    @torch.no_grad()
    def reduce_scatter(self, reduce_dtype: torch.dtype | None = None) -> None:
        """Average the gradient over the data-parallel ranks, each rank receiving its own rows (sent in
        ``reduce_dtype``, --grad-reduce-in-bf16); the main weights' gradients are those rows."""
        flat = self.grad_flat.div_(self.dp)
        self._hold(self.shard_grad)
        if reduce_dtype is None or reduce_dtype == flat.dtype:
            _reduce_scatter(self.shard_grad, flat, self.group)
        else:
            low = torch.empty(self.region, dtype=reduce_dtype, device=flat.device)
            _reduce_scatter(low, flat.to(reduce_dtype), self.group)
            self.shard_grad.copy_(low)
        for m, g in zip(self.main, self._grads):
            m.grad = g
        self._free(self.grad_flat)  # held again by copy_to_model (not reached after a skipped fp16 step)
        self._first = True

    def grad_squares(self) -> torch.Tensor:
        """This rank's share of the gradients' squared norm (its rows; the padding is zero)."""
        return torch.linalg.vector_norm(self.shard_grad).square()

    def release_grads(self) -> None:
        """After the update (skipped or not): the reduced rows are done with."""
        for m in self.main:
            m.grad = None
        self._free(self.shard_grad)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Every rank's updated rows into every rank's model: one all-gather in the parameters' dtype."""
        self._hold(self.grad_flat)  # freed already where no backward ran since (a checkpoint's load)
        if self.in_place:  # this rank's rows are the model's own: into the gather's input, and not back
            if self._own_in[0]:
                torch._foreach_copy_(*self._own_in)
        else:
            self._mine.copy_(self.main_flat)
        _all_gather(self._gathered, self._mine, self.group)
        if self._out[0]:
            torch._foreach_copy_(*self._out)
        self._free(self.grad_flat)
        self._first = True
