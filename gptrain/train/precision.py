"""Megatron's dynamic loss scaling for fp16 (DynamicGradScaler): start at 2^32, halve after
``hysteresis`` overflowing steps (each one skipped and counted), double after ``window`` clean
steps, never below ``min_scale``. A static ``--loss-scale`` never changes."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScaler:
    scale: float = 2.0 ** 32
    min_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    dynamic: bool = True
    growth_tracker: int = 0
    hysteresis_tracker: int = 2

    @classmethod
    def from_config(cls, precision) -> "LossScaler | None":
        if not precision.fp16:
            return None
        if precision.loss_scale is not None:
            return cls(scale=precision.loss_scale, dynamic=False)
        return cls(scale=precision.initial_loss_scale, min_scale=precision.min_loss_scale,
                   window=precision.loss_scale_window, hysteresis=precision.hysteresis,
                   hysteresis_tracker=precision.hysteresis)

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * 0.5, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.window:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])
