"""Megatron-LM's ``--manual-gc``: Python's garbage collector off while training, full collections only at
points every rank reaches together (the start, before and after each periodic evaluation, every
``--manual-gc-interval`` iterations after that iteration's evaluation). A collection that a rank's own
allocations trigger at its own moment stalls that rank's host, and in a step that waits on every rank's
collectives the others wait with it.
"""
from __future__ import annotations

import gc


class ManualGC:
    """The collector's schedule for one training loop; ``end()`` gives the process its collector back."""

    def __init__(self, interval: int, around_eval: bool):
        self.interval, self.around_eval = interval, around_eval
        self._was_enabled = None

    def start(self) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()

    def after_step(self, iteration: int) -> None:
        if self.interval and iteration % self.interval == 0:
            gc.collect()

    def before_eval(self) -> None:
        if self.around_eval:
            gc.collect()

    def after_eval(self) -> None:
        if self.around_eval:  # what the evaluation made and dropped (Megatron's generation 0)
            gc.collect(generation=0)

    def end(self) -> None:
        """The collector as ``start()`` found it (nothing if it never started)."""
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
