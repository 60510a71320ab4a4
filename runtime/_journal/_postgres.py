"""The PostgreSQL journal store: the logs and documents of one host in a database.

The second implementation of :class:`~runtime._journal._interface.JournalStore`
(``docs/design/postgres-store.md``). A log keeps its name (``rel``: exactly the file store's
names, :meth:`Store.delivery_rel`, :meth:`Store.lane_rel`, ``admissions/admissions.log``,
``results.log``) and each record is one row ``(log, seq, frame)`` whose ``frame`` is the file
store's frame of that one record (:func:`~runtime._journal._frame.encode_frame`). Reading a
log concatenates its frames in ``seq`` order and decodes them with the file store's
:func:`~runtime._journal._journal.decode_log`, so damage, sequence gaps, unknown records and
newer schemas fail closed with the same reason codes; since a row is written whole or not at
all, a "torn tail" there is damage too (``journal_corrupt``).

Durable means committed: an append is one ``INSERT`` in its own transaction and returns only
once the server answered its ``COMMIT`` (J1); unfenced appends to a shared log made at once (the
admissions of many clients) are written as one group, one statement (S22). When the connection
breaks around an append (a database restart, a failover, a proxy cutting an idle connection),
its outcome is unknown, and it is resolved, not guessed: the store reconnects under its
:data:`DEFAULT_RETRY` backoff and looks on the new connection — the row ``(log, seq)`` holds exactly
this record's frame (it committed: acknowledged), or it is absent (inserted again; the frame is
deterministic, so that is idempotent). Only when the policy's bound is spent is the log
poisoned, in this process only, and :attr:`PgStore.disk_failure` set (``store_unavailable``):
the host stops admitting; no poison is written for it — a row is atomic, so what a later
reader finds is exactly what committed. A definite refusal by the server (a trigger raising, a
constraint other than the key, permissions) poisons the log in this process and, in a
separate transaction, in the database (J5). An append whose ``(log, seq)`` another writer took
first (with other bytes) is refused ``journal_conflict`` and the log takes no more appends from
this process (nothing is recorded: the other writer's log is sound).

psycopg 3 is blocking; every call runs in a worker thread (``trio.to_thread``), one thread at
a time per connection (each has its own :class:`trio.CapacityLimiter`). Connections: one for
the shared logs (admissions, results), a few more for the other logs, reads and documents,
chosen by the log's name; a broken one is replaced on its next use. A thread, once started,
is waited for (never abandoned): an append handed over always reports its fate to its caller
(once sent, its resolution is shielded from cancellation, bounded by the policy), and no
connection is closed under a running call.

The DSN may hold a password: no error, log line, record or file holds it. Every message
that names the database uses :func:`redact_dsn`; the server's own error texts are scrubbed
of the password too.
"""

from __future__ import annotations

import contextlib
import enum
import os
import secrets
import shutil
import socket
import tempfile
import zlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Final, NoReturn, TypeVar

import psycopg
import psycopg.errors
import trio

from .._clock import Backoff, Clocks
from .._errors import DiskFailedError, JournalError, ReasonCode
from .._records import SCHEMA_VERSION, Admission, Header, LogKind, Poison, Record
from ._fence import Fence, Lease
from ._frame import encode_frame
from ._interface import JournalStore, LeaseStore, Log, SharedRows
from ._journal import (
    LogContents,
    decode_frames,
    decode_log,
    decode_poison,
    encode_record,
    slimmed,
)
from ._pg_connection import (
    DEFAULT_RETRY,
    Broken,
    Closed,
    Conn,
    Connection,
    RolledBack,
    Unreachable,
    Unsettled,
    Vanished,
    connect,
    describe,
    parse_dsn,
    redact_dsn,
    server_reason,
)
from ._pg_schema import (
    CHANNEL,
    RELEASED,
    SCHEMA,
    STORE_SCHEMA_VERSION,
    migrate,
    newer_schema,
    schema_version,
)
from ._store import ADMISSIONS, RESULTS, Store, _prepare_root, lane_key

__all__ = [
    "DEFAULT_RETRY",
    "STORE_SCHEMA_VERSION",
    "PgLog",
    "PgStore",
    "migrate",
    "open_pg_reader",
    "open_pg_store",
    "redact_dsn",
]

_T = TypeVar("_T")

_NEVER: Final = 2**63 - 1
_SHARED: Final = (ADMISSIONS, RESULTS)
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
_GUARD: Final = f"""
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
_INSERT_GUARDED: Final = f"{_INSERT_MANY}{_GUARD}"
_INSERT_GUARDED_IF_ABSENT: Final = f"""{_INSERT_MANY}{_GUARD}
ON CONFLICT (log, seq) DO NOTHING RETURNING seq"""
_COMPACT_BEGIN: Final = f"""
UPDATE {SCHEMA}.compaction SET generation = generation + 1
 WHERE EXISTS (SELECT {_LEASED})
RETURNING generation"""
"""A compaction's first statement: the next generation, taken while the compaction's lease
holds (no row comes back when it does not), the row locked until the compaction commits."""
_COMPACT_SLIM: Final = f"""
UPDATE {SCHEMA}.log_records AS r SET frame = t.frame
  FROM unnest(%s::bigint[], %s::bytea[]) AS t (seq, frame)
 WHERE r.log = %s AND r.seq = t.seq"""
_COMPACT_DELETE: Final = f"""
DELETE FROM {SCHEMA}.log_records WHERE log = %s AND seq = ANY(%s::bigint[]) AND seq > 0"""
_COMPACT_EXPIRE: Final = f"""
INSERT INTO {SCHEMA}.expired_deliveries (delivery_id, since_ms, forget_after_ms, generation)
SELECT t.id, t.since, t.since + %s, %s FROM unnest(%s::text[], %s::bigint[]) AS t (id, since)
ON CONFLICT (delivery_id) DO NOTHING"""
"""Each row its own time, and the forget-after time under the writer's ``forget_days`` (what
it is held to while no host has recorded a count: :data:`_UNTIL`)."""
_COMPACT_FORGET: Final = f"DELETE FROM {SCHEMA}.expired_deliveries e WHERE {_UNTIL} <= %s"
"""The rows past their days: before the new ones go in, so that an id let go, admitted
again and expired again is recorded afresh."""
_COMPACT_END: Final = f"SELECT pg_notify('{CHANNEL}', 'compaction')"
_EXPIRED_AMONG: Final = f"""
SELECT e.delivery_id, {_UNTIL} FROM {SCHEMA}.expired_deliveries e
 WHERE e.delivery_id = ANY(%s::text[]) AND {_UNTIL} > %s"""
_EXPIRED_SINCE: Final = f"""
SELECT NULL, NULL, generation, (SELECT forget_ms FROM {SCHEMA}.retention)
  FROM {SCHEMA}.compaction
UNION ALL
SELECT e.delivery_id, {_UNTIL}, e.generation, NULL FROM {SCHEMA}.expired_deliveries e
 WHERE e.generation > %s"""
"""The generation and the count now, and every delivery expired after the generation named
(with until when it is held back), in one snapshot."""
_COUNT_FOR_UPDATE: Final = f"SELECT forget_ms FROM {SCHEMA}.retention FOR UPDATE"
_COUNT_WITH: Final = f"UPDATE {SCHEMA}.retention SET forget_ms = %s"
_FENCE_HOLDS: Final = f"SELECT true {_LEASED}"
_DELETE_LOG: Final = f"DELETE FROM {SCHEMA}.log_records WHERE log = %s RETURNING seq"
_INSERT_LOG: Final = f"""
INSERT INTO {SCHEMA}.log_records (log, seq, frame)
SELECT %s, t.ord - 1, t.frame FROM unnest(%s::bytea[]) WITH ORDINALITY AS t (frame, ord)"""
_EXPIRE_TASK: Final = f"""
INSERT INTO {SCHEMA}.expired_tasks (lane_key, task_id, since_ms, forget_after_ms)
VALUES (%s, %s, %s, %s)
ON CONFLICT (lane_key) DO NOTHING"""
_FORGET_TASK: Final = (
    f"DELETE FROM {SCHEMA}.expired_tasks e WHERE e.lane_key = %s AND {_UNTIL} <= %s"
)
"""One lane's row past its days, before its task is recorded expired again (an id let go,
submitted again, ended and expired once more)."""
_FORGET_TASKS: Final = f"DELETE FROM {SCHEMA}.expired_tasks e WHERE {_UNTIL} <= %s"
_EXPIRED_TASKS_AMONG: Final = f"""
SELECT e.lane_key, {_UNTIL} FROM {SCHEMA}.expired_tasks e
 WHERE e.lane_key = ANY(%s::text[]) AND {_UNTIL} > %s"""
_WORKTREE_LOCK: Final = zlib.crc32(b"pi-runtime task worktrees")
"""The transaction-level advisory lock that serialises worktree leases (S33)."""
_WORKTREE_HOLDERS: Final = f"""
SELECT task_id FROM {SCHEMA}.task_worktrees
 WHERE task_id <> %s AND (worktree = ANY(%s::text[]) OR worktree LIKE %s)
 ORDER BY task_id"""
"""The other tasks holding the worktree, a directory around it or one inside it."""
_LEASE_WORKTREE: Final = f"""
INSERT INTO {SCHEMA}.task_worktrees (task_id, worktree) VALUES (%s, %s)
ON CONFLICT (task_id) DO UPDATE SET worktree = EXCLUDED.worktree"""
_RELEASE_WORKTREE: Final = f"DELETE FROM {SCHEMA}.task_worktrees WHERE task_id = %s"
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
 WHERE log = %(log)s AND seq < COALESCE((SELECT good_seq FROM poison), {_NEVER})
ORDER BY 1 NULLS FIRST"""
"""One statement, so one snapshot: the poison (if any) first, then the rows it vouches for."""
_READ_AFTER: Final = f"""
WITH poison AS (SELECT good_seq, document FROM {SCHEMA}.log_poison WHERE log = %(log)s)
SELECT NULL::bigint, NULL::bytea, good_seq, document FROM poison
UNION ALL
SELECT seq, frame, NULL, NULL FROM {SCHEMA}.log_records
 WHERE log = %(log)s AND seq >= %(after)s
   AND seq < COALESCE((SELECT good_seq FROM poison), {_NEVER})
ORDER BY 1 NULLS FIRST"""
""":data:`_READ` from ``after`` on: what other writers appended since (a shared log)."""
_POISON: Final = f"""
INSERT INTO {SCHEMA}.log_poison (log, good_seq, reason, document) VALUES (%s, %s, %s, %s)
ON CONFLICT (log) DO NOTHING"""
_POISON_FENCED: Final = f"""
INSERT INTO {SCHEMA}.log_poison (log, good_seq, reason, document) SELECT %s, %s, %s, %s {_LEASED}
ON CONFLICT (log) DO NOTHING"""
"""The poison of a log its writer holds under a lease (S11): recorded only while that lease
holds — a new owner's records past the old one's number are acknowledged records, never
bounded by its poison (PG5)."""
_WRITE_DOCUMENT: Final = f"""
INSERT INTO {SCHEMA}.documents (name, data) VALUES (%s, %s)
ON CONFLICT (name) DO UPDATE SET data = EXCLUDED.data, updated_at = now()"""
_WRITE_DOCUMENT_FENCED: Final = f"""
INSERT INTO {SCHEMA}.documents (name, data) SELECT %s, %s {_LEASED}
ON CONFLICT (name) DO UPDATE SET data = EXCLUDED.data, updated_at = now() RETURNING true"""
_CLAIM: Final = f"""
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
_RENEW: Final = f"""
UPDATE {SCHEMA}.lanes AS l SET lease_until = now() + make_interval(secs => %(ttl)s)
  FROM unnest(%(lanes)s::text[], %(epochs)s::bigint[]) AS held (lane, epoch)
 WHERE l.lane = held.lane AND l.epoch = held.epoch AND l.owner = %(owner)s
   AND l.lease_until > now()
RETURNING l.lane"""
"""S12: every lease this owner still holds at its epoch, extended; an expired one is not
(it is claimed again, under a new epoch)."""
_RELEASE: Final = f"""
WITH released AS (
    UPDATE {SCHEMA}.lanes SET lease_until = '-infinity'
     WHERE lane = %s AND owner = %s AND epoch = %s RETURNING lane)
SELECT pg_notify('{CHANNEL}', '{RELEASED}') FROM released"""
"""A lease given up: it runs out now (the row, and so the epoch, stays), announced (S23)."""
_LEASE: Final = f"""
SELECT owner, epoch, lease_until > now(),
       CASE WHEN isfinite(lease_until)
            THEN greatest(extract(epoch FROM lease_until - now()), 0) ELSE 0 END,
       CASE WHEN isfinite(lease_until)
            THEN greatest(extract(epoch FROM now() - lease_until), 0) ELSE 'Infinity' END
  FROM {SCHEMA}.lanes WHERE lane = %s"""
"""S10, S32: who holds a lane, whether it runs, for how long yet, and how long it has been out
(a released lease, ``-infinity``, has been out forever: given up, not lost)."""
_READ_DOCUMENT: Final = f"SELECT data FROM {SCHEMA}.documents WHERE name = %s"
_DOCUMENTS: Final = f"SELECT name, data FROM {SCHEMA}.documents WHERE name LIKE %s ORDER BY name"
_ANNOUNCE: Final = f"SELECT pg_notify('{CHANNEL}', 'documents')"
_SWEEP_DOCUMENTS: Final = f"""
DELETE FROM {SCHEMA}.documents
 WHERE name LIKE %s AND name <> ALL(%s::text[])
   AND updated_at < now() - make_interval(secs => %s)"""
_DELETE_DOCUMENTS: Final = f"DELETE FROM {SCHEMA}.documents WHERE name = ANY(%s::text[])"
_DELETE_DOCUMENTS_AND_PARTS: Final = f"""
DELETE FROM {SCHEMA}.documents AS d USING unnest(%s::text[]) AS named (name)
 WHERE d.name = named.name OR starts_with(d.name, named.name || '@')"""
"""A document and its parts (``<name>@…``, a session kept by difference: scale-out.md S36)."""
_DELETE_LOGS: Final = f"""
WITH gone AS (DELETE FROM {SCHEMA}.log_records WHERE log = ANY(%s::text[]) RETURNING log, seq),
     poison AS (DELETE FROM {SCHEMA}.log_poison WHERE log = ANY(%s::text[]) RETURNING log)
SELECT count(*) FROM gone WHERE seq = 0
"""
_EXISTS: Final = f"""
SELECT EXISTS (SELECT FROM {SCHEMA}.log_records WHERE log = %(log)s)
    OR EXISTS (SELECT FROM {SCHEMA}.log_poison WHERE log = %(log)s)"""
_LANE_LOGS: Final = f"""
SELECT log FROM {SCHEMA}.log_records WHERE seq = 0 AND log LIKE 'lanes/%/lane.log'
UNION
SELECT log FROM {SCHEMA}.log_poison WHERE log LIKE 'lanes/%/lane.log'
ORDER BY 1"""
_LOG_NAMES: Final = f"""
SELECT log FROM {SCHEMA}.log_records WHERE seq = 0
UNION
SELECT log FROM {SCHEMA}.log_poison
ORDER BY 1"""
"""Every log has its header row (seq 0) unless its creation was poisoned; ``COLLATE "C"``
orders names as Python's ``sorted`` does."""


# -- the blocking halves ----------------------------------------------------------------------


_Rows = tuple[list[tuple[int, bytes]], bytes | None]
"""A log's rows ``(seq, frame)`` in order, and its poison document if it has one."""


def _read_rows(rel: str, *, after: int | None = None) -> Callable[[Conn], _Rows]:
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


class _Landed(enum.Enum):
    """What became of an append."""

    OURS = "ours"
    """Committed: the row holds this record."""
    THEIRS = "theirs"
    """Another writer holds ``(log, seq)``: this record is not in the log."""
    FENCED = "fenced"
    """The fence no longer holds (another owner claimed the lane): nothing was written."""
    REFUSED = "refused"
    """The admission guard refused it (:data:`_GUARD`): nothing was written."""


def _generation(conn: Conn) -> int:
    row = conn.execute(f"SELECT generation FROM {SCHEMA}.compaction").fetchone()
    assert row is not None, "migration 4 inserts the row"
    return int(row[0])


def _like(prefix: str) -> str:
    """A ``LIKE`` pattern for the names that start with ``prefix``."""
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _fence_params(fence: Fence | None) -> list[Any]:
    return [] if fence is None else [fence.lane, fence.owner, fence.epoch]


def _insert(rel: str, seq: int, frame: bytes, fence: Fence | None) -> Callable[[Conn], _Landed]:
    """An append's first attempt (a definite answer: nothing of this process was sent
    before), fenced by ``fence`` when one is given (S11)."""

    def insert(conn: Conn) -> _Landed:
        try:
            if fence is None:
                conn.execute(_INSERT, [rel, seq, frame])
            elif (
                conn.execute(_INSERT_FENCED, [rel, seq, frame, *_fence_params(fence)]).rowcount != 1
            ):
                return _Landed.FENCED
        except psycopg.errors.UniqueViolation as exc:
            if exc.diag.constraint_name != _KEY:  # another constraint refused it
                raise
            return _Landed.THEIRS
        return _Landed.OURS

    return insert


def _resolve(rel: str, seq: int, frame: bytes, fence: Fence | None) -> Callable[[Conn], _Landed]:
    """An append after an attempt whose outcome is unknown: ``OURS`` if the row is there now
    with exactly ``frame`` (inserted by this call, or committed by the earlier attempt),
    ``THEIRS`` if it holds other bytes (another writer's record), ``FENCED`` if it is absent,
    or holds other bytes (the lane's new owner's record), and the fence no longer holds."""

    def resolve(conn: Conn) -> _Landed:
        if fence is None:
            inserted = conn.execute(_INSERT_IF_ABSENT, [rel, seq, frame]).fetchone()
        else:
            params = [rel, seq, frame, *_fence_params(fence)]
            inserted = conn.execute(_INSERT_FENCED_IF_ABSENT, params).fetchone()
        if inserted is not None:
            return _Landed.OURS  # it had not committed: it has now
        row = conn.execute(_FRAME, [rel, seq], binary=True).fetchone()
        if row is None:
            if fence is not None:
                return _Landed.FENCED
            raise Vanished(f"record {seq} was neither inserted nor found")
        if bytes(row[0]) == frame:
            return _Landed.OURS
        if (
            fence is not None
            and conn.execute(_FENCE_HOLDS, _fence_params(fence)).fetchone() is None
        ):
            return _Landed.FENCED  # the lane's new owner wrote it (S11), not a rival writer
        return _Landed.THEIRS

    return resolve


class _Changed(Exception):
    """A log being rewritten (:meth:`PgStore.slim_log`) no longer ends where it was read:
    the transaction is rolled back."""


class _Mixed(Exception):
    """Part of a group was found taken by another writer: the group's transaction is
    rolled back (it is all or none)."""


_Guard = tuple[int, list[str], int]
"""An admission group's guard (:data:`_GUARD`): the compaction generation its writer knows,
the delivery ids it admits, and its writer's wall clock (ms) when it decided."""


def _insert_many(
    rel: str, seq: int, frames: list[bytes], guard: _Guard | None = None
) -> Callable[[Conn], _Landed]:
    """A group's first attempt (unfenced: the admission log, S22); with ``guard``, written
    only while it holds (:data:`_GUARD`; ``THEIRS`` if not)."""

    def insert(conn: Conn) -> _Landed:
        try:
            if guard is None:
                conn.execute(_INSERT_MANY, [rel, seq, frames])
            elif conn.execute(_INSERT_GUARDED, [rel, seq, frames, *guard]).rowcount == 0:
                return _Landed.REFUSED  # a compaction since, or an expired one: decide again
        except psycopg.errors.UniqueViolation as exc:
            if exc.diag.constraint_name != _KEY:
                raise
            return _Landed.THEIRS
        return _Landed.OURS

    return insert


def _resolve_many(
    rel: str, seq: int, frames: list[bytes], guard: _Guard | None = None
) -> Callable[[Conn], _Landed]:
    """A group after an attempt whose outcome is unknown. The earlier attempt committed all
    of it or none: ``OURS`` if the rows hold exactly these frames now (inserted here, or by
    that attempt), ``THEIRS`` if another writer holds any of the numbers (nothing of this
    group is then written: a partial insert is rolled back) — or, with ``guard``, when
    nothing is there and the guard refused the insert."""

    def resolve(conn: Conn) -> _Landed:
        try:
            with conn.transaction():
                if guard is None:
                    inserted = conn.execute(_INSERT_MANY_IF_ABSENT, [rel, seq, frames]).fetchall()
                else:
                    params = [rel, seq, frames, *guard]
                    inserted = conn.execute(_INSERT_GUARDED_IF_ABSENT, params).fetchall()
                if len(inserted) == len(frames):
                    return _Landed.OURS  # it had not committed: it has now
                if inserted:
                    raise _Mixed
        except _Mixed:
            return _Landed.THEIRS
        rows = conn.execute(_FRAMES, [rel, seq, seq + len(frames)], binary=True).fetchall()
        if not rows and guard is not None:
            return _Landed.REFUSED  # not written, and the guard refused it now: decide again
        if not rows:
            raise Vanished(f"records {seq}…{seq + len(frames) - 1} were neither inserted nor found")
        return _Landed.OURS if [bytes(r[0]) for r in rows] == frames else _Landed.THEIRS

    return resolve


# -- logs -------------------------------------------------------------------------------------


GROUP_MAX: Final = 256
"""The most records one group commit of a shared log writes (S22)."""


class _Queued:
    """One record waiting for its group (S22), and its fate once the group is written."""

    __slots__ = ("decided", "error", "key", "payload", "seq", "unless", "wake")

    def __init__(self, payload: bytes, unless: Callable[[], bool] | None, key: str) -> None:
        self.payload = payload
        self.unless = unless
        self.key = key
        self.decided = False
        """Its fate is known (``seq``, ``error``; neither: not written)."""
        self.wake = trio.Event()
        """Set when its fate is known, or when its caller is to write the next groups."""
        self.seq: int | None = None
        self.error: Exception | None = None

    def settle(self) -> None:
        self.decided = True
        self.wake.set()


class PgLog:
    """An open log of the PostgreSQL store (:class:`~runtime._journal._interface.Log`).
    Obtain one from :class:`PgStore`; do not construct it."""

    def __init__(
        self,
        store: PgStore,
        connection: Connection,
        contents: LogContents,
        *,
        next_seq: int,
        good_length: int,
        fence: Fence | None = None,
    ) -> None:
        self.contents = contents
        """The records the log held when it was opened (``records[0]`` is the header)."""
        self.fence = fence
        """The lease every append is fenced by unless it names its own (S11)."""
        self._store = store
        self._connection = connection
        self._rel = contents.rel
        self._next_seq = next_seq
        self._good_length = good_length
        """Bytes of the frames of every acknowledged record (a poison's ``good_length``)."""
        self._lock = trio.StrictFIFOLock()
        """One append at a time, in call order, held until the append is resolved: a record
        is committed only after the one before it (a failed one poisons, so no later one can
        commit after a gap)."""
        self._refusal: JournalError | None = None
        self._closed = False
        self._queued: list[_Queued] = []
        """The unfenced ``try_append`` calls waiting for the next group (S22)."""
        self._flushing = False
        self._in_line = 0
        """Appends of this log's own (:meth:`append`) called and not yet resolved: each lands
        at the number after those before it (the lock is FIFO), so :attr:`next_seq` counts
        them — what a caller reads there right before its ``append`` is where it lands."""
        self.on_records: Callable[[list[Record]], object] | None = None
        """Called, under the log's lock, with what each :meth:`refresh` read (a host taking in
        the others' admissions before its next ``try_append`` decides, S21)."""
        self.commits = 0
        """Commits this process made on the log (a group is one): for tests and benchmarks."""
        self._guarded = self._rel == ADMISSIONS
        """RT11: an admission is written only under the compaction generation this host has
        learned (:data:`_GUARD`); refused, it is decided again as a lost number is."""

    @property
    def rel(self) -> str:
        return self._rel

    @property
    def next_seq(self) -> int:
        """The number the next :meth:`append` lands at, counting those in line before it
        (as the file store's: its writer numbers a record when it is handed over)."""
        return self._next_seq + self._in_line

    @property
    def poisoned(self) -> bool:
        return self._refusal is not None

    async def append(self, record: Record, *, fence: Fence | None = None) -> int:
        """Append ``record``; return its sequence number once its ``INSERT`` committed.

        ``fence`` (default: the log's own, :attr:`fence`): the write is made only while that
        lease holds, in the same statement (S11).

        A connection that breaks around the append is replaced and the append resolved on
        the new one (its row found, or inserted again), within the store's backoff. Raises
        :class:`JournalError`: ``lane_fenced`` when the fence no longer holds (nothing was
        written; a log fenced by its own fence takes no more appends here),
        ``journal_conflict`` when another writer holds that sequence number,
        ``journal_poisoned`` when the server refused this append or an earlier append
        failed, ``journal_closed`` after :meth:`aclose` or the store's end; and
        :class:`DiskFailedError` (``store_unavailable``) when the database could not be
        reached within the backoff (the record is then in the log if and only if it
        committed, which this process cannot tell; the log takes no more appends here).
        """
        self._in_line += 1
        try:
            seq = await self._append(record, fence, shared=False)
        finally:
            self._in_line -= 1
        assert seq is not None
        return seq

    async def try_append(
        self,
        record: Record,
        *,
        fence: Fence | None = None,
        unless: Callable[[], bool] | None = None,
    ) -> int | None:
        """Append ``record`` to a log other hosts append to too (a shared log, S21): as
        :meth:`append`, but ``None`` when another writer took the next sequence number
        first — nothing was written and the log goes on: :meth:`refresh` to learn what was
        written, decide again, try again."""
        return await self._append(record, fence, shared=True, unless=unless)

    async def refresh(self) -> list[Record]:
        """The records other writers appended since this process last read or wrote the
        log, in order; later appends follow them (S21). A poison another process recorded
        refuses appends here too (the records it vouches for are returned). A refusal stops
        appends, not reads: a log that refuses appends in this process (PG13: one whose
        append met an outage) is still read — only a closed one is not."""
        async with self._lock:
            self._check_not_closed()
            rows, document = await self._store._run(
                self._rel, _read_rows(self._rel, after=self._next_seq)
            )
            if document is not None:
                poison = decode_poison(document, path=self._rel, what="poison row")
                self._refusal = JournalError(
                    ReasonCode.JOURNAL_POISONED,
                    f"the log was poisoned ({poison.reason}); it accepts no more records",
                    path=self._rel,
                )
            if self._rel in _SHARED:  # RT11: a compaction may have left holes
                records, _ = _decode_runs(rows, rel=self._rel, offset=self._good_length)
            else:
                records = _decode_tail(
                    rows, rel=self._rel, first_seq=self._next_seq, offset=self._good_length
                )
            if rows:
                self._next_seq = rows[-1][0] + 1
            self._good_length += sum(len(frame) for _seq, frame in rows)
            if records and self.on_records is not None:
                self.on_records(records)  # under the lock: before any later append decides
            if self._guarded:  # RT11: and what compactions removed, before it decides too
                await self._store.sync_expired()
            return records

    async def _append(
        self,
        record: Record,
        fence: Fence | None,
        *,
        shared: bool,
        unless: Callable[[], bool] | None = None,
    ) -> int | None:
        payload = encode_record(record)
        fence = fence or self.fence
        key = record.delivery_id if isinstance(record, Admission) else ""
        if shared and fence is None:
            return await self._grouped(payload, unless, key)
        async with self._lock:
            if unless is not None and unless():
                return None
            first = await self._append_locked([payload], fence, shared=shared, keys=[key])
        return first

    async def _grouped(
        self, payload: bytes, unless: Callable[[], bool] | None, key: str
    ) -> int | None:
        """S22: an unfenced append to a shared log (an admission) joins the next group; a
        caller that finds no group being written writes the queued ones, in call order, each
        group one statement (``GROUP_MAX`` records at most), until its own record's group is
        written, while later callers queue behind it; then the first caller still in line
        writes the next groups. So a caller waits for the groups before its own, never for
        the records queued after it. Once queued, a record's fate is waited for shielded (its
        group may commit), bounded by the store's retry policy, as a single append's is once
        sent."""
        queued = _Queued(payload, unless, key)
        self._queued.append(queued)
        with trio.CancelScope(shield=True):
            while not queued.decided:
                if self._flushing:  # another caller writes: its fate, or its turn, comes
                    await queued.wake.wait()
                    queued.wake = trio.Event()
                    continue
                self._flushing = True
                try:
                    await self._flush(until=queued)
                finally:
                    self._flushing = False
                    if self._queued:  # the next caller in line writes what is left
                        self._queued[0].wake.set()
        if queued.error is not None:
            raise queued.error
        return queued.seq

    async def _flush(self, *, until: _Queued) -> None:
        """Write the queued records, group after group in call order, until ``until``'s
        fate is known."""
        async with self._lock:
            while self._queued and not until.decided:
                group, self._queued = self._queued[:GROUP_MAX], self._queued[GROUP_MAX:]
                for q in group:  # decided now, after every refresh before this group
                    if q.unless is not None and q.unless():
                        q.settle()  # seq None: not written
                group = [q for q in group if not q.decided]
                if not group:
                    continue
                try:
                    payloads, keys = [q.payload for q in group], [q.key for q in group]
                    first = await self._append_locked(payloads, None, shared=True, keys=keys)
                except Exception as error:  # every record of the group shares its fate
                    for q in group:
                        q.error = error
                        q.settle()
                    continue
                for i, q in enumerate(group):
                    q.seq = None if first is None else first + i
                    q.settle()

    async def _append_locked(
        self, payloads: list[bytes], fence: Fence | None, *, shared: bool, keys: list[str]
    ) -> int | None:
        """Append ``payloads`` as consecutive records, all or none, holding the lock: the
        first one's number, or ``None`` when another writer took one of the numbers first
        on a shared log (nothing written) — or, on the admission log, when the guard
        refused them (:data:`_GUARD`; ``keys``: the delivery id each admits)."""
        self._check_open()
        seq = self._next_seq
        frames = [encode_frame(seq + i, [payload]) for i, payload in enumerate(payloads)]
        try:
            landed = await self._commit(seq, frames, fence, keys)
        except Unsettled as unsettled:
            self._refuse(unsettled.why)
            raise self._store._unavailable(unsettled.why, self._rel) from None
        except Closed:
            raise JournalError(
                ReasonCode.JOURNAL_CLOSED, "the store is closed", path=self._rel
            ) from None
        except (psycopg.Error, Vanished) as exc:  # the server's definite refusal
            if isinstance(exc, psycopg.Error):
                reason = server_reason(exc, self._store._params)
            else:
                reason = str(exc)
            with trio.CancelScope(shield=True):
                await self._poison(reason, fence)
            raise JournalError(
                ReasonCode.JOURNAL_POISONED,
                f"an append did not commit ({reason}); the log accepts no more records",
                path=self._rel,
            ) from None
        if landed is _Landed.FENCED:
            assert fence is not None
            raise self._fenced(fence)
        if landed is _Landed.REFUSED:  # RT11: learn why before anything decides again
            await self._store.learn_expired([k for k in keys if k])
            return None
        if landed is _Landed.THEIRS:
            if shared:
                return None
            raise self._conflict(seq)
        self.commits += 1
        self._next_seq = seq + len(frames)
        self._good_length += sum(len(frame) for frame in frames)
        return seq

    async def _commit(
        self, seq: int, frames: list[bytes], fence: Fence | None, keys: list[str]
    ) -> _Landed:
        """Commit the rows ``(rel, seq…, frames)`` under ``fence`` (a group of more than one:
        unfenced, in one statement). Retried under the store's policy while the connection
        breaks or cannot be made, or the server rolls an attempt back for a passing reason (a
        cancel, a timeout, a deadlock: :class:`RolledBack`); once an attempt was sent (its
        outcome unknown) every later one resolves it (:func:`_resolve`), shielded from
        cancellation: the log's next number depends on it. Raises :class:`Unsettled` when
        the bound is spent, the driver's error on a definite refusal."""
        policy = self._store.retry
        # what the decision knew: the generation, the deliveries it admits, and when
        now = self._store.clocks.wall.time_ms()
        guard = (self._store.generation, [k for k in keys if k], now) if self._guarded else None
        sent = False
        problem = ""
        for attempt in range(policy.attempts):
            with trio.CancelScope(shield=sent):
                if attempt:
                    await trio.sleep(policy.delay(attempt))
                if len(frames) == 1 and not self._guarded:
                    work = (_resolve if sent else _insert)(self._rel, seq, frames[0], fence)
                else:
                    assert fence is None
                    many = _resolve_many if sent else _insert_many
                    work = many(self._rel, seq, frames, guard)
                try:
                    return await self._connection.run(work)
                except (Unreachable, RolledBack) as exc:  # nothing took effect this time
                    problem = str(exc)
                except Broken as exc:
                    sent = True
                    problem = str(exc)
        if sent:
            why = (
                f"record {seq} was sent but its commit could not be confirmed or found in "
                f"{policy.attempts} attempts ({problem}); the log holds it after a restart "
                "if and only if it committed"
            )
        else:
            why = f"record {seq} could not be written in {policy.attempts} attempts ({problem})"
        raise Unsettled(why)

    def _fenced(self, fence: Fence) -> JournalError:
        """The lease ``fence`` was taken over: a log fenced by it is this host's no more —
        it takes no more appends here and is forgotten by the store (opening it again reads
        what the new owner wrote); a shared log goes on for the other lanes."""
        error = JournalError(
            ReasonCode.LANE_FENCED,
            f"lane {fence.lane} is no longer held by this host at epoch {fence.epoch} "
            "(another host claimed it); nothing was written",
            path=self._rel,
        )
        if fence == self.fence:
            self._refusal = error
            self._store._forget(self)
        return error

    def _check_not_closed(self) -> None:
        if self._closed or self._store._closed:
            what = "the store is closed" if self._store._closed else "the log is closed"
            raise JournalError(ReasonCode.JOURNAL_CLOSED, what, path=self._rel)

    def _check_open(self) -> None:
        """Whether the log takes appends: not closed, and not refusing them."""
        self._check_not_closed()
        if self._refusal is not None:
            raise self._refusal

    def _conflict(self, seq: int) -> JournalError:
        self._refusal = JournalError(
            ReasonCode.JOURNAL_POISONED,
            f"another writer appended record {seq} first; this process appends no more here",
            path=self._rel,
        )
        return JournalError(
            ReasonCode.JOURNAL_CONFLICT,
            f"record {seq} was already written by another writer; this process appends no "
            "more to the log",
            path=self._rel,
        )

    def _refuse(self, why: str) -> None:
        """Refuse every later append in this process (nothing is recorded)."""
        self._refusal = JournalError(
            ReasonCode.JOURNAL_POISONED,
            f"an earlier append failed ({why}); the log accepts no more records",
            path=self._rel,
        )

    async def _poison(self, reason: str, fence: Fence | None) -> None:
        """Refuse every later append; record the poison in the database (retried under the
        store's policy) if it can be reached, else the store is failed: the host stops
        admitting. Only for a definite refusal: if an earlier attempt's outcome was unknown,
        the row may have committed after all, and the poison's ``good_seq`` keeps it from
        being read — but on a shared log, where every host appends, it hides nothing: a row
        is whole, and the rows past this host's view are other hosts' acknowledged records;
        and a log written under ``fence`` is poisoned only while that lease holds, since
        once another host claimed the lane the log is its own (PG5)."""
        self._refusal = JournalError(
            ReasonCode.JOURNAL_POISONED,
            f"an earlier append did not commit ({reason}); the log accepts no more records",
            path=self._rel,
        )
        poison = Poison(
            log_path=self._rel,
            good_length=self._good_length,
            reason=reason,
            errno=None,
            poisoned_ms=self._store.clocks.wall.time_ms(),
        )
        document = encode_record(poison)
        # a shared log's rows past the number this host knew are other hosts' acknowledged
        # records (S21), before the poison and after it: its poison bounds nothing (PG5)
        good_seq = _NEVER if self._rel in _SHARED else self._next_seq
        fenced = fence is not None and self._rel not in _SHARED

        def record(conn: Conn) -> None:
            if fenced:
                params = [self._rel, good_seq, reason, document, *_fence_params(fence)]
                conn.execute(_POISON_FENCED, params)
            else:
                conn.execute(_POISON, [self._rel, good_seq, reason, document])

        try:
            await self._store._retrying(self._connection, record)
        except (Unreachable, Closed) as exc:
            self._store._unavailable(f"the poison of {self._rel} could not be recorded: {exc}")
        except psycopg.Error as exc:
            self._store._unavailable(
                f"the poison of {self._rel} could not be recorded: "
                f"{server_reason(exc, self._store._params)}"
            )

    async def aclose(self) -> None:
        """Take no more appends (after the one in flight, if any). Idempotent."""
        if self._closed:
            return
        async with self._lock:
            self._closed = True


# -- the store --------------------------------------------------------------------------------


class PgStore:
    """An open PostgreSQL journal store (:class:`~runtime._journal._interface.JournalStore`).
    Use :func:`open_pg_store`."""

    def __init__(
        self,
        params: dict[str, Any],
        root: Path,
        clocks: Clocks,
        pool: int,
        retry: Backoff = DEFAULT_RETRY,
        owner: str | None = None,
    ) -> None:
        if pool < 1:
            raise ValueError("the PostgreSQL store needs at least one pooled connection")
        self.root = root
        self.clocks = clocks
        self.retry = retry
        """How work whose connection broke or could not be made is retried."""
        self.owner = owner or new_owner_id()
        """This host's name in the lease rows (S10): unique to this process's life, so a host
        started again claims its lanes anew, under new epochs."""
        self._params = params
        self._shared = Connection(params)
        """Appends and reads of the shared logs (admissions, results)."""
        self._leases = Connection(params)
        """Claims, renewals and releases: never queued behind an append (S12)."""
        self._pool = [Connection(params) for _ in range(pool)]
        """Every other log, reads and documents, chosen by name."""
        self._open: dict[str, PgLog] = {}
        self._disk_failure: DiskFailedError | None = None
        self._closed = False
        self.admissions: PgLog
        self.results: PgLog
        self.generation = 0
        """The compaction generation this store has learned the expired deliveries of (RT11):
        every admission is written under it (:data:`_GUARD`)."""
        self.expired: dict[str, int] = {}
        """RT4, RT11: the deliveries expired since this store was opened — id to the time a
        duplicate is no longer refused (``delivery_expired``) for it, counted with
        :attr:`forget_ms` — as of :attr:`generation`; a decision compares that time with
        the wall clock (an entry past it is let go, though still listed until the next
        look). Those expired before are not held (a year of them would be millions):
        :meth:`expired_among` asks the database, and an admission of one is refused by the
        database itself (:data:`_GUARD`)."""
        self.forget_ms: int | None = None
        """The ``[retention] forget_days`` (ms) the database's expired rows count with, as of
        the last look (:meth:`sync_expired`, :meth:`follow_forget_days`); ``None`` while no
        host has recorded one (each row is then held to its forget-after time)."""
        self._learning = trio.Lock()
        """One :meth:`sync_expired` at a time."""
        self.on_expired: Callable[[Mapping[str, int]], object] | None = None
        """Called with the deliveries each :meth:`sync_expired` learned (a host forgetting
        what it knows of them)."""

    # -- health --------------------------------------------------------------------------

    @property
    def disk_failure(self) -> DiskFailedError | None:
        """The first failure of the database itself (``store_unavailable``); once set the
        host must stop admitting."""
        return self._disk_failure

    def _unavailable(self, problem: str, rel: str | None = None) -> DiskFailedError:
        error = DiskFailedError(ReasonCode.STORE_UNAVAILABLE, problem, path=rel)
        if self._disk_failure is None:
            self._disk_failure = error
        return error

    def _connection(self, rel: str) -> Connection:
        if rel in (ADMISSIONS, RESULTS):
            return self._shared
        return self._pool[zlib.crc32(rel.encode()) % len(self._pool)]

    async def _retrying(self, connection: Connection, fn: Callable[[Conn], _T]) -> _T:
        """Idempotent work (a read, an upsert) on ``connection``, run again under the retry
        policy while the connection breaks or cannot be made, or the server rolls the work
        back for a passing reason (:class:`RolledBack`); :class:`Unreachable` when the bound
        is spent. A definite refusal (the driver's error) is not retried."""
        problem = ""
        for attempt in range(self.retry.attempts):
            if attempt:
                await trio.sleep(self.retry.delay(attempt))
            try:
                return await connection.run(fn)
            except (Unreachable, Broken, RolledBack) as exc:
                problem = str(exc)
        raise Unreachable(f"{problem} (in {self.retry.attempts} attempts)")

    async def _run(
        self,
        rel: str | None,
        fn: Callable[[Conn], _T],
        *,
        connection: Connection | None = None,
        store_failure: bool = True,
    ) -> _T:
        """Idempotent work (a read, an upsert) on ``rel``'s connection (the shared one for
        ``None``; or ``connection``), retried under the policy (:meth:`_retrying`). A
        failure is ``store_unavailable``, and the database's (``disk_failure``) unless
        ``store_failure`` is false."""
        if self._closed:
            raise JournalError(ReasonCode.JOURNAL_CLOSED, "the store is closed", path=rel)
        if connection is None:
            connection = self._shared if rel is None else self._connection(rel)
        try:
            return await self._retrying(connection, fn)
        except Closed:
            raise JournalError(ReasonCode.JOURNAL_CLOSED, "the store is closed", path=rel) from None
        except Unreachable as exc:
            problem = str(exc)
        except psycopg.Error as exc:
            problem = f"the database failed: {server_reason(exc, self._params)}"
        if store_failure:
            raise self._unavailable(problem, rel)
        raise DiskFailedError(ReasonCode.STORE_UNAVAILABLE, problem, path=rel)

    # -- names ---------------------------------------------------------------------------

    @staticmethod
    def delivery_rel(delivery_id: str) -> str:
        return Store.delivery_rel(delivery_id)

    @staticmethod
    def lane_rel(lane: str) -> str:
        return Store.lane_rel(lane)

    # -- logs ----------------------------------------------------------------------------

    async def create_delivery_log(self, delivery_id: str, *, fence: Fence | None = None) -> PgLog:
        """Create a delivery's log (its header committed). ``FileExistsError`` if it exists.
        ``fence``: every append to it (the header too) is fenced by that lease (S11)."""
        rel = self.delivery_rel(delivery_id)
        return await self._create(rel, LogKind.DELIVERY, delivery_id, fence)

    async def open_or_create_delivery_log(
        self, delivery_id: str, *, fence: Fence | None = None
    ) -> PgLog:
        rel = self.delivery_rel(delivery_id)
        return await self._open_or_create(rel, LogKind.DELIVERY, delivery_id, fence)

    async def open_delivery_log(self, delivery_id: str, *, fence: Fence | None = None) -> PgLog:
        """Open an existing delivery's log for appending; ``FileNotFoundError`` if none."""
        return await self._open_existing(self.delivery_rel(delivery_id), LogKind.DELIVERY, fence)

    async def read_delivery_log(self, delivery_id: str) -> LogContents:
        """Read a delivery's log without opening it for appends (even if poisoned)."""
        return await self.read(self.delivery_rel(delivery_id), LogKind.DELIVERY)

    async def open_lane_log(self, lane: str, *, fence: Fence | None = None) -> PgLog:
        return await self._open_or_create(self.lane_rel(lane), LogKind.LANE, lane, fence)

    async def read(self, rel: str, kind: LogKind | None = None) -> LogContents:
        """What a log holds (its acknowledged records; up to its poison, if poisoned).
        ``FileNotFoundError`` if it holds nothing; :class:`JournalError` on any damage."""
        contents, _next_seq = await self._read(rel, kind)
        return contents

    async def _read(self, rel: str, kind: LogKind | None) -> tuple[LogContents, int]:
        """:meth:`read`, and the log's next number (past its records on every log but a
        shared one, whose compaction leaves holes: RT11)."""
        rows, document = await self._run(rel, _read_rows(rel))
        if not rows and document is None:
            raise FileNotFoundError(f"{rel} holds no record")
        poison = None if document is None else decode_poison(document, path=rel, what="poison row")
        if rel in _SHARED and rows:
            contents, _numbers = _decode_shared_rows(rows, rel=rel, kind=kind, poison=poison)
            return contents, rows[-1][0] + 1
        contents = _decode_rows(rows, rel=rel, kind=kind, poison=poison)
        return contents, contents.next_seq

    async def _open_or_create(
        self, rel: str, kind: LogKind, subject: str, fence: Fence | None = None
    ) -> PgLog:
        with contextlib.suppress(FileNotFoundError):
            return await self._open_existing(rel, kind, fence)
        return await self._create(rel, kind, subject, fence)

    def _cached(self, rel: str, fence: Fence | None) -> PgLog | None:
        """The open log ``rel`` if it was opened under ``fence``; one opened under another
        lease is forgotten (what it knows may be stale: another owner may have appended)."""
        log = self._open.get(rel)
        if log is not None and log.fence != fence:
            self._forget(log)
            return None
        return log

    def _forget(self, log: PgLog) -> None:
        """Open ``log`` no more (it stays usable to whoever holds it, until refused)."""
        if self._open.get(log.rel) is log:
            del self._open[log.rel]

    async def _open_existing(self, rel: str, kind: LogKind, fence: Fence | None = None) -> PgLog:
        if (cached := self._cached(rel, fence)) is not None:
            return cached
        contents, next_seq = await self._read(rel, kind)
        if contents.poison is not None:
            raise JournalError(
                ReasonCode.JOURNAL_POISONED,
                f"log was poisoned ({contents.poison.reason}); it is not replayed",
                path=rel,
            )
        if (cached := self._cached(rel, fence)) is not None:  # opened by another task meanwhile
            return cached
        log = PgLog(
            self,
            self._connection(rel),
            contents,
            next_seq=next_seq,
            good_length=contents.good_length,
            fence=fence,
        )
        self._open[rel] = log
        return log

    async def _create(
        self, rel: str, kind: LogKind, subject: str, fence: Fence | None = None
    ) -> PgLog:
        """Create a log whose header is committed before this returns; ``FileExistsError``
        if the log holds a record or a poison."""
        if self._cached(rel, fence) is not None:
            raise JournalError(
                ReasonCode.JOURNAL_IN_USE,
                "log is already open: it is not created a second time",
                path=rel,
            )

        if await self.exists(rel):
            raise FileExistsError(f"{rel} already exists")
        header = Header(
            schema_version=SCHEMA_VERSION,
            kind=kind,
            subject=subject,
            created_ms=self.clocks.wall.time_ms(),
        )
        contents = LogContents(rel, (header,), 0, 0)
        log = PgLog(self, self._connection(rel), contents, next_seq=0, good_length=0, fence=fence)
        self._open[rel] = log
        try:
            await log.append(header)
        except JournalError as error:
            self._forget(log)
            if error.code is ReasonCode.JOURNAL_CONFLICT:  # created by another writer
                raise FileExistsError(f"{rel} already exists") from None
            raise
        except BaseException:
            self._forget(log)
            raise
        log.contents = LogContents(rel, (header,), log._good_length, 0)
        return log

    async def exists(self, rel: str) -> bool:
        """Whether the log ``rel`` was ever created (it holds a record or a poison)."""

        def exists(conn: Conn) -> bool:
            row = conn.execute(_EXISTS, {"log": rel}).fetchone()
            return bool(row and row[0])

        return await self._run(rel, exists)

    async def log_names(self) -> list[str]:
        """The names of every log (its header row, or its poison), sorted."""

        def names(conn: Conn) -> list[str]:
            return [str(row[0]) for row in conn.execute(_LOG_NAMES).fetchall()]

        return await self._run(None, names)

    async def lane_logs(self) -> list[str]:
        """The names of every lane log, sorted."""

        def names(conn: Conn) -> list[str]:
            return [str(row[0]) for row in conn.execute(_LANE_LOGS).fetchall()]

        return await self._run("lanes", names)

    async def close_log(self, journal: Log) -> None:
        self._open.pop(journal.rel, None)
        await journal.aclose()

    # -- documents -----------------------------------------------------------------------

    async def write_document(self, rel: str, data: bytes, *, fence: Fence | None = None) -> None:
        """Replace a document atomically: one upsert, committed before this returns.
        ``fence``: only while that lease holds (S11), else ``lane_fenced`` and nothing is
        written."""

        def write(conn: Conn) -> bool:
            if fence is None:
                conn.execute(_WRITE_DOCUMENT, [rel, data])
                return True
            params = [rel, data, *_fence_params(fence)]
            return conn.execute(_WRITE_DOCUMENT_FENCED, params).fetchone() is not None

        if not await self._run(rel, write):
            assert fence is not None
            raise JournalError(
                ReasonCode.LANE_FENCED,
                f"lane {fence.lane} is no longer held by this host at epoch {fence.epoch}; "
                "the document was not written",
                path=rel,
            )

    async def documents(self, prefix: str) -> dict[str, bytes]:
        """Every document whose name starts with ``prefix``, by name (S26)."""

        def read(conn: Conn) -> dict[str, bytes]:
            pattern = _like(prefix)
            rows = conn.execute(_DOCUMENTS, [pattern], binary=True).fetchall()
            return {str(name): bytes(data) for name, data in rows}

        return await self._run(prefix, read)

    async def remove_logs(self, rels: Sequence[str]) -> int:
        """Remove the logs ``rels`` — their rows and any poison — in one statement (retention,
        docs/design/retention.md RT11: logs nothing will read again); how many were there.
        Idempotent: two hosts removing the same logs remove them once."""

        def delete(conn: Conn) -> int:
            row = conn.execute(_DELETE_LOGS, [list(rels), list(rels)]).fetchone()
            return int(row[0]) if row else 0

        for rel in rels:
            self._open.pop(rel, None)
        return await self._run(rels[0], delete) if rels else 0

    async def sweep_documents(
        self, prefix: str, *, keep: Sequence[str], idle_seconds: float
    ) -> int:
        """Remove every document named ``prefix…`` but those of ``keep`` and those written
        in the last ``idle_seconds`` of the database's clock (RT11: an attachment another
        host may be writing again now stays); how many went. One statement."""

        def delete(conn: Conn) -> int:
            params = [_like(prefix), list(keep), idle_seconds]
            return conn.execute(_SWEEP_DOCUMENTS, params).rowcount

        return await self._run(prefix, delete)

    async def delete_documents(self, names: Sequence[str], *, with_parts: bool = False) -> None:
        """Remove the named documents (those absent are no matter): one statement.
        ``with_parts``: and every document named ``<name>@…`` (S36)."""

        def delete(conn: Conn) -> None:
            conn.execute(
                _DELETE_DOCUMENTS_AND_PARTS if with_parts else _DELETE_DOCUMENTS, [list(names)]
            )

        if names:
            await self._run(names[0], delete)

    # -- the shared logs' retention (retention.md RT11) ---------------------------------

    async def sync_expired(self) -> dict[str, int]:
        """Learn the deliveries compactions expired since :attr:`generation` (one statement,
        one snapshot: the generation and the count now, and what was expired up to it); the
        new ones, also handed to :attr:`on_expired` (whether or not they are still held back:
        their records left the logs). Those past their time are let go; when the count
        changed (a host started with another ``forget_days``), those held are asked again."""
        async with self._learning:  # one at a time: a recount reads and replaces them all

            def read(conn: Conn) -> list[tuple[str | None, int | None, int, int | None]]:
                return conn.execute(_EXPIRED_SINCE, [self.generation]).fetchall()

            rows = await self._run(None, read)
            learned = {d: u for d, u, _g, _f in rows if d is not None and u is not None}
            generation, forget_ms = next((g, f) for d, _u, g, f in rows if d is None)
            recount = forget_ms != self.forget_ms
            if generation <= self.generation and not recount:
                return {}
            if recount:  # each until moved: asked again (those let go are not returned)
                held = await self.expired_among(list(self.expired))
                self.forget_ms, self.expired = forget_ms, held
            now = self.clocks.wall.time_ms()
            self.expired = {d: u for d, u in (self.expired | learned).items() if u > now}
            self.generation = generation
            if learned and self.on_expired is not None:
                self.on_expired(learned)
            return learned

    async def expired_among(self, delivery_ids: Sequence[str]) -> dict[str, int]:
        """Which of ``delivery_ids`` the database holds as expired (RT11) now — held back
        at this host's wall clock, counted with the database's ``forget_days`` (RT4) — each
        with the time it is let go."""
        now = self.clocks.wall.time_ms()

        def read(conn: Conn) -> dict[str, int]:
            rows = conn.execute(_EXPIRED_AMONG, [list(delivery_ids), now]).fetchall()
            return {str(d): int(until) for d, until in rows}

        return await self._run(None, read) if delivery_ids else {}

    async def learn_expired(self, delivery_ids: Sequence[str]) -> dict[str, int]:
        """:meth:`sync_expired`, and those of ``delivery_ids`` that expired before this
        store was opened (an admission the guard refused: :data:`_GUARD`), now in
        :attr:`expired` too; what was learned."""
        learned = await self.sync_expired()
        found = await self.expired_among(delivery_ids)
        older = {d: u for d, u in found.items() if d not in self.expired}
        if older:
            self.expired.update(older)
            if self.on_expired is not None:
                self.on_expired(older)
        return learned | older

    async def follow_forget_days(self, forget_ms: int) -> int | None:
        """Make the database's expired ids — the deliveries' and the tasks' — count with
        ``forget_ms`` (``[retention] forget_days``, RT4): a host's start, as the file store
        rewrites its filters. One row: every id is held back ``forget_ms`` from its own time
        from the commit on, for every host (their lookups read the count; each host's memory
        follows at its next look, told at once). The count it replaced (``None``: none was
        recorded; nothing is written when it is ``forget_ms`` already)."""

        def follow(conn: Conn) -> int | None:
            with conn.transaction():
                row = conn.execute(_COUNT_FOR_UPDATE).fetchone()
                assert row is not None, "migration 7 inserts the row"
                before = None if row[0] is None else int(row[0])
                if before != forget_ms:
                    conn.execute(_COUNT_WITH, [forget_ms])
                    conn.execute(_COMPACT_END)  # every host looks again
                return before

        before = await self._run(None, follow)
        await self.sync_expired()
        return before

    async def read_shared(self) -> SharedRows:
        """The shared logs as a compaction plans on them (RT11): the result log's records
        first, then the admission log's, each with its number — so every result read has
        its admission among those read (an admission commits before its result)."""
        results = await self._read_numbered(RESULTS, LogKind.RESULTS)
        admissions = await self._read_numbered(ADMISSIONS, LogKind.ADMISSIONS)
        return SharedRows(admissions=admissions, results=results)

    async def _read_numbered(self, rel: str, kind: LogKind) -> list[tuple[int, Record]]:
        rows, document = await self._run(rel, _read_rows(rel))
        if document is not None:
            raise JournalError(
                ReasonCode.JOURNAL_POISONED, "the log was poisoned; not compacted", path=rel
            )
        contents, numbers = _decode_shared_rows(rows, rel=rel, kind=kind, poison=None)
        return list(zip(numbers, contents.records, strict=True))

    async def compact_shared(
        self,
        fence: Fence,
        *,
        slim: Mapping[int, Record],
        admissions: Sequence[int],
        results: Sequence[int],
        expire: Mapping[str, int],
        forget_ms: int,
    ) -> int | None:
        """One compaction of the shared logs (RT11), in one transaction, while ``fence`` (the
        compaction's lease) holds: the admission rows numbered in ``slim`` rewritten as those
        records (each framed under its own number), the rows numbered ``admissions`` and
        ``results`` deleted from their logs (never a header, nor a log's last row: the caller
        leaves it out), those expired before and past their days let go, ``expire``'s
        deliveries recorded as expired from their times (each its publication: held back
        ``forget_days`` from it, RT4; ``forget_ms``, the caller's, counts only while no host
        has recorded one), and every host told. The compaction's generation, or ``None``
        when the fence no longer held (nothing changed). Idempotent: done again it changes
        nothing more than a first time would."""
        now = self.clocks.wall.time_ms()
        seqs = list(slim)
        frames = [encode_frame(seq, [encode_record(slim[seq])]) for seq in seqs]

        def compact(conn: Conn) -> int | None:
            with conn.transaction():
                row = conn.execute(_COMPACT_BEGIN, _fence_params(fence)).fetchone()
                if row is None:
                    return None
                generation = int(row[0])
                if seqs:
                    conn.execute(_COMPACT_SLIM, [seqs, frames, ADMISSIONS])
                for rel, numbers in ((ADMISSIONS, admissions), (RESULTS, results)):
                    if numbers:
                        conn.execute(_COMPACT_DELETE, [rel, list(numbers)])
                conn.execute(_COMPACT_FORGET, [now])
                if expire:
                    params = [forget_ms, generation, list(expire), list(expire.values())]
                    conn.execute(_COMPACT_EXPIRE, params)
                conn.execute(_COMPACT_END)
                return generation

        return await self._run(None, compact)

    # -- ended task lanes' retention (retention.md RT13) ------------------------------------

    async def slim_log(self, rel: str, records: Sequence[Record], *, fence: Fence) -> bool:
        """Replace the log ``rel`` — an ended task's lane log, which nothing appends to — by
        a new header, a :class:`Compacted` record and ``records`` (records of the log),
        numbered from 0, in one transaction while ``fence`` holds (the claim of the lane a
        retention pass made: a claim moves the epoch on, so no earlier holder can append
        from then on) and only when the log still ends where this read found it. Whether it
        was rewritten (``False``: the fence or the log changed; nothing was)."""
        contents, next_seq = await self._read(rel, None)
        stray = [r for r in records if r not in contents.records]
        if stray:
            raise ValueError(f"{rel}: a slim log keeps records of the log, not {stray[0]!r}")
        new = slimmed(contents, records, now_ms=self.clocks.wall.time_ms())
        frames = [encode_frame(seq, [encode_record(r)]) for seq, r in enumerate(new)]

        def slim(conn: Conn) -> bool:
            with conn.transaction():
                if conn.execute(_FENCE_HOLDS, _fence_params(fence)).fetchone() is None:
                    return False
                gone = [int(row[0]) for row in conn.execute(_DELETE_LOG, [rel]).fetchall()]
                if max(gone, default=-1) != next_seq - 1 or len(gone) != next_seq:
                    raise _Changed  # rolled back: a later pass reads it again
                conn.execute(_INSERT_LOG, [rel, frames])
                return True

        self._open.pop(rel, None)
        try:
            return await self._run(rel, slim)
        except _Changed:
            return False

    async def expire_task(
        self, task_id: str, since_ms: int, *, forget_ms: int, fence: Fence
    ) -> bool:
        """Record the task ``task_id`` expired from ``since_ms`` (its end: held back
        ``forget_days`` from it, RT4, RT13; ``forget_ms``, the caller's, counts only while no
        host has recorded one) and remove its lane log (its rows and any poison) in one
        transaction while ``fence`` — the claim of its lane a retention pass made — holds.
        Whether this call recorded it (``False``: the fence no longer held, or it was expired
        already). Idempotent."""
        subject = f"task:{task_id}"
        rel = self.lane_rel(subject)
        now = self.clocks.wall.time_ms()

        def expire(conn: Conn) -> bool:
            with conn.transaction():
                if conn.execute(_FENCE_HOLDS, _fence_params(fence)).fetchone() is None:
                    return False
                key = lane_key(subject)
                conn.execute(_FORGET_TASK, [key, now])
                params = [key, task_id, since_ms, since_ms + forget_ms]
                recorded = conn.execute(_EXPIRE_TASK, params).rowcount == 1
                conn.execute(_DELETE_LOGS, [[rel], [rel]])
                conn.execute(_RELEASE_WORKTREE, [task_id])  # S33: ended long ago
                return recorded

        self._open.pop(rel, None)
        return await self._run(rel, expire)

    # -- task worktrees across hosts (scale-out.md S33) ----------------------------------

    async def lease_worktree(self, task_id: str, worktree: str) -> list[str]:
        """Record ``worktree`` (an absolute real path) as held by the task ``task_id`` —
        unless another task holds it, a directory around it or one inside it: then nothing
        is recorded and their ids come back (the caller checks they still live, S33). One
        transaction under an advisory lock, so two hosts leasing overlapping worktrees at
        once are served one after the other. Idempotent."""
        path = worktree.rstrip("/") or "/"
        around = [path, *(str(parent) for parent in PurePosixPath(path).parents)]
        inside = _like(path.rstrip("/") + "/")

        def lease(conn: Conn) -> list[str]:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", [_WORKTREE_LOCK])
                rows = conn.execute(_WORKTREE_HOLDERS, [task_id, around, inside]).fetchall()
                if rows:
                    return [str(row[0]) for row in rows]
                conn.execute(_LEASE_WORKTREE, [task_id, path])
                return []

        return await self._run(None, lease)

    async def release_worktree(self, task_id: str) -> None:
        """The task ``task_id`` holds no worktree any more (it ended, S33). Idempotent."""
        await self._run(None, lambda conn: conn.execute(_RELEASE_WORKTREE, [task_id]))

    async def forget_expired_tasks(self) -> int:
        """Remove the rows of the expired tasks past their days (on this host's wall clock,
        counted with the database's ``forget_days``): a submission under such an id is new
        again — as it is from their time on already, for every lookup. How many."""
        now = self.clocks.wall.time_ms()
        return await self._run(None, lambda conn: conn.execute(_FORGET_TASKS, [now]).rowcount)

    async def expired_task_keys(self, keys: Sequence[str]) -> dict[str, int]:
        """Which of the lane keys ``keys`` (``lane_key(f"task:{id}")``) name a task the
        database holds as expired now (RT13) — held back at this host's wall clock, counted
        with the database's ``forget_days`` (RT4) — each with the time it is let go."""
        now = self.clocks.wall.time_ms()

        def read(conn: Conn) -> dict[str, int]:
            rows = conn.execute(_EXPIRED_TASKS_AMONG, [list(keys), now]).fetchall()
            return {str(key): int(until) for key, until in rows}

        return await self._run(None, read) if keys else {}

    async def announce(self) -> None:
        """Tell every host watching the shared logs to look again (S23, S26): sent at once."""
        await self._run(None, lambda conn: conn.execute(_ANNOUNCE))

    async def read_document(self, rel: str) -> bytes | None:
        def read(conn: Conn) -> bytes | None:
            row = conn.execute(_READ_DOCUMENT, [rel], binary=True).fetchone()
            return None if row is None else bytes(row[0])

        return await self._run(rel, read)

    # -- transactions of other parts ------------------------------------------------------

    async def transaction(self, key: str, fn: Callable[[Conn], _T]) -> _T:
        """``fn(connection)`` inside one transaction on ``key``'s pooled connection, committed
        when it returns and rolled back when it raises (its exception then passes through).
        When the connection breaks or cannot be made the whole transaction runs again, under
        the retry policy, so ``fn`` must be idempotent *across a commit*: a transaction whose
        ``COMMIT`` was sent may have committed (the receipt store's guarded write is: its
        receipt says so). A failure is ``store_unavailable`` for the caller, not the host's
        :attr:`disk_failure`."""

        def run(conn: Conn) -> _T:
            with conn.transaction():
                return fn(conn)

        return await self._run(key, run, store_failure=False)

    # -- leases (S10-S12) -----------------------------------------------------------------

    async def _on_leases(self, fn: Callable[[Conn], _T]) -> _T:
        """Lease work on its own connection, retried under the policy; a database that
        cannot be reached is ``store_unavailable`` here, not the host's :attr:`disk_failure`:
        the lease keeper decides what losing its leases means (S12)."""
        return await self._run(None, fn, connection=self._leases, store_failure=False)

    async def claim(self, lane: str, ttl: float) -> Fence | None:
        """Claim ``lane`` (its name as :meth:`open_lane_log` takes it) for ``ttl`` seconds of
        the database's clock: a :class:`Fence` one epoch above every earlier claim, or
        ``None`` while another owner's lease on it runs (S10). Claiming a lane this host
        holds claims it anew (its earlier epoch's writes are refused from now on)."""
        key = self.lane_rel(lane)

        def claim(conn: Conn) -> int | None:
            params = {"lane": key, "owner": self.owner, "ttl": ttl}
            row = conn.execute(_CLAIM, params).fetchone()
            return None if row is None else int(row[0])

        epoch = await self._on_leases(claim)
        return None if epoch is None else Fence(key, self.owner, epoch)

    async def renew(self, fences: Sequence[Fence], ttl: float) -> set[Fence]:
        """Extend every lease of ``fences`` this host still holds at its epoch by ``ttl``
        seconds from now (the database's clock), in one statement; the ones returned are
        held, the others are lost (S12)."""
        mine = [fence for fence in fences if fence.owner == self.owner]
        if not mine:
            return set()

        def renew(conn: Conn) -> set[str]:
            params = {
                "lanes": [fence.lane for fence in mine],
                "epochs": [fence.epoch for fence in mine],
                "owner": self.owner,
                "ttl": ttl,
            }
            return {str(row[0]) for row in conn.execute(_RENEW, params).fetchall()}

        held = await self._on_leases(renew)
        return {fence for fence in mine if fence.lane in held}

    async def release(self, fence: Fence) -> None:
        """Give ``fence``'s lease up (it runs out now; its epoch stays spent)."""

        def release(conn: Conn) -> None:
            conn.execute(_RELEASE, [fence.lane, fence.owner, fence.epoch])

        await self._on_leases(release)

    async def lease(self, lane: str) -> Lease | None:
        """Who holds ``lane``'s lease now, by the database's clock (``None``: never
        claimed)."""
        key = self.lane_rel(lane)

        def lease(conn: Conn) -> Lease | None:
            row = conn.execute(_LEASE, [key]).fetchone()
            if row is None:
                return None
            fence = Fence(key, str(row[0]), int(row[1]))
            return Lease(fence, bool(row[2]), float(row[3]), float(row[4]))

        return await self._on_leases(lease)

    async def watch_shared(self, changed: Callable[[bool], None], *, poll: float) -> NoReturn:
        """Call ``changed(released)`` whenever another process may have appended to a shared
        log or given a lease up (``released``): on each announcement (``NOTIFY``, S23), after
        a reconnect (one may have been missed: ``released`` too) and every ``poll`` seconds
        whatever happens, so a lost announcement delays, never loses. Runs until cancelled,
        on a connection of its own."""
        listener: Conn | None = None
        fd = -1  # the listener's socket, taken once: a lost connection no longer names it
        failures = 0

        async def close() -> None:
            nonlocal listener
            assert listener is not None
            trio.lowlevel.notify_closing(fd)
            await trio.to_thread.run_sync(listener.close)
            listener = None

        try:
            while True:
                if listener is None:
                    try:
                        listener = await trio.to_thread.run_sync(_listen, self._params)
                        fd = listener.fileno()
                        failures = 0
                    except (Unreachable, psycopg.Error):
                        failures += 1
                        await trio.sleep(self.retry.delay(min(failures, self.retry.attempts)))
                    changed(True)
                    continue
                with trio.move_on_after(poll):
                    await trio.lowlevel.wait_readable(fd)
                released = False
                try:
                    payloads = await trio.to_thread.run_sync(_drain_notifications, listener)
                    released = RELEASED in payloads
                except psycopg.Error:
                    await close()
                    released = True
                changed(released)
        finally:
            if listener is not None:
                with trio.CancelScope(shield=True):
                    await close()

    # -- opening and closing -------------------------------------------------------------

    async def _check_schema(self) -> None:
        version = await self._run(None, schema_version)
        if version > STORE_SCHEMA_VERSION:
            raise newer_schema(version, self._params)
        if version < STORE_SCHEMA_VERSION:
            found = "no pi-runtime schema" if version == 0 else f"store schema {version}"
            raise JournalError(
                ReasonCode.STORE_SCHEMA_MISSING,
                f"the database {describe(self._params)} has {found}; this pi-runtime needs "
                f"version {STORE_SCHEMA_VERSION}: run `pi-runtime db migrate` first",
            )

    async def _release(self) -> None:
        """Close every log, then every connection (each after its call in flight)."""
        first: BaseException | None = None
        for log in list(self._open.values()):
            try:
                await log.aclose()
            except Exception as exc:  # pragma: no cover - aclose only waits
                first = first or exc
        self._open.clear()
        self._closed = True
        for connection in [self._shared, self._leases, *self._pool]:
            try:
                await connection.aclose()
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first


def _decode_rows(
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


def _decode_shared_rows(
    rows: list[tuple[int, bytes]], *, rel: str, kind: LogKind | None, poison: Poison | None
) -> tuple[LogContents, list[int]]:
    """A shared log's rows decoded as :func:`_decode_rows` decodes a log's, but for the holes
    a compaction leaves (RT11: it deletes finished deliveries' rows, never the header nor the
    last row, so the next number stays where every host expects it): the log's live records
    (``records[0]`` the header; not indexed by number) and the number of each."""
    if not rows or rows[0][0] != 0:
        raise JournalError(
            ReasonCode.JOURNAL_HEADER_MISSING, "the header row (0) is missing", path=rel, offset=0
        )
    head = decode_log(rows[0][1], rel=rel, kind=kind)
    records, numbers = _decode_runs(rows[1:], rel=rel, offset=head.good_length)
    good_length = head.good_length + sum(len(frame) for _seq, frame in rows[1:])
    contents = LogContents(rel, (*head.records, *records), good_length, 0, poison)
    return contents, [0, *numbers]


def _decode_runs(
    rows: list[tuple[int, bytes]], *, rel: str, offset: int
) -> tuple[list[Record], list[int]]:
    """Rows of a shared log, holes allowed (:func:`_decode_shared_rows`), decoded a run of
    consecutive numbers at a time, each as :func:`_decode_tail` checks it (every row holds
    the record of its own number, alone): the records and the number of each."""
    records: list[Record] = []
    numbers: list[int] = []
    start = 0
    while start < len(rows):
        end = start + 1
        while end < len(rows) and rows[end][0] == rows[end - 1][0] + 1:
            end += 1
        first = rows[start][0]
        records += _decode_tail(rows[start:end], rel=rel, first_seq=first, offset=offset)
        numbers += range(first, first + end - start)
        offset += sum(len(frame) for _seq, frame in rows[start:end])
        start = end
    return records, numbers


def _decode_tail(
    rows: list[tuple[int, bytes]], *, rel: str, first_seq: int, offset: int
) -> list[Record]:
    """The records of a log's rows from ``first_seq`` on (:meth:`PgLog.refresh`), checked
    as :func:`_decode_rows` checks a whole log; ``offset`` is where the rows begin in the
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


def _local_root(root: Path | str) -> Path:
    path = Path(root).absolute()
    _prepare_root(path)
    return path


@contextlib.asynccontextmanager
async def open_pg_store(
    dsn: str,
    *,
    root: Path | str,
    clocks: Clocks | None = None,
    connections: int = 2,
    retry: Backoff = DEFAULT_RETRY,
    exclusive: bool = False,
    owner: str | None = None,
) -> AsyncIterator[PgStore]:
    """Use the PostgreSQL store in the database ``dsn`` names for the duration of the block.

    ``exclusive``: hold the database's owner lock for the block (PG14: a host serving it);
    another exclusive store on the same database is refused ``store_locked``.

    ``root`` is this host's local state directory (sessions, sockets; created 0700 if
    missing, refused if others can read it): the store keeps no journal file there.
    ``connections`` is the number of pooled connections beside the one of the shared logs.
    ``retry`` bounds how long work whose connection broke or could not be made is tried
    again (a :class:`~runtime._clock.Backoff`, :data:`DEFAULT_RETRY` by default; opening the
    store too) before the store fails. ``owner``: this host's name in the lease rows
    (default: :func:`new_owner_id`).

    Refuses a database without the store's schema (``store_schema_missing``: run
    ``pi-runtime db migrate``) or with a newer one (``store_schema_newer``), and one that
    cannot be reached (``store_unavailable``). Reads the shared logs: damage in one raises
    :class:`JournalError` and nothing starts.

    Resource handling: on exit, however the block ends (cancelled too), every open log is
    closed and every connection closed, shielded; the first error of that is raised after
    all of it ran.
    """
    clocks = clocks or Clocks.system()
    params = parse_dsn(dsn)
    path = await trio.to_thread.run_sync(_local_root, root)
    store = PgStore(params, path, clocks, connections, retry, owner)
    holder: Conn | None = None
    try:
        if exclusive:
            holder = await trio.to_thread.run_sync(_own, params)
        await store._check_schema()
        # RT11: the generation before the logs are read, what was expired since after: so
        # what the logs no longer hold is known, and nothing expired before is held in memory
        store.generation = await store._run(None, _generation)
        store.admissions = await store._open_or_create(ADMISSIONS, LogKind.ADMISSIONS, "admissions")
        store.results = await store._open_or_create(RESULTS, LogKind.RESULTS, "results")
        await store.sync_expired()
        yield store
    finally:
        with trio.CancelScope(shield=True):
            try:
                await store._release()
            finally:
                if holder is not None:
                    await trio.to_thread.run_sync(holder.close)


@contextlib.asynccontextmanager
async def open_pg_reader(dsn: str) -> AsyncIterator[PgStore]:
    """:func:`open_pg_store` for a command that is not a host (``journal``, ``cancel``): its
    local root a temporary directory, removed on the way out (nothing local is read)."""
    root = Path(await trio.to_thread.run_sync(lambda: tempfile.mkdtemp(prefix="pi-runtime-")))
    try:
        async with open_pg_store(dsn, root=root) as store:
            yield store
    finally:
        await trio.to_thread.run_sync(lambda: shutil.rmtree(root, ignore_errors=True))


def _listen(params: Mapping[str, Any]) -> Conn:
    conn = connect(params)
    try:
        conn.execute(f"LISTEN {CHANNEL}")
    except BaseException:
        conn.close()
        raise
    return conn


def _drain_notifications(conn: Conn) -> set[str]:
    """Read what the server sent the listener (without waiting); the announcements'
    payloads. A broken connection raises the driver's error."""
    return {notify.payload for notify in conn.notifies(timeout=0)}


def new_owner_id() -> str:
    """A name for this host's life in the lease rows: its host name, process id and a random
    part (a process id is reused; a host started again is a new owner)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


OWNER_LOCK: Final = 0x70692D72756E  # "pi-run": the database-wide lock of PG14
"""The key of the session advisory lock an exclusive store holds for its whole life (PG14)."""


def _own(params: Mapping[str, Any]) -> Conn:
    """A connection holding the store's owner lock (PG14), or ``store_locked``."""
    conn = connect(params)
    try:
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", [OWNER_LOCK]).fetchone()
    except BaseException:
        conn.close()
        raise
    if row is None or not row[0]:
        conn.close()
        raise JournalError(
            ReasonCode.STORE_LOCKED,
            f"another host holds the database {describe(params)}; until lanes are leased "
            "(docs/design/scale-out.md S10) one host serves one database",
        )
    return conn


if TYPE_CHECKING:

    def _is_a_journal_store(store: PgStore) -> JournalStore:
        return store  # mypy: PgStore satisfies the interface

    def _is_a_log(log: PgLog) -> Log:
        return log

    def _is_a_lease_store(store: PgStore) -> LeaseStore:
        return store
