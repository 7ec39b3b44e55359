"""Half-precision model parameters with fp32 main copies (Megatron's ``--bf16``).

The model holds bf16 parameters, so weights, activations and the residual stream are bf16 and no
autocast cast runs per matmul; the optimizer updates fp32 "main" copies (its moments are fp32 too)
and the new weights are copied back into the model after each step. Gradients are accumulated in
fp32 on the main copies after every micro-batch, as Megatron's ``main_grad`` buffers do, so many
micro-batches lose nothing to bf16 rounding.
"""
from __future__ import annotations

import torch


class MainParams:
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.model_params = [p for _, p in named]
        # the fp32 copies are taken before the cast, so the main weights are the exact initialisation
        self.main = [p.detach().float().clone() for p in self.model_params]
        model.to(dtype)
        self.dtype = dtype
        self.grad_flat: torch.Tensor | None = None

    def named(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.main))

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Move the model's half-precision gradients into the fp32 main gradients (added to what is
        there). The main gradients are views of one flat buffer, allocated at the first micro-batch
        and released after the step: one conversion launch, and one kernel for the norm."""
        grads = [p.grad for p in self.model_params]
        if self.grad_flat is None:
            self.grad_flat = torch.empty(sum(m.numel() for m in self.main), device=self.main[0].device)
            views, offset = [], 0
            for m in self.main:
                views.append(self.grad_flat[offset : offset + m.numel()].view(m.shape))
                offset += m.numel()
            for m, view in zip(self.main, views):
                m.grad = view
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

    def grad_norm(self) -> torch.Tensor:
        return torch.linalg.vector_norm(self.grad_flat)

    def release_grads(self) -> None:
        for m in self.main:
            m.grad = None
        self.grad_flat = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        torch._foreach_copy_(self.model_params, self.main)
