"""Pi session files (JSONL v3), the format: entries, parsing, encoding and attestation.

A pure core: nothing here touches the file system. Lines are written and read exactly as Pi
1.6.0 does (the JavaScript-exact JSON comes from ``runtime._pi._pijson``; what Pi was seen to
write: ``docs/design/pi-observed.md`` §5, §8). Invariants S1..S13 are in
``docs/design/sessions.md``. The files on disk and their Trio wrappers are
:mod:`runtime._pi._session_files`; a dead worker's dangling calls, answered before a
relaunch, are :mod:`runtime._pi._session_settle`.
"""

from __future__ import annotations

import enum
import hashlib
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from .._errors import ReasonCode, SessionError
from ._pijson import iso_timestamp, loads, stringify

__all__ = [
    "LEAF",
    "Attestation",
    "Session",
    "SessionEntry",
    "SessionIssue",
    "SessionIssueKind",
    "SessionReadResult",
    "attest",
    "contains_path",
    "encode_entry",
    "parse_session",
    "uuid7",
    "verify_attestation",
]

StrPath = str | os.PathLike[str]
SESSION_VERSION: Final = 3
_FRONT_KEYS: Final = ("type", "id", "parentId", "timestamp")


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

        An unknown parent ends the path. A forward reference is followed, as Pi follows it;
        one that closes a loop (an entry that is its own ancestor: only a damaged file has
        one) raises ``SessionError(SESSION_MALFORMED)`` at the line whose ``parentId`` closes
        it, where Pi would loop for ever (S4).
        """
        if entry_id is None:
            if self.leaf is None:
                return ()
            entry_id = self.leaf.id
        path = [self.get(entry_id)]
        on_path = {entry_id}
        while (parent := path[-1].parent_id) is not None and parent in self._by_id:
            if parent in on_path:
                message = f"the parentId {parent!r} on line {path[-1].line} closes a loop"
                raise SessionError(ReasonCode.SESSION_MALFORMED, message, line=path[-1].line)
            on_path.add(parent)
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


def _decode_line(
    raw_line: bytes, *, tail: bool
) -> tuple[SessionIssueKind | None, str, dict[str, Any] | None]:
    """Decode one line after the header and check its shape, before any id is compared:
    (issue or None, message, entry object or None). Shared by :func:`parse_session` and
    the index of ``runtime._pi._session_index`` (S14), so both classify a line alike."""
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
    return None, "", obj


def _check_line(
    raw_line: bytes, seen: Mapping[str, SessionEntry], *, tail: bool
) -> tuple[SessionIssueKind | None, str, dict[str, Any] | None]:
    """Classify one line after the header: (issue or None, message, entry object or None)."""
    kind = SessionIssueKind
    issue, message, obj = _decode_line(raw_line, tail=tail)
    if obj is None:
        return issue, message, None
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


def uuid7(time_ms: int) -> str:
    """An RFC 9562 UUIDv7: 48-bit ``time_ms``, version 7, variant 0b10, 74 random bits."""
    value = (time_ms & (2**48 - 1)) << 80 | 0x7 << 76 | secrets.randbits(12) << 64
    h = f"{value | 0b10 << 62 | secrets.randbits(62):032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


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
