"""Exclusive hold of a disk tier's location: an OS lock for a local directory, a seam for leases.

One live disk tier holds its location exclusively. Two tiers on one directory
would wipe and then reload each other's pages, so the second open is refused
with ``DiskPathInUseError`` naming the path and the holder (pid and host).

``LocalDirLock`` takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``<dir>/.tiering.lock``.
The lock belongs to the open file description, so the kernel drops it when the
holding process dies (no stale lock after a crash), and a second open in the
same process is refused as well: it opens the file again, gets its own open file
description, and its ``flock`` conflicts with the first. After taking the lock
the holder checks that the file it locked is still the one at the path (a lock
file unlinked and recreated meanwhile would otherwise give two holders), then
writes ``pid host`` into it for the error message of the next one.

The lock file is opened with ``O_NOFOLLOW`` and must be a regular file: a symlink (or a FIFO,
a device) planted at ``<dir>/.tiering.lock`` in a shared directory is refused with an
``OSError`` naming it, never followed, so the tier cannot be made to truncate a file it does
not own.

``PathLease`` is the seam for stores that are not a local directory (an object
store, a shared filesystem): anything with ``acquire()`` (raise
``DiskPathInUseError`` when another holder has it) and ``release()`` can be passed
as ``DiskConfig.lease``. The disk tier calls ``acquire`` before it touches the
store and ``release`` at ``close()`` or when its constructor fails.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
from pathlib import Path
from typing import Protocol, runtime_checkable

from tiering.errors import DiskPathInUseError

LOCK_FILE_NAME = ".tiering.lock"


@runtime_checkable
class PathLease(Protocol):
    """Exclusive hold of one store location (see the module docstring)."""

    def acquire(self) -> None: ...

    def release(self) -> None: ...


class LocalDirLock:
    """``flock`` on ``<root>/.tiering.lock``; ``created_root`` / ``created_file`` tell what
    ``acquire`` made, so that a failed start can remove exactly that."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.path = self.root / LOCK_FILE_NAME
        self.created_root = False
        self.created_file = False
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        if self._fd is not None:
            raise ValueError(f"lock {self.path} is already held by this object")
        if not self.root.exists():
            self.root.mkdir(parents=True)
            self.created_root = True
        elif not self.root.is_dir():
            raise NotADirectoryError(
                errno.ENOTDIR, "disk tier path is not a directory", str(self.root)
            )
        for _ in range(8):  # the file may be unlinked and recreated under us; bounded retries
            existed = os.path.lexists(self.path)
            fd = _open_own_file(self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise DiskPathInUseError(
                    errno.EBUSY,
                    f"disk tier path {str(self.root)!r} is in use by another live disk tier "
                    f"(holder: {holder}); each cache needs its own disk path",
                ) from None
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            self.created_file = self.created_file or not existed
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} host {socket.gethostname()}\n".encode(), 0)
            self._fd = fd
            return
        raise DiskPathInUseError(
            errno.EBUSY, f"disk tier path {str(self.root)!r}: its lock file keeps being replaced"
        )

    def release(self) -> None:
        """Drop the lock (idempotent). The lock file stays: removing it could let two
        openers lock two different files."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor of the description drops the flock

    def discard(self) -> None:
        """After a failed start: remove the lock file if ``acquire`` created it, then release.

        Unlinking while still holding the lock is safe: a waiter that opened the
        old file notices at its inode check and retries on a new one."""
        if self._fd is not None and self.created_file:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        self.release()


def _open_own_file(path: Path) -> int:
    """Open (creating) a regular file at ``path`` without following a symlink there."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "disk tier lock file is a symlink; refusing to follow it"
                                       " (remove it, or give the tier a directory of its own)",
                          str(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "disk tier lock file is not a regular file", str(path))
    return fd


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 256, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "unknown (no holder recorded)"
