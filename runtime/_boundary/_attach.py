"""``attach``: the runtime tool that adds a file of the agent's working directory to its reply
(docs/design/attachments.md, A4-A5).

The worker only carries the call (a runtime tool, T10): the gate has made the intent durable,
this handler copies the file into the attachment root (durable, content-addressed) and answers
with a result whose :attr:`GateResult.attachments` names it; the gate records that outcome
before the model sees it, and the room's ``result`` frame carries the attachments the turn's
outcomes name. An attachment exists for the reply only through that recorded outcome.

Its replay class is ``receipt``: the recorded outcome is the receipt. Present, the attachment
is part of the reply and a replay hands back the same result; absent, nothing of the call
reached anyone (a file in the root that no record names is an orphan, swept at the next start),
so the call is run once more with the same intent (T13) — copying the same file again is the
same content-addressed write.

Refusals are the tool's error results, each with its stable code, and nothing is stored:

* ``attachment_outside_workdir`` — the path leaves the working directory (``..``, absolute
  elsewhere), or the file has other names (hard links: they may lie anywhere on its disk) —
  counted again once its bytes are read, its one name then looked up again;
* ``attachment_symlink`` — a component of the path is a symbolic link: links are not followed,
  so none can point out of the directory, not even by a swap between check and open (each
  component is opened with ``O_NOFOLLOW`` below the one before);
* ``attachment_not_file`` — not a regular file (a directory, a FIFO, a device), or missing;
* ``attachment_too_large`` — over the configured ``max_bytes``;
* ``attachment_type_refused`` — its media type (from its bytes for images and PDF, from its
  name for text) is not in the configured allow-list;
* ``attachment_limit`` — the reply already carries ``max_per_reply`` distinct files (A12):
  counted over the delivery's recorded outcomes (``attached``) and the results this tool
  handed out whose outcomes are not recorded yet (the calls of one round run side by side;
  the count and the reservation are one step, with no checkpoint between them);
* ``attachment_damaged`` — the attachment root holds a directory under the bytes' sha256
  (:class:`~runtime._journal._attachments.AttachmentNameTaken`): the store's own directory is
  damaged there, and the file cannot be stored until an operator removes it (A2).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import unicodedata
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Final

import trio

from .._errors import ReasonCode
from .._journal._attachments import AttachmentNameTaken, AttachmentStore
from .._records import AttachmentRef
from .._wire import MAX_ATTACHMENT_NAME
from ._calls import GateCall, GateResult

__all__ = ["AttachTool", "sniff_media_type"]

_MAGIC: Final = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"%PDF-", "application/pdf"),
)
_TEXT_SUFFIXES: Final = {
    ".txt": "text/plain",
    ".log": "text/plain",
    ".md": "text/markdown",
    ".csv": "text/csv",
    ".json": "application/json",
}


def sniff_media_type(name: str, data: bytes) -> str | None:
    """The media type of ``data``: images and PDF by their first bytes, text by the name's
    suffix when the bytes are UTF-8; ``None`` when it is none of those."""
    for magic, media_type in _MAGIC:
        if data.startswith(magic):
            return media_type
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    suffix = PurePosixPath(name).suffix.lower()
    if suffix in _TEXT_SUFFIXES:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return None
        return _TEXT_SUFFIXES[suffix]
    return None


class _Refused(Exception):
    def __init__(self, code: ReasonCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class AttachTool:
    """The ``attach`` handler of one lane (a :data:`~runtime._boundary._calls.RuntimeTool`)."""

    store: AttachmentStore
    workdir: Callable[[], Path]
    """The working directory of the worker whose call this is (the lane's ``cwd``)."""
    max_bytes: int
    media_types: Collection[str]
    share: Callable[[str, bytes], Awaitable[None]] | None = None
    """On a store several hosts share: make the bytes durable there too, ``(sha256, data)``,
    before the result names them (A11)."""
    max_per_reply: int = 16
    """The most distinct files one delivery's reply carries (A12)."""
    attached: Callable[[], Iterable[AttachmentRef]] = tuple
    """What the current delivery's recorded outcomes attached (the gate's account, A4)."""
    _handed: dict[str, set[str]] = field(default_factory=dict, init=False, repr=False)
    """The sha256s this tool handed out, by delivery key: their outcomes may not be recorded
    yet. Only the current delivery's are kept."""

    async def __call__(self, call: GateCall, intent_id: str) -> GateResult:
        path, name = call.args.get("path"), call.args.get("name")
        if not isinstance(path, str) or not path or "\0" in path:
            return _refusal(ReasonCode.ATTACHMENT_ARGUMENTS, "attach needs the path of a file")
        if name is not None and not isinstance(name, str):
            return _refusal(ReasonCode.ATTACHMENT_ARGUMENTS, "its name must be a string")
        try:
            ref, data = await trio.to_thread.run_sync(self._read, path, name)
        except _Refused as refused:
            return _refusal(refused.code, str(refused))
        # the gate's intent ids are "<delivery key>:<made>:<seq>" (gate T2): all but the seq
        # is one delivery's log
        key = intent_id.rpartition(":")[0]
        handed = self._handed.setdefault(key, set())
        for other in [k for k in self._handed if k != key]:
            del self._handed[other]
        carried = handed | {r.sha256 for r in self.attached()}
        if ref.sha256 not in carried and len(carried) >= self.max_per_reply:  # A12
            return _refusal(
                ReasonCode.ATTACHMENT_LIMIT,
                f"this reply already carries {len(carried)} files, the most one reply may "
                f"carry ([attachments] max_per_reply = {self.max_per_reply}); choose the ones "
                "that matter, or send the rest in a later reply",
            )
        new = ref.sha256 not in handed
        handed.add(ref.sha256)  # reserved before the next checkpoint: no other call passes
        try:
            await trio.to_thread.run_sync(self.store.put, data)
            if self.share is not None:
                await self.share(ref.sha256, data)
        except AttachmentNameTaken as taken:  # the root is damaged at this name (A2, A5)
            if new:
                handed.discard(ref.sha256)
            return _refusal(
                taken.code,
                "the attachment store holds a directory where this file's bytes belong "
                "(an operator must remove it); the reply goes without this file",
            )
        except BaseException:
            if new:
                handed.discard(ref.sha256)
            raise
        text = (
            f"attached {ref.name} ({ref.media_type}, {ref.size} bytes); it is sent with your reply"
        )
        return GateResult(
            content=[{"type": "text", "text": text}],
            details={"attachment": {"id": ref.id, "name": ref.name, "sha256": ref.sha256}},
            attachments=(ref,),
        )

    def _read(self, path: str, name: str | None) -> tuple[AttachmentRef, bytes]:
        """The attachment ``path`` would be, and its bytes; nothing stored yet."""
        data = self._read_inside(path)
        shown = _display_name(name if name else PurePosixPath(path).name)
        media_type = sniff_media_type(shown, data) or sniff_media_type(path, data)
        if media_type is None or media_type not in self.media_types:
            allowed = ", ".join(sorted(self.media_types))
            raise _Refused(
                ReasonCode.ATTACHMENT_TYPE_REFUSED,
                f"{path} is {media_type or 'of an unknown type'}; allowed: {allowed}",
            )
        digest = hashlib.sha256(data).hexdigest()  # what the store names it (A2)
        ref = AttachmentRef(
            id=digest, name=shown, media_type=media_type, size=len(data), sha256=digest
        )
        return ref, data

    def _read_inside(self, path: str) -> bytes:
        """The bytes of ``path`` below the working directory, opened one component at a time
        with ``O_NOFOLLOW`` (no symbolic link is ever followed), of a file whose one name, once
        they are read, is still that path (:func:`_only_name`)."""
        workdir = self.workdir()
        given = PurePosixPath(path)
        relative: PurePosixPath | None = given
        if given.is_absolute():
            relative = next(
                (given.relative_to(d) for d in (workdir, workdir.resolve()) if _under(given, d)),
                None,
            )
        if relative is None or ".." in relative.parts or not relative.parts:
            raise _Refused(
                ReasonCode.ATTACHMENT_OUTSIDE_WORKDIR,
                f"{path} is not a file inside the working directory {workdir}",
            )
        parts = relative.parts
        try:  # the working directory itself is not followed either (a worker may swap it)
            directory = os.open(
                workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            )
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(workdir):
                raise _Refused(
                    ReasonCode.ATTACHMENT_SYMLINK,
                    f"the working directory {workdir} is a symbolic link; nothing is attached",
                ) from None
            raise
        try:
            for part in parts[:-1]:
                below = _step(directory, part, path, os.O_RDONLY | os.O_DIRECTORY)
                os.close(directory)
                directory = below
            # O_NONBLOCK: opening a FIFO does not wait for a writer (it is refused next)
            fd = _step(directory, parts[-1], path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                data = self._read_file(fd, path)
                _only_name(directory, parts[-1], fd, path)
            finally:
                os.close(fd)
        finally:
            os.close(directory)
        return data

    def _read_file(self, fd: int, path: str) -> bytes:
        """The bytes of the open file ``fd``, once it is found a regular file with one name
        and not too large (before and after the read)."""
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _Refused(ReasonCode.ATTACHMENT_NOT_FILE, f"{path} is not a regular file")
        if info.st_nlink > 1:  # a hard link: its other names may lie anywhere on the disk
            raise _Refused(
                ReasonCode.ATTACHMENT_OUTSIDE_WORKDIR,
                f"{path} has {info.st_nlink} names (hard links), which may lie outside the "
                "working directory; attach a copy of it",
            )
        if info.st_size > self.max_bytes:
            raise _Refused(
                ReasonCode.ATTACHMENT_TOO_LARGE,
                f"{path} has {info.st_size} bytes; at most {self.max_bytes} are attached",
            )
        with os.fdopen(os.dup(fd), "rb") as file:
            data = file.read(self.max_bytes + 1)
        if len(data) > self.max_bytes:  # it grew after the check
            raise _Refused(
                ReasonCode.ATTACHMENT_TOO_LARGE, f"{path} has more than {self.max_bytes} bytes"
            )
        return data


def _only_name(directory: int, part: str, fd: int, path: str) -> None:
    """Refuse the file open as ``fd`` unless, now that its bytes are read, it has one name
    and that name is ``part`` in ``directory`` (A5). A count of one taken before is no proof
    the one name is the path's: a link made in from outside and removed after the open
    leaves the file open with its one name outside."""
    info = os.fstat(fd)
    try:
        named = os.stat(part, dir_fd=directory, follow_symlinks=False)
    except OSError:
        named = None
    if (
        info.st_nlink != 1
        or named is None
        or (named.st_dev, named.st_ino) != (info.st_dev, info.st_ino)
    ):
        raise _Refused(
            ReasonCode.ATTACHMENT_OUTSIDE_WORKDIR,
            f"{path} changed its names while it was read (a hard link made or removed): its "
            "one name may lie outside the working directory; attach a copy of it",
        )


def _under(path: PurePosixPath, directory: Path) -> bool:
    return path.is_relative_to(PurePosixPath(directory))


def _step(parent: int, part: str, path: str, flags: int) -> int:
    """Open ``part`` below the directory ``parent`` without following a link. A link is
    ``attachment_symlink``, anything missing ``attachment_not_file``."""
    try:
        return os.open(part, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except OSError as error:
        if error.errno == errno.ELOOP or (error.errno == errno.ENOTDIR and _is_link(parent, part)):
            raise _Refused(
                ReasonCode.ATTACHMENT_SYMLINK,
                f"{path} goes through the symbolic link {part!r}; attach the file itself",
            ) from None
        raise _Refused(
            ReasonCode.ATTACHMENT_NOT_FILE, f"{path}: {os.strerror(error.errno or 0)}"
        ) from None


def _is_link(parent: int, part: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(part, dir_fd=parent).st_mode)
    except OSError:
        return False


def _display_name(name: str) -> str:
    """A name fit to show, never a path: its last component — split at ``/``, at ``\\`` (a
    Windows client's separator) and at every character compatibility normalisation (NFKC)
    makes one of those —, control and format characters dropped, bounded; ``.`` or ``..``
    in any spelling NFKC reads so is no name."""
    flat = "".join("/" if _separates(c) else c for c in name)
    shown = "".join(c for c in PurePosixPath(flat).name if c.isprintable()).strip()
    if unicodedata.normalize("NFKC", shown) in ("", ".", ".."):
        return "attachment"
    return shown[:MAX_ATTACHMENT_NAME]


def _separates(c: str) -> bool:
    plain = unicodedata.normalize("NFKC", c)
    return "/" in plain or "\\" in plain


def _refusal(code: ReasonCode, why: str) -> GateResult:
    """The tool's error result for a refused ``attach`` (A5): its stable code, and that
    nothing was attached."""
    return GateResult.text(f"attach refused ({code}): {why}; nothing was attached", is_error=True)
