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

import os
from typing import Protocol

__all__ = ["FileSystem", "OsFileSystem"]


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

    def makedirs(self, path: str) -> None:
        os.makedirs(path, mode=0o700, exist_ok=True)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def unlink(self, path: str) -> None:
        os.unlink(path)
