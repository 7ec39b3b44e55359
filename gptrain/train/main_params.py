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

    def named(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.main))

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Move the model's half-precision gradients into fp32 main gradients (added to what is there)."""
        acc, add = [], []
        for m, p in zip(self.main, self.model_params):
            if p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                acc.append(m.grad)
                add.append(p.grad)
        if acc:
            torch._foreach_add_(acc, add)
        for p in self.model_params:
            p.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        torch._foreach_copy_(self.model_params, self.main)
