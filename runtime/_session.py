"""Pi session files (JSONL v3): read, create and append exactly as Pi 1.6.0 does.

The invariants S1..S11 are stated in ``docs/design/sessions.md``; the tests cite them.
Format facts come from ``shared/pi-real/REPORT.md`` §5 and §8.

Layout: a pure core (:func:`encode_entry`, :func:`parse_session`, :class:`Session`,
:func:`attest`) that never touches the file system, blocking shells (:func:`read_session`,
:func:`create_session`, :class:`SessionWriter`, :func:`truncate_torn_tail`) and Trio
wrappers (``a*`` and :func:`open_session_writer`) that run the shells in a worker thread.

Co-ownership: Pi appends to the same file without locks or fsync. The runtime writes a
session file only while the lane's worker is proven dead; :class:`SessionWriter` also
refuses to append if the file's size changed behind it (S8).
"""

from __future__ import annotations

import decimal
import enum
import functools
import hashlib
import json
import os
import re
import secrets
import threading
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
import trio

from ._clock import WallClock, iso_timestamp
from ._errors import ReasonCode, SessionError

__all__ = [
    "LEAF",
    "Attestation",
    "Session",
    "SessionEntry",
    "SessionIssue",
    "SessionIssueKind",
    "SessionReadResult",
    "SessionWriter",
    "aappend_entry",
    "acreate_session",
    "afsync",
    "append_custom",
    "append_entry",
    "append_message",
    "aread_session",
    "atruncate_torn_tail",
    "attest",
    "contains_path",
    "create_session",
    "encode_entry",
    "open_session_writer",
    "parse_session",
    "read_session",
    "truncate_torn_tail",
    "uuid7",
    "verify_attestation",
]

StrPath = str | os.PathLike[str]
SESSION_VERSION: Final = 3
_FRONT_KEYS: Final = ("type", "id", "parentId", "timestamp")
_SURROGATE = re.compile("[\ud800-\udfff]")
_MAX_SAFE_INT: Final = 2**53 - 1


class _Leaf(enum.Enum):
    LEAF = "leaf"


LEAF: Final = _Leaf.LEAF
"""Default ``parent_id``: the entry's own ``parentId`` if it has one, else the leaf."""

# ---------------------------------------------------------------- encoding (S2)

_encoder = msgspec.json.Encoder()


def _js_number(value: float) -> str:
    """ECMAScript Number::toString of a finite double (shortest round-trip digits)."""
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError("NaN and infinities are not JSON (JSON.stringify would write null)")
    if value == 0:
        return "0"
    sign = "-" if value < 0 else ""
    dec = decimal.Decimal(repr(abs(value))).as_tuple()
    raw = "".join(map(str, dec.digits))
    assert isinstance(dec.exponent, int)
    n = len(raw) + dec.exponent  # value = 0.<digits> * 10**n
    s = raw.rstrip("0")
    k = len(s)
    if k <= n <= 21:
        return sign + s + "0" * (n - k)
    if 0 < n <= 21:
        return sign + s[:n] + "." + s[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * -n + s
    exp = n - 1
    mantissa = s if k == 1 else s[0] + "." + s[1:]
    return f"{sign}{mantissa}e{'+' if exp >= 0 else '-'}{abs(exp)}"


def _js_string(value: str) -> msgspec.Raw:
    """A string holding surrogates: JS joins valid pairs and escapes lone halves."""
    joined = value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
    text = json.dumps(joined, ensure_ascii=False)
    text = _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return msgspec.Raw(text.encode("utf-8"))


def _is_array_index(key: str) -> bool:
    return (
        key.isascii() and key.isdigit() and (key == "0" or key[0] != "0") and int(key) < 2**32 - 1
    )


def _js_ready(value: Any) -> Any:
    """Rewrite ``value`` so msgspec emits what ``JSON.stringify`` would."""
    if value is None or isinstance(value, bool | str) and not isinstance(value, str):
        return value
    if isinstance(value, str):
        return _js_string(value) if _SURROGATE.search(value) else value
    if isinstance(value, int):
        if abs(value) > _MAX_SAFE_INT:
            raise ValueError(f"integer {value} is beyond JavaScript's safe range")
        return value
    if isinstance(value, float):
        return msgspec.Raw(_js_number(value).encode("ascii"))
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("JSON object keys must be strings")
        index_keys = sorted((k for k in value if _is_array_index(k)), key=int)
        keys = index_keys + [k for k in value if not _is_array_index(k)]
        return {k: _js_ready(value[k]) for k in keys}
    if isinstance(value, list | tuple):
        return [_js_ready(item) for item in value]
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def encode_entry(entry: Mapping[str, Any]) -> bytes:
    """Encode one line (without LF) byte-identical to Pi's ``JSON.stringify(entry)``.

    Compact separators, insertion order (array-index keys first, as JavaScript orders
    them), non-ASCII unescaped, JavaScript number formatting. Raises ``ValueError`` for
    NaN, infinities and integers beyond 2**53 - 1, which Pi could not have written.
    """
    return _encoder.encode(_js_ready(entry))


def _decode(line: bytes) -> Any:
    """Decode one JSON line; falls back to the stdlib for lone-surrogate escapes."""
    try:
        return msgspec.json.decode(line)
    except msgspec.DecodeError:
        try:
            return json.loads(line.decode("utf-8"), parse_constant=_reject_constant)
        except ValueError:
            raise msgspec.DecodeError("invalid JSON") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# ---------------------------------------------------------------- model (pure)


@dataclass(frozen=True, slots=True)
class SessionEntry:
    """One entry line. ``raw`` is the decoded object in file key order (do not mutate);
    ``raw_line`` its exact bytes without the LF; ``line`` the 1-based line number."""

    type: str
    id: str
    parent_id: str | None
    timestamp: str | None
    line: int
    raw_line: bytes
    raw: dict[str, Any] = field(compare=False, hash=False, repr=False)

    @property
    def role(self) -> str | None:
        """``message.role`` for ``message`` entries, else ``None``."""
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
    """A line that is not a clean entry (S3). ``offset`` is its byte offset."""

    kind: SessionIssueKind
    line: int
    offset: int
    message: str
    raw_line: bytes = field(repr=False)


class Session:
    """An immutable view: the header plus the entries in file order (S4, S5).

    Built by :func:`parse_session`; grown with :meth:`with_entry`. ``line_count`` is
    the number of the last line seen (malformed lines included).
    """

    __slots__ = ("_by_id", "_children", "entries", "header", "header_line", "line_count")

    def __init__(
        self,
        header: dict[str, Any],
        header_line: bytes,
        entries: Iterable[SessionEntry] = (),
        *,
        line_count: int | None = None,
    ) -> None:
        self.header = header
        self.header_line = header_line
        self.entries: tuple[SessionEntry, ...] = tuple(entries)
        self._by_id = {e.id: e for e in self.entries}
        self._children: dict[str | None, list[SessionEntry]] = {}
        for e in self.entries:
            self._children.setdefault(e.parent_id, []).append(e)
        last = self.entries[-1].line if self.entries else 1
        self.line_count = max(last, line_count or 1)

    @property
    def id(self) -> str:
        """The session id (a UUIDv7) from the header."""
        return str(self.header["id"])

    @property
    def leaf(self) -> SessionEntry | None:
        """The last entry in file order: Pi's leaf on (re)open (REPORT §8)."""
        return self.entries[-1] if self.entries else None

    @property
    def by_id(self) -> Mapping[str, SessionEntry]:
        return self._by_id

    def get(self, entry_id: str) -> SessionEntry:
        """The entry with ``entry_id``; raises ``SessionError(SESSION_ENTRY_UNKNOWN)``."""
        try:
            return self._by_id[entry_id]
        except KeyError:
            raise SessionError(
                ReasonCode.SESSION_ENTRY_UNKNOWN, f"no entry {entry_id!r} in session {self.id}"
            ) from None

    def children(self, entry_id: str | None) -> tuple[SessionEntry, ...]:
        """Entries whose ``parentId`` is ``entry_id`` (``None``: the roots), file order."""
        return tuple(self._children.get(entry_id, ()))

    def path_to_root(self, entry_id: str | None = None) -> tuple[SessionEntry, ...]:
        """Root first, ending at ``entry_id`` (default: the leaf). Terminates: parents
        are on earlier lines (S4). A parent that is unknown ends the path."""
        if entry_id is None:
            if self.leaf is None:
                return ()
            entry_id = self.leaf.id
        path = [self.get(entry_id)]
        while (parent := path[-1].parent_id) is not None and parent in self._by_id:
            path.append(self._by_id[parent])
        path.reverse()
        return tuple(path)

    def new_entry(
        self,
        entry: Mapping[str, Any],
        *,
        time_ms: int,
        parent_id: str | None | _Leaf = LEAF,
    ) -> SessionEntry:
        """Build (do not write) the next entry line (S2, S7).

        ``entry`` holds ``type`` and the type's fields; missing ``id`` (fresh 8 hex,
        unique here), ``parentId`` (the leaf) and ``timestamp`` (``time_ms``) are filled.
        Keys come out as ``type, id, parentId, timestamp``, then ``entry``'s order.
        Raises ``SessionError`` (SESSION_ENTRY_INVALID / SESSION_ENTRY_UNKNOWN).
        """
        kind = entry.get("type")
        if not isinstance(kind, str) or kind == "session":
            raise SessionError(ReasonCode.SESSION_ENTRY_INVALID, f"bad entry type {kind!r}")
        entry_id = entry.get("id")
        if entry_id is None:
            entry_id = _fresh_entry_id(self._by_id)
        elif not isinstance(entry_id, str) or entry_id in self._by_id:
            raise SessionError(ReasonCode.SESSION_ENTRY_INVALID, f"id {entry_id!r} not new")
        if parent_id is LEAF:
            leaf = self.leaf
            parent_id = entry["parentId"] if "parentId" in entry else leaf and leaf.id
        elif "parentId" in entry and entry["parentId"] != parent_id:
            raise SessionError(ReasonCode.SESSION_ENTRY_INVALID, "two different parentIds")
        if parent_id is not None:
            self.get(parent_id)
        raw = {"type": kind, "id": entry_id, "parentId": parent_id}
        raw["timestamp"] = entry.get("timestamp", iso_timestamp(time_ms))
        raw.update((k, v) for k, v in entry.items() if k not in _FRONT_KEYS)
        try:
            line = encode_entry(raw)
        except (TypeError, ValueError) as exc:
            raise SessionError(ReasonCode.SESSION_ENTRY_INVALID, str(exc)) from exc
        return SessionEntry(
            type=kind,
            id=entry_id,
            parent_id=parent_id,
            timestamp=raw["timestamp"],
            line=self.line_count + 1,
            raw_line=line,
            raw=msgspec.json.decode(line) if _SURROGATE.search(str(raw)) else raw,
        )

    def branch_at(self, entry_id: str, entry: Mapping[str, Any], *, time_ms: int) -> SessionEntry:
        """The entry that branches at ``entry_id``: written, it becomes the leaf (S5)."""
        return self.new_entry(entry, time_ms=time_ms, parent_id=entry_id)

    def with_entry(self, entry: SessionEntry) -> Session:
        """A new view with ``entry`` appended (as built by :meth:`new_entry`)."""
        if entry.line <= self.line_count or entry.id in self._by_id:
            raise SessionError(ReasonCode.SESSION_ENTRY_INVALID, "entry is not the next line")
        return Session(self.header, self.header_line, (*self.entries, entry))

    def to_bytes(self) -> bytes:
        """Header and entries, each LF-terminated, exactly as read (S1)."""
        return b"".join(
            line + b"\n" for line in (self.header_line, *(e.raw_line for e in self.entries))
        )


def _fresh_entry_id(taken: Mapping[str, object]) -> str:
    while (candidate := secrets.token_hex(4)) in taken:
        pass
    return candidate


@dataclass(frozen=True, slots=True)
class SessionReadResult:
    """What :func:`parse_session` found. ``issues`` lists every line that is not a
    clean entry, in file order (S3). ``unterminated`` is true when the last line is a
    complete entry without its LF (S6); ``torn_tail`` is the torn final line, if any."""

    path: str | None
    session: Session
    issues: tuple[SessionIssue, ...]
    size: int
    unterminated: bool
    torn_tail: SessionIssue | None

    def require_clean(self) -> Session:
        """The session, or ``SessionError`` naming the first issue's line:
        SESSION_TORN_TAIL for a torn tail, SESSION_MALFORMED otherwise."""
        if self.issues:
            first = self.issues[0]
            code = ReasonCode.SESSION_MALFORMED
            if first.kind is SessionIssueKind.TORN_TAIL:
                code = ReasonCode.SESSION_TORN_TAIL
            raise SessionError(code, first.message, path=self.path, line=first.line)
        return self.session


def _header_error(message: str, path: str | None) -> SessionError:
    return SessionError(ReasonCode.SESSION_HEADER_INVALID, message, path=path, line=1)


def parse_session(data: bytes, *, path: str | None = None) -> SessionReadResult:
    """Parse a whole session file (pure). Raises ``SessionError(SESSION_HEADER_INVALID)``
    when line 1 is not a version-3 header; every other problem is an issue (S3, S11)."""
    lines = data.split(b"\n")
    unterminated = lines[-1] != b""
    if not unterminated:
        lines.pop()
    if not lines:
        raise _header_error("empty session file", path)
    try:
        header = _decode(lines[0])
    except msgspec.DecodeError:
        raise _header_error("line 1 is not JSON (torn header?)", path) from None
    if not isinstance(header, dict) or header.get("type") != "session":
        raise _header_error("line 1 is not a session header", path)
    if header.get("version") != SESSION_VERSION or not isinstance(header.get("id"), str):
        raise _header_error(f"unsupported header version {header.get('version')!r}", path)
    issues: list[SessionIssue] = []
    entries: list[SessionEntry] = []
    seen: dict[str, SessionEntry] = {}
    torn: SessionIssue | None = None
    offset = len(lines[0]) + 1
    for number, raw_line in enumerate(lines[1:], start=2):

        def issue(
            kind: SessionIssueKind, message: str, at: int = offset, ln: bytes = raw_line
        ) -> None:
            issues.append(
                SessionIssue(kind=kind, line=number, offset=at, message=message, raw_line=ln)
            )

        last = number == len(lines)
        try:
            obj = _decode(raw_line) if raw_line.strip() else None
        except msgspec.DecodeError:
            if last and unterminated:
                issue(SessionIssueKind.TORN_TAIL, "torn final line (no LF, incomplete JSON)")
                torn = issues[-1]
                unterminated = False
            else:
                issue(SessionIssueKind.BAD_JSON, "line is not valid JSON")
            obj = ...
        if obj is None:
            issue(SessionIssueKind.BLANK_LINE, "blank line")
        elif obj is ...:
            pass
        elif not isinstance(obj, dict):
            issue(SessionIssueKind.NOT_AN_OBJECT, "line is not a JSON object")
        elif obj.get("type") == "session":
            issue(SessionIssueKind.REPEATED_HEADER, "a second session header")
        elif not isinstance(obj.get("type"), str) or not isinstance(obj.get("id"), str):
            issue(SessionIssueKind.MISSING_FIELD, "entry lacks a string 'type' or 'id'")
        elif not isinstance(obj.get("parentId", 0), str | None):
            issue(SessionIssueKind.MISSING_FIELD, "entry lacks 'parentId' (string or null)")
        elif obj["id"] in seen:
            issue(
                SessionIssueKind.DUPLICATE_ID,
                f"id {obj['id']!r} repeats line {seen[obj['id']].line}",
            )
        else:
            parent = obj["parentId"]
            if parent is not None and parent not in seen:
                issue(
                    SessionIssueKind.UNKNOWN_PARENT, f"parentId {parent!r} names no earlier entry"
                )
            ts = obj.get("timestamp")
            entry = SessionEntry(
                type=obj["type"],
                id=obj["id"],
                parent_id=parent,
                timestamp=ts if isinstance(ts, str) else None,
                line=number,
                raw_line=raw_line,
                raw=obj,
            )
            seen[entry.id] = entry
            entries.append(entry)
        offset += len(raw_line) + 1
    session = Session(header, lines[0], entries, line_count=len(lines))
    return SessionReadResult(
        path=path,
        session=session,
        issues=tuple(issues),
        size=len(data),
        unterminated=unterminated,
        torn_tail=torn,
    )
