"""Megatron's learning-rate schedule (OptimizerParamScheduler), counted in samples.

The step count advances by the iteration's global batch size (the ramp-up's, train/rampup.py) after each
successful (not skipped) update; with --train-samples the warmup and decay are given in samples;
an update uses the rate of the current count, and the log shows the rate for the next one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup_steps: float
    decay_steps: float
    style: str
    num_steps: int = 0

    @classmethod
    def from_config(cls, optim, train) -> "LRSchedule":
        if train.train_samples is not None:  # Megatron's sample-based schedule: its settings are samples
            decay_steps = optim.lr_decay_samples if optim.lr_decay_samples is not None else train.train_samples
            warmup_steps = (optim.lr_warmup_fraction * decay_steps if optim.lr_warmup_fraction is not None
                            else optim.lr_warmup_samples)
            return cls(optim.lr, optim.min_lr, warmup_steps, decay_steps, optim.lr_decay_style)
        gbs = train.global_batch_size
        decay_iters = optim.lr_decay_iters if optim.lr_decay_iters is not None else train.train_iters
        decay_steps = decay_iters * gbs
        if optim.lr_warmup_fraction is not None:
            warmup_steps = optim.lr_warmup_fraction * decay_steps
        else:
            warmup_steps = optim.lr_warmup_iters * gbs
        return cls(optim.lr, optim.min_lr, warmup_steps, decay_steps, optim.lr_decay_style)

    def lr(self, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """The rate at the current count; ``max_lr``/``min_lr``: a parameter group's own peak and final rates
        (--decoupled-lr's), the same warmup and decay (Megatron's per-group overrides)."""
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        n = self.num_steps
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return max_lr * float(n) / float(self.warmup_steps)
        if self.style == "constant":
            return max_lr
        if n > self.decay_steps:
            return min_lr
        if self.style == "inverse-square-root":
            warmup = max(self.warmup_steps, 1)
            return max(min_lr, max_lr * warmup ** 0.5 / max(n, 1) ** 0.5)
        ratio = float(n - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int) -> None:
        self.num_steps += increment

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "warmup_steps": self.warmup_steps, "decay_steps": self.decay_steps, "style": self.style}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
