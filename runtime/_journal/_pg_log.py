"""An open log of the PostgreSQL store (:class:`PgLog`, ``docs/design/postgres-store.md``):
its appends committed one at a time in call order, or a shared log's group-committed (S22);
an append whose outcome is unknown resolved on a new connection, never guessed; fenced by
its lane's lease (S11); poisoned on a definite refusal (J5).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol, TypeVar

import psycopg
import psycopg.errors
import trio

from .._clock import Backoff, Clocks
from .._errors import DiskFailedError, JournalError, ReasonCode
from .._records import Admission, Poison, Record
from ._fence import Fence
from ._frame import encode_frame
from ._journal import (
    LogContents,
    decode_poison,
    encode_record,
)
from ._pg_connection import (
    Broken,
    Closed,
    Conn,
    Connection,
    RolledBack,
    Unreachable,
    Unsettled,
    Vanished,
    server_reason,
)
from ._pg_rows import (
    NEVER,
    POISON,
    POISON_FENCED,
    SHARED,
    Landed,
    decode_runs,
    decode_tail,
    fence_params,
    insert_group,
    insert_record,
    read_rows,
    resolve_group,
    resolve_record,
)
from ._store import ADMISSIONS

__all__ = ["GROUP_MAX", "LogOwner", "PgLog"]

_T = TypeVar("_T")


class LogOwner(Protocol):
    """What a log uses of the store that opened it (:class:`~runtime._journal._postgres.PgStore`,
    which imports this module, so a log names it by this)."""

    clocks: Clocks
    retry: Backoff
    generation: int
    _closed: bool
    _params: dict[str, Any]

    def _unavailable(self, problem: str, rel: str | None = None) -> DiskFailedError: ...
    async def _retrying(self, connection: Connection, fn: Callable[[Conn], _T]) -> _T: ...
    async def _run(
        self,
        rel: str | None,
        fn: Callable[[Conn], _T],
        *,
        connection: Connection | None = None,
        store_failure: bool = True,
    ) -> _T: ...
    def _forget(self, log: PgLog) -> None: ...
    async def sync_expired(self) -> dict[str, int]: ...
    async def learn_expired(self, delivery_ids: Sequence[str]) -> dict[str, int]: ...


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
    Obtain one from :class:`~runtime._journal._postgres.PgStore`; do not construct it."""

    def __init__(
        self,
        store: LogOwner,
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
        learned (:data:`GUARD`); refused, it is decided again as a lost number is."""

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
                self._rel, read_rows(self._rel, after=self._next_seq)
            )
            if document is not None:
                poison = decode_poison(document, path=self._rel, what="poison row")
                self._refusal = JournalError(
                    ReasonCode.JOURNAL_POISONED,
                    f"the log was poisoned ({poison.reason}); it accepts no more records",
                    path=self._rel,
                )
            if self._rel in SHARED:  # RT11: a compaction may have left holes
                records, _ = decode_runs(rows, rel=self._rel, offset=self._good_length)
            else:
                records = decode_tail(
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
        refused them (:data:`GUARD`; ``keys``: the delivery id each admits)."""
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
        if landed is Landed.FENCED:
            assert fence is not None
            raise self._fenced(fence)
        if landed is Landed.REFUSED:  # RT11: learn why before anything decides again
            await self._store.learn_expired([k for k in keys if k])
            return None
        if landed is Landed.THEIRS:
            if shared:
                return None
            raise self._conflict(seq)
        self.commits += 1
        self._next_seq = seq + len(frames)
        self._good_length += sum(len(frame) for frame in frames)
        return seq

    async def _commit(
        self, seq: int, frames: list[bytes], fence: Fence | None, keys: list[str]
    ) -> Landed:
        """Commit the rows ``(rel, seq…, frames)`` under ``fence`` (a group of more than one:
        unfenced, in one statement). Retried under the store's policy while the connection
        breaks or cannot be made, or the server rolls an attempt back for a passing reason (a
        cancel, a timeout, a deadlock: :class:`RolledBack`); once an attempt was sent (its
        outcome unknown) every later one resolves it (:func:`resolve_record`), shielded from
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
                    work = (resolve_record if sent else insert_record)(
                        self._rel, seq, frames[0], fence
                    )
                else:
                    assert fence is None
                    many = resolve_group if sent else insert_group
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
        good_seq = NEVER if self._rel in SHARED else self._next_seq
        fenced = fence is not None and self._rel not in SHARED

        def record(conn: Conn) -> None:
            if fenced:
                params = [self._rel, good_seq, reason, document, *fence_params(fence)]
                conn.execute(POISON_FENCED, params)
            else:
                conn.execute(POISON, [self._rel, good_seq, reason, document])

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
