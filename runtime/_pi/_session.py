"""Pi session files (JSONL v3): read, create and append them exactly as Pi 1.6.0 does.

Invariants S1..S13 are stated in ``docs/design/sessions.md`` and cited by the tests; the
format facts come from the Pi research report (``docs/design/pi-observed.md`` §5, §8).

A pure core (:func:`encode_entry`, :func:`parse_session`, :class:`Session`, :func:`attest`)
never touches the file system; the JavaScript-exact JSON it writes and reads comes from
``runtime._pi._pijson``; blocking shells (:func:`read_session`, :func:`create_session`,
:class:`SessionWriter`, :func:`truncate_torn_tail`) do the I/O; the ``a*`` wrappers and
:func:`open_session_writer` run the shells in a Trio worker thread (S10).

Co-ownership: Pi appends to the same file with no lock and no fsync. The runtime writes a
session file only while the lane's worker is proven dead, and a :class:`SessionWriter`
refuses to append when the file changed size behind it (S8). Before a relaunch,
:func:`prepare_for_relaunch` repairs a torn tail and answers the dead worker's dangling tool
calls (:func:`dangling_tool_calls`, :func:`settle_dangling`; S12, S13).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import secrets
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, ParamSpec, TypeVar

import msgspec
import trio

from .._clock import WallClock, iso_timestamp
from .._errors import ReasonCode, SessionError
from ._pijson import loads, stringify

__all__ = [
    "LEAF",
    "Attestation",
    "DanglingCall",
    "RelaunchReport",
    "Session",
    "SessionEntry",
    "SessionIssue",
    "SessionIssueKind",
    "SessionReadResult",
    "SessionWriter",
    "SettledResult",
    "aappend_entry",
    "acreate_session",
    "afsync",
    "append_entry",
    "aprepare_for_relaunch",
    "aread_session",
    "asettle_dangling",
    "atruncate_torn_tail",
    "attest",
    "contains_path",
    "create_session",
    "dangling_tool_calls",
    "encode_entry",
    "interrupted_text",
    "not_started_text",
    "open_session_writer",
    "parse_session",
    "possibly_ran_result",
    "prepare_for_relaunch",
    "read_session",
    "settle_dangling",
    "truncate_torn_tail",
    "uuid7",
    "verify_attestation",
]

StrPath = str | os.PathLike[str]
SESSION_VERSION: Final = 3
_FRONT_KEYS: Final = ("type", "id", "parentId", "timestamp")
_P = ParamSpec("_P")
_T = TypeVar("_T")


class _Leaf(enum.Enum):
    LEAF = "leaf"


LEAF: Final = _Leaf.LEAF
"""Default ``parent_id``: the entry's own ``parentId`` if it has one, else the leaf."""


def encode_entry(entry: Mapping[str, Any]) -> bytes:
    """One line (no LF), byte-identical to Pi's ``JSON.stringify(entry)`` (S2).

    Raises ``ValueError`` or ``TypeError`` for what Pi cannot write: see
    :func:`runtime._pi._pijson.stringify`, which holds the JavaScript rules.
    """
    return stringify(entry)


# ------------------------------------------------------------------------------ model (pure)


@dataclass(frozen=True, slots=True)
class SessionEntry:
    """One entry line: ``raw`` is the decoded object in file key order (do not mutate),
    ``raw_line`` its exact bytes without the LF, ``line`` its 1-based line number."""

    type: str
    id: str
    parent_id: str | None
    timestamp: str | None
    line: int
    raw_line: bytes
    raw: dict[str, Any] = field(compare=False, hash=False, repr=False)

    @property
    def role(self) -> str | None:
        """``message.role`` of a ``message`` entry, else ``None``."""
        message = self.raw.get("message")
        role = message.get("role") if isinstance(message, dict) else None
        return role if isinstance(role, str) else None


class SessionIssueKind(enum.StrEnum):
    BLANK_LINE = "blank_line"
    BAD_JSON = "bad_json"
    NOT_AN_OBJECT = "not_an_object"
    MISSING_FIELD = "missing_field"
    REPEATED_HEADER = "repeated_header"
    DUPLICATE_ID = "duplicate_id"
    UNKNOWN_PARENT = "unknown_parent"
    TORN_TAIL = "torn_tail"


@dataclass(frozen=True, slots=True)
class SessionIssue:
    """A line that is not a clean entry (S3); ``offset`` is its byte offset in the file."""

    kind: SessionIssueKind
    line: int
    offset: int
    message: str
    raw_line: bytes = field(repr=False)


class Session:
    """An immutable view: the header and the entries in file order (S4, S5).

    ``line_count`` is the number of the last line read or built (malformed lines count).
    """

    __slots__ = ("_by_id", "_children", "entries", "header", "header_line", "line_count")

    def __init__(
        self,
        header: dict[str, Any],
        header_line: bytes,
        entries: Iterable[SessionEntry] = (),
        *,
        line_count: int = 1,
    ) -> None:
        self.header = header
        self.header_line = header_line
        self.entries: tuple[SessionEntry, ...] = tuple(entries)
        self._by_id = {e.id: e for e in self.entries}
        self._children: dict[str | None, list[SessionEntry]] = {}
        for e in self.entries:
            self._children.setdefault(e.parent_id, []).append(e)
        self.line_count = max(line_count, self.entries[-1].line if self.entries else 1)

    @property
    def id(self) -> str:
        """The session id (a UUIDv7) from the header."""
        return str(self.header["id"])

    @property
    def leaf(self) -> SessionEntry | None:
        """The last entry in file order: Pi's leaf when it (re)opens the file (S5)."""
        return self.entries[-1] if self.entries else None

    @property
    def by_id(self) -> Mapping[str, SessionEntry]:
        return self._by_id

    def get(self, entry_id: str) -> SessionEntry:
        """The entry ``entry_id``, or ``SessionError(SESSION_ENTRY_UNKNOWN)``."""
        if (entry := self._by_id.get(entry_id)) is None:
            message = f"no entry {entry_id!r} in session {self.id}"
            raise SessionError(ReasonCode.SESSION_ENTRY_UNKNOWN, message)
        return entry

    def children(self, entry_id: str | None) -> tuple[SessionEntry, ...]:
        """Entries whose ``parentId`` is ``entry_id`` (``None``: the roots), in file order."""
        return tuple(self._children.get(entry_id, ()))

    def path_to_root(self, entry_id: str | None = None) -> tuple[SessionEntry, ...]:
        """Root first, ending at ``entry_id`` (default: the leaf; ``()`` if no entries).

        Terminates, since a parent always lies on an earlier line (S4); an unknown parent
        ends the path.
        """
        if entry_id is None:
            if self.leaf is None:
                return ()
            entry_id = self.leaf.id
        path = [self.get(entry_id)]
        while (parent := path[-1].parent_id) is not None and parent in self._by_id:
            path.append(self._by_id[parent])
        return tuple(reversed(path))

    def new_entry(
        self, entry: Mapping[str, Any], *, time_ms: int, parent_id: str | _Leaf | None = LEAF
    ) -> SessionEntry:
        """Build, without writing, the next entry line (S2, S7).

        ``entry`` holds ``type`` and that type's fields. A missing ``id`` becomes 8 fresh
        hex chars unique in this session; ``parentId`` defaults to ``parent_id``, else the
        leaf; ``timestamp`` to ``time_ms``. Keys come out as ``type, id, parentId,
        timestamp`` and then ``entry``'s own order. Raises ``SessionError``:
        SESSION_ENTRY_INVALID for a bad entry, SESSION_ENTRY_UNKNOWN for an unknown parent.
        """
        invalid = ReasonCode.SESSION_ENTRY_INVALID
        kind, entry_id = entry.get("type"), entry.get("id")
        if not isinstance(kind, str) or kind == "session":
            raise SessionError(invalid, f"bad entry type {kind!r}")
        if entry_id is None:
            entry_id = _fresh_id(self._by_id)
        if not isinstance(entry_id, str) or entry_id in self._by_id:
            raise SessionError(invalid, f"entry id {entry_id!r} is not new")
        if parent_id is LEAF:
            parent_id = entry.get("parentId", self.leaf.id if self.leaf else None)
        elif entry.get("parentId", parent_id) != parent_id:
            raise SessionError(invalid, "entry names a different parentId")
        if not isinstance(parent_id, str | None):
            raise SessionError(invalid, "parentId must be a string or null")
        if parent_id is not None:
            self.get(parent_id)
        timestamp = entry.get("timestamp", iso_timestamp(time_ms))
        raw = {"type": kind, "id": entry_id, "parentId": parent_id, "timestamp": timestamp}
        raw.update((k, v) for k, v in entry.items() if k not in _FRONT_KEYS)
        try:
            line = encode_entry(raw)
        except (TypeError, ValueError) as exc:
            raise SessionError(invalid, str(exc)) from exc
        return SessionEntry(
            type=kind,
            id=entry_id,
            parent_id=parent_id,
            timestamp=timestamp,
            line=self.line_count + 1,
            raw_line=line,
            raw=loads(line),
        )

    def branch_at(self, entry_id: str, entry: Mapping[str, Any], *, time_ms: int) -> SessionEntry:
        """The entry that branches at the earlier ``entry_id``; once written it is the
        leaf, and Pi's context becomes the path root…``entry_id`` (S5, pi-observed.md §8 (a))."""
        return self.new_entry(entry, time_ms=time_ms, parent_id=entry_id)

    def with_entry(self, entry: SessionEntry) -> Session:
        """A new view with ``entry`` (built by :meth:`new_entry`) appended."""
        if entry.line <= self.line_count or entry.id in self._by_id:
            raise SessionError(ReasonCode.SESSION_ENTRY_INVALID, "entry is not the next line")
        return Session(self.header, self.header_line, (*self.entries, entry))

    def to_bytes(self) -> bytes:
        """Header and entries, LF-terminated, each line exactly as read (S1)."""
        lines = (self.header_line, *(e.raw_line for e in self.entries))
        return b"".join(line + b"\n" for line in lines)


def _fresh_id(taken: Mapping[str, object]) -> str:
    """8 random hex chars (as Pi's entry ids) not in ``taken``."""
    while (candidate := secrets.token_hex(4)) in taken:
        pass
    return candidate


@dataclass(frozen=True, slots=True)
class SessionReadResult:
    """What :func:`parse_session` found. ``issues`` holds every line that is not a clean
    entry, in file order (S3). ``unterminated``: the last line is complete JSON without
    its LF (S6). ``torn_tail``: the torn last line's issue, if any. ``size``: file bytes."""

    path: str | None
    session: Session
    issues: tuple[SessionIssue, ...]
    size: int
    unterminated: bool
    torn_tail: SessionIssue | None

    def require_clean(self) -> Session:
        """The session; or ``SessionError`` at the first issue's line: SESSION_TORN_TAIL
        for a torn tail, SESSION_MALFORMED for anything else."""
        if not self.issues:
            return self.session
        first = self.issues[0]
        code = ReasonCode.SESSION_MALFORMED
        if first.kind is SessionIssueKind.TORN_TAIL:
            code = ReasonCode.SESSION_TORN_TAIL
        raise SessionError(code, first.message, path=self.path, line=first.line)


def _check_line(
    raw_line: bytes, seen: Mapping[str, SessionEntry], *, tail: bool
) -> tuple[SessionIssueKind | None, str, dict[str, Any] | None]:
    """Classify one line after the header: (issue or None, message, entry object or None)."""
    kind = SessionIssueKind
    try:
        obj = loads(raw_line)
    except msgspec.DecodeError:
        if tail:
            return kind.TORN_TAIL, "torn last line (no LF, incomplete JSON)", None
        if not raw_line.strip():
            return kind.BLANK_LINE, "blank line", None
        return kind.BAD_JSON, "line is not valid JSON", None
    if not isinstance(obj, dict):
        return kind.NOT_AN_OBJECT, "line is not a JSON object", None
    if obj.get("type") == "session":
        return kind.REPEATED_HEADER, "a second session header", None
    if not isinstance(obj.get("type"), str) or not isinstance(obj.get("id"), str):
        return kind.MISSING_FIELD, "entry lacks a string 'type' or 'id'", None
    if not isinstance(obj.get("parentId", 0), str | None):
        return kind.MISSING_FIELD, "entry lacks 'parentId' (a string or null)", None
    if (twin := seen.get(obj["id"])) is not None:
        return kind.DUPLICATE_ID, f"id {obj['id']!r} repeats line {twin.line}", None
    if (parent := obj["parentId"]) is not None and parent not in seen:
        return kind.UNKNOWN_PARENT, f"parentId {parent!r} names no earlier entry", obj
    return None, "", obj


def parse_session(data: bytes, *, path: str | None = None) -> SessionReadResult:
    """Parse a whole session file (pure).

    Raises ``SessionError(SESSION_HEADER_INVALID)`` when line 1 is not a version-3 session
    header (S11); every other problem becomes an issue with its line number (S3). An
    entry with an unknown parent is kept and reported; other bad lines are only reported.
    """
    lines = data.split(b"\n")
    unterminated = lines[-1] != b""
    if not unterminated:
        lines.pop()
    try:
        header = loads(lines[0]) if lines else None
    except msgspec.DecodeError:
        header = None
    if not isinstance(header, dict) or header.get("type") != "session":
        raise SessionError(
            ReasonCode.SESSION_HEADER_INVALID, "line 1 is no session header", path=path, line=1
        )
    if header.get("version") != SESSION_VERSION or not isinstance(header.get("id"), str):
        message = f"header version {header.get('version')!r} is not 3 (or has no id)"
        raise SessionError(ReasonCode.SESSION_HEADER_INVALID, message, path=path, line=1)
    issues: list[SessionIssue] = []
    seen: dict[str, SessionEntry] = {}
    offset = len(lines[0]) + 1
    for number, raw_line in enumerate(lines[1:], start=2):
        tail = unterminated and number == len(lines)
        kind, message, obj = _check_line(raw_line, seen, tail=tail)
        if kind is not None:
            issues.append(SessionIssue(kind, number, offset, message, raw_line))
        if obj is not None:
            ts = obj.get("timestamp")
            seen[obj["id"]] = SessionEntry(
                type=obj["type"],
                id=obj["id"],
                parent_id=obj["parentId"],
                timestamp=ts if isinstance(ts, str) else None,
                line=number,
                raw_line=raw_line,
                raw=obj,
            )
        offset += len(raw_line) + 1
    torn = issues[-1] if issues and issues[-1].kind is SessionIssueKind.TORN_TAIL else None
    return SessionReadResult(
        path=path,
        session=Session(header, lines[0], seen.values(), line_count=len(lines)),
        issues=tuple(issues),
        size=len(data),
        unterminated=unterminated and torn is None,
        torn_tail=torn,
    )


# -------------------------------------------------------------------- blocking I/O shells


def read_session(path: StrPath) -> SessionReadResult:
    """Read and parse ``path``; ``SessionError(SESSION_MISSING)`` if it does not exist."""
    try:
        with open(path, "rb") as f:
            return parse_session(f.read(), path=os.fspath(path))
    except FileNotFoundError:
        message = "no session file"
        raise SessionError(ReasonCode.SESSION_MISSING, message, path=os.fspath(path)) from None


def truncate_torn_tail(path: StrPath) -> int:
    """Cut a torn last line back to the last LF, fsync, and return the bytes cut (S6).

    Returns 0 and changes nothing when the file ends with LF or its unterminated last
    line is complete JSON. Call it only while no Pi process can write the file.
    """
    with open(path, "r+b") as f:
        data = f.read()
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


def uuid7(time_ms: int) -> str:
    """An RFC 9562 UUIDv7: 48-bit ``time_ms``, version 7, variant 0b10, 74 random bits."""
    value = (time_ms & (2**48 - 1)) << 80 | 0x7 << 76 | secrets.randbits(12) << 64
    h = f"{value | 0b10 << 62 | secrets.randbits(62):032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


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
    ``os.write`` into a file created with ``O_EXCL`` (mode 0600), then fsyncs the file and
    its directory. On failure the partial file is removed. ``SessionError(SESSION_EXISTS)``
    if ``path`` exists. ``session_id`` defaults to a fresh UUIDv7.
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
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        exists = ReasonCode.SESSION_EXISTS
        raise SessionError(exists, "session file exists", path=os.fspath(path)) from None
    try:
        try:
            if os.write(fd, data) != len(data):
                raise OSError("short write while creating a session file")
            os.fsync(fd)
        finally:
            os.close(fd)
        dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        os.unlink(path)
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


# ------------------------------------------------------------------------ attestation (S9)


class Attestation(msgspec.Struct, frozen=True, kw_only=True):
    """Names one path of one session: ``path_digest`` is the hex SHA-256 over
    ``raw_line + b"\\n"`` of each entry from the root to ``leaf_id``; ``count`` entries."""

    session_id: str
    leaf_id: str
    path_digest: str
    count: int


def _attest_path(session: Session, path: tuple[SessionEntry, ...]) -> Attestation:
    digest = hashlib.sha256()
    for entry in path:
        digest.update(entry.raw_line + b"\n")
    return Attestation(
        session_id=session.id, leaf_id=path[-1].id, path_digest=digest.hexdigest(), count=len(path)
    )


def attest(session: Session, leaf_id: str | None = None) -> Attestation:
    """Attest the path to ``leaf_id`` (default: the leaf); ``SESSION_ENTRY_UNKNOWN`` if
    there is no such entry or no entry at all."""
    if leaf_id is None and session.leaf is None:
        raise SessionError(ReasonCode.SESSION_ENTRY_UNKNOWN, "the session has no entries")
    return _attest_path(session, session.path_to_root(leaf_id))


def verify_attestation(session: Session, attestation: Attestation) -> None:
    """``SessionError(SESSION_ATTESTATION_MISMATCH)`` unless ``session`` has the same id,
    the same leaf and the same bytes on the path root→leaf."""
    if (found := attest(session)) != attestation:
        message = f"expected {attestation}, found {found}"
        raise SessionError(ReasonCode.SESSION_ATTESTATION_MISMATCH, message)


def contains_path(session: Session, attestation: Attestation) -> bool:
    """Whether the current path root→leaf begins, byte for byte, with the attested path:
    the session only grew below the attested leaf."""
    path = session.path_to_root()
    ids = [entry.id for entry in path]
    if session.id != attestation.session_id or attestation.leaf_id not in ids:
        return False
    prefix = path[: ids.index(attestation.leaf_id) + 1]
    return _attest_path(session, prefix) == attestation


# ------------------------------------------------------------ dangling tool calls (S12, S13)
# Pi answers a tool call only by running it. A worker killed mid-tool leaves the assistant's
# toolCall blocks without a toolResult (pi-observed.md §8); each later request then carries Pi's
# synthetic "No result provided" for them, in the request only. Before a relaunch the runtime
# writes a real answer instead. Which calls count mirrors Pi's own request building:
# ``buildSessionProjection`` (session-manager.js), ``convertToLlm`` (messages.js) and
# ``transformMessages`` (pi-ai transform-messages.js); ``fake_pi/_messages.py`` mirrors them too.

_DROPPED_STOP_REASONS: Final = frozenset({"aborted", "error"})
"""Pi leaves assistant messages that stopped so out of the model context, calls and all."""
_USER_SIDE_ROLES: Final = frozenset(
    {"user", "bashExecution", "custom", "branchSummary", "compactionSummary"}
)
"""Roles Pi sends as a user message; one after the calls closes them ("No result provided")."""
_EDITABLE_ROLES: Final = frozenset({"user", "assistant", "toolResult", "custom"})
"""Roles whose content a ``context_edit`` replacement replaces."""


@dataclass(frozen=True, slots=True)
class DanglingCall:
    """A toolCall block of the last assistant message in context, without a toolResult (S12).

    ``arguments`` is the block's arguments object (``{}`` if it has none); do not mutate it.
    """

    tool_call_id: str
    name: str
    arguments: dict[str, Any] = field(hash=False)
    assistant_entry_id: str


class SettledResult(NamedTuple):
    """The answer to one dangling call: the toolResult's ``content`` blocks (Pi's shape,
    e.g. ``[{"type": "text", "text": …}]``) and its ``isError``."""

    content: list[dict[str, Any]]
    is_error: bool


Results = Mapping[str, SettledResult] | Callable[[DanglingCall], SettledResult]
"""Answers by tool-call id, or a function from the call to its answer."""


@dataclass(frozen=True, slots=True)
class RelaunchReport:
    """What :func:`prepare_for_relaunch` did: ``torn_bytes`` cut from a torn tail (S6), the
    ``settled`` calls in source order and the toolResult ``entries`` written for them (S13);
    ``session`` is the file as it now stands."""

    torn_bytes: int
    settled: tuple[DanglingCall, ...]
    entries: tuple[SessionEntry, ...]
    session: Session = field(compare=False, repr=False)


def interrupted_text(name: str) -> str:
    """What the model gets for a never-replay tool whose intent has no outcome (gate.md T5)."""
    return f"tool {name} was interrupted and possibly ran; inspect before repeating"


def not_started_text(name: str) -> str:
    """What the model gets for a call the worker died holding before the gate let it run."""
    return f"tool {name} was interrupted before it started; it did not run"


def possibly_ran_result(name: str) -> SettledResult:
    """The standard answer for a call that may have run: :func:`interrupted_text`, as an
    error."""
    return SettledResult([{"type": "text", "text": interrupted_text(name)}], is_error=True)


def _context_entries(path: tuple[SessionEntry, ...]) -> list[SessionEntry]:
    """Pi's ``buildContextEntries``: the path; or, after a ``compaction``, the newest one,
    then the entries from its ``firstKeptEntryId`` up to it (no system messages), then the
    entries after it."""
    latest = max((i for i, e in enumerate(path) if e.type == "compaction"), default=-1)
    if latest < 0:
        return list(path)
    first_kept = path[latest].raw.get("firstKeptEntryId")
    kept: list[SessionEntry] = []
    found = False
    for entry in path[:latest]:
        found = found or entry.id == first_kept
        if found and not (entry.type == "message" and entry.role == "system"):
            kept.append(entry)
    return [path[latest], *kept, *path[latest + 1 :]]


def _entry_messages(entry: SessionEntry) -> list[dict[str, Any]]:
    """Pi's ``sessionEntryToContextMessages``, with only the fields that S12 reads."""
    raw = entry.raw
    if entry.type == "message":
        message = raw.get("message")
        return [message] if isinstance(message, dict) else []
    if entry.type == "custom_message":
        return [{"role": "custom", "content": raw.get("content") or []}]
    if entry.type == "branch_summary" and raw.get("summary"):
        return [{"role": "branchSummary"}]
    if entry.type == "compaction":
        system = raw.get("systemMessage")
        return [*([system] if isinstance(system, dict) else []), {"role": "compactionSummary"}]
    return []


def _projected(entry: SessionEntry, edit: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Pi's ``projectContextEntry``: the entry's newest ``context_edit`` hides its messages
    (``replacement: null``) or replaces their content."""
    messages = _entry_messages(entry)
    if edit is None:
        return messages
    replacement = edit.get("replacement")
    if not isinstance(replacement, dict):
        return []
    out = []
    for message in messages:
        role, content = message.get("role"), replacement.get("content")
        if role in ("assistant", "toolResult") and isinstance(content, str):
            content = [{"type": "text", "text": content}]
        out.append({**message, "content": content} if role in _EDITABLE_ROLES else message)
    return out


def _context(session: Session) -> list[tuple[SessionEntry, dict[str, Any]]]:
    """The messages Pi builds its next request from, each with its source entry."""
    entries = _context_entries(session.path_to_root())
    edits = {e.raw.get("targetId"): e.raw for e in entries if e.type == "context_edit"}
    return [
        (entry, message)
        for index, entry in enumerate(entries)
        if not (index > 0 and entry.type == "compaction")
        for message in _projected(entry, edits.get(entry.id))
    ]


def _sent_as_user(message: Mapping[str, Any]) -> bool:
    """Pi's ``convertToLlm`` turns ``message`` into a user message."""
    role = message.get("role")
    if role == "bashExecution":
        return not message.get("excludeFromContext")
    return isinstance(role, str) and role in _USER_SIDE_ROLES


def _tool_calls(entry_id: str, assistant: Mapping[str, Any]) -> list[DanglingCall]:
    """The assistant's toolCall blocks that carry a string id, in source order."""
    content = assistant.get("content")
    calls = []
    for block in content if isinstance(content, list) else ():
        if not isinstance(block, dict) or block.get("type") != "toolCall":
            continue
        call_id, name, arguments = block.get("id"), block.get("name"), block.get("arguments")
        if isinstance(call_id, str):
            calls.append(
                DanglingCall(
                    tool_call_id=call_id,
                    name=name if isinstance(name, str) else "",
                    arguments=arguments if isinstance(arguments, dict) else {},
                    assistant_entry_id=entry_id,
                )
            )
    return calls


def dangling_tool_calls(session: Session) -> tuple[DanglingCall, ...]:
    """The tool calls Pi would answer with "No result provided" in its next request (S12).

    These are the toolCall blocks of the last assistant message in context on the path
    root→leaf that no toolResult after it answers, in the assistant's source order. There
    are none when that message stopped ``aborted`` or ``error`` (Pi leaves it out of the
    context, and closes any earlier calls there), or when a message Pi sends as a user
    message (user, bashExecution, custom_message, branch_summary, compaction summary)
    follows it: Pi already answered the calls before it, and a result below it would
    answer nothing. ``context_edit`` and ``compaction`` entries apply as Pi applies them.
    """
    context = _context(session)
    roles = [message.get("role") for _, message in context]
    last = max((i for i, role in enumerate(roles) if role == "assistant"), default=-1)
    if last < 0:
        return ()
    entry, assistant = context[last]
    stop = assistant.get("stopReason")
    if isinstance(stop, str) and stop in _DROPPED_STOP_REASONS:
        return ()
    answered: set[str] = set()
    for _, message in context[last + 1 :]:
        if _sent_as_user(message):
            return ()
        if message.get("role") == "toolResult" and isinstance(message.get("toolCallId"), str):
            answered.add(message["toolCallId"])
    return tuple(c for c in _tool_calls(entry.id, assistant) if c.tool_call_id not in answered)


def _result_for(call: DanglingCall, results: Results) -> SettledResult:
    """``call``'s answer from ``results``; ``SESSION_ENTRY_INVALID`` if there is none or
    it is not (a list of content blocks, a bool)."""
    invalid = ReasonCode.SESSION_ENTRY_INVALID
    if isinstance(results, Mapping):
        if call.tool_call_id not in results:
            raise SessionError(invalid, f"no result for dangling call {call.tool_call_id!r}")
        content, is_error = results[call.tool_call_id]
    else:
        content, is_error = results(call)
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise SessionError(invalid, f"result content for {call.tool_call_id!r} is not blocks")
    if not isinstance(is_error, bool):
        raise SessionError(invalid, f"result is_error for {call.tool_call_id!r} is not a bool")
    return SettledResult(content, is_error)


def _tool_result(call: DanglingCall, result: SettledResult) -> dict[str, Any]:
    """Pi's toolResult message for ``call``, keys in Pi's order (``timestamp`` is added on
    append); ``SESSION_ENTRY_INVALID`` if Pi could not write it (S2)."""
    message = {
        "role": "toolResult",
        "toolCallId": call.tool_call_id,
        "toolName": call.name,
        "content": result.content,
        "isError": result.is_error,
    }
    try:
        encode_entry(message)
    except (TypeError, ValueError) as exc:
        raise SessionError(ReasonCode.SESSION_ENTRY_INVALID, str(exc)) from exc
    return message


def _plan(
    session: Session, results: Results
) -> tuple[tuple[DanglingCall, ...], tuple[dict[str, Any], ...]]:
    """The dangling calls and their toolResult messages, all checked before anything is
    written (pure apart from calling ``results``)."""
    calls = dangling_tool_calls(session)
    return calls, tuple(_tool_result(call, _result_for(call, results)) for call in calls)


def _append_results(
    writer: SessionWriter, messages: Iterable[Mapping[str, Any]], *, fsync: bool
) -> tuple[SessionEntry, ...]:
    """Append each message at the leaf, then fsync once if anything was written (or if
    ``fsync`` says always)."""
    entries = tuple(writer.append_message(message) for message in messages)
    if entries or fsync:
        writer.fsync()
    return entries


def _cut_torn_tail(path: StrPath) -> int:
    """:func:`truncate_torn_tail`, but only on a readable version-3 session file
    (``SESSION_MISSING``, ``SESSION_HEADER_INVALID`` otherwise)."""
    return truncate_torn_tail(path) if read_session(path).torn_tail is not None else 0


def settle_dangling(
    path: StrPath, results: Results, *, clock: WallClock
) -> tuple[SessionEntry, ...]:
    """Answer the session's dangling calls (S12) with toolResult entries (S13).

    One toolResult message per dangling call, in source order, each the child of the one
    before (plain leaf appends through a :class:`SessionWriter`), then one fsync; returns
    the new entries. No dangling calls: writes nothing. Every result is looked up and
    checked before the first write (``SESSION_ENTRY_INVALID``). Refused like any append:
    ``SESSION_TORN_TAIL`` on a torn tail, ``SESSION_CHANGED`` if the file changes behind
    the writer (the worker is not dead). Call it only while no worker can write the file.
    """
    with SessionWriter.open(path, clock=clock) as writer:
        _, messages = _plan(writer.session, results)
        return _append_results(writer, messages, fsync=False)


def prepare_for_relaunch(path: StrPath, results: Results, *, clock: WallClock) -> RelaunchReport:
    """What the runtime does to a session whose worker is proven dead, before relaunching.

    Cuts a torn tail (S6), settles the dangling calls as :func:`settle_dangling` does and
    fsyncs the file, also when nothing was cut or settled, so that the dead worker's own
    unsynced appends are durable too (S13). Raises as those do.
    """
    cut = _cut_torn_tail(path)
    with SessionWriter.open(path, clock=clock) as writer:
        calls, messages = _plan(writer.session, results)
        entries = _append_results(writer, messages, fsync=True)
        return RelaunchReport(cut, calls, entries, writer.session)


# ----------------------------------------------------------------------- Trio wrappers (S10)
# The blocking core runs in a Trio worker thread. On cancellation the thread is not
# abandoned, so a write is never left half-known. The wall clock is read here, on the
# Trio thread (a MockWallClock needs the Trio run), and its reading passed along.


@dataclass(frozen=True, slots=True)
class _Reading:
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
        clock=_Reading(clock.time_ms()),
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
        append_entry, target, entry, parent_id=parent_id, clock=_Reading(now), time_ms=now
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


async def asettle_dangling(
    path: StrPath, results: Results, *, clock: WallClock
) -> tuple[SessionEntry, ...]:
    """:func:`settle_dangling` with its I/O in worker threads; ``results`` is called, and
    the clock read once, on the Trio thread."""
    async with open_session_writer(path, clock=_Reading(clock.time_ms())) as writer:
        _, messages = _plan(writer.session, results)
        append = functools.partial(_append_results, writer, messages, fsync=False)
        return await trio.to_thread.run_sync(append)


async def aprepare_for_relaunch(
    path: StrPath, results: Results, *, clock: WallClock
) -> RelaunchReport:
    """:func:`prepare_for_relaunch` with its I/O in worker threads; ``results`` is called,
    and the clock read once, on the Trio thread."""
    reading = _Reading(clock.time_ms())
    cut = await trio.to_thread.run_sync(_cut_torn_tail, path)
    async with open_session_writer(path, clock=reading) as writer:
        calls, messages = _plan(writer.session, results)
        append = functools.partial(_append_results, writer, messages, fsync=True)
        entries = await trio.to_thread.run_sync(append)
        return RelaunchReport(cut, calls, entries, writer.session)
