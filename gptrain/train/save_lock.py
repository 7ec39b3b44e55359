"""One run per ``--save`` folder: rank 0 holds an exclusive advisory lock (``fcntl.flock``) on
``SAVE/.gptrain.lock`` from the start-up checks, before anything is written or cleaned there, to the
end of the run. The operating system drops the lock when the process ends, however it ends, so a
killed run never leaves a stale lock; the file itself stays (it holds the last holder's host and pid,
for the message a second launch prints). No reader takes it for checkpoint content: it is not an
``iter_*``/``release`` folder, nor a ``.*.tmp``/``.*.old`` one, and it sits beside the iteration
folders, outside every manifest. On NFS, Linux maps ``flock`` onto the server's byte-range locks.

``recover()`` (the start's cleanup) also cleans a folder only under this lock: a ``--load`` folder that
another run is saving into keeps its temporary folders.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = ".gptrain.lock"

_held: dict[str, int] = {}  # absolute folder -> the open, locked file descriptor
# a file system without flock (some Lustre and FUSE mounts): the run goes on unlocked, with a warning
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}
_UNLOCKABLE = -1


class FolderInUse(ValueError):
    """Another process holds the folder's lock."""


def _key(folder: str | os.PathLike) -> str:
    return os.path.realpath(folder)


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        return f" (held by pid {int(info['pid'])} on {info['host']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def _try_lock(folder: Path) -> int | None:
    """The locked descriptor of ``folder``'s lock file, or None where another process holds it."""
    path = folder / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
        writable = True
    except PermissionError:  # a teammate's lock file: flock works on a read-only descriptor too
        fd, writable = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW), False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        if err.errno in _NO_LOCKS:
            return _UNLOCKABLE
        raise
    if writable:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode() + b"\n", 0)
    return fd


def lock_save_folder(save: str | os.PathLike) -> None:
    """Rank 0 at start: create ``save`` if needed and hold its lock until ``release_all`` or the
    process's end; another run holding it is a FolderInUse naming the folder and the holder."""
    folder = Path(save)
    if _key(folder) in _held:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = _try_lock(folder)
    except OSError as err:  # a symbolic link in its place, a read-only folder, ...
        raise ValueError(f"--save {save}: its lock file {folder / LOCK_NAME} cannot be taken "
                         f"({err.strerror or err})") from None
    if fd == _UNLOCKABLE:
        import sys

        print(f"WARNING: --save {save}: its file system does not support flock; this run does not lock the "
              "folder against a second run saving into it", file=sys.stderr, flush=True)
        return
    if fd is None:
        raise FolderInUse(f"--save {save} is in use by another gptrain run{_holder(folder / LOCK_NAME)}: two runs "
                          "saving into one folder would delete each other's saves; wait for it to end, or pass "
                          "another --save")
    _held[_key(folder)] = fd


def holds(folder: str | os.PathLike) -> bool:
    return _key(folder) in _held


def release_all() -> None:
    """At the run's end: every lock this process holds."""
    while _held:
        _, fd = _held.popitem()
        os.close(fd)  # closing the last descriptor of the open file drops the flock


@contextmanager
def cleaning(folder: str | os.PathLike):
    """Yields (whether this process may clean ``folder``, the holder for a message): it may where it
    holds the lock or takes it for the while, not where another run holds it."""
    folder = Path(folder)
    fd = None
    if not holds(folder) and folder.is_dir():
        try:
            fd = _try_lock(folder)
        except OSError:  # a read-only folder without a lock file: nothing can be cleaned there anyway
            fd = -1
        if fd is None:
            yield False, _holder(folder / LOCK_NAME)
            return
    try:
        yield True, ""
    finally:
        if fd is not None and fd >= 0:
            os.close(fd)
