"""SIGINT and SIGTERM during a run.

With ``--exit-signal-handler`` (Megatron's flag) a signal only sets a flag: the loop finishes the
iteration, every rank agrees (one all-reduce per iteration, the latest rank's signal counts), the
run saves and exits 0. Without it the signal stops the run at once with ``Interrupted``, which the
command turns into one line naming the newest complete checkpoint; a save in progress is finished
first (``deferred_signals``), so a signal never leaves half a checkpoint behind.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

import torch

from gptrain.parallel.collectives import distributed

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The run was stopped by a signal (BaseException, like KeyboardInterrupt: no handler of
    ordinary errors swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class SignalGuard:
    def __init__(self, exit_handler: bool):
        self.exit_handler = exit_handler
        self.received: int | None = None
        self.deferring = False
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = self.received or signum
        if not self.exit_handler and not self.deferring:
            raise Interrupted(signum)

    def agreed(self) -> int | None:
        """The signal any rank received, the same answer on every rank (all ranks call this)."""
        flag = torch.tensor([float(self.received or 0)])
        if distributed():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item()) or None

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


_active: SignalGuard | None = None


def install(exit_handler: bool) -> SignalGuard:
    global _active
    if _active is not None:
        _active.restore()
    _active = SignalGuard(exit_handler)
    return _active


def uninstall() -> None:
    global _active
    if _active is not None:
        _active.restore()
        _active = None


def exit_signal() -> str | None:
    """With --exit-signal-handler: the name of the signal some rank received, agreed by all ranks
    (every rank calls this once per iteration); else None."""
    if _active is None or not _active.exit_handler:
        return None
    signum = _active.agreed()
    return signal.Signals(signum).name if signum else None


def signalled() -> bool:
    """Whether SIGINT/SIGTERM reached this process during the run (handler or not)."""
    return _active is not None and _active.received is not None


@contextmanager
def deferred_signals():
    """A signal arriving inside (a checkpoint being written) takes effect when the block ends."""
    guard = _active
    if guard is None or guard.deferring:
        yield
        return
    already = guard.received  # a signal before the block was acted on then (the run is stopping)
    guard.deferring = True
    try:
        yield
    finally:
        guard.deferring = False
    if guard.received and not already and not guard.exit_handler:
        raise Interrupted(guard.received)
