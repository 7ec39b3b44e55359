"""Naming the rank that stopped: each rank's thread writes a heartbeat (a counter, the iteration and what
the rank was doing) into the process group's store; rank 0 watches every rank, and every other rank
watches rank 0. A heartbeat that stops changing means a process stopped, froze or died: the watcher
prints one line naming that rank, its host, its iteration and step phase, and exits non-zero so the
launcher restarts the group, well before the collectives' own timeout would end the run without
saying who.

A rank blocked in a collective keeps beating (its thread is alive): only a stopped process goes stale.
Start-up is not judged (building index maps or reading a checkpoint may hold the interpreter's lock
for long stretches); a rank is watched from its first training step.
Staleness is judged by the watcher's own clock (how long the value has not changed), so the hosts'
clocks need not agree.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time

import torch.distributed as dist

_PREFIX = "gptrain/heartbeat/"


class Heartbeat:
    def __init__(self, store, rank: int, world: int, stale_after_s: float):
        self.store, self.rank, self.world = store, rank, world
        self.stale_after_s = stale_after_s
        self.period_s = max(0.2, min(5.0, stale_after_s / 6))
        self.host = socket.gethostname()
        self.iteration, self.phase = 0, "start-up"
        self._beats = 0
        self._seen: dict[int, tuple[bytes, float]] = {}  # rank -> (last value, when it last changed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gptrain-heartbeat", daemon=True)

    def progress(self, iteration: int, phase: str) -> None:
        self.iteration, self.phase = iteration, phase

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"{_PREFIX}{self.rank}", f"{self._beats}|{self.iteration}|{self.phase}|{self.host}")

    def _watched(self) -> range | tuple[int, ...]:
        return range(1, self.world) if self.rank == 0 else (0,)

    def stale(self) -> tuple[int, str] | None:
        """(rank, its last heartbeat) of a watched rank whose heartbeat stopped changing, else None."""
        now = time.monotonic()
        for r in self._watched():
            key = f"{_PREFIX}{r}"
            if not self.store.check([key]):
                continue  # not beating yet: still starting
            value = self.store.get(key)
            last, since = self._seen.get(r, (None, now))
            if value != last:
                self._seen[r] = (value, now)
            elif now - since > self.stale_after_s and b"|start-up|" not in value:
                return r, value.decode(errors="replace")
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._beat()
                found = self.stale()
            except Exception:  # the store went away: the group is being torn down
                return
            if found is not None:
                rank, value = found
                _, iteration, phase, host = (value.split("|") + ["?"] * 4)[:4]
                print(f"gptrain: error: rank {rank} on {host} stopped progressing: no heartbeat for "
                      f"{self.stale_after_s:.0f} s, last at iteration {iteration} ({phase}); rank {self.rank} exits so "
                      "the launcher can restart the group", file=sys.stderr, flush=True)
                os._exit(1)

    def start(self) -> "Heartbeat":
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


_active: Heartbeat | None = None


def start(timeout_minutes: float) -> None:
    """Beat and watch in a real process group of several ranks (not a simulated one)."""
    global _active
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    _active = Heartbeat(store, dist.get_rank(), dist.get_world_size(), 60.0 * timeout_minutes / 2).start()


def progress(iteration: int, phase: str) -> None:
    if _active is not None:
        _active.progress(iteration, phase)


def stop() -> None:
    global _active
    if _active is not None:
        _active.stop()
        _active = None
