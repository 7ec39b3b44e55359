"""Half-precision model parameters with fp32 main copies (Megatron's ``--bf16``).

The model holds bf16 parameters, so weights, activations and the residual stream are bf16 and no
autocast cast runs per matmul; the optimizer updates fp32 "main" copies (its moments are fp32 too)
and the new weights are copied back into the model after each step. Gradients are accumulated in
fp32 on the main copies after every micro-batch, as Megatron's ``main_grad`` buffers do, so many
micro-batches lose nothing to bf16 rounding.

Tensor-parallel parameters are DTensors: their main copies are DTensors too (what the optimizer
and checkpoints see), and the flat buffer holds this rank's shards.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``p.grad``, laid out as ``p``'s: DTensor's embedding backward gives the
    vocabulary-parallel embedding a replicated gradient when nothing else (the tied output layer)
    adds a sharded one, and each rank keeps its rows of it (no communication)."""
    g = p.grad
    if isinstance(g, DTensor) and g.placements != p.placements:
        g = g.redistribute(p.device_mesh, p.placements)
    return _local(g)


@torch.no_grad()
def _cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast every parameter to ``dtype``. Plain ones in place; a DTensor's dtype is fixed at
    creation, so it is replaced by a new parameter, the same one wherever the old one was shared
    (the tied output layer)."""
    replaced: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if not isinstance(p, DTensor):
                p.data = p.data.to(dtype)
                continue
            if id(p) not in replaced:
                local = p.to_local().to(dtype)
                replaced[id(p)] = torch.nn.Parameter(
                    DTensor.from_local(local, p.device_mesh, p.placements, run_check=False), p.requires_grad)
            module._parameters[name] = replaced[id(p)]


class MainParams:
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        # the fp32 copies are taken before the cast, so the main weights are the exact initialisation
        self.main = [p.detach().float().clone() for _, p in named]
        _cast_parameters(model, dtype)
        params = dict(model.named_parameters())
        self.model_params = [params[n] for n in self.names]
        self.dtype = dtype
        self.grad_flat: torch.Tensor | None = None

    def named(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.main))

    def _attach_flat_grads(self) -> list[torch.Tensor]:
        locals_ = [_local(m) for m in self.main]
        self.grad_flat = torch.empty(sum(m.numel() for m in locals_), device=locals_[0].device)
        views, offset = [], 0
        for m, loc in zip(self.main, locals_):
            view = self.grad_flat[offset: offset + loc.numel()].view(loc.shape)
            offset += loc.numel()
            m.grad = DTensor.from_local(view, m.device_mesh, m.placements, run_check=False) \
                if isinstance(m, DTensor) else view
            views.append(view)
        return views

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Move the model's half-precision gradients into the fp32 main gradients (added to what is
        there). The main gradients are views of one flat buffer, allocated at the first micro-batch
        and released after the step: one conversion launch, and one kernel for the norm."""
        grads = [None if p.grad is None else local_grad(p) for p in self.model_params]
        if self.grad_flat is None:
            views = self._attach_flat_grads()
            pairs = [(v, g) for v, g in zip(views, grads) if g is not None]
            for v, g in zip(views, grads):
                if g is None:
                    v.zero_()
            if pairs:
                torch._foreach_copy_([v for v, _ in pairs], [g for _, g in pairs])
        else:
            pairs = [(_local(m.grad), g) for m, g in zip(self.main, grads) if g is not None]
            if pairs:
                torch._foreach_add_([v for v, _ in pairs], [g for _, g in pairs])
        for p in self.model_params:
            p.grad = None

    def accumulate_on_backward(self) -> None:
        """For pipeline schedules, which run every micro-batch's backward inside one call: each
        model gradient is added to its fp32 main gradient as soon as autograd has accumulated it."""
        for i, p in enumerate(self.model_params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._take_grad(i, p))

    @torch.no_grad()
    def _take_grad(self, i: int, p: torch.Tensor) -> None:
        if self.grad_flat is None:
            self._attach_flat_grads()
            self.grad_flat.zero_()
        _local(self.main[i].grad).add_(local_grad(p))
        p.grad = None

    def grad_norm(self) -> torch.Tensor:
        """This rank's gradient norm (the whole norm when no parameter is sharded)."""
        return torch.linalg.vector_norm(self.grad_flat)

    def release_grads(self) -> None:
        for m in self.main:
            m.grad = None
        self.grad_flat = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        torch._foreach_copy_([_local(p) for p in self.model_params], [_local(m) for m in self.main])
