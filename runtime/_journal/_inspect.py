"""Read-only views of a state directory, for the command line (``docs/design/operations.md``).

:func:`offline_status` is ``pi-runtime status`` when no server runs; :func:`verify_journal` is
``pi-runtime journal verify``; :func:`delivery_records` is ``pi-runtime journal show``.

Nothing here takes the state directory's lock or writes a byte (O9): the logs are read whole
and decoded by the journal reader, which forgives exactly one thing — a torn final frame, which
is also what a record being appended right now looks like — so these views are safe while a
server runs. Blocking; the command line calls them from its main thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import msgspec

from .._errors import JournalError, PiRuntimeError, ReasonCode, StateDirError
from .._linux._fs import OsFileSystem
from .._linux._proc import is_alive
from .._records import (
    Admission,
    AttachmentRef,
    Compacted,
    LogKind,
    Record,
    Result,
    ResultAcked,
    ResultPublished,
    Settled,
    ToolOutcome,
)
from .._wire import DeliveryResult
from ._attachments import AttachmentStore, attachment_root
from ._expired import EXPIRED, read_expired
from ._journal import LogContents, read_log
from ._store import ADMISSIONS, RESULTS, _read_owner, delivery_key, lane_key
from ._sync_log import SYNC_DIR, read_owed

if TYPE_CHECKING:
    from ._postgres import PgStore

__all__ = [
    "RECENT_RESULTS",
    "Finding",
    "database_status",
    "delivery_records",
    "delivery_records_in_database",
    "offline_status",
    "pg_reader",
    "verify_database",
    "verify_journal",
]

RECENT_RESULTS: Final = 10


def offline_status(state_dir: Path, *, recent: int = RECENT_RESULTS) -> dict[str, Any]:
    """What the state directory says, read without the lock and without writing (O9):
    pending deliveries (admitted, no published result), each room's state and the most
    recent results. Raises :class:`JournalError` when a shared log is damaged and
    :class:`StateDirError` when ``state_dir`` is not a state directory."""
    root = state_dir.absolute()
    if not (root / ADMISSIONS).exists() and not (root / RESULTS).exists():
        raise StateDirError(
            ReasonCode.STATE_DIR_INVALID,
            f"{root} is not a state directory (no {ADMISSIONS}); check --state-dir",
        )
    admissions = _read_shared(root, ADMISSIONS, LogKind.ADMISSIONS)
    results = _read_shared(root, RESULTS, LogKind.RESULTS)
    owner = _read_owner(root)
    running = owner is not None and is_alive(owner.identity)
    server = {"running": running, "pid": owner.pid if running and owner else None}
    return {"source": "state_dir", "server": server} | _summary(admissions, results, recent)


async def database_status(dsn: str, *, recent: int = RECENT_RESULTS) -> dict[str, Any]:
    """:func:`offline_status` of the PostgreSQL store ``dsn`` names (scale-out.md): the
    deployment's pending deliveries, rooms and recent results, and which host holds each
    room's lane (its lease: owner, epoch, whether it still runs)."""
    async with pg_reader(dsn) as store:
        summary = _summary(
            store.admissions.contents.records, store.results.contents.records, recent
        )
        for room in summary["rooms"]:
            lease = await store.lease(str(room["room"]))
            room["holder"] = (
                None
                if lease is None
                else {"host": lease.fence.owner, "epoch": lease.fence.epoch, "live": lease.live}
            )
    return {"source": "database"} | summary


def _summary(
    admissions: Sequence[Record], results: Sequence[Record], recent: int
) -> dict[str, Any]:
    """Pending deliveries (admitted, no published result), each room's state, the most
    recent results: what the shared logs say."""
    published: dict[str, ResultPublished] = {}
    acked = 0
    for record in results:
        if isinstance(record, ResultPublished):
            published.setdefault(record.delivery_id, record)
        elif isinstance(record, ResultAcked):
            acked = max(acked, record.seq)
    ordered = sorted(published.values(), key=lambda r: r.seq)
    rooms: dict[str, dict[str, Any]] = {}
    pending: list[dict[str, Any]] = []
    for record in admissions:
        if not isinstance(record, Admission):
            continue
        room = str(record.request.get("room", "?"))
        entry = rooms.setdefault(
            room,
            {
                "room": room,
                "state": "idle",
                "queued": 0,
                "live_worker": False,
                "last_result_seq": 0,
            },
        )
        if record.delivery_id not in published:
            entry["queued"] += 1
            entry["state"] = "pending"
            pending.append(
                {"delivery_id": record.delivery_id, "room": room, "admitted_ms": record.admitted_ms}
            )
    for result in ordered:
        entry = rooms.setdefault(
            result.room,
            {"room": result.room, "state": "idle", "queued": 0, "live_worker": False},
        )
        entry["last_result_seq"] = result.seq
    return {
        "pending": len(pending),
        "pending_deliveries": pending,
        "rooms": sorted(rooms.values(), key=lambda r: str(r["room"])),
        "last_seq": ordered[-1].seq if ordered else 0,
        "acked_seq": acked,
        "recent_results": [_result(r, acked) for r in ordered[-recent:]] if recent > 0 else [],
    }


def _result(record: ResultPublished, acked: int) -> dict[str, Any]:
    """A published result as the wire's ``result`` frame carries it, plus ``acked``."""
    result: dict[str, Any] = msgspec.structs.asdict(DeliveryResult.of(record))
    return result | {"outcome": str(record.outcome), "acked": record.seq <= acked}


def _read_shared(root: Path, rel: str, kind: LogKind) -> tuple[Record, ...]:
    try:
        return read_log(OsFileSystem(), str(root), rel, kind=kind).records
    except FileNotFoundError:
        return ()


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing ``journal verify`` found in a log: a ``problem`` fails the check, a note
    (torn tail, poisoned, no record yet) does not."""

    rel: str
    message: str
    problem: bool
    code: str | None = None


def _logs(root: Path) -> list[tuple[str, LogKind]]:
    """Every log of the state directory, relative, with the kind its place implies."""
    found = [(ADMISSIONS, LogKind.ADMISSIONS), (RESULTS, LogKind.RESULTS)]
    deliveries = root / "deliveries"
    if deliveries.is_dir():
        found += [
            (f"deliveries/{p.name}", LogKind.DELIVERY)
            for p in sorted(deliveries.iterdir())
            if p.name.endswith(".log")
        ]
    lanes = root / "lanes"
    if lanes.is_dir():
        found += [
            (f"lanes/{p.name}/lane.log", LogKind.LANE)
            for p in sorted(lanes.iterdir())
            if (p / "lane.log").exists()
        ]
    return found


def verify_journal(state_dir: Path, attachments: Path | None = None) -> tuple[int, list[Finding]]:
    """Check every log (O10) and the attachments they name (A10, in ``attachments``, the
    attachment root; default: the state directory's): ``(logs checked, findings)``.
    Read-only, no lock."""
    root = state_dir.absolute()
    if not (root / ADMISSIONS).exists():
        raise StateDirError(
            ReasonCode.STATE_DIR_INVALID,
            f"{root} is not a state directory (no {ADMISSIONS}); check --state-dir",
        )
    findings: list[Finding] = []
    try:  # before the logs: a record leaves the sync log only once it is in its file (J17)
        owed = read_owed(OsFileSystem(), str(root))
    except JournalError as error:
        owed = {}
        findings.append(
            Finding(error.path or SYNC_DIR, error.message, problem=True, code=str(error.code))
        )
    if owed:
        count = sum(len(records) for entries in owed.values() for _, records in entries)
        message = (
            f"{count} records of {len(owed)} delivery logs are durable in the sync log, not "
            "yet in their files (read from there; written to the files soon, or at the next "
            "start)"
        )
        findings.append(Finding(SYNC_DIR, message, problem=False))
    logs = _logs(root)
    named: dict[str, tuple[AttachmentRef, str]] = {}
    for rel, kind in logs:
        try:
            contents = read_log(OsFileSystem(), str(root), rel, kind=kind, owed=owed)
        except FileNotFoundError:
            findings.append(Finding(rel, "missing", problem=True))
            continue
        except JournalError as error:
            findings.append(Finding(rel, error.message, problem=True, code=str(error.code)))
            continue
        findings += _check_contents(rel, kind, contents)
        for ref, where in _named_attachments(rel, contents.records):
            named.setdefault(ref.sha256, (ref, where))
    store = AttachmentStore(attachments or attachment_root(root))
    findings += _check_attachments(store, named)
    try:  # RT4: a damaged filter would let an expired delivery run again as new
        read_expired(OsFileSystem(), str(root / EXPIRED))
    except JournalError as error:
        findings.append(Finding(EXPIRED, error.message, problem=True, code=str(error.code)))
    return len(logs), findings


def _named_attachments(
    rel: str, records: tuple[Record, ...]
) -> Iterator[tuple[AttachmentRef, str]]:
    """The attachments a log needs (A10): those of its published results, and those of the
    outcomes of a delivery not finished yet (its result will name them). A finished
    delivery needs what its result names (published or about to be), and no other."""
    result = next((r for r in records if isinstance(r, Result)), None)
    if result is not None:
        yield from ((ref, f"the result in {rel}") for ref in result.attachments)
        return
    for record in records:
        if isinstance(record, ResultPublished):
            yield from ((ref, f"the result of seq {record.seq}") for ref in record.attachments)
        elif isinstance(record, ToolOutcome):
            yield from ((ref, f"an outcome in {rel}") for ref in record.attachments)


def _check_attachments(
    store: AttachmentStore, named: dict[str, tuple[AttachmentRef, str]]
) -> list[Finding]:
    found: list[Finding] = []
    for sha256, (ref, where) in sorted(named.items()):
        problem = store.check(sha256, ref.size)
        if problem is not None:
            message = f"{ref.name} ({ref.size} bytes), named by {where}, is not there intact"
            found.append(Finding(f"attachments/{sha256}", message, problem=True, code=str(problem)))
    for sha256 in store.names():
        if sha256 not in named:
            message = "no record names it (an orphan; removed at the next start)"
            found.append(Finding(f"attachments/{sha256}", message, problem=False))
    return found


async def verify_database(dsn: str) -> tuple[int, list[Finding]]:
    """:func:`verify_journal` of the PostgreSQL store ``dsn`` names (scale-out.md): every
    log in the database read and checked as a file's is. Opening the store reads the shared
    logs (their damage raises :class:`JournalError`); nothing else is written."""
    async with pg_reader(dsn) as store:
        names = await store.log_names()
        findings: list[Finding] = []
        for rel in names:
            kind = _kind_of(rel)
            try:
                contents = await store.read(rel, kind)
            except JournalError as error:
                findings.append(Finding(rel, error.message, problem=True, code=str(error.code)))
                continue
            findings += _check_contents(rel, kind, contents, compacted=store.generation > 0)
    return len(names), findings


async def delivery_records_in_database(
    dsn: str, delivery_id: str
) -> tuple[list[Record], str | None]:
    """:func:`delivery_records` from the PostgreSQL store ``dsn`` names."""
    async with pg_reader(dsn) as store:
        contents = None
        if await store.exists(store.delivery_rel(delivery_id)):
            contents = await store.read_delivery_log(delivery_id)
        admissions = store.admissions.contents.records
        results = store.results.contents.records
        expired = bool(await store.expired_among([delivery_id]))  # RT11
    return _records_of(contents, admissions, results, delivery_id, "the database", expired=expired)


def _kind_of(rel: str) -> LogKind:
    if rel == ADMISSIONS:
        return LogKind.ADMISSIONS
    if rel == RESULTS:
        return LogKind.RESULTS
    return LogKind.LANE if rel.startswith("lanes/") else LogKind.DELIVERY


def pg_reader(dsn: str) -> AbstractAsyncContextManager[PgStore]:
    """The PostgreSQL store ``dsn`` names, opened to read (no lease, no lock, no write)."""
    from ._postgres import open_pg_reader  # the optional extra, only here

    return open_pg_reader(dsn)


def _check_contents(
    rel: str, kind: LogKind, contents: LogContents, *, compacted: bool = False
) -> list[Finding]:
    """What is wrong with a log's contents; ``compacted``: a shared store's result log that
    a compaction left holes in (RT11: the seqs must only increase)."""
    found: list[Finding] = []
    if contents.torn_bytes:
        found.append(
            Finding(
                rel,
                f"torn tail of {contents.torn_bytes} bytes after offset {contents.good_length} "
                "(never acknowledged: a write a crash cut, or a delivery log's zeros allocated "
                "ahead of its next frame, J19; cut off when the log is next opened)",
                problem=False,
            )
        )
    if contents.poison is not None:
        found.append(
            Finding(
                rel,
                f"poisoned ({contents.poison.reason}); read up to offset "
                f"{contents.poison.good_length}, never replayed",
                problem=False,
                code=str(ReasonCode.JOURNAL_POISONED),
            )
        )
    if not contents.records:
        found.append(Finding(rel, "holds no acknowledged record yet", problem=False))
        return found
    subject = contents.header.subject
    expected = {
        LogKind.DELIVERY: f"deliveries/{delivery_key(subject)}.log",
        LogKind.LANE: f"lanes/{lane_key(subject)}/lane.log",
    }.get(kind, rel)
    if expected != rel:
        found.append(
            Finding(
                rel,
                f"its header names {subject!r}, whose log is {expected}",
                problem=True,
                code=str(ReasonCode.JOURNAL_CORRUPT),
            )
        )
    if kind is LogKind.RESULTS:
        seqs = [r.seq for r in contents.records if isinstance(r, ResultPublished)]
        mark = contents.records[1] if len(contents.records) > 1 else None
        if isinstance(mark, Compacted):  # RT6: what a compaction kept, in order, gaps allowed
            bad = any(b <= a for a, b in itertools.pairwise([0, *seqs])) or (
                seqs[-1] < mark.last_seq if seqs else False
            )
            shape = "increasing, and through the last seq before the compaction"
        elif compacted:  # RT11: rows deleted in place; the last one never is
            bad = any(b <= a for a, b in itertools.pairwise([0, *seqs]))
            shape = "increasing"
        else:
            bad, shape = seqs != list(range(1, len(seqs) + 1)), "1, 2, 3, …"
        if bad:
            found.append(
                Finding(
                    rel,
                    f"result seqs are not {shape}",
                    problem=True,
                    code=str(ReasonCode.JOURNAL_SEQUENCE_GAP),
                )
            )
    return found


def delivery_records(state_dir: Path, delivery_id: str) -> tuple[list[Record], str | None]:
    """A delivery's records in order, and a note when they do not come from its own log
    (its turn never started: its admission and result from the shared logs)."""
    root = state_dir.absolute()
    rel = f"deliveries/{delivery_key(delivery_id)}.log"
    owed = read_owed(OsFileSystem(), str(root))  # first (J17)
    try:
        contents = read_log(OsFileSystem(), str(root), rel, kind=LogKind.DELIVERY, owed=owed)
    except FileNotFoundError:
        contents = None
    admissions = _read_shared(root, ADMISSIONS, LogKind.ADMISSIONS)
    results = _read_shared(root, RESULTS, LogKind.RESULTS)
    expired = read_expired(OsFileSystem(), str(root / EXPIRED))
    gone = bool(expired) and delivery_key(delivery_id) in expired
    return _records_of(contents, admissions, results, delivery_id, str(root), expired=gone)


def _records_of(
    contents: LogContents | None,
    admissions: Sequence[Record],
    results: Sequence[Record],
    delivery_id: str,
    where: str,
    *,
    expired: bool = False,
) -> tuple[list[Record], str | None]:
    if contents is not None and contents.records:
        note = None
        if contents.poison is not None:
            note = f"the log was poisoned ({contents.poison.reason})"
        return list(contents.records), note
    found: list[Record] = [
        r for r in admissions if isinstance(r, Admission | Settled) and r.delivery_id == delivery_id
    ]
    if not found:
        if expired:
            raise PiRuntimeError(
                ReasonCode.DELIVERY_EXPIRED,
                f"delivery {delivery_id!r} finished longer ago than [retention] "
                f"idempotency_days; retention removed its records from {where}",
            )
        raise PiRuntimeError(ReasonCode.DELIVERY_UNKNOWN, f"no delivery {delivery_id!r} in {where}")
    found += [r for r in results if isinstance(r, ResultPublished) and r.delivery_id == delivery_id]
    return found, f"no log of its own (its turn never started); from {ADMISSIONS} and {RESULTS}"
