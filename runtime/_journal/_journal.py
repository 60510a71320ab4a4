"""Typed append-only logs: records in, durable sequence numbers out.

A :class:`Journal` is one log file of the state directory (a delivery's log, a
lane's log, the shared admissions log, the result log). Its first record
(sequence 0) is a :class:`~runtime._records.Header`. Appends go through the
:class:`~runtime._journal._writer.WriterPool` and return only once durable.

Reading (:func:`decode_log`) is pure and fails closed: the only thing it
forgives is a torn final frame (see :mod:`runtime._journal._frame`); damage, a sequence
gap, an unknown record tag or a header from a newer schema raise
:class:`~runtime._errors.JournalError` with a stable reason code, the file
(relative to the state directory) and the byte offset.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from .._errors import JournalError, ReasonCode
from .._linux._fs import FileSystem
from .._records import KNOWN_TAGS, SCHEMA_VERSION, Compacted, Header, LogKind, Poison, Record
from ._fence import Fence
from ._frame import Frame, FrameDamage, scan
from ._sync_log import Owed, with_owed
from ._writer import LogTarget, WriterPool

__all__ = ["Journal", "LogContents", "decode_frames", "decode_log", "encode_record", "read_log"]

_ENCODER: Final = msgspec.json.Encoder()
_DECODER: Final = msgspec.json.Decoder(list[Record])
_LOOSE: Final = msgspec.json.Decoder(list[Any])
_POISON_DECODER: Final = msgspec.json.Decoder(Poison)


def encode_record(record: Record) -> bytes:
    return _ENCODER.encode(record)


@dataclass(frozen=True, slots=True)
class LogContents:
    """What a log file holds: every accepted record, by sequence number."""

    rel: str
    records: tuple[Record, ...]
    """``records[seq]``; ``records[0]`` is the header."""
    good_length: int
    torn_bytes: int
    poison: Poison | None = None

    @property
    def header(self) -> Header:
        header = self.records[0]
        assert isinstance(header, Header)
        return header

    @property
    def next_seq(self) -> int:
        return len(self.records)


def slimmed(contents: LogContents, records: Sequence[Record], *, now_ms: int) -> list[Record]:
    """What a slimmed log holds (RT12, RT13): a new header (the log's kind and subject, made
    ``now_ms``), a :class:`Compacted` mark counting what was left out, then ``records``."""
    header = Header(
        schema_version=SCHEMA_VERSION,
        kind=contents.header.kind,
        subject=contents.header.subject,
        created_ms=now_ms,
    )
    kept = [r for r in contents.records[1:] if not isinstance(r, Compacted)]
    mark = Compacted(compacted_ms=now_ms, removed=max(0, len(kept) - len(records)))
    return [header, mark, *records]


def _decode_frame(frame: Frame, rel: str) -> list[Record]:
    try:
        records: list[Record] = _DECODER.decode(frame.body)
    except msgspec.ValidationError as exc:
        raise _classify_invalid(frame, rel, exc) from exc
    except msgspec.DecodeError as exc:
        raise JournalError(
            ReasonCode.JOURNAL_CORRUPT, f"undecodable frame: {exc}", path=rel, offset=frame.offset
        ) from exc
    if len(records) != frame.count:
        raise JournalError(
            ReasonCode.JOURNAL_CORRUPT,
            f"frame announces {frame.count} records but holds {len(records)}",
            path=rel,
            offset=frame.offset,
        )
    return records


def _classify_invalid(frame: Frame, rel: str, exc: msgspec.ValidationError) -> JournalError:
    """Tell an unknown record type from a malformed known one."""
    try:
        items = _LOOSE.decode(frame.body)
    except msgspec.DecodeError:  # pragma: no cover - the typed decode got further
        items = []
    for item in items:
        tag = item.get("type") if isinstance(item, dict) else None
        if tag not in KNOWN_TAGS:
            return JournalError(
                ReasonCode.JOURNAL_UNKNOWN_RECORD,
                f"unknown record type {tag!r}; written by a newer pi-runtime?",
                path=rel,
                offset=frame.offset,
            )
    return JournalError(
        ReasonCode.JOURNAL_CORRUPT, f"invalid record: {exc}", path=rel, offset=frame.offset
    )


def decode_log(
    data: bytes, *, rel: str, kind: LogKind | None = None, poison: Poison | None = None
) -> LogContents:
    """Decode a log's bytes. Pure; raises :class:`JournalError` on any damage.

    With a ``poison`` document only the bytes it vouches for are read, followed by the
    records it carries that were acknowledged through the sync log (J5).
    """
    if poison is not None:
        data = data[: poison.good_length] + poison.owed
    try:
        scanned = scan(data)
    except FrameDamage as exc:
        raise JournalError(exc.code, exc.detail, path=rel, offset=exc.offset) from exc
    records: list[Record] = []
    try:
        for frame in scanned.frames:
            records.extend(_decode_frame(frame, rel))
    except JournalError as exc:
        # what a newer version wrote (a record type, a log kind it added) is refused as
        # newer, not as unknown further on or as damage: its header says so (schema rule 4)
        if scanned.frames and (newer := _newer_version(scanned.frames[0])) is not None:
            raise _version_unsupported(newer, rel) from exc
        raise
    if not records:
        # empty, or only a torn header: the header is the first record and is
        # synced before anything is acknowledged, so nothing was acknowledged
        return LogContents(rel, (), 0, scanned.torn_bytes, poison)
    header = records[0]
    if not isinstance(header, Header):
        raise JournalError(
            ReasonCode.JOURNAL_HEADER_MISSING,
            "the first record is not a header",
            path=rel,
            offset=0,
        )
    if header.schema_version > SCHEMA_VERSION:
        raise _version_unsupported(header.schema_version, rel)
    if kind is not None and header.kind != kind:
        raise JournalError(
            ReasonCode.JOURNAL_CORRUPT,
            f"expected a {kind} log, found a {header.kind} log",
            path=rel,
            offset=0,
        )
    return LogContents(rel, tuple(records), scanned.good_length, scanned.torn_bytes, poison)


def _newer_version(first: Frame) -> int | None:
    """The schema version the header in the log's first frame names, if newer than this
    pi-runtime's; read loosely, since this version may not decode the rest of it."""
    try:
        items = _LOOSE.decode(first.body)
    except msgspec.DecodeError:
        return None
    header = items[0] if first.first_seq == 0 and items else None
    if not isinstance(header, dict) or header.get("type") != "header":
        return None
    version = header.get("schema_version")
    if type(version) is int and version > SCHEMA_VERSION:
        return version
    return None


def _version_unsupported(version: int, rel: str) -> JournalError:
    return JournalError(
        ReasonCode.JOURNAL_VERSION_UNSUPPORTED,
        f"schema version {version} is newer than this pi-runtime's "
        f"{SCHEMA_VERSION}; upgrade pi-runtime to read it",
        path=rel,
        offset=0,
    )


def decode_frames(data: bytes, *, rel: str, first_seq: int, offset: int) -> list[Record]:
    """The records of whole frames that continue a log at record ``first_seq`` (what other
    writers appended to a shared log, read as rows: there is no torn tail, a short final
    frame is damage). ``offset`` is where ``data`` begins in the log (for the errors)."""
    try:
        scanned = scan(data, first_seq=first_seq)
    except FrameDamage as exc:
        raise JournalError(exc.code, exc.detail, path=rel, offset=offset + exc.offset) from exc
    if scanned.torn_bytes:
        raise JournalError(
            ReasonCode.JOURNAL_CORRUPT,
            "a frame is unreadable",
            path=rel,
            offset=offset + scanned.good_length,
        )
    records: list[Record] = []
    for frame in scanned.frames:
        records.extend(_decode_frame(frame, rel))
    return records


def decode_poison(data: bytes, *, path: str, what: str = "poison document") -> Poison:
    """A stored poison record (a file's poison document, a database's poison row);
    ``journal_corrupt`` naming ``path`` if it cannot be read."""
    try:
        return _POISON_DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise JournalError(
            ReasonCode.JOURNAL_CORRUPT, f"unreadable {what}: {exc}", path=path
        ) from exc


def read_poison(fs: FileSystem, path: str) -> Poison | None:
    try:
        data = fs.read(path)
    except FileNotFoundError:
        return None
    return decode_poison(data, path=path)


def read_log(
    fs: FileSystem,
    root: str,
    rel: str,
    *,
    kind: LogKind | None = None,
    owed: Owed | None = None,
) -> LogContents:
    """Read and decode one log (blocking). ``FileNotFoundError`` if missing. ``owed``, the
    sync log as :func:`~runtime._journal._sync_log.read_owed` read it (before this call),
    adds the records it holds for the log that its file does not hold yet (J12): what a
    read-only view of a state directory must pass for its delivery logs."""
    path = os.path.join(root, rel)
    poison = read_poison(fs, path + ".poison")
    data = fs.read(path)
    if owed and poison is None and (entries := owed.get(rel)):
        data = with_owed(data, entries)
    return decode_log(data, rel=rel, kind=kind, poison=poison)


class Journal:
    """An open log: read what it held at open, append durably.

    Obtain one from the :class:`~runtime._journal._store.Store`; do not construct it.
    """

    def __init__(self, pool: WriterPool, target: LogTarget, contents: LogContents) -> None:
        self._pool = pool
        self._target = target
        self.contents = contents
        """The records the log held when it was opened (including the header)."""

    @property
    def rel(self) -> str:
        return self._target.rel

    @property
    def next_seq(self) -> int:
        return self._target.next_seq

    def group_handoffs(self) -> None:
        """Many tasks append here at once (a shared log): gather their hand-offs per
        scheduler pass (:class:`~runtime._journal._writer.LogTarget`'s ``grouped``). Only
        while no append through it is in flight."""
        self._target.grouped = True

    @property
    def poisoned(self) -> bool:
        return self._target.poisoned is not None

    @property
    def unrecorded(self) -> tuple[int, bytes, str] | None:
        """A poison the writer could not record on disk (J15): the file's good length, the
        frame of the records the log owed, and why; ``None`` otherwise."""
        target = self._target
        if target.unrecorded is None:
            return None
        return target.good_length, target.unrecorded, str(target.poisoned)

    async def append(self, record: Record, *, fence: Fence | None = None) -> int:
        """Append ``record``; return its sequence number once it is durable.

        Raises :class:`JournalError` (``journal_poisoned``) if this or an
        earlier append failed, and :class:`~runtime._errors.DiskFailedError`
        when the disk itself failed. The file has one writer (the directory lock's
        holder): a ``fence`` has nothing to check.
        """
        return await self._pool.append(self._target, encode_record(record))

    async def try_append(
        self,
        record: Record,
        *,
        fence: Fence | None = None,
        unless: Callable[[], bool] | None = None,
    ) -> int | None:
        """:meth:`append`: no other writer can take a number first."""
        if unless is not None and unless():
            return None
        return await self.append(record, fence=fence)

    async def refresh(self) -> list[Record]:
        """Nothing: this process is the file's only writer."""
        return []

    async def hold_open(self) -> None:
        """Open the file now and keep it open until :meth:`aclose` (a shared log: its
        appends then never need a file descriptor, L21)."""
        await self._pool.open_target(self._target)

    async def flush(self) -> None:
        """Make the file hold every record acknowledged so far (a delivery's log may owe
        some to it, made durable in the sync log: J12)."""
        await self._pool.flush_target(self._target)

    async def aclose(self) -> None:
        """Close the file once earlier appends are settled. Idempotent."""
        await self._pool.close_target(self._target)
