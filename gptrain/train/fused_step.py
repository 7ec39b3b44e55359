"""The optimizer's fused AdamW step called on the parameters' local tensors: for DTensor parameters (FSDP2's
shards, the distributed optimizer's rows) torch's own step runs the kernel through DTensor's Python dispatch,
which costs the host milliseconds a step and holds the GIL throughout; called on the local tensors with the
optimizer's own state and hyperparameters, the numbers, step counts and checkpoints are the same.
"""
from __future__ import annotations

import torch

from gptrain.parallel.collectives import local  # under no_grad: a DTensor's local tensor itself


class FusedStep:
    """The optimizer's step over a set of its parameters (``params``: their ids; a module's, or all): per
    optimizer group, the fused kernel's call over the group's parameters in the set."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: set[int]):
        self.optimizer = optimizer
        self.groups = []  # (the optimizer's group, its parameters that this module holds)
        for group in optimizer.param_groups:
            mine = [p for p in group["params"] if id(p) in params]
            if mine:
                unsupported = [k for k in ("amsgrad", "maximize", "capturable", "differentiable") if group.get(k)]
                if not group.get("fused") or unsupported:
                    raise ValueError("the step on local tensors runs fused AdamW without "
                                     f"{', '.join(unsupported) or 'other options'}: the optimizer's group differs")
                with torch.no_grad():
                    kinds = {(local(p).device, p.dtype) for p in mine}
                if len(kinds) > 1:
                    raise ValueError("the step on local tensors takes one device and dtype per group")
                self.groups.append((group, mine))
        self.params = [p for _, ps in self.groups for p in ps]
        with torch.no_grad():  # --optimizer-offload-fraction keeps some modules on the GPU
            self.on_host = all(local(p).device.type == "cpu" for p in self.params)
        # torch.optim.AdamW decouples the weight decay (Adam's flag, per group; the class in older torch)
        self.decoupled = optimizer.defaults.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))

    def step(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """torch.optim.adam._fused_adam's calls, on the local tensors (the state read now: a checkpoint load
        may have replaced it)."""
        with torch.no_grad():
            self._step(grad_scale, found_inf)
        for p in self.params:
            p.grad = None

    def _step(self, grad_scale, found_inf) -> None:
        for group, ps in self.groups:
            decoupled = group.get("decoupled_weight_decay", self.decoupled)
            kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
            ps = [p for p in ps if p.grad is not None]
            if not ps:
                continue
            states = [self.optimizer.state[p] for p in ps]
            steps = [s["step"] for s in states]
            device = local(ps[0]).device  # the scalars where the kernel reads them, as torch's step moves them
            scale = grad_scale.to(device) if grad_scale is not None else None
            skip = found_inf.to(device) if found_inf is not None else None
            torch._foreach_add_(steps, 1)
            beta1, beta2 = group["betas"]
            kernel([local(p) for p in ps], [local(p.grad) for p in ps], [local(s["exp_avg"]) for s in states],
                   [local(s["exp_avg_sq"]) for s in states], [], steps, amsgrad=False, lr=group["lr"],
                   beta1=float(beta1), beta2=float(beta2), weight_decay=group["weight_decay"], eps=group["eps"],
                   maximize=False, grad_scale=scale, found_inf=skip)
            if skip is not None:
                torch._foreach_sub_(steps, [skip] * len(steps))
