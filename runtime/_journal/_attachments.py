"""The attachment root: the bytes of every file an agent attached to a reply, content-addressed
(docs/design/attachments.md, A1-A3, A8).

One function derives the root (:func:`attachment_root`): ``<state>/attachments`` unless the
configuration names another directory. Whoever writes an attachment (the ``attach`` tool), sends
one (the server's ``result`` and ``attachment_data`` frames), checks one (``journal verify``) or
sweeps orphans (the room worker's start) calls it, so there is one reading of one path.

A file is named by the sha256 of its bytes and written with the store's durability rule —
exclusive temporary file, write, fsync, rename, directory fsync (:func:`atomic_write`) — before
any record names it; mode 0600 in a 0700 directory. Writing the same bytes twice leaves one
file. A file no record names (its writer died between the file and the record) is an orphan,
removed by :meth:`AttachmentStore.sweep` at the next start.

A read that finds a file intact remembers the file's identity (device, inode, size, mtime,
ctime); :meth:`AttachmentStore.unchanged` answers from that, with one ``stat`` and no read, while
the file is unchanged (A13): a result re-sent at every reconnect costs a hash of its attachments
once, not at every send. A file whose last change is less than :data:`SETTLE_MS` before the
read is not remembered (a change in the same tick of the file system's coarse clock would keep
the same stamps).

A fetch sends an attachment in pieces (:meth:`AttachmentStore.open`): the file is checked
before its first piece — by its identity while a read verified it unchanged (A13), else by its
bytes, hashed a piece at a time — and the pieces handed out are hashed again as they are
read, so the piece that ends the file is handed out only when every byte read was the
attachment's. What a reader holds is one piece, never the file.

Every method here blocks (file I/O): call them with ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import stat
import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from .._clock import SystemWallClock, WallClock
from .._errors import ReasonCode
from .._linux._fs import FileSystem, OsFileSystem
from ._writer import TMP_MARK, atomic_write

__all__ = [
    "ATTACHMENTS_DIR",
    "SHARED_ATTACHMENTS",
    "AttachmentNameTaken",
    "AttachmentReader",
    "AttachmentStore",
    "attachment_root",
]

ATTACHMENTS_DIR: Final = "attachments"
"""The root's name in the state directory when the configuration names none."""
SHARED_ATTACHMENTS: Final = "attachments/"
"""On a store several hosts share: the documents holding attachments' bytes, named this and
the sha256 (A11): written before the outcome that names them, read by a host whose own root
lacks them."""

_NAME: Final = re.compile(r"[0-9a-f]{64}")
_TEMPORARY: Final = re.compile(r"[0-9a-f]{64}" + re.escape(TMP_MARK) + r"[0-9a-f]+")
"""A temporary file of :func:`atomic_write` under the root: ``<sha256>.tmp-<hex>``, the one
shape the store's writes make (A8: the sweep removes no other name as a temporary)."""

logger = logging.getLogger("runtime.attachments")

SETTLE_MS: Final = 2_000
"""A file changed less than this before a read that found it intact is not remembered as
verified (A13): file systems stamp a change with a coarse clock (a tick; a second on some), so
a second change within the same stamp would leave every field of ``stat`` as it was."""
REMEMBERED: Final = 4096
"""At most this many verified files are remembered (the oldest forgotten first)."""
PIECE: Final = 64 * 1024
"""Bytes read at a time when a file is hashed without being kept (:meth:`AttachmentStore.check`,
:meth:`AttachmentStore.open`)."""

_Identity = tuple[int, int, int, int, int]
"""(device, inode, size, mtime_ns, ctime_ns) of a file found intact."""


class AttachmentNameTaken(IsADirectoryError):
    """:meth:`AttachmentStore.put` found a directory under the sha256's name (A2): the store
    writes only files there, so the root is damaged at that name — ``code`` is
    ``attachment_damaged``. The directory is left as it is (what it holds is not the store's
    to remove, A8); nothing was stored. An ``OSError`` still, so a caller that keeps a copy
    only if it can (the server keeping a shared store's copy, A11) goes on as for a full
    disk; the ``attach`` tool refuses the call with the code (A5)."""

    code: Final = ReasonCode.ATTACHMENT_DAMAGED


def _identity(info: os.stat_result) -> _Identity:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _read_pieces(fd: int, size: int, *, keep: bool) -> tuple[str, bytes]:
    """The sha256 of what the open file ``fd`` holds — ``""`` unless it holds exactly
    ``size`` bytes (it is read to its end, or to one byte past ``size``) — and, when
    ``keep``, those bytes; else ``b""``, the file read :data:`PIECE` bytes at a time, only a
    piece ever held."""
    digest = hashlib.sha256()
    buffer = bytearray(size + 1 if keep else min(PIECE, size + 1))
    view = memoryview(buffer)
    offset = 0
    while offset <= size:
        target = view[offset:] if keep else view
        count = os.preadv(fd, [target], offset)
        if not count:
            break
        digest.update(target[:count])
        offset += count
    if offset != size:
        return "", b""
    return digest.hexdigest(), bytes(view[:size]) if keep else b""


@dataclass(slots=True)
class _Verified:
    """The identity of each file a read found intact and settled (shared by threads)."""

    files: dict[str, _Identity] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def remember(self, sha256: str, identity: _Identity) -> None:
        with self.lock:
            self.files.pop(sha256, None)
            self.files[sha256] = identity
            while len(self.files) > REMEMBERED:
                del self.files[next(iter(self.files))]

    def forget(self, sha256: str) -> None:
        with self.lock:
            self.files.pop(sha256, None)

    def get(self, sha256: str) -> _Identity | None:
        with self.lock:
            return self.files.get(sha256)


def attachment_root(state_dir: str | os.PathLike[str], configured: str | None = None) -> Path:
    """Where attachments live: ``configured`` (already absolute, from the configuration) or
    ``<state_dir>/attachments``. The one place this path is derived (A1)."""
    if configured is not None:
        return Path(configured)
    return Path(state_dir) / ATTACHMENTS_DIR


@dataclass(frozen=True, slots=True)
class AttachmentStore:
    """The files under one attachment root (blocking methods; see the module doc)."""

    root: Path
    fs: FileSystem = field(default_factory=OsFileSystem)
    wall: WallClock = field(default_factory=SystemWallClock)
    """Tells a settled file from one changed just before its read (:data:`SETTLE_MS`)."""
    _verified: _Verified = field(default_factory=_Verified, compare=False, repr=False)

    def path_of(self, sha256: str) -> Path:
        if not _NAME.fullmatch(sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256!r}")
        return self.root / sha256

    def put(self, data: bytes) -> str:
        """Store ``data`` durably (A2); its sha256. Bytes already stored intact are not
        written again, but their name is synced: they may be what a killed process renamed
        into place and never made durable (the page cache shows them all the same). A
        damaged copy under the same name is replaced.

        Raises :class:`AttachmentNameTaken` (``attachment_damaged``) when a directory holds
        that name: nothing is stored and the directory is left as it is."""
        digest = hashlib.sha256(data).hexdigest()
        self._prepare()
        path = self.path_of(digest)
        if self.check(digest, len(data)) is None:
            self.fs.fsync_dir(str(self.root))
            return digest
        try:
            atomic_write(self.fs, str(path), data)  # its temporary file removed on failure
        except IsADirectoryError as error:  # the rename found a directory at the name
            raise AttachmentNameTaken(
                errno.EISDIR,
                f"the attachment root is damaged: {path} is a directory, where only the "
                "store's file of these bytes belongs; nothing was stored (remove the "
                "directory to attach them)",
            ) from error
        return digest

    def _prepare(self) -> None:
        """The root, made and its own name synced — each time: a root found there may be
        one a killed process made and never synced."""
        if not self.root.is_dir():
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.fs.fsync_dir(str(self.root.parent))
        os.chmod(self.root, 0o700)

    def read(self, sha256: str, size: int) -> bytes | ReasonCode:
        """The intact bytes of an attachment, or why they cannot be had:
        ``attachment_missing`` (no such file, or not a plain file) or ``attachment_damaged``
        (its size or sha256 is not the recorded one, or the disk failed to read it). Bytes
        found intact in a settled file are remembered as verified (A13)."""
        self._verified.forget(sha256)
        now_ms = self.wall.time_ms()  # before the file is looked at (A13)
        try:
            fd = os.open(  # not blocked by a FIFO under its name: found not regular below
                self.path_of(sha256), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            )
        except OSError:
            return ReasonCode.ATTACHMENT_MISSING
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return ReasonCode.ATTACHMENT_MISSING
            if info.st_size != size:
                return ReasonCode.ATTACHMENT_DAMAGED
            digest, data = _read_pieces(fd, size, keep=True)
            if digest != sha256:
                return ReasonCode.ATTACHMENT_DAMAGED
            self._remember_if_settled(sha256, fd, info, now_ms)
        except OSError:  # EIO: the bytes cannot be had intact
            return ReasonCode.ATTACHMENT_DAMAGED
        finally:
            os.close(fd)
        return data

    def _remember_if_settled(self, sha256: str, fd: int, info: os.stat_result, now_ms: int) -> None:
        """Remember the file open as ``fd``, whose bytes were just found intact, as verified
        (A13) — when it is settled: its last change (``info``, the ``fstat`` taken before the
        read) at least :data:`SETTLE_MS` before ``now_ms``, the clock read *before* the file
        was looked at; and its ``fstat`` after the read still ``info``'s. A clock read after
        the read would take a read that lasted the settling time for one of a settled file,
        however fresh the file was when it began, and a change within the stamp of its last
        one would then leave ``stat`` as it was; a change during the read (a moved size,
        mtime or ctime) means the bytes read may not be the file's now."""
        if info.st_ctime_ns // 1_000_000 > now_ms - SETTLE_MS:
            return
        if _identity(os.fstat(fd)) != _identity(info):
            return
        self._verified.remember(sha256, _identity(info))

    def open(self, sha256: str, size: int) -> AttachmentReader | ReasonCode:
        """The attachment's file, open and found intact, to be read in pieces in order
        (:class:`AttachmentReader`; close it), or why not (see :meth:`read`). Intact is known
        by the file's identity while a read verified it and it is unchanged since (A13), else
        by its bytes, hashed a piece at a time; either way the reader hashes what it reads
        again, and fails rather than end on bytes that are not the attachment's."""
        opened = self._open_checked(sha256, size, trust_identity=True)
        if isinstance(opened, ReasonCode):
            return opened
        fd, info = opened
        return AttachmentReader(fd, sha256, size, info, self._verified)

    def _open_checked(
        self, sha256: str, size: int, *, trust_identity: bool
    ) -> tuple[int, os.stat_result] | ReasonCode:
        """The file open (its descriptor, and ``fstat`` before any read) once found intact,
        or why not: its bytes hashed a piece at a time unless ``trust_identity`` and it is
        the file a read verified, unchanged (A13). Bytes found intact in a settled file are
        remembered as verified; a damaged file is forgotten."""
        now_ms = self.wall.time_ms()  # before the file is looked at (A13)
        try:
            fd = os.open(  # not blocked by a FIFO under its name: found not regular below
                self.path_of(sha256), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            )
        except OSError:
            self._verified.forget(sha256)
            return ReasonCode.ATTACHMENT_MISSING
        try:
            info = os.fstat(fd)
            problem = self._problem(
                fd, info, sha256, size, now_ms=now_ms, trust_identity=trust_identity
            )
        except OSError:  # EIO: the bytes cannot be had intact
            problem = ReasonCode.ATTACHMENT_DAMAGED
        except BaseException:
            os.close(fd)
            raise
        if problem is not None:
            os.close(fd)
            self._verified.forget(sha256)
            return problem
        return fd, info

    def _problem(
        self,
        fd: int,
        info: os.stat_result,
        sha256: str,
        size: int,
        *,
        now_ms: int,
        trust_identity: bool,
    ) -> ReasonCode | None:
        if not stat.S_ISREG(info.st_mode):
            return ReasonCode.ATTACHMENT_MISSING
        if info.st_size != size:
            return ReasonCode.ATTACHMENT_DAMAGED
        if trust_identity and self._verified.get(sha256) == _identity(info):
            return None
        digest, _ = _read_pieces(fd, size, keep=False)
        if digest != sha256:
            return ReasonCode.ATTACHMENT_DAMAGED
        self._remember_if_settled(sha256, fd, info, now_ms)
        return None

    def unchanged(self, sha256: str, size: int) -> bool:
        """True when a read found this attachment intact and its file is, by ``stat``, the
        same file unchanged since (device, inode, size, mtime, ctime): no read, no hash (A13).
        False means "not known": :meth:`read` or :meth:`check` it."""
        known = self._verified.get(sha256)
        if known is None or known[2] != size:
            return False
        try:
            info = os.stat(self.path_of(sha256), follow_symlinks=False)
        except OSError:
            return False
        return stat.S_ISREG(info.st_mode) and _identity(info) == known

    def check(self, sha256: str, size: int) -> ReasonCode | None:
        """``None`` when the attachment is there intact; else why not (see :meth:`read`). Its
        bytes are read and hashed a piece at a time, never kept; a settled file found intact
        is remembered as verified (A13)."""
        self._verified.forget(sha256)
        opened = self._open_checked(sha256, size, trust_identity=False)
        if isinstance(opened, ReasonCode):
            return opened
        os.close(opened[0])
        return None

    def names(self) -> list[str]:
        """Every stored attachment's sha256 (temporary files excluded)."""
        try:
            entries = self.fs.listdir(str(self.root))
        except FileNotFoundError:
            return []
        return [name for name in entries if _NAME.fullmatch(name)]

    def sweep(self, referenced: Collection[str]) -> list[str]:
        """Remove every file of the root that no record names (``referenced``: the sha256s
        records name) and every temporary file a crash left (A8: ``<sha256>.tmp-<hex>``, the
        shape :func:`atomic_write` gives; a name merely holding ``.tmp-`` is not the store's and
        stays, like any name that is no sha256); the names removed. An entry
        that is not a regular file (a directory under a sha256's name), or that cannot be
        removed, is left and logged once per sweep; the rest is swept all the same. Call it
        only while nothing is writing attachments (a start, before any lane runs)."""
        try:
            entries = self.fs.listdir(str(self.root))
        except FileNotFoundError:
            return []
        removed: list[str] = []
        skipped: list[str] = []
        for name in entries:
            orphan = _TEMPORARY.fullmatch(name) or (
                _NAME.fullmatch(name) and name not in referenced
            )
            if not orphan:
                continue
            path = self.root / name
            try:  # the store writes only regular files: anything else is not its to remove
                if not stat.S_ISREG(os.lstat(path).st_mode):
                    skipped.append(f"{name} (not a regular file)")
                    continue
                self.fs.unlink(str(path))
            except FileNotFoundError:
                pass
            except OSError as error:  # this entry cannot go; the others still do
                skipped.append(f"{name} ({error.strerror})")
                continue
            removed.append(name)
        if skipped:
            logger.warning(
                "attachment sweep of %s left %d entr%s it cannot remove: %s",
                self.root,
                len(skipped),
                "y" if len(skipped) == 1 else "ies",
                ", ".join(skipped),
                extra={"event": "attachments_skipped"},
            )
        if removed:
            self.fs.fsync_dir(str(self.root))
        return removed


class AttachmentReader:
    """An attachment's file, open and found intact (:meth:`AttachmentStore.open`), read in
    order a piece at a time (blocking; :meth:`close` it).

    Each piece's bytes are hashed as they are read, and the piece that reaches the recorded
    size is handed out only once everything read is the recorded sha256: a reader never ends
    on bytes that are not the attachment's. A file written over in place after it was checked
    fails the reader ``attachment_damaged`` — at the first piece read after a change its
    ``stat`` shows (size, mtime), else, the change made within one tick of the file system's
    clock, at the end; the pieces handed out before are then the file's bytes, but not all of
    the attachment's. A file replaced or removed by its name is not seen: the reader reads
    the file it opened, which the change leaves as it was."""

    def __init__(
        self, fd: int, sha256: str, size: int, info: os.stat_result, verified: _Verified
    ) -> None:
        self._verified = verified
        self._fd: int | None = fd
        self.sha256 = sha256
        self.size = size
        self._stamp = (info.st_size, info.st_mtime_ns)
        self._digest = hashlib.sha256()
        self.offset = 0
        """Bytes handed out so far."""

    def next(self, limit: int) -> bytes | ReasonCode:
        """The next piece of at most ``limit`` bytes (at least one, while any is left; the
        empty piece of an empty attachment), or ``attachment_damaged`` (from then on)."""
        if self._fd is None:
            return ReasonCode.ATTACHMENT_DAMAGED
        left = self.size - self.offset
        try:
            piece = os.pread(self._fd, min(limit, left), self.offset) if left else b""
            info = os.fstat(self._fd)
        except OSError:  # EIO
            return self._failed()
        if (left and not piece) or (info.st_size, info.st_mtime_ns) != self._stamp:
            return self._failed()  # shorter than recorded, or written over since checked
        self._digest.update(piece)
        self.offset += len(piece)
        if self.offset == self.size and self._digest.hexdigest() != self.sha256:
            return self._failed()
        return piece

    def _failed(self) -> ReasonCode:
        self._verified.forget(self.sha256)
        self.close()
        return ReasonCode.ATTACHMENT_DAMAGED

    def close(self) -> None:
        """Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
