"""Half-precision model parameters with fp32 main copies (Megatron's ``--bf16``).

The model holds bf16 parameters, so weights, activations and the residual stream are bf16 and no
autocast cast runs per matmul; the optimizer updates fp32 "main" copies (its moments are fp32 too)
and the new weights are copied back into the model after each step. Gradients are accumulated in
fp32 on the main copies after every micro-batch, as Megatron's ``main_grad`` buffers do, so many
micro-batches lose nothing to bf16 rounding.

Tensor-parallel parameters are plain tensors holding this rank's shard, so are their main copies;
the flat buffer holds this rank's shards.
"""
from __future__ import annotations

import torch

from gptrain.parallel.grad_hooks import on_grad_accumulated


@torch.no_grad()
def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast every parameter to ``dtype`` in place (a tied parameter once)."""
    for p in model.parameters():
        p.data = p.data.to(dtype)


class MainParams:
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        # the fp32 copies are taken before the cast, so the main weights are the exact initialisation
        self.main = [p.detach().float().clone() for _, p in named]
        cast_parameters(model, dtype)
        params = dict(model.named_parameters())
        self.model_params = [params[n] for n in self.names]
        self.dtype = dtype
        self.grad_flat: torch.Tensor | None = None
        self._keep: list[torch.Tensor] | None = None  # keep_flat_grads: the views of one buffer for the run

    def named(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.main))

    def _attach_flat_grads(self) -> list[torch.Tensor]:
        self.grad_flat = torch.empty(sum(m.numel() for m in self.main), device=self.main[0].device)
        views, offset = [], 0
        for m in self.main:
            view = self.grad_flat[offset: offset + m.numel()].view(m.shape)
            offset += m.numel()
            m.grad = view
            views.append(view)
        return views

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Move the model's half-precision gradients into the fp32 main gradients (added to what is
        there). The main gradients are views of one flat buffer, allocated at the first micro-batch
        and released after the step: one conversion launch, and one kernel for the norm."""
        grads = [p.grad for p in self.model_params]
        if self.grad_flat is None:
            views = self._attach_flat_grads()
            pairs = [(v, g) for v, g in zip(views, grads) if g is not None]
            for v, g in zip(views, grads):
                if g is None:
                    v.zero_()
            if pairs:
                torch._foreach_copy_([v for v, _ in pairs], [g for _, g in pairs])
        else:
            pairs = [(m.grad, g) for m, g in zip(self.main, grads) if g is not None]
            if pairs:
                torch._foreach_add_([v for v, _ in pairs], [g for _, g in pairs])
        for p in self.model_params:
            p.grad = None

    def accumulate_on_backward(self) -> None:
        """For pipeline schedules, which run every micro-batch's backward inside one call: each model
        gradient is added to its fp32 main gradient as soon as autograd has accumulated it."""
        on_grad_accumulated(self.model_params, self._take_grad)

    def report_arrivals(self, arrived) -> None:
        """For overlapped data-parallel reduction: ``arrived(i)`` as soon as autograd has accumulated
        model gradient ``i`` (a bound method, held weakly); the reduction's buckets hand them back through
        ``take_grads``."""
        on_grad_accumulated(self.model_params, arrived)

    @torch.no_grad()
    def take_grads(self, indices: list[int], first: bool) -> None:
        """Model gradients ``indices`` into their fp32 main gradients, then dropped: copied in the step's
        first micro-batch (the buffer is zeroed after each step; a multi-tensor copy casts in one launch,
        where an add of two dtypes falls back to one kernel a tensor), added after."""
        pairs = [(self.main[i].grad, self.model_params[i].grad) for i in indices
                 if self.model_params[i].grad is not None]
        if pairs:
            (torch._foreach_copy_ if first else torch._foreach_add_)([m for m, _ in pairs], [g for _, g in pairs])
        for i in indices:
            self.model_params[i].grad = None

    def keep_flat_grads(self) -> list[torch.Tensor]:
        """Allocate the flat fp32 gradient buffer now and keep it from step to step (zeroed after
        each), so its views stay put for the reduction buckets; returns the views."""
        self._keep = self._attach_flat_grads()
        self.grad_flat.zero_()
        return self._keep

    @torch.no_grad()
    def _take_grad(self, i: int) -> None:
        p = self.model_params[i]
        if self.grad_flat is None:
            self._attach_flat_grads()
            self.grad_flat.zero_()
        self.main[i].grad.add_(p.grad)
        p.grad = None

    def grad_norm(self) -> torch.Tensor:
        """This rank's gradient norm (the whole norm when no parameter is sharded)."""
        return torch.linalg.vector_norm(self.grad_flat)

    def release_grads(self) -> None:
        if self._keep:  # the optimizer's zero_grad dropped the views: zero the buffer, attach them again
            self.grad_flat.zero_()
            for m, view in zip(self.main, self._keep):
                m.grad = view
            return
        for m in self.main:
            m.grad = None
        self.grad_flat = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        torch._foreach_copy_([p.detach() for p in self.model_params], self.main)
