"""The file operations the durable store is built from, behind one interface.

The store never calls ``os`` directly for journal I/O: it calls a
:class:`FileSystem`. :class:`OsFileSystem` is the real one. Tests substitute a
fault-injecting file system (fails the Nth write / sync / rename before, after
or short) and a power-loss file system (drops every byte not yet synced), and
the same store code must keep its guarantees on all of them.

Every method is blocking; callers run them on a writer thread or through
``trio.to_thread``, never on the Trio loop.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Callable
from typing import Protocol

__all__ = ["FileSystem", "OsFileSystem", "syncfs_available"]


class FileSystem(Protocol):
    """Blocking file primitives with POSIX meaning. Handles are opaque ints."""

    def open_append(self, path: str) -> int:
        """Open ``path`` for appending, creating it (mode 0600) if missing."""
        ...

    def open_exclusive(self, path: str) -> int:
        """Create ``path`` (mode 0600) for writing; fail if it exists."""
        ...

    def open_write(self, path: str) -> int:
        """Open ``path`` for positional writes (``pwrite``, not appending), creating it
        (mode 0600) if missing."""
        ...

    def allocate(self, handle: int, offset: int, length: int) -> None:
        """Allocate ``length`` bytes from ``offset`` (``posix_fallocate``): the file grows to
        at least ``offset + length``, and what it did not hold reads as zeros."""
        ...

    def write(self, handle: int, data: bytes) -> int:
        """Write at the end (append) or the current position; may be short."""
        ...

    def pwrite(self, handle: int, data: bytes, offset: int) -> int:
        """Write at ``offset`` of a handle not opened for appending; may be short."""
        ...

    def fdatasync(self, handle: int) -> None: ...

    def fsync(self, handle: int) -> None: ...

    def truncate(self, handle: int, length: int) -> None: ...

    def size(self, handle: int) -> int: ...

    def close(self, handle: int) -> None: ...

    def read(self, path: str) -> bytes:
        """The whole content of ``path``; ``FileNotFoundError`` if missing."""
        ...

    def rename(self, src: str, dst: str) -> None:
        """Atomically replace ``dst`` by ``src``."""
        ...

    def fsync_dir(self, path: str) -> None:
        """Make the directory's entries (creations, renames) durable."""
        ...

    def sync_tree(self, path: str) -> None:
        """Make everything under the directory ``path`` durable — every file's content and
        every directory's entries, whoever wrote them and whether or not they were synced —
        as a power loss would find them (journal.md J23). Raises ``OSError`` if any of it
        may not have reached the disk."""
        ...

    def makedirs(self, path: str) -> None:
        """Create ``path`` and missing parents, mode 0700; no error if it exists."""
        ...

    def exists(self, path: str) -> bool: ...

    def listdir(self, path: str) -> list[str]: ...

    def unlink(self, path: str) -> None: ...


class OsFileSystem:
    """The real file system."""

    def open_append(self, path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def open_exclusive(self, path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)

    def open_write(self, path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def allocate(self, handle: int, offset: int, length: int) -> None:
        os.posix_fallocate(handle, offset, length)

    def write(self, handle: int, data: bytes) -> int:
        return os.write(handle, data)

    def pwrite(self, handle: int, data: bytes, offset: int) -> int:
        return os.pwrite(handle, data, offset)

    def fdatasync(self, handle: int) -> None:
        os.fdatasync(handle)

    def fsync(self, handle: int) -> None:
        os.fsync(handle)

    def truncate(self, handle: int, length: int) -> None:
        os.ftruncate(handle, length)

    def size(self, handle: int) -> int:
        return os.fstat(handle).st_size

    def close(self, handle: int) -> None:
        os.close(handle)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def sync_tree(self, path: str) -> None:
        """``syncfs(2)`` of the file system holding ``path`` (one call, whatever the number
        of files; since Linux 5.8 it reports a writeback error no one has seen yet, a
        killed writer's too); where the C library or the kernel has none, ``fsync`` of
        every file and directory under ``path`` (:func:`_fsync_each`)."""
        if _SYNCFS is not None:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                if _SYNCFS(fd) == 0:
                    return
                code = ctypes.get_errno()
            finally:
                os.close(fd)
            if code != errno.ENOSYS:  # a kernel without it (or a filter refusing it): walk
                raise OSError(code, f"syncfs: {os.strerror(code)}", path)
        _fsync_each(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, mode=0o700, exist_ok=True)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def unlink(self, path: str) -> None:
        os.unlink(path)


def _load_syncfs() -> Callable[[int], int] | None:
    """The C library's ``syncfs``, or ``None`` where it has none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syncfs = libc.syncfs
    except (OSError, AttributeError):
        return None
    syncfs.argtypes = [ctypes.c_int]
    syncfs.restype = ctypes.c_int
    return syncfs


_SYNCFS: Callable[[int], int] | None = _load_syncfs()


def syncfs_available() -> bool:
    """Whether :meth:`OsFileSystem.sync_tree` can use ``syncfs(2)`` (not the walk)."""
    return _SYNCFS is not None


def _fsync_each(path: str) -> None:
    """``fsync`` every regular file and directory under ``path`` (files before the directory
    holding them), symbolic links not followed; one that vanished meanwhile is skipped."""

    def fail(error: OSError) -> None:
        raise error

    for directory, _, names in os.walk(path, topdown=False, onerror=fail):
        for name in [*names, ""]:
            target = os.path.join(directory, name) if name else directory
            try:
                fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as error:
                if error.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO):
                    continue  # gone, a symbolic link, a socket
                raise
            try:
                mode = os.fstat(fd).st_mode
                if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
                    os.fsync(fd)
            finally:
                os.close(fd)
