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
from .._records import SCHEMA_VERSION, Header, LogKind, Record, ends_at
from ._fence import Fence, Lease
from ._frame import encode_frame
from ._interface import JournalStore, LeaseStore, Log, SharedRows
from ._journal import (
    LogContents,
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
    connect,
    describe,
    parse_dsn,
    redact_dsn,
    server_reason,
)
from ._pg_log import PgLog
from ._pg_rows import (
    ANNOUNCE,
    CLAIM,
    COMPACT_BEGIN,
    COMPACT_DELETE,
    COMPACT_END,
    COMPACT_EXPIRE,
    COMPACT_FORGET,
    COMPACT_SLIM,
    COUNT_FOR_UPDATE,
    COUNT_WITH,
    DELETE_DOCUMENTS,
    DELETE_DOCUMENTS_AND_PARTS,
    DELETE_LOG,
    DELETE_LOGS,
    DOCUMENTS,
    EXPIRE_TASK,
    EXPIRE_TASK_AGAIN,
    EXPIRED_AMONG,
    EXPIRED_SINCE,
    EXPIRED_TASKS_AMONG,
    FENCE_HOLDS,
    FORGET_TASK,
    FORGET_TASKS,
    INSERT_LOG,
    LANE_LOGS,
    LEASE,
    LEASE_WORKTREE,
    LOG_EXISTS,
    LOG_NAMES,
    READ_DOCUMENT,
    RELEASE,
    RELEASE_WORKTREE,
    RENEW,
    SHARED,
    SWEEP_DOCUMENTS,
    WORKTREE_HOLDERS,
    WORKTREE_LOCK,
    WRITE_DOCUMENT,
    WRITE_DOCUMENT_FENCED,
    Changed,
    compaction_generation,
    decode_rows,
    decode_shared_rows,
    fence_params,
    like_prefix,
    read_rows,
)
from ._pg_schema import (
    CHANNEL,
    RELEASED,
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
        every admission is written under it (:data:`GUARD`)."""
        self.expired: dict[str, int] = {}
        """RT4, RT11: the deliveries expired since this store was opened — id to the time a
        duplicate is no longer refused (``delivery_expired``) for it, counted with
        :attr:`forget_ms` — as of :attr:`generation`; a decision compares that time with
        the wall clock (an entry past it is let go, though still listed until the next
        look). Those expired before are not held (a year of them would be millions):
        :meth:`expired_among` asks the database, and an admission of one is refused by the
        database itself (:data:`GUARD`)."""
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
        rows, document = await self._run(rel, read_rows(rel))
        if not rows and document is None:
            raise FileNotFoundError(f"{rel} holds no record")
        poison = None if document is None else decode_poison(document, path=rel, what="poison row")
        if rel in SHARED and rows:
            contents, _numbers = decode_shared_rows(rows, rel=rel, kind=kind, poison=poison)
            return contents, rows[-1][0] + 1
        contents = decode_rows(rows, rel=rel, kind=kind, poison=poison)
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
            row = conn.execute(LOG_EXISTS, {"log": rel}).fetchone()
            return bool(row and row[0])

        return await self._run(rel, exists)

    async def log_names(self) -> list[str]:
        """The names of every log (its header row, or its poison), sorted."""

        def names(conn: Conn) -> list[str]:
            return [str(row[0]) for row in conn.execute(LOG_NAMES).fetchall()]

        return await self._run(None, names)

    async def lane_logs(self) -> list[str]:
        """The names of every lane log, sorted."""

        def names(conn: Conn) -> list[str]:
            return [str(row[0]) for row in conn.execute(LANE_LOGS).fetchall()]

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
                conn.execute(WRITE_DOCUMENT, [rel, data])
                return True
            params = [rel, data, *fence_params(fence)]
            return conn.execute(WRITE_DOCUMENT_FENCED, params).fetchone() is not None

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
            pattern = like_prefix(prefix)
            rows = conn.execute(DOCUMENTS, [pattern], binary=True).fetchall()
            return {str(name): bytes(data) for name, data in rows}

        return await self._run(prefix, read)

    async def remove_logs(self, rels: Sequence[str]) -> int:
        """Remove the logs ``rels`` — their rows and any poison — in one statement (retention,
        docs/design/retention.md RT11: logs nothing will read again); how many were there.
        Idempotent: two hosts removing the same logs remove them once."""

        def delete(conn: Conn) -> int:
            row = conn.execute(DELETE_LOGS, [list(rels), list(rels)]).fetchone()
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
            params = [like_prefix(prefix), list(keep), idle_seconds]
            return conn.execute(SWEEP_DOCUMENTS, params).rowcount

        return await self._run(prefix, delete)

    async def delete_documents(self, names: Sequence[str], *, with_parts: bool = False) -> None:
        """Remove the named documents (those absent are no matter): one statement.
        ``with_parts``: and every document named ``<name>@…`` (S36)."""

        def delete(conn: Conn) -> None:
            conn.execute(
                DELETE_DOCUMENTS_AND_PARTS if with_parts else DELETE_DOCUMENTS, [list(names)]
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
                return conn.execute(EXPIRED_SINCE, [self.generation]).fetchall()

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
            rows = conn.execute(EXPIRED_AMONG, [list(delivery_ids), now]).fetchall()
            return {str(d): int(until) for d, until in rows}

        return await self._run(None, read) if delivery_ids else {}

    async def learn_expired(self, delivery_ids: Sequence[str]) -> dict[str, int]:
        """:meth:`sync_expired`, and those of ``delivery_ids`` that expired before this
        store was opened (an admission the guard refused: :data:`GUARD`), now in
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
                row = conn.execute(COUNT_FOR_UPDATE).fetchone()
                assert row is not None, "migration 7 inserts the row"
                before = None if row[0] is None else int(row[0])
                if before != forget_ms:
                    conn.execute(COUNT_WITH, [forget_ms])
                    conn.execute(COMPACT_END)  # every host looks again
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
        rows, document = await self._run(rel, read_rows(rel))
        if document is not None:
            raise JournalError(
                ReasonCode.JOURNAL_POISONED, "the log was poisoned; not compacted", path=rel
            )
        contents, numbers = decode_shared_rows(rows, rel=rel, kind=kind, poison=None)
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
                row = conn.execute(COMPACT_BEGIN, fence_params(fence)).fetchone()
                if row is None:
                    return None
                generation = int(row[0])
                if seqs:
                    conn.execute(COMPACT_SLIM, [seqs, frames, ADMISSIONS])
                for rel, numbers in ((ADMISSIONS, admissions), (RESULTS, results)):
                    if numbers:
                        conn.execute(COMPACT_DELETE, [rel, list(numbers)])
                conn.execute(COMPACT_FORGET, [now])
                if expire:
                    params = [forget_ms, generation, list(expire), list(expire.values())]
                    conn.execute(COMPACT_EXPIRE, params)
                conn.execute(COMPACT_END)
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
                if conn.execute(FENCE_HOLDS, fence_params(fence)).fetchone() is None:
                    return False
                gone = [int(row[0]) for row in conn.execute(DELETE_LOG, [rel]).fetchall()]
                if max(gone, default=-1) != next_seq - 1 or len(gone) != next_seq:
                    raise Changed  # rolled back: a later pass reads it again
                conn.execute(INSERT_LOG, [rel, frames])
                return True

        self._open.pop(rel, None)
        try:
            return await self._run(rel, slim)
        except Changed:
            return False

    async def expire_task(
        self, task_id: str, since_ms: int, *, forget_ms: int, fence: Fence
    ) -> bool:
        """Record the task ``task_id`` expired from ``since_ms`` (its end: held back
        ``forget_days`` from it, RT4, RT13; ``forget_ms``, the caller's, counts only while no
        host has recorded one) and remove its lane log (its rows and any poison) in one
        transaction while ``fence`` — the claim of its lane a retention pass made — holds.
        Whether this call recorded it (``False``: the fence no longer held, or it was expired
        already). Idempotent. A row of the lane held back still — an earlier task's under
        the same id, let go at its time and held back again by a raised ``forget_days`` or
        a clock set back — is this task's from now on: it counts from the later time (RT4,
        RT19), never from the earlier task's end.

        **Only this task's** (RT13, RT19 e): the lane log, read in the transaction under the
        fence (its lease row locked for share: nothing claims the lane or writes to it until
        the transaction ends), must be absent or end with this task's end (a ``TaskEnded``
        at ``since_ms``); a log that holds another task under the id — a later one, the id
        let go and submitted again while a host still remembers the earlier task, live or
        ended — is left whole and nothing is recorded (``False``)."""
        subject = f"task:{task_id}"
        rel = self.lane_rel(subject)
        now = self.clocks.wall.time_ms()

        def expire(conn: Conn) -> bool:
            with conn.transaction():
                if conn.execute(FENCE_HOLDS, fence_params(fence)).fetchone() is None:
                    return False
                if not _ends_at(read_rows(rel)(conn), rel, since_ms):
                    return False  # another task's log under the id: not ours to expire
                key = lane_key(subject)
                conn.execute(FORGET_TASK, [key, now])
                params = [key, task_id, since_ms, since_ms + forget_ms]
                recorded = conn.execute(EXPIRE_TASK, params).rowcount == 1
                if not recorded:  # RT19: a row held back still may be an earlier task's
                    params = [since_ms, since_ms + forget_ms, key, since_ms, since_ms + forget_ms]
                    recorded = conn.execute(EXPIRE_TASK_AGAIN, params).rowcount == 1
                conn.execute(DELETE_LOGS, [[rel], [rel]])
                conn.execute(RELEASE_WORKTREE, [task_id])  # S33: ended long ago
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
        inside = like_prefix(path.rstrip("/") + "/")

        def lease(conn: Conn) -> list[str]:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", [WORKTREE_LOCK])
                rows = conn.execute(WORKTREE_HOLDERS, [task_id, around, inside]).fetchall()
                if rows:
                    return [str(row[0]) for row in rows]
                conn.execute(LEASE_WORKTREE, [task_id, path])
                return []

        return await self._run(None, lease)

    async def release_worktree(self, task_id: str) -> None:
        """The task ``task_id`` holds no worktree any more (it ended, S33). Idempotent."""
        await self._run(None, lambda conn: conn.execute(RELEASE_WORKTREE, [task_id]))

    async def forget_expired_tasks(self) -> int:
        """Remove the rows of the expired tasks past their days (on this host's wall clock,
        counted with the database's ``forget_days``): a submission under such an id is new
        again — as it is from their time on already, for every lookup. How many."""
        now = self.clocks.wall.time_ms()
        return await self._run(None, lambda conn: conn.execute(FORGET_TASKS, [now]).rowcount)

    async def expired_task_keys(self, keys: Sequence[str]) -> dict[str, int]:
        """Which of the lane keys ``keys`` (``lane_key(f"task:{id}")``) name a task the
        database holds as expired now (RT13) — held back at this host's wall clock, counted
        with the database's ``forget_days`` (RT4) — each with the time it is let go."""
        now = self.clocks.wall.time_ms()

        def read(conn: Conn) -> dict[str, int]:
            rows = conn.execute(EXPIRED_TASKS_AMONG, [list(keys), now]).fetchall()
            return {str(key): int(until) for key, until in rows}

        return await self._run(None, read) if keys else {}

    async def announce(self) -> None:
        """Tell every host watching the shared logs to look again (S23, S26): sent at once."""
        await self._run(None, lambda conn: conn.execute(ANNOUNCE))

    async def read_document(self, rel: str) -> bytes | None:
        def read(conn: Conn) -> bytes | None:
            row = conn.execute(READ_DOCUMENT, [rel], binary=True).fetchone()
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
            row = conn.execute(CLAIM, params).fetchone()
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

        def renew(conn: Conn) -> set[tuple[str, int]]:
            params = {
                "lanes": [fence.lane for fence in mine],
                "epochs": [fence.epoch for fence in mine],
                "owner": self.owner,
                "ttl": ttl,
            }
            rows = conn.execute(RENEW, params).fetchall()
            return {(str(row[0]), int(row[1])) for row in rows}

        held = await self._on_leases(renew)  # by lane and epoch: an older epoch is not held
        return {fence for fence in mine if (fence.lane, fence.epoch) in held}

    async def release(self, fence: Fence) -> None:
        """Give ``fence``'s lease up (it runs out now; its epoch stays spent)."""

        def release(conn: Conn) -> None:
            conn.execute(RELEASE, [fence.lane, fence.owner, fence.epoch])

        await self._on_leases(release)

    async def lease(self, lane: str) -> Lease | None:
        """Who holds ``lane``'s lease now, by the database's clock (``None``: never
        claimed)."""
        key = self.lane_rel(lane)

        def lease(conn: Conn) -> Lease | None:
            row = conn.execute(LEASE, [key]).fetchone()
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
        store.generation = await store._run(None, compaction_generation)
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


def _ends_at(rows: tuple[list[tuple[int, bytes]], bytes | None], rel: str, ended_ms: int) -> bool:
    """Whether the task lane log ``rel`` (its rows as :func:`read_rows` reads them) is absent
    or holds the end of the task that ended at ``ended_ms`` (RT13, RT19 e)."""
    frames, document = rows
    if not frames:  # absent (expired already); a poison row alone goes with it, as before
        return True
    poison = None if document is None else decode_poison(document, path=rel, what="poison row")
    contents = decode_rows(frames, rel=rel, kind=None, poison=poison)
    return ends_at(contents.records, ended_ms)
