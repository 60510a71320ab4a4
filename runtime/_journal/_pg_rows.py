"""A log's rows in the PostgreSQL store (``docs/design/postgres-store.md``): the statements
that write and read them, the blocking halves that run those statements on a connection in a
worker thread (:mod:`~runtime._journal._postgres` hands them over), and the rows decoded as
the file store decodes its bytes, so damage fails closed with the same reason codes (J4).
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Callable
from typing import Any, Final

import psycopg
import psycopg.errors

from .._errors import JournalError, ReasonCode
from .._records import LogKind, Poison, Record
from ._fence import Fence
from ._journal import (
    LogContents,
    decode_frames,
    decode_log,
)
from ._pg_connection import (
    Conn,
    Vanished,
)
from ._pg_schema import (
    CHANNEL,
    RELEASED,
    SCHEMA,
)
from ._store import ADMISSIONS, RESULTS

__all__ = [
    "ANNOUNCE",
    "CLAIM",
    "COMPACT_BEGIN",
    "COMPACT_DELETE",
    "COMPACT_END",
    "COMPACT_EXPIRE",
    "COMPACT_FORGET",
    "COMPACT_SLIM",
    "COUNT_FOR_UPDATE",
    "COUNT_WITH",
    "DELETE_DOCUMENTS",
    "DELETE_DOCUMENTS_AND_PARTS",
    "DELETE_LOG",
    "DELETE_LOGS",
    "DOCUMENTS",
    "EXPIRED_AMONG",
    "EXPIRED_SINCE",
    "EXPIRED_TASKS_AMONG",
    "EXPIRE_TASK",
    "FENCE_HOLDS",
    "FORGET_TASK",
    "FORGET_TASKS",
    "GUARD",
    "INSERT_LOG",
    "LANE_LOGS",
    "LEASE",
    "LEASE_WORKTREE",
    "LOG_EXISTS",
    "LOG_NAMES",
    "NEVER",
    "POISON",
    "POISON_FENCED",
    "READ_DOCUMENT",
    "RELEASE",
    "RELEASE_WORKTREE",
    "RENEW",
    "SHARED",
    "SWEEP_DOCUMENTS",
    "WORKTREE_HOLDERS",
    "WORKTREE_LOCK",
    "WRITE_DOCUMENT",
    "WRITE_DOCUMENT_FENCED",
    "Changed",
    "Landed",
    "compaction_generation",
    "decode_rows",
    "decode_runs",
    "decode_shared_rows",
    "decode_tail",
    "fence_params",
    "insert_group",
    "insert_record",
    "like_prefix",
    "read_rows",
    "resolve_group",
    "resolve_record",
]

NEVER: Final = 2**63 - 1
SHARED: Final = (ADMISSIONS, RESULTS)
"""The logs every host appends to (S21), the only ones a compaction leaves holes in."""

_INSERT: Final = f"INSERT INTO {SCHEMA}.log_records (log, seq, frame) VALUES (%s, %s, %s)"
_INSERT_IF_ABSENT: Final = f"""
INSERT INTO {SCHEMA}.log_records (log, seq, frame) VALUES (%s, %s, %s)
ON CONFLICT (log, seq) DO NOTHING RETURNING true"""
"""The resolution of an append whose outcome is unknown. If the old backend is still running
its ``INSERT`` of that row, this one waits for it to end (PostgreSQL's speculative insertion)
and then does nothing if it committed."""
_LEASED: Final = f"FROM {SCHEMA}.lanes WHERE lane = %s AND owner = %s AND epoch = %s FOR SHARE"
"""The fence of a write (S11): the lane's lease row, as this owner holds it at this epoch,
locked for share until the write commits — a claim (an ``UPDATE`` of the row) waits for the
write, or the write, waiting for the claim, finds the epoch changed and writes nothing."""
_INSERT_FENCED: Final = (
    f"INSERT INTO {SCHEMA}.log_records (log, seq, frame) SELECT %s, %s, %s {_LEASED}"
)
_INSERT_FENCED_IF_ABSENT: Final = f"""
INSERT INTO {SCHEMA}.log_records (log, seq, frame) SELECT %s, %s, %s {_LEASED}
ON CONFLICT (log, seq) DO NOTHING RETURNING true"""
_INSERT_MANY: Final = f"""
INSERT INTO {SCHEMA}.log_records (log, seq, frame)
SELECT %s, %s + t.ord - 1, t.frame FROM unnest(%s::bytea[]) WITH ORDINALITY AS t (frame, ord)"""
"""A group of consecutive records in one statement, so one transaction: all or none (S22)."""
_INSERT_MANY_IF_ABSENT: Final = f"""{_INSERT_MANY}
ON CONFLICT (log, seq) DO NOTHING RETURNING seq"""
_UNTIL: Final = (
    f"COALESCE(e.since_ms + (SELECT forget_ms FROM {SCHEMA}.retention), e.forget_after_ms)"
)
"""RT4, RT11, RT13: until when (wall clock ms) the expired row ``e`` holds its id back:
``forget_days`` — the deployment's count, :meth:`PgStore.follow_forget_days` — from its own
time (``since_ms``: a delivery's publication, a task's end). A row an earlier version wrote
(no ``since_ms``), and any row while no host has recorded a count: the forget-after time it
was written with. Every lookup compares it with the asking host's wall clock."""
GUARD: Final = f"""
 WHERE EXISTS (SELECT FROM {SCHEMA}.compaction WHERE generation = %s FOR SHARE)
   AND NOT EXISTS (SELECT FROM {SCHEMA}.expired_deliveries e
                    WHERE e.delivery_id = ANY(%s::text[]) AND {_UNTIL} > %s)"""
"""RT11: admissions are written only while no compaction committed since the writer last
learned the expired deliveries (the generation it names) — the row locked for share until the
write commits, so a compaction (an ``UPDATE`` of the row) waits for the write, or the write,
waiting for the compaction, finds the generation changed and writes nothing — and only when
none of them is an expired delivery held back at the writer's time (those expired before this
host started, which it does not hold in memory, too; RT4: one past its ``forget_days`` is
not): a host can never admit an expired delivery again as new."""
_INSERT_GUARDED: Final = f"{_INSERT_MANY}{GUARD}"
_INSERT_GUARDED_IF_ABSENT: Final = f"""{_INSERT_MANY}{GUARD}
ON CONFLICT (log, seq) DO NOTHING RETURNING seq"""
COMPACT_BEGIN: Final = f"""
UPDATE {SCHEMA}.compaction SET generation = generation + 1
 WHERE EXISTS (SELECT {_LEASED})
RETURNING generation"""
"""A compaction's first statement: the next generation, taken while the compaction's lease
holds (no row comes back when it does not), the row locked until the compaction commits."""
COMPACT_SLIM: Final = f"""
UPDATE {SCHEMA}.log_records AS r SET frame = t.frame
  FROM unnest(%s::bigint[], %s::bytea[]) AS t (seq, frame)
 WHERE r.log = %s AND r.seq = t.seq"""
COMPACT_DELETE: Final = f"""
DELETE FROM {SCHEMA}.log_records WHERE log = %s AND seq = ANY(%s::bigint[]) AND seq > 0"""
COMPACT_EXPIRE: Final = f"""
INSERT INTO {SCHEMA}.expired_deliveries (delivery_id, since_ms, forget_after_ms, generation)
SELECT t.id, t.since, t.since + %s, %s FROM unnest(%s::text[], %s::bigint[]) AS t (id, since)
ON CONFLICT (delivery_id) DO NOTHING"""
"""Each row its own time, and the forget-after time under the writer's ``forget_days`` (what
it is held to while no host has recorded a count: :data:`_UNTIL`)."""
COMPACT_FORGET: Final = f"DELETE FROM {SCHEMA}.expired_deliveries e WHERE {_UNTIL} <= %s"
"""The rows past their days: before the new ones go in, so that an id let go, admitted
again and expired again is recorded afresh."""
COMPACT_END: Final = f"SELECT pg_notify('{CHANNEL}', 'compaction')"
EXPIRED_AMONG: Final = f"""
SELECT e.delivery_id, {_UNTIL} FROM {SCHEMA}.expired_deliveries e
 WHERE e.delivery_id = ANY(%s::text[]) AND {_UNTIL} > %s"""
EXPIRED_SINCE: Final = f"""
SELECT NULL, NULL, generation, (SELECT forget_ms FROM {SCHEMA}.retention)
  FROM {SCHEMA}.compaction
UNION ALL
SELECT e.delivery_id, {_UNTIL}, e.generation, NULL FROM {SCHEMA}.expired_deliveries e
 WHERE e.generation > %s"""
"""The generation and the count now, and every delivery expired after the generation named
(with until when it is held back), in one snapshot."""
COUNT_FOR_UPDATE: Final = f"SELECT forget_ms FROM {SCHEMA}.retention FOR UPDATE"
COUNT_WITH: Final = f"UPDATE {SCHEMA}.retention SET forget_ms = %s"
FENCE_HOLDS: Final = f"SELECT true {_LEASED}"
DELETE_LOG: Final = f"DELETE FROM {SCHEMA}.log_records WHERE log = %s RETURNING seq"
INSERT_LOG: Final = f"""
INSERT INTO {SCHEMA}.log_records (log, seq, frame)
SELECT %s, t.ord - 1, t.frame FROM unnest(%s::bytea[]) WITH ORDINALITY AS t (frame, ord)"""
EXPIRE_TASK: Final = f"""
INSERT INTO {SCHEMA}.expired_tasks (lane_key, task_id, since_ms, forget_after_ms)
VALUES (%s, %s, %s, %s)
ON CONFLICT (lane_key) DO NOTHING"""
EXPIRE_TASK_AGAIN: Final = f"""
UPDATE {SCHEMA}.expired_tasks SET since_ms = %s, forget_after_ms = %s
 WHERE lane_key = %s
   AND (since_ms < %s OR (since_ms IS NULL AND forget_after_ms < %s))"""
"""RT4, RT19: a task expired again under an id whose row an earlier task left held back
(a raised ``forget_days``, a clock set back) counts from its own, later time; a row of this
task's (its time the same or later) is left as it is."""
FORGET_TASK: Final = (
    f"DELETE FROM {SCHEMA}.expired_tasks e WHERE e.lane_key = %s AND {_UNTIL} <= %s"
)
"""One lane's row past its days, before its task is recorded expired again (an id let go,
submitted again, ended and expired once more)."""
FORGET_TASKS: Final = f"DELETE FROM {SCHEMA}.expired_tasks e WHERE {_UNTIL} <= %s"
EXPIRED_TASKS_AMONG: Final = f"""
SELECT e.lane_key, {_UNTIL} FROM {SCHEMA}.expired_tasks e
 WHERE e.lane_key = ANY(%s::text[]) AND {_UNTIL} > %s"""
WORKTREE_LOCK: Final = zlib.crc32(b"pi-runtime task worktrees")
"""The transaction-level advisory lock that serialises worktree leases (S33)."""
WORKTREE_HOLDERS: Final = f"""
SELECT task_id FROM {SCHEMA}.task_worktrees
 WHERE task_id <> %s AND (worktree = ANY(%s::text[]) OR worktree LIKE %s)
 ORDER BY task_id"""
"""The other tasks holding the worktree, a directory around it or one inside it."""
LEASE_WORKTREE: Final = f"""
INSERT INTO {SCHEMA}.task_worktrees (task_id, worktree) VALUES (%s, %s)
ON CONFLICT (task_id) DO UPDATE SET worktree = EXCLUDED.worktree"""
RELEASE_WORKTREE: Final = f"DELETE FROM {SCHEMA}.task_worktrees WHERE task_id = %s"
_FRAMES: Final = f"""
SELECT frame FROM {SCHEMA}.log_records WHERE log = %s AND seq >= %s AND seq < %s ORDER BY seq"""
_FRAME: Final = f"SELECT frame FROM {SCHEMA}.log_records WHERE log = %s AND seq = %s"
"""A statement of its own after :data:`_INSERT_IF_ABSENT`: its snapshot is taken after that
one ended, so it sees a row another backend committed while it waited."""
_KEY: Final = "log_records_pkey"
"""The primary key ``(log, seq)``: a unique violation on it is another writer's record."""
_READ: Final = f"""
WITH poison AS (SELECT good_seq, document FROM {SCHEMA}.log_poison WHERE log = %(log)s)
SELECT NULL::bigint, NULL::bytea, good_seq, document FROM poison
UNION ALL
SELECT seq, frame, NULL, NULL FROM {SCHEMA}.log_records
 WHERE log = %(log)s AND seq < COALESCE((SELECT good_seq FROM poison), {NEVER})
ORDER BY 1 NULLS FIRST"""
"""One statement, so one snapshot: the poison (if any) first, then the rows it vouches for."""
_READ_AFTER: Final = f"""
WITH poison AS (SELECT good_seq, document FROM {SCHEMA}.log_poison WHERE log = %(log)s)
SELECT NULL::bigint, NULL::bytea, good_seq, document FROM poison
UNION ALL
SELECT seq, frame, NULL, NULL FROM {SCHEMA}.log_records
 WHERE log = %(log)s AND seq >= %(after)s
   AND seq < COALESCE((SELECT good_seq FROM poison), {NEVER})
ORDER BY 1 NULLS FIRST"""
""":data:`_READ` from ``after`` on: what other writers appended since (a shared log)."""
POISON: Final = f"""
INSERT INTO {SCHEMA}.log_poison (log, good_seq, reason, document) VALUES (%s, %s, %s, %s)
ON CONFLICT (log) DO NOTHING"""
POISON_FENCED: Final = f"""
INSERT INTO {SCHEMA}.log_poison (log, good_seq, reason, document) SELECT %s, %s, %s, %s {_LEASED}
ON CONFLICT (log) DO NOTHING"""
"""The poison of a log its writer holds under a lease (S11): recorded only while that lease
holds — a new owner's records past the old one's number are acknowledged records, never
bounded by its poison (PG5)."""
WRITE_DOCUMENT: Final = f"""
INSERT INTO {SCHEMA}.documents (name, data) VALUES (%s, %s)
ON CONFLICT (name) DO UPDATE SET data = EXCLUDED.data, updated_at = now()"""
WRITE_DOCUMENT_FENCED: Final = f"""
INSERT INTO {SCHEMA}.documents (name, data) SELECT %s, %s {_LEASED}
ON CONFLICT (name) DO UPDATE SET data = EXCLUDED.data, updated_at = now() RETURNING true"""
CLAIM: Final = f"""
INSERT INTO {SCHEMA}.lanes AS l (lane, owner, epoch, lease_until)
VALUES (%(lane)s, %(owner)s, 1, now() + make_interval(secs => %(ttl)s))
ON CONFLICT (lane) DO UPDATE
   SET owner = EXCLUDED.owner, epoch = l.epoch + 1, lease_until = EXCLUDED.lease_until,
       claimed_at = now()
 WHERE l.lease_until <= now() OR l.owner = EXCLUDED.owner
RETURNING epoch"""
"""S10: a lane nobody holds, whose lease ran out, or that this owner holds is claimed, its
epoch one higher than any before (a row is never deleted, so an epoch is never reused); one
another owner holds is not (no row comes back). Times are the database's (``now()``)."""
RENEW: Final = f"""
UPDATE {SCHEMA}.lanes AS l SET lease_until = now() + make_interval(secs => %(ttl)s)
  FROM unnest(%(lanes)s::text[], %(epochs)s::bigint[]) AS held (lane, epoch)
 WHERE l.lane = held.lane AND l.epoch = held.epoch AND l.owner = %(owner)s
   AND l.lease_until > now()
RETURNING l.lane, l.epoch"""
"""S12: every lease this owner still holds at its epoch, extended, by lane and epoch; an expired
one is not (it is claimed again, under a new epoch)."""
RELEASE: Final = f"""
WITH released AS (
    UPDATE {SCHEMA}.lanes SET lease_until = '-infinity'
     WHERE lane = %s AND owner = %s AND epoch = %s RETURNING lane)
SELECT pg_notify('{CHANNEL}', '{RELEASED}') FROM released"""
"""A lease given up: it runs out now (the row, and so the epoch, stays), announced (S23)."""
LEASE: Final = f"""
SELECT owner, epoch, lease_until > now(),
       CASE WHEN isfinite(lease_until)
            THEN greatest(extract(epoch FROM lease_until - now()), 0) ELSE 0 END,
       CASE WHEN isfinite(lease_until)
            THEN greatest(extract(epoch FROM now() - lease_until), 0) ELSE 'Infinity' END
  FROM {SCHEMA}.lanes WHERE lane = %s"""
"""S10, S32: who holds a lane, whether it runs, for how long yet, and how long it has been out
(a released lease, ``-infinity``, has been out forever: given up, not lost)."""
READ_DOCUMENT: Final = f"SELECT data FROM {SCHEMA}.documents WHERE name = %s"
DOCUMENTS: Final = f"SELECT name, data FROM {SCHEMA}.documents WHERE name LIKE %s ORDER BY name"
ANNOUNCE: Final = f"SELECT pg_notify('{CHANNEL}', 'documents')"
SWEEP_DOCUMENTS: Final = f"""
DELETE FROM {SCHEMA}.documents
 WHERE name LIKE %s AND name <> ALL(%s::text[])
   AND updated_at < now() - make_interval(secs => %s)"""
DELETE_DOCUMENTS: Final = f"DELETE FROM {SCHEMA}.documents WHERE name = ANY(%s::text[])"
DELETE_DOCUMENTS_AND_PARTS: Final = f"""
DELETE FROM {SCHEMA}.documents AS d USING unnest(%s::text[]) AS named (name)
 WHERE d.name = named.name OR starts_with(d.name, named.name || '@')"""
"""A document and its parts (``<name>@…``, a session kept by difference: scale-out.md S36)."""
DELETE_LOGS: Final = f"""
WITH gone AS (DELETE FROM {SCHEMA}.log_records WHERE log = ANY(%s::text[]) RETURNING log, seq),
     poison AS (DELETE FROM {SCHEMA}.log_poison WHERE log = ANY(%s::text[]) RETURNING log)
SELECT count(*) FROM gone WHERE seq = 0
"""
LOG_EXISTS: Final = f"""
SELECT EXISTS (SELECT FROM {SCHEMA}.log_records WHERE log = %(log)s)
    OR EXISTS (SELECT FROM {SCHEMA}.log_poison WHERE log = %(log)s)"""
LANE_LOGS: Final = f"""
SELECT log FROM {SCHEMA}.log_records WHERE seq = 0 AND log LIKE 'lanes/%/lane.log'
UNION
SELECT log FROM {SCHEMA}.log_poison WHERE log LIKE 'lanes/%/lane.log'
ORDER BY 1"""
LOG_NAMES: Final = f"""
SELECT log FROM {SCHEMA}.log_records WHERE seq = 0
UNION
SELECT log FROM {SCHEMA}.log_poison
ORDER BY 1"""
"""Every log has its header row (seq 0) unless its creation was poisoned; ``COLLATE "C"``
orders names as Python's ``sorted`` does."""


# -- the blocking halves ----------------------------------------------------------------------


_Rows = tuple[list[tuple[int, bytes]], bytes | None]
"""A log's rows ``(seq, frame)`` in order, and its poison document if it has one."""


def read_rows(rel: str, *, after: int | None = None) -> Callable[[Conn], _Rows]:
    """The whole log, or its rows from ``after`` on."""

    def read(conn: Conn) -> _Rows:
        if after is None:
            rows = conn.execute(_READ, {"log": rel}, binary=True).fetchall()
        else:
            params = {"log": rel, "after": after}
            rows = conn.execute(_READ_AFTER, params, binary=True).fetchall()
        poison: bytes | None = None
        frames: list[tuple[int, bytes]] = []
        for seq, frame, _good_seq, document in rows:
            if seq is None:
                poison = bytes(document)
            else:
                frames.append((seq, bytes(frame)))
        return frames, poison

    return read


class Landed(enum.Enum):
    """What became of an append."""

    OURS = "ours"
    """Committed: the row holds this record."""
    THEIRS = "theirs"
    """Another writer holds ``(log, seq)``: this record is not in the log."""
    FENCED = "fenced"
    """The fence no longer holds (another owner claimed the lane): nothing was written."""
    REFUSED = "refused"
    """The admission guard refused it (:data:`GUARD`): nothing was written."""


def compaction_generation(conn: Conn) -> int:
    row = conn.execute(f"SELECT generation FROM {SCHEMA}.compaction").fetchone()
    assert row is not None, "migration 4 inserts the row"
    return int(row[0])


def like_prefix(prefix: str) -> str:
    """A ``LIKE`` pattern for the names that start with ``prefix``."""
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def fence_params(fence: Fence | None) -> list[Any]:
    return [] if fence is None else [fence.lane, fence.owner, fence.epoch]


def insert_record(
    rel: str, seq: int, frame: bytes, fence: Fence | None
) -> Callable[[Conn], Landed]:
    """An append's first attempt (a definite answer: nothing of this process was sent
    before), fenced by ``fence`` when one is given (S11)."""

    def insert(conn: Conn) -> Landed:
        try:
            if fence is None:
                conn.execute(_INSERT, [rel, seq, frame])
            elif (
                conn.execute(_INSERT_FENCED, [rel, seq, frame, *fence_params(fence)]).rowcount != 1
            ):
                return Landed.FENCED
        except psycopg.errors.UniqueViolation as exc:
            if exc.diag.constraint_name != _KEY:  # another constraint refused it
                raise
            return Landed.THEIRS
        return Landed.OURS

    return insert


def resolve_record(
    rel: str, seq: int, frame: bytes, fence: Fence | None
) -> Callable[[Conn], Landed]:
    """An append after an attempt whose outcome is unknown: ``OURS`` if the row is there now
    with exactly ``frame`` (inserted by this call, or committed by the earlier attempt),
    ``THEIRS`` if it holds other bytes (another writer's record), ``FENCED`` if it is absent,
    or holds other bytes (the lane's new owner's record), and the fence no longer holds."""

    def resolve(conn: Conn) -> Landed:
        if fence is None:
            inserted = conn.execute(_INSERT_IF_ABSENT, [rel, seq, frame]).fetchone()
        else:
            params = [rel, seq, frame, *fence_params(fence)]
            inserted = conn.execute(_INSERT_FENCED_IF_ABSENT, params).fetchone()
        if inserted is not None:
            return Landed.OURS  # it had not committed: it has now
        row = conn.execute(_FRAME, [rel, seq], binary=True).fetchone()
        if row is None:
            if fence is not None:
                return Landed.FENCED
            raise Vanished(f"record {seq} was neither inserted nor found")
        if bytes(row[0]) == frame:
            return Landed.OURS
        if fence is not None and conn.execute(FENCE_HOLDS, fence_params(fence)).fetchone() is None:
            return Landed.FENCED  # the lane's new owner wrote it (S11), not a rival writer
        return Landed.THEIRS

    return resolve


class Changed(Exception):
    """A log being rewritten (:meth:`PgStore.slim_log`) no longer ends where it was read:
    the transaction is rolled back."""


class _Mixed(Exception):
    """Part of a group was found taken by another writer: the group's transaction is
    rolled back (it is all or none)."""


_Guard = tuple[int, list[str], int]
"""An admission group's guard (:data:`GUARD`): the compaction generation its writer knows,
the delivery ids it admits, and its writer's wall clock (ms) when it decided."""


def insert_group(
    rel: str, seq: int, frames: list[bytes], guard: _Guard | None = None
) -> Callable[[Conn], Landed]:
    """A group's first attempt (unfenced: the admission log, S22); with ``guard``, written
    only while it holds (:data:`GUARD`; ``THEIRS`` if not)."""

    def insert(conn: Conn) -> Landed:
        try:
            if guard is None:
                conn.execute(_INSERT_MANY, [rel, seq, frames])
            elif conn.execute(_INSERT_GUARDED, [rel, seq, frames, *guard]).rowcount == 0:
                return Landed.REFUSED  # a compaction since, or an expired one: decide again
        except psycopg.errors.UniqueViolation as exc:
            if exc.diag.constraint_name != _KEY:
                raise
            return Landed.THEIRS
        return Landed.OURS

    return insert


def resolve_group(
    rel: str, seq: int, frames: list[bytes], guard: _Guard | None = None
) -> Callable[[Conn], Landed]:
    """A group after an attempt whose outcome is unknown. The earlier attempt committed all
    of it or none: ``OURS`` if the rows hold exactly these frames now (inserted here, or by
    that attempt), ``THEIRS`` if another writer holds any of the numbers (nothing of this
    group is then written: a partial insert is rolled back) — or, with ``guard``, when
    nothing is there and the guard refused the insert."""

    def resolve(conn: Conn) -> Landed:
        try:
            with conn.transaction():
                if guard is None:
                    inserted = conn.execute(_INSERT_MANY_IF_ABSENT, [rel, seq, frames]).fetchall()
                else:
                    params = [rel, seq, frames, *guard]
                    inserted = conn.execute(_INSERT_GUARDED_IF_ABSENT, params).fetchall()
                if len(inserted) == len(frames):
                    return Landed.OURS  # it had not committed: it has now
                if inserted:
                    raise _Mixed
        except _Mixed:
            return Landed.THEIRS
        rows = conn.execute(_FRAMES, [rel, seq, seq + len(frames)], binary=True).fetchall()
        if not rows and guard is not None:
            return Landed.REFUSED  # not written, and the guard refused it now: decide again
        if not rows:
            raise Vanished(f"records {seq}…{seq + len(frames) - 1} were neither inserted nor found")
        return Landed.OURS if [bytes(r[0]) for r in rows] == frames else Landed.THEIRS

    return resolve


# -- the rows read back ---------------------------------------------------------------------


def decode_rows(
    rows: list[tuple[int, bytes]], *, rel: str, kind: LogKind | None, poison: Poison | None
) -> LogContents:
    """Decode a log's rows as the file store decodes its file (J4), then check what only a
    row can get wrong: a "torn" final frame (rows are written whole, so it is damage) and a
    row whose ``seq`` is not its record's."""
    data = b"".join(frame for _seq, frame in rows)
    contents = decode_log(data, rel=rel, kind=kind, poison=poison)
    if contents.torn_bytes:
        raise JournalError(
            ReasonCode.JOURNAL_CORRUPT,
            "the last row's frame is unreadable (a row is never torn: this is damage)",
            path=rel,
            offset=contents.good_length,
        )
    if len(contents.records) != len(rows):
        raise JournalError(
            ReasonCode.JOURNAL_CORRUPT, "a row holds more than one record", path=rel, offset=0
        )
    offset = 0
    for index, (seq, frame) in enumerate(rows):  # record ``index`` is in row ``index``
        if seq != index:
            raise JournalError(
                ReasonCode.JOURNAL_CORRUPT,
                f"row {seq} holds record {index}",
                path=rel,
                offset=offset,
            )
        offset += len(frame)
    return contents


def decode_shared_rows(
    rows: list[tuple[int, bytes]], *, rel: str, kind: LogKind | None, poison: Poison | None
) -> tuple[LogContents, list[int]]:
    """A shared log's rows decoded as :func:`decode_rows` decodes a log's, but for the holes
    a compaction leaves (RT11: it deletes finished deliveries' rows, never the header nor the
    last row, so the next number stays where every host expects it): the log's live records
    (``records[0]`` the header; not indexed by number) and the number of each."""
    if not rows or rows[0][0] != 0:
        raise JournalError(
            ReasonCode.JOURNAL_HEADER_MISSING, "the header row (0) is missing", path=rel, offset=0
        )
    head = decode_log(rows[0][1], rel=rel, kind=kind)
    records, numbers = decode_runs(rows[1:], rel=rel, offset=head.good_length)
    good_length = head.good_length + sum(len(frame) for _seq, frame in rows[1:])
    contents = LogContents(rel, (*head.records, *records), good_length, 0, poison)
    return contents, [0, *numbers]


def decode_runs(
    rows: list[tuple[int, bytes]], *, rel: str, offset: int
) -> tuple[list[Record], list[int]]:
    """Rows of a shared log, holes allowed (:func:`decode_shared_rows`), decoded a run of
    consecutive numbers at a time, each as :func:`decode_tail` checks it (every row holds
    the record of its own number, alone): the records and the number of each."""
    records: list[Record] = []
    numbers: list[int] = []
    start = 0
    while start < len(rows):
        end = start + 1
        while end < len(rows) and rows[end][0] == rows[end - 1][0] + 1:
            end += 1
        first = rows[start][0]
        records += decode_tail(rows[start:end], rel=rel, first_seq=first, offset=offset)
        numbers += range(first, first + end - start)
        offset += sum(len(frame) for _seq, frame in rows[start:end])
        start = end
    return records, numbers


def decode_tail(
    rows: list[tuple[int, bytes]], *, rel: str, first_seq: int, offset: int
) -> list[Record]:
    """The records of a log's rows from ``first_seq`` on (:meth:`PgLog.refresh`), checked
    as :func:`decode_rows` checks a whole log; ``offset`` is where the rows begin in the
    log's bytes (for the errors)."""
    data = b"".join(frame for _seq, frame in rows)
    records = decode_frames(data, rel=rel, first_seq=first_seq, offset=offset)
    for index, (seq, _frame) in enumerate(rows):
        if seq != first_seq + index or len(records) != len(rows):
            raise JournalError(
                ReasonCode.JOURNAL_CORRUPT,
                f"row {seq} does not hold record {first_seq + index} alone",
                path=rel,
                offset=offset,
            )
    return records
