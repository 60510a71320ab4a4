"""Pi session files on disk: read, create, append and repair them (the blocking shells), and
their Trio wrappers, which run the shells in a worker thread (S10). The format itself is
:mod:`runtime._pi._session` (pure); answering a dead worker's calls is
:mod:`runtime._pi._session_settle`. Invariants: ``docs/design/sessions.md``.

Co-ownership: Pi appends to the same file with no lock and no fsync. The runtime writes a
session file only while the lane's worker is proven dead, and a :class:`SessionWriter`
refuses to append when the file changed size behind it (S8).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import msgspec
import trio

from .._clock import WallClock
from .._errors import ReasonCode, SessionError
from ._pijson import iso_timestamp, loads
from ._session import (
    LEAF,
    SESSION_VERSION,
    Session,
    SessionEntry,
    SessionReadResult,
    StrPath,
    _Leaf,
    encode_entry,
    parse_session,
    uuid7,
)

__all__ = [
    "ClockReading",
    "SessionWriter",
    "aappend_entry",
    "acreate_session",
    "afsync",
    "afsync_session",
    "append_entry",
    "aread_session",
    "atruncate_torn_tail",
    "create_session",
    "fsync_session",
    "open_session_writer",
    "read_session",
    "truncate_torn_tail",
]

_P = ParamSpec("_P")
_T = TypeVar("_T")


def read_session(path: StrPath) -> SessionReadResult:
    """Read and parse ``path``; ``SessionError(SESSION_MISSING)`` if it does not exist."""
    try:
        with open(path, "rb") as f:
            return parse_session(f.read(), path=os.fspath(path))
    except FileNotFoundError:
        message = "no session file"
        raise SessionError(ReasonCode.SESSION_MISSING, message, path=os.fspath(path)) from None


def fsync_session(path: StrPath) -> None:
    """Make what is in the session file durable (``fsync``): Pi appends without a sync, so
    its last lines may be in the page cache only — the runtime syncs them before it acts on
    what it read there (S15)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def truncate_torn_tail(path: StrPath) -> int:
    """Cut a torn last line back to the last LF, fsync, and return the bytes cut (S6).

    Returns 0 and changes nothing when the file ends with LF or its unterminated last
    line is complete JSON. Cuts nothing from what is no session (S11): raises
    ``SessionError`` ``SESSION_MISSING`` or ``SESSION_HEADER_INVALID`` (a path that leads
    to some other file, a torn header). Call it only while no Pi process can write the file.
    """
    try:
        f = open(path, "r+b")  # noqa: SIM115 - closed by the with below
    except FileNotFoundError:
        message = "no session file"
        raise SessionError(ReasonCode.SESSION_MISSING, message, path=os.fspath(path)) from None
    with f:
        data = f.read()
        header = data.find(b"\n") + 1 or len(data)
        parse_session(data[:header], path=os.fspath(path))  # the header, or refused
        cut = data.rfind(b"\n") + 1
        if cut == len(data):
            return 0
        try:
            loads(data[cut:])
        except msgspec.DecodeError:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())
            return len(data) - cut
        return 0


def create_session(
    path: StrPath,
    *,
    cwd: str,
    provider: str,
    model_id: str,
    thinking_level: str = "off",
    clock: WallClock,
    session_id: str | None = None,
    parent_session: str | None = None,
) -> Session:
    """Create a Pi-shaped session file and return its view (S7).

    Writes header, ``model_change`` (the root) and ``thinking_level_change`` with one
    ``os.write`` into a temporary file (mode 0600) beside ``path``, fsyncs it, links it into
    place (atomic; fails if ``path`` exists) and fsyncs the directory: a crash leaves no
    session or a whole one. ``SessionError(SESSION_EXISTS)`` if ``path`` exists.
    ``session_id`` defaults to a fresh UUIDv7.
    """
    now = clock.time_ms()
    header: dict[str, Any] = {
        "type": "session",
        "version": SESSION_VERSION,
        "id": session_id or uuid7(now),
        "timestamp": iso_timestamp(now),
        "cwd": cwd,
    }
    if parent_session is not None:
        header["parentSession"] = parent_session
    session = Session(header, encode_entry(header))
    model = {"type": "model_change", "provider": provider, "modelId": model_id}
    session = session.with_entry(session.new_entry(model, time_ms=now, parent_id=None))
    level = {"type": "thinking_level_change", "thinkingLevel": thinking_level}
    session = session.with_entry(session.new_entry(level, time_ms=now))
    data = session.to_bytes()
    # Written whole to a private temporary file, fsynced, then linked into place: ``link``
    # fails if the path exists (O_EXCL's promise) and is atomic, so a crash at any instant
    # leaves no session or a whole one — never an empty or torn header (S7).
    target = os.path.abspath(path)
    directory = os.path.dirname(target)
    temp = os.path.join(directory, f".{os.path.basename(target)}.{uuid7(now)}.creating")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    fd = os.open(temp, flags, 0o600)
    try:
        try:
            if os.write(fd, data) != len(data):
                raise OSError("short write while creating a session file")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp, target)
        except FileExistsError:
            exists = ReasonCode.SESSION_EXISTS
            raise SessionError(exists, "session file exists", path=os.fspath(path)) from None
    finally:
        os.unlink(temp)
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:  # its name may not be durable (EMFILE, L21; EIO): no session,
        with contextlib.suppress(OSError):  # so that the next try creates it whole again
            os.unlink(target)
        raise
    return session


class SessionWriter:
    """Appends entries to one session file (S8). Blocking; thread-safe; not re-entrant.

    Each append builds the line with :meth:`Session.new_entry`, checks that the file
    still has the size this writer last saw (``SESSION_CHANGED`` otherwise: someone else
    wrote to it) and writes the whole line with one ``os.write`` on an ``O_APPEND``
    descriptor. Nothing is durable until :meth:`fsync`. A failed or short write poisons
    the writer, since the tail may now be torn: re-read and truncate before going on.
    """

    def __init__(self, path: str, fd: int, clock: WallClock, read: SessionReadResult) -> None:
        self.path = path
        self.clock = clock
        self._fd = fd
        self._session = read.session
        self._size = read.size
        self._needs_lf = read.unterminated
        self._poisoned = False
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: StrPath, *, clock: WallClock) -> SessionWriter:
        """Read ``path`` and open it for appending; ``SESSION_TORN_TAIL`` if its tail is
        torn (call :func:`truncate_torn_tail` first)."""
        read = read_session(path)
        if read.torn_tail is not None:
            message = "torn last line; truncate it before appending"
            line = read.torn_tail.line
            raise SessionError(ReasonCode.SESSION_TORN_TAIL, message, path=read.path, line=line)
        return cls(
            os.fspath(path), os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC), clock, read
        )

    @property
    def session(self) -> Session:
        """The session including every entry this writer appended."""
        return self._session

    def append(
        self,
        entry: Mapping[str, Any],
        *,
        parent_id: str | _Leaf | None = LEAF,
        time_ms: int | None = None,
    ) -> SessionEntry:
        """Append ``entry`` (see :meth:`Session.new_entry`); it becomes the leaf. After a
        complete last line that lacked its LF, the LF is written first (as Pi does).
        ``time_ms`` defaults to a reading of the writer's clock."""
        now = self.clock.time_ms() if time_ms is None else time_ms
        with self._lock:
            if self._fd < 0 or self._poisoned:
                message = "the writer is closed or a write failed"
                raise SessionError(ReasonCode.SESSION_CHANGED, message, path=self.path)
            new = self._session.new_entry(entry, time_ms=now, parent_id=parent_id)
            data = b"\n" * self._needs_lf + new.raw_line + b"\n"
            if os.fstat(self._fd).st_size != self._size:
                message = "the file changed behind the writer; is the worker really dead?"
                raise SessionError(ReasonCode.SESSION_CHANGED, message, path=self.path)
            self._poisoned = True
            if os.write(self._fd, data) != len(data):
                message = "short write"
                raise SessionError(ReasonCode.SESSION_TORN_TAIL, message, path=self.path)
            self._poisoned, self._needs_lf = False, False
            self._size += len(data)
            self._session = self._session.with_entry(new)
            return new

    def append_custom(
        self, custom_type: str, data: Any, *, parent_id: str | _Leaf | None = LEAF
    ) -> SessionEntry:
        """Append a ``custom`` entry (Pi keeps it and never sends it to the LLM)."""
        entry = {"type": "custom", "customType": custom_type, "data": data}
        return self.append(entry, parent_id=parent_id)

    def append_message(
        self, message: Mapping[str, Any], *, parent_id: str | _Leaf | None = LEAF
    ) -> SessionEntry:
        """Append a ``message`` entry; a missing ``message.timestamp`` (epoch ms) is
        added last, as Pi shapes messages, from the same clock reading as the entry's."""
        now = self.clock.time_ms()
        body = {**message, "timestamp": message.get("timestamp", now)}
        return self.append({"type": "message", "message": body}, parent_id=parent_id, time_ms=now)

    def fsync(self) -> None:
        """Make every append so far durable."""
        with self._lock:
            os.fsync(self._fd)

    def close(self) -> None:
        """Close the descriptor; idempotent; does not fsync."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> SessionWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def append_entry(
    target: SessionWriter | StrPath,
    entry: Mapping[str, Any],
    *,
    parent_id: str | _Leaf | None = LEAF,
    clock: WallClock | None = None,
    time_ms: int | None = None,
) -> SessionEntry:
    """Append through a writer; or open the path ``target`` (``clock`` required), append,
    fsync and close. ``time_ms`` defaults to a reading of the writer's clock."""
    if isinstance(target, SessionWriter):
        return target.append(entry, parent_id=parent_id, time_ms=time_ms)
    if clock is None:
        raise TypeError("append_entry on a path needs a clock")
    with SessionWriter.open(target, clock=clock) as writer:
        new = writer.append(entry, parent_id=parent_id, time_ms=time_ms)
        writer.fsync()
        return new


# ----------------------------------------------------------------------- Trio wrappers (S10)
# The blocking core runs in a Trio worker thread. On cancellation the thread is not
# abandoned, so a write is never left half-known. The wall clock is read here, on the
# Trio thread (a MockWallClock needs the Trio run), and its reading passed along.


@dataclass(frozen=True, slots=True)
class ClockReading:
    """A wall clock stopped at one reading."""

    ms: int

    def time_ms(self) -> int:
        return self.ms


def _in_thread(fn: Callable[_P, _T]) -> Callable[_P, Awaitable[_T]]:
    """The async twin of a clock-free blocking ``fn``: same contract, in a worker thread."""

    @functools.wraps(fn)
    async def twin(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))

    return twin


aread_session = _in_thread(read_session)


atruncate_torn_tail = _in_thread(truncate_torn_tail)


afsync = _in_thread(SessionWriter.fsync)


afsync_session = _in_thread(fsync_session)


async def acreate_session(
    path: StrPath,
    *,
    cwd: str,
    provider: str,
    model_id: str,
    thinking_level: str = "off",
    clock: WallClock,
    session_id: str | None = None,
    parent_session: str | None = None,
) -> Session:
    """:func:`create_session` in a worker thread."""
    call = functools.partial(
        create_session,
        path,
        cwd=cwd,
        provider=provider,
        model_id=model_id,
        thinking_level=thinking_level,
        clock=ClockReading(clock.time_ms()),
        session_id=session_id,
        parent_session=parent_session,
    )
    return await trio.to_thread.run_sync(call)


async def aappend_entry(
    target: SessionWriter | StrPath,
    entry: Mapping[str, Any],
    *,
    parent_id: str | _Leaf | None = LEAF,
    clock: WallClock | None = None,
) -> SessionEntry:
    """:func:`append_entry` in a worker thread (``clock`` defaults to the writer's)."""
    wall = target.clock if clock is None and isinstance(target, SessionWriter) else clock
    if wall is None:
        raise TypeError("aappend_entry on a path needs a clock")
    now = wall.time_ms()
    call = functools.partial(
        append_entry, target, entry, parent_id=parent_id, clock=ClockReading(now), time_ms=now
    )
    return await trio.to_thread.run_sync(call)


@asynccontextmanager
async def open_session_writer(path: StrPath, *, clock: WallClock) -> AsyncIterator[SessionWriter]:
    """A :class:`SessionWriter` opened in a worker thread, closed on exit (no fsync).
    Its own clock is read by sync appends: use :func:`aappend_entry` from Trio code."""
    writer = await trio.to_thread.run_sync(functools.partial(SessionWriter.open, path, clock=clock))
    try:
        yield writer
    finally:
        writer.close()
