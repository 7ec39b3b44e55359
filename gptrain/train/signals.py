"""SIGINT and SIGTERM during a run.

With ``--exit-signal-handler`` (Megatron's flag) a signal only sets a flag: the loop finishes the
iteration, every rank agrees (one all-reduce per iteration, the latest rank's signal counts), the
run saves and exits 0. Without it the signal stops the run at once with ``Interrupted``, which the
command turns into one line naming the newest complete checkpoint; a save in progress is finished
first (``deferred_signals``), so a signal never leaves half a checkpoint behind.

Python runs a signal handler only when the main thread is back in Python, and a rank whose peer died
waits inside a collective for as long as the distributed timeout: ``torchrun`` then sends SIGTERM,
waits 30 s and kills the worker, and the restart is that much later. Without ``--exit-signal-handler``
a watcher thread (woken through ``signal.set_wakeup_fd``) ends such a process itself once the handler
has not run within ``STUCK_GRACE_S``; never while a checkpoint is being written.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

import torch

from gptrain.parallel.collectives import distributed

SIGNALS = (signal.SIGINT, signal.SIGTERM)
STUCK_GRACE_S = 3.0


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
        self.acted = False  # the handler ran in the main thread (raised, or was deferred)
        self._previous = {}
        self._wakeup: tuple[int, int] | None = None
        self._previous_fd = -1
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
            if not exit_handler:
                self._watch()

    def _handle(self, signum, frame) -> None:
        self.received = self.received or signum
        self.acted = True
        if not self.exit_handler and not self.deferring:
            raise Interrupted(signum)

    def _watch(self) -> None:
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:  # not the main thread of the main interpreter
            os.close(read), os.close(write)
            return
        self._wakeup = (read, write)
        threading.Thread(target=self._watcher, args=(read,), name="gptrain-signal-watch", daemon=True).start()

    def _watcher(self, read: int) -> None:
        while True:
            try:
                data = os.read(read, 16)
            except OSError:
                return
            if not data:  # restore() closed the pipe
                os.close(read)
                return
            signum = next((b for b in data if b in SIGNALS), None)
            if signum is None:
                continue
            deadline = time.monotonic() + STUCK_GRACE_S
            while not self.acted and (self.deferring or time.monotonic() < deadline):
                time.sleep(0.05)
            if not self.acted:
                print(f"gptrain: {signal.Signals(signum).name} while this process was blocked (in a collective "
                      "whose peer is gone, or a GPU wait): exiting now", file=sys.stderr, flush=True)
                os._exit(128 + signum)

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
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_fd)
            read, write = self._wakeup
            self._wakeup = None
            os.close(write)  # the watcher reads end-of-file and returns


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
