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

Every method here blocks (file I/O): call them with ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from .._errors import ReasonCode
from .._linux._fs import FileSystem, OsFileSystem
from ._writer import TMP_MARK, atomic_write

__all__ = ["ATTACHMENTS_DIR", "SHARED_ATTACHMENTS", "AttachmentStore", "attachment_root"]

ATTACHMENTS_DIR: Final = "attachments"
"""The root's name in the state directory when the configuration names none."""
SHARED_ATTACHMENTS: Final = "attachments/"
"""On a store several hosts share: the documents holding attachments' bytes, named this and
the sha256 (A11): written before the outcome that names them, read by a host whose own root
lacks them."""

_NAME: Final = re.compile(r"[0-9a-f]{64}")


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

    def path_of(self, sha256: str) -> Path:
        if not _NAME.fullmatch(sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256!r}")
        return self.root / sha256

    def put(self, data: bytes) -> str:
        """Store ``data`` durably (A2); its sha256. Bytes already stored intact are not
        written again, but their name is synced: they may be what a killed process renamed
        into place and never made durable (the page cache shows them all the same). A
        damaged copy under the same name is replaced."""
        digest = hashlib.sha256(data).hexdigest()
        self._prepare()
        path = self.path_of(digest)
        if self.check(digest, len(data)) is None:
            self.fs.fsync_dir(str(self.root))
            return digest
        atomic_write(self.fs, str(path), data)
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
        (its size or sha256 is not the recorded one, or the disk failed to read it)."""
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
            with os.fdopen(os.dup(fd), "rb") as file:
                data = file.read(size + 1)
        except OSError:  # EIO: the bytes cannot be had intact
            return ReasonCode.ATTACHMENT_DAMAGED
        finally:
            os.close(fd)
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
            return ReasonCode.ATTACHMENT_DAMAGED
        return data

    def check(self, sha256: str, size: int) -> ReasonCode | None:
        """``None`` when the attachment is there intact; else why not (see :meth:`read`)."""
        found = self.read(sha256, size)
        return found if isinstance(found, ReasonCode) else None

    def names(self) -> list[str]:
        """Every stored attachment's sha256 (temporary files excluded)."""
        try:
            entries = self.fs.listdir(str(self.root))
        except FileNotFoundError:
            return []
        return [name for name in entries if _NAME.fullmatch(name)]

    def sweep(self, referenced: Collection[str]) -> list[str]:
        """Remove every file of the root that no record names (``referenced``: the sha256s
        records name) and every temporary file a crash left (A8); the names removed. Call it
        only while nothing is writing attachments (a start, before any lane runs)."""
        try:
            entries = self.fs.listdir(str(self.root))
        except FileNotFoundError:
            return []
        removed: list[str] = []
        for name in entries:
            orphan = TMP_MARK in name or (_NAME.fullmatch(name) and name not in referenced)
            if orphan:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.unlink(str(self.root / name))
                removed.append(name)
        if removed:
            self.fs.fsync_dir(str(self.root))
        return removed
