"""File systems that misbehave on purpose, for the journal store's tests.

Both classes implement :class:`runtime._linux._fs.FileSystem`, so the store runs on
them unchanged (``open_store(root, fs=...)``):

* :class:`FaultyFileSystem` wraps another file system and makes the *N*-th
  operation of one kind (``write``, ``sync``, ``rename``, ``truncate``,
  ``close``) fail with an errno — before it happens, after it happened, or
  (for writes) after writing only part of the data.
* :class:`PowerLossFileSystem` is an in-memory file system that keeps the page
  cache apart from the disk. :meth:`PowerLossFileSystem.crash` turns it into
  what a machine finds after losing power: synced bytes and directory entries
  survive, everything else survives partly, torn or not at all. A torn write keeps its new
  bytes up to a 512-byte sector boundary of the file (a disk writes a sector whole); past
  the old end of a file the rest reads as zeros (as on ext4, XFS and btrfs), never as
  stale data. :meth:`PowerLossFileSystem.kill` ends the process instead (the page cache
  stays, synced or not, for the next one to read; the next start's ``sync_tree``, J23, makes
  it durable), and
  :meth:`PowerLossFileSystem.fail_next_sync` fails a sync as Linux does (fsyncgate).
"""

from __future__ import annotations

import errno
import os
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from runtime._linux._fs import FileSystem

__all__ = [
    "Fault",
    "FaultHit",
    "FaultyFileSystem",
    "OpKind",
    "PowerCut",
    "PowerLossFileSystem",
    "When",
]

OpKind = Literal["write", "sync", "rename", "truncate", "close", "allocate", "sync_tree"]
"""``sync`` counts ``fdatasync``, ``fsync`` and ``fsync_dir`` alike; ``sync_tree`` (the whole
state directory made durable at a start, J23) is counted apart, so that a start does not move
the count of the *N*-th sync a test aims at."""

When = Literal["before", "after", "short"]
"""``before``: nothing is done. ``after``: the operation is done, then it raises.
``short``: a write writes only part of the data and returns the short count
(no exception); for every other kind ``short`` behaves like ``after``."""


@dataclass(frozen=True, slots=True)
class Fault:
    """Fail the ``nth`` (1-based) operation of ``kind`` counted since arming."""

    kind: OpKind
    nth: int = 1
    when: When = "before"
    errno: int = errno.EIO
    sticky: bool = False
    """Also fail every later operation of the kind."""
    path_contains: str | None = None
    """Count only operations on paths containing this string."""

    def __post_init__(self) -> None:
        if self.nth < 1:
            raise ValueError("operations are counted from 1")


@dataclass(frozen=True, slots=True)
class FaultHit:
    """One operation a :class:`Fault` made fail."""

    fault: Fault
    op: str
    path: str
    count: int


class FaultyFileSystem:
    """Wrap ``inner`` and fail the operations ``plan`` names.

    Each fault counts the operations it matches from the moment the file system
    is armed (at construction unless ``armed=False``; :meth:`arm` restarts the
    count). When several faults match one operation, the first that fires wins.
    Thread-safe: the store calls it from several writer threads at once.
    """

    def __init__(
        self, inner: FileSystem, plan: Fault | Sequence[Fault] = (), *, armed: bool = True
    ) -> None:
        self.inner = inner
        self.plan: tuple[Fault, ...] = (plan,) if isinstance(plan, Fault) else tuple(plan)
        self.hits: list[FaultHit] = []
        """Every operation that was made to fail, in order."""
        self.counts: dict[OpKind, int] = {}
        """Operations seen per kind since arming (all paths)."""
        self._lock = threading.Lock()
        self._armed = armed
        self._matched = [0] * len(self.plan)
        self._paths: dict[int, str] = {}

    def arm(self, plan: Fault | Sequence[Fault] | None = None) -> None:
        """Start (or restart) counting, optionally with a new plan."""
        with self._lock:
            if plan is not None:
                self.plan = (plan,) if isinstance(plan, Fault) else tuple(plan)
            self._matched = [0] * len(self.plan)
            self.counts = {}
            self._armed = True

    def disarm(self) -> None:
        with self._lock:
            self._armed = False

    @property
    def fired(self) -> bool:
        return bool(self.hits)

    def _decide(self, kind: OpKind, op: str, path: str) -> Fault | None:
        with self._lock:
            if not self._armed:
                return None
            self.counts[kind] = self.counts.get(kind, 0) + 1
            chosen: Fault | None = None
            for i, fault in enumerate(self.plan):
                if fault.kind != kind:
                    continue
                if fault.path_contains is not None and fault.path_contains not in path:
                    continue
                self._matched[i] += 1
                n = self._matched[i]
                if chosen is None and (n == fault.nth or (fault.sticky and n > fault.nth)):
                    chosen = fault
                    self.hits.append(FaultHit(fault, op, path, n))
            return chosen

    @staticmethod
    def _error(fault: Fault, op: str, path: str) -> OSError:
        return OSError(fault.errno, f"{os.strerror(fault.errno)} (injected into {op})", path)

    def path_of(self, handle: int) -> str:
        """The path a handle was opened with (for messages and filters)."""
        with self._lock:
            return self._paths.get(handle, f"<handle {handle}>")

    # -- FileSystem ------------------------------------------------------------------

    def open_append(self, path: str) -> int:
        handle = self.inner.open_append(path)
        with self._lock:
            self._paths[handle] = path
        return handle

    def open_exclusive(self, path: str) -> int:
        handle = self.inner.open_exclusive(path)
        with self._lock:
            self._paths[handle] = path
        return handle

    def open_write(self, path: str) -> int:
        handle = self.inner.open_write(path)
        with self._lock:
            self._paths[handle] = path
        return handle

    def allocate(self, handle: int, offset: int, length: int) -> None:
        path = self.path_of(handle)
        self._simple(
            "allocate", "allocate", path, lambda: self.inner.allocate(handle, offset, length)
        )

    def write(self, handle: int, data: bytes) -> int:
        path = self.path_of(handle)
        fault = self._decide("write", "write", path)
        if fault is None:
            return self.inner.write(handle, data)
        if fault.when == "before":
            raise self._error(fault, "write", path)
        if fault.when == "after":
            self.inner.write(handle, data)
            raise self._error(fault, "write", path)
        return self.inner.write(handle, data[: len(data) // 2]) if len(data) > 1 else 0

    def pwrite(self, handle: int, data: bytes, offset: int) -> int:
        path = self.path_of(handle)
        fault = self._decide("write", "pwrite", path)
        if fault is None:
            return self.inner.pwrite(handle, data, offset)
        if fault.when == "before":
            raise self._error(fault, "pwrite", path)
        if fault.when == "after":
            self.inner.pwrite(handle, data, offset)
            raise self._error(fault, "pwrite", path)
        part = data[: len(data) // 2] if len(data) > 1 else b""
        return self.inner.pwrite(handle, part, offset) if part else 0

    def _simple(self, kind: OpKind, op: str, path: str, call: Callable[[], object]) -> None:
        """An operation without a result: ``short`` behaves like ``after``."""
        fault = self._decide(kind, op, path)
        if fault is not None and fault.when == "before":
            raise self._error(fault, op, path)
        call()
        if fault is not None:
            raise self._error(fault, op, path)

    def fdatasync(self, handle: int) -> None:
        self._simple(
            "sync", "fdatasync", self.path_of(handle), lambda: self.inner.fdatasync(handle)
        )

    def fsync(self, handle: int) -> None:
        self._simple("sync", "fsync", self.path_of(handle), lambda: self.inner.fsync(handle))

    def fsync_dir(self, path: str) -> None:
        self._simple("sync", "fsync_dir", path, lambda: self.inner.fsync_dir(path))

    def sync_tree(self, path: str) -> None:
        self._simple("sync_tree", "sync_tree", path, lambda: self.inner.sync_tree(path))

    def truncate(self, handle: int, length: int) -> None:
        path = self.path_of(handle)
        self._simple("truncate", "truncate", path, lambda: self.inner.truncate(handle, length))

    def rename(self, src: str, dst: str) -> None:
        self._simple("rename", "rename", f"{src} -> {dst}", lambda: self.inner.rename(src, dst))

    def close(self, handle: int) -> None:
        path = self.path_of(handle)
        with self._lock:
            self._paths.pop(handle, None)
        self._simple("close", "close", path, lambda: self.inner.close(handle))

    def size(self, handle: int) -> int:
        return self.inner.size(handle)

    def read(self, path: str) -> bytes:
        return self.inner.read(path)

    def makedirs(self, path: str) -> None:
        self.inner.makedirs(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def listdir(self, path: str) -> list[str]:
        return self.inner.listdir(path)

    def unlink(self, path: str) -> None:
        self.inner.unlink(path)


# -- power loss ------------------------------------------------------------------------


class PowerCut(OSError):
    """What every operation raises once the power is gone.

    An :class:`OSError` with ``EIO`` on purpose. A real power loss stops the
    process: nothing it does afterwards reaches the disk, and nothing it
    believes afterwards matters. Raising ``EIO`` gives the same disk — every
    later operation fails, so nothing after the cut becomes durable — while
    the process takes its ordinary disk-failure path (the writer poisons the
    log, the waiting producers get an error) and the test can wind down and
    inspect what was acknowledged. A dedicated non-``OSError`` exception would
    instead kill the writer thread and leave its producers waiting forever (an
    append's wait refuses cancellation), which no real machine does either.
    """

    def __init__(self, op: str) -> None:
        super().__init__(errno.EIO, f"power cut (refused {op})")


@dataclass(frozen=True, slots=True)
class _Write:
    offset: int
    data: bytes


@dataclass(frozen=True, slots=True)
class _Truncate:
    length: int


@dataclass(frozen=True, slots=True)
class _Allocate:
    """``posix_fallocate``: the file grows to at least ``length``, with zeros; never shrinks."""

    length: int


_Change = _Write | _Truncate | _Allocate


def _apply(content: bytearray, op: _Change) -> None:
    if isinstance(op, _Allocate):
        if op.length > len(content):
            content.extend(bytes(op.length - len(content)))
        return
    if isinstance(op, _Truncate):
        if op.length < len(content):
            del content[op.length :]
        else:
            content.extend(bytes(op.length - len(content)))
        return
    if op.offset > len(content):
        content.extend(bytes(op.offset - len(content)))
    content[op.offset : op.offset + len(op.data)] = op.data


@dataclass(eq=False, slots=True)
class _File:
    """An inode: what the page cache holds and what the disk holds."""

    data: bytearray = field(default_factory=bytearray)
    durable: bytes = b""
    pending: list[_Change] = field(default_factory=list)
    """Changes since the last sync, in order (``durable`` + all of them = ``data``, unless a
    failed sync dropped some: :meth:`PowerLossFileSystem.fail_next_sync`)."""

    def sync(self) -> None:
        """Write the changes since the last sync to the disk. Only those: the pages a failed
        sync dropped (:meth:`PowerLossFileSystem.fail_next_sync`) stay off the disk."""
        content = bytearray(self.durable)
        for op in self.pending:
            _apply(content, op)
        self.durable = bytes(content)
        self.pending.clear()


@dataclass(eq=False, slots=True)
class _Dir:
    """A directory: its current entries and the entries the disk holds."""

    entries: dict[str, _File | _Dir] = field(default_factory=dict)
    durable: dict[str, _File | _Dir] = field(default_factory=dict)


@dataclass(slots=True)
class _Handle:
    file: _File
    path: str
    append: bool
    position: int = 0


_NO_CUT: Final = -1
SECTOR: Final = 512
"""The unit the modelled disk writes whole: a torn write keeps its new bytes up to a multiple
of it in the file, never a part of a sector (journal.md J3)."""


class PowerLossFileSystem:
    """An in-memory file system that loses what was not synced.

    Model (per POSIX and Linux ext4/xfs behaviour, erring towards loss):

    * each file has its current content (the page cache) and its durable
      content; ``fdatasync``/``fsync`` make the current content durable;
    * each directory has its current entries and its durable entries; a new
      entry (file creation, ``makedirs``, ``rename``, ``unlink``) becomes
      durable only when that directory is ``fsync_dir``-ed, which makes all of
      its current entries durable;
    * every operation acts on the current view, with POSIX meaning.

    :meth:`cut_after` arms a power cut; :meth:`crash` produces the image the
    disk holds afterwards and makes the file system usable again. ``roots``
    (and their parents) exist, durably, from the start. Thread-safe.
    """

    def __init__(self, *roots: str | os.PathLike[str]) -> None:
        self._root = _Dir()
        self._lock = threading.RLock()
        self._handles: dict[int, _Handle] = {}
        self._next_handle = 3
        self._cut = _NO_CUT
        self.ops = 0
        """Operations performed so far (``close`` is not counted)."""
        self.refused = 0
        """Operations refused because the power was cut."""
        self.on_cut: Callable[[], object] | None = None
        """Called once per :meth:`cut_after`, with the lock held, on the thread of the first
        refused operation: the moment the power goes (a test stops its process there)."""
        self._cut_reported = False
        self._failing_sync: str | None = None
        self._cut_at_sync: str | None = None
        for root in roots:
            self._makedirs(os.fspath(root), durable=True)

    # -- power ---------------------------------------------------------------------

    def cut_after(self, n_ops: int) -> None:
        """Cut the power after ``n_ops`` more operations: all later ones raise."""
        if n_ops < 0:
            raise ValueError("n_ops must be >= 0")
        with self._lock:
            self._cut = self.ops + n_ops
            self._cut_reported = False

    def kill(self) -> None:
        """The process died (SIGKILL) and the machine did not: every handle is gone, the
        page cache keeps what the process wrote, synced or not, and a power cut armed is
        disarmed (the next process runs on). What a later :meth:`crash` keeps of the
        unsynced changes is decided then."""
        with self._lock:
            self._handles.clear()
            self._cut = _NO_CUT

    def fail_next_sync(self, path_contains: str) -> None:
        """Make the next ``fdatasync``/``fsync`` of a file whose path contains
        ``path_contains`` fail with ``EIO`` the way Linux fails one (fsyncgate): the pages it
        should have written are marked clean — a read still shows them, the disk never gets
        them — and a later sync of the file reports success without writing them."""
        with self._lock:
            self._failing_sync = path_contains

    def cut_at_sync(self, path_contains: str) -> None:
        """Cut the power (as :meth:`cut_after`) at the next ``fdatasync``/``fsync`` of a
        file whose path contains ``path_contains``: it and every later operation are refused.
        With :meth:`kill` instead of :meth:`crash` afterwards, the process died there."""
        with self._lock:
            self._cut_at_sync = path_contains

    def _cut_if_syncing(self, handle: int) -> None:
        cut_at = self._cut_at_sync
        if cut_at is not None and handle in self._handles and cut_at in self._handles[handle].path:
            self._cut_at_sync = None
            self._cut = self.ops
            self._cut_reported = False

    def _sync_file(self, handle: int, op: str) -> None:
        h = self._handle(handle)
        if self._failing_sync is not None and self._failing_sync in h.path:
            self._failing_sync = None
            h.file.pending.clear()  # off the way to the disk, for good
            raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} (injected into {op})", h.path)
        h.file.sync()

    @property
    def power_cut(self) -> bool:
        """Whether the cut point was reached (some operation was refused)."""
        return self.refused > 0

    def _tick(self, op: str) -> None:
        if self._cut != _NO_CUT and self.ops >= self._cut:
            self.refused += 1
            if not self._cut_reported:
                self._cut_reported = True
                if self.on_cut is not None:
                    self.on_cut()
            raise PowerCut(op)
        self.ops += 1

    def crash(self, rng: random.Random) -> None:
        """Replace the state by what the disk holds after the power loss.

        For every directory, each entry whose current and durable states differ
        is decided at random between the two (a new entry that was never made
        durable may or may not exist; an unlink or rename that was never made
        durable may or may not have happened; a renamed-over name shows the old
        or the new file, never nothing). Each surviving file holds its durable
        content, then a random prefix of its unsynced changes in order (so an
        unsynced truncation is applied or not), the first change left out
        possibly applied in part and followed by zeros or garbage (a torn
        tail). Afterwards every handle is gone, every byte is durable and the
        power is back.
        """
        with self._lock:
            contents: dict[int, bytes] = {}
            seen: set[int] = set()

            def rebuild(directory: _Dir) -> None:
                if id(directory) in seen:
                    return
                seen.add(id(directory))
                survivors: dict[str, _File | _Dir] = {}
                for name in sorted(set(directory.entries) | set(directory.durable)):
                    current = directory.entries.get(name)
                    durable = directory.durable.get(name)
                    chosen = current if current is durable or rng.random() < 0.5 else durable
                    if chosen is not None:
                        survivors[name] = chosen
                directory.entries = survivors
                directory.durable = dict(survivors)
                for node in survivors.values():
                    if isinstance(node, _Dir):
                        rebuild(node)
                    elif id(node) not in contents:
                        contents[id(node)] = _crash_content(node, rng)
                        node.data = bytearray(contents[id(node)])
                        node.durable = contents[id(node)]
                        node.pending.clear()

            rebuild(self._root)
            self._handles.clear()
            self._cut = _NO_CUT

    # -- views for assertions --------------------------------------------------------

    def snapshot(self) -> dict[str, bytes]:
        """Every file in the current view (what a reader sees now), by path."""
        with self._lock:
            return {path: bytes(f.data) for path, f in self._walk(self._root, "/", durable=False)}

    def durable_snapshot(self) -> dict[str, bytes]:
        """What survives any power loss: durable entries, durable content."""
        with self._lock:
            return {path: f.durable for path, f in self._walk(self._root, "/", durable=True)}

    def durable_read(self, path: str) -> bytes | None:
        """The content ``path`` is guaranteed to have after a crash, if any."""
        with self._lock:
            node: _File | _Dir = self._root
            for part in _parts(path):
                if not isinstance(node, _Dir) or part not in node.durable:
                    return None
                node = node.durable[part]
            return node.durable if isinstance(node, _File) else None

    def unsynced(self) -> list[str]:
        """Paths of files in the current view holding changes not yet durable."""
        with self._lock:
            return [p for p, f in self._walk(self._root, "/", durable=False) if f.pending]

    def _walk(self, directory: _Dir, prefix: str, *, durable: bool) -> Iterator[tuple[str, _File]]:
        entries = directory.durable if durable else directory.entries
        for name, node in sorted(entries.items()):
            path = os.path.join(prefix, name)
            if isinstance(node, _Dir):
                yield from self._walk(node, path, durable=durable)
            else:
                yield path, node

    # -- path resolution ---------------------------------------------------------------

    def _lookup(self, path: str) -> _File | _Dir:
        node: _File | _Dir = self._root
        for part in _parts(path):
            if not isinstance(node, _Dir):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
            if part not in node.entries:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
            node = node.entries[part]
        return node

    def _parent(self, path: str) -> tuple[_Dir, str]:
        parts = _parts(path)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        parent = self._lookup("/" + "/".join(parts[:-1]))
        if not isinstance(parent, _Dir):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        return parent, parts[-1]

    def _file(self, path: str) -> _File:
        node = self._lookup(path)
        if isinstance(node, _Dir):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        return node

    def _handle(self, handle: int) -> _Handle:
        try:
            return self._handles[handle]
        except KeyError:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF)) from None

    def _open(self, path: str, *, exclusive: bool, append: bool) -> int:
        parent, name = self._parent(path)
        node = parent.entries.get(name)
        if node is not None and exclusive:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
        if isinstance(node, _Dir):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if node is None:
            node = parent.entries[name] = _File()
        handle = self._next_handle
        self._next_handle += 1
        self._handles[handle] = _Handle(node, path, append=append)
        return handle

    def _makedirs(self, path: str, *, durable: bool) -> None:
        directory = self._root
        for part in _parts(path):
            child = directory.entries.get(part)
            if child is None:
                child = directory.entries[part] = _Dir()
                if durable:
                    directory.durable[part] = child
            if not isinstance(child, _Dir):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
            directory = child

    # -- FileSystem ----------------------------------------------------------------------

    def open_append(self, path: str) -> int:
        with self._lock:
            self._tick("open_append")
            return self._open(path, exclusive=False, append=True)

    def open_exclusive(self, path: str) -> int:
        with self._lock:
            self._tick("open_exclusive")
            return self._open(path, exclusive=True, append=False)

    def open_write(self, path: str) -> int:
        with self._lock:
            self._tick("open_write")
            return self._open(path, exclusive=False, append=False)

    def allocate(self, handle: int, offset: int, length: int) -> None:
        with self._lock:
            self._tick("allocate")
            h = self._handle(handle)
            if offset < 0 or length <= 0:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), h.path)
            op = _Allocate(offset + length)
            _apply(h.file.data, op)
            h.file.pending.append(op)

    def write(self, handle: int, data: bytes) -> int:
        with self._lock:
            self._tick("write")
            h = self._handle(handle)
            offset = len(h.file.data) if h.append else h.position
            op = _Write(offset, bytes(data))
            _apply(h.file.data, op)
            h.file.pending.append(op)
            h.position = offset + len(data)
            return len(data)

    def pwrite(self, handle: int, data: bytes, offset: int) -> int:
        with self._lock:
            self._tick("pwrite")
            h = self._handle(handle)
            op = _Write(offset, bytes(data))
            _apply(h.file.data, op)
            h.file.pending.append(op)
            return len(data)

    def fdatasync(self, handle: int) -> None:
        with self._lock:
            self._cut_if_syncing(handle)
            self._tick("fdatasync")
            self._sync_file(handle, "fdatasync")

    def fsync(self, handle: int) -> None:
        with self._lock:
            self._cut_if_syncing(handle)
            self._tick("fsync")
            self._sync_file(handle, "fsync")

    def truncate(self, handle: int, length: int) -> None:
        with self._lock:
            self._tick("truncate")
            h = self._handle(handle)
            if length < 0:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), h.path)
            op = _Truncate(length)
            _apply(h.file.data, op)
            h.file.pending.append(op)

    def size(self, handle: int) -> int:
        with self._lock:
            self._tick("size")
            return len(self._handle(handle).file.data)

    def close(self, handle: int) -> None:
        """Not counted and never refused: closing touches no disk."""
        with self._lock:
            self._handle(handle)
            del self._handles[handle]

    def read(self, path: str) -> bytes:
        with self._lock:
            self._tick("read")
            return bytes(self._file(path).data)

    def rename(self, src: str, dst: str) -> None:
        with self._lock:
            self._tick("rename")
            src_parent, src_name = self._parent(src)
            node = src_parent.entries.get(src_name)
            if node is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), src)
            dst_parent, dst_name = self._parent(dst)
            if isinstance(dst_parent.entries.get(dst_name), _Dir):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), dst)
            del src_parent.entries[src_name]
            dst_parent.entries[dst_name] = node

    def fsync_dir(self, path: str) -> None:
        with self._lock:
            self._tick("fsync_dir")
            node = self._lookup(path)
            if not isinstance(node, _Dir):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
            node.durable = dict(node.entries)

    def sync_tree(self, path: str) -> None:
        """``syncfs``: every file under ``path`` gets its changes since its last sync to the
        disk — only those: pages a failed sync dropped stay off it (:meth:`fail_next_sync`) —
        and every directory under it its entries. Only what is under ``path``: a real
        ``syncfs`` does the whole file system, the fallback walk no more than this."""
        with self._lock:
            self._tick("sync_tree")
            node = self._lookup(path)
            if not isinstance(node, _Dir):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
            stack = [node]
            while stack:
                directory = stack.pop()
                directory.durable = dict(directory.entries)
                for child in directory.entries.values():
                    if isinstance(child, _Dir):
                        stack.append(child)
                    else:
                        child.sync()

    def makedirs(self, path: str) -> None:
        with self._lock:
            self._tick("makedirs")
            self._makedirs(path, durable=False)

    def exists(self, path: str) -> bool:
        with self._lock:
            self._tick("exists")
            try:
                self._lookup(path)
            except OSError:
                return False
            return True

    def listdir(self, path: str) -> list[str]:
        with self._lock:
            self._tick("listdir")
            node = self._lookup(path)
            if not isinstance(node, _Dir):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
            return sorted(node.entries)

    def unlink(self, path: str) -> None:
        with self._lock:
            self._tick("unlink")
            parent, name = self._parent(path)
            node = parent.entries.get(name)
            if node is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
            if isinstance(node, _Dir):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            del parent.entries[name]


def _parts(path: str) -> list[str]:
    if not os.path.isabs(path):
        raise ValueError(f"PowerLossFileSystem takes absolute paths, not {path!r}")
    return [p for p in os.path.normpath(path).split("/") if p]


def _crash_content(file: _File, rng: random.Random) -> bytes:
    """Durable content, a random prefix of the unsynced changes, maybe a torn tail."""
    content = bytearray(file.durable)
    kept = rng.randint(0, len(file.pending))
    for op in file.pending[:kept]:
        _apply(content, op)
    if kept < len(file.pending) and rng.random() < 0.5:
        torn = file.pending[kept]
        if isinstance(torn, _Write):
            # the disk writes a sector whole: the new bytes end at a sector boundary of the
            # file (or before the write's first one), never inside a sector (J3)
            first = (-torn.offset) % SECTOR or SECTOR
            prefix = rng.choice([0, *range(first, len(torn.data), SECTOR)])
            fill = rng.randint(0, len(torn.data) - prefix)
            start = torn.offset + prefix
            # Inside the old length a torn overwrite leaves the old bytes (a sector not yet
            # written), or zeros. Past the old end of the file it reads as zeros, never as
            # stale blocks: ext4 (data=ordered, the default), XFS and btrfs commit a file's new
            # size only with its data, or read unwritten extents as zeros. (An append has no
            # old bytes; a positional write over a pre-zeroed sync log generation has zeros.)
            filler = bytearray(fill)
            if rng.random() >= 0.5:
                for i in range(min(fill, max(len(content) - start, 0))):
                    filler[i] = content[start + i]
            _apply(content, _Write(torn.offset, torn.data[:prefix] + bytes(filler)))
    return bytes(content)
