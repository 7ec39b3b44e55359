"""How long a command took to get ready, by phase (imports, load, warm-up), for the one line `gptrain
serve` and `gptrain generate` print: where a start-up's seconds go, counted from the package's import."""
from __future__ import annotations

import time

import gptrain


class StartClock:
    def __init__(self):
        self.last = gptrain.STARTED
        self.phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        """``phase`` ended now (it began at the previous mark, or at the package's import)."""
        now = time.perf_counter()
        self.phases.append((phase, now - self.last))
        self.last = now

    def line(self) -> str:
        """``12.3 s (imports 2.1 s, load 4.0 s, ...)``."""
        total = self.last - gptrain.STARTED
        return f"{total:.1f} s (" + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases) + ")"
