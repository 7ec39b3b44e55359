"""Durable file operations for checkpoints: fsync of files and directories, and the crash points
the kill tests use.

A rename is durable only once the directory holding it is fsynced, and a file's bytes only once
the file is; a checkpoint is published (renamed into place, then named by the tracker) only after
both, so a power loss or a SIGKILL never leaves a published name over missing data.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

CRASH_ENV = "GPTRAIN_CRASH_AT"  # tests: "POINT" or "POINT@ITERATION" -> SIGKILL there
STALL_ENV = "GPTRAIN_STALL_AT"  # tests: "RANK@ITERATION" -> that rank stops responding there


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """Every file directly in ``path``, then ``path`` itself."""
    for p in Path(path).iterdir():
        if p.is_file():
            fsync_file(p)
    fsync_dir(path)


def write_durable(path: str | os.PathLike, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def replace_durable(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """``os.replace`` and fsync of the directory holding both."""
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it process-wide, racing
    with other threads' file creation)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file``, durable, and with the mode every other file gets (its writer
    creates files owner-only, so a teammate resuming from a shared folder could not read them)."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())
    fsync_file(path)


def crash_point(name: str, iteration: int | str | None = None) -> None:
    """SIGKILL this process here when ``GPTRAIN_CRASH_AT`` names this point (kill tests only)."""
    want = os.environ.get(CRASH_ENV)
    if not want:
        return
    point, _, at = want.partition("@")
    if point == name and (not at or str(iteration) == at):
        os.kill(os.getpid(), signal.SIGKILL)


def stall_point(rank: int, iteration: int) -> None:
    """Stop responding (sleep) here when ``GPTRAIN_STALL_AT`` is ``RANK@ITERATION`` (the hang tests)."""
    want = os.environ.get(STALL_ENV)
    if want and want == f"{rank}@{iteration}":
        import time

        time.sleep(3600)
