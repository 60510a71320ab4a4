"""The storage conformance suite: the journal invariants of ``docs/design/journal.md`` against
every journal store, through the store interface only (``runtime/_journal/_interface.py``).

Each test runs on the file store (a real state directory, real fsync) and on the PostgreSQL store
(a real, throw-away PostgreSQL from ``pgserver``, a fresh database per test). What a test may not
do through the interface — damage a stored record, make the next write fail — it asks of the
backend (:class:`Backend`), which does it the way that store would really meet it: a flipped
byte in the file or in the row, a failing ``write(2)`` (``tests/faultfs.py``) or an insert the
database server refuses.

Test names cite the invariants: ``test_sc_j<N>_*`` checks J<N> of journal.md on every store.
Invariants that are the file store's alone (torn tails of a file, fdatasync, the directory
lock: J3, J6, J9 to J11) stay in ``tests/journal/test_store*.py``.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest
import trio

from runtime._clock import Clocks, MockWallClock, SystemSilenceClock
from runtime._config import RetentionConfig
from runtime._errors import JournalError, ReasonCode
from runtime._journal._frame import HEADER_SIZE, encode_frame, scan
from runtime._journal._interface import JournalStore
from runtime._journal._journal import encode_record
from runtime._journal._postgres import PgStore, open_pg_store
from runtime._journal._store import Store, delivery_key, lane_key, open_store
from runtime._linux._fs import OsFileSystem
from runtime._records import SCHEMA_VERSION, Header, LogKind, OutboxAction, Record
from runtime._retention import follow_forget_days

from ..faultfs import Fault, FaultyFileSystem
from .pg_fixtures import execute

LIMIT: Final = 20.0


def _action(log: str, n: int) -> OutboxAction:
    return OutboxAction(
        action_id=f"{log}:{n}", kind="test", state="done", detail={"n": n, "pad": "x" * (n % 5)}
    )


# -- backends -----------------------------------------------------------------------------


@dataclass
class Backend:
    """One store under test, and the raw access its tests need."""

    name: str
    open: Callable[[], contextlib.AbstractAsyncContextManager[JournalStore]]
    damage: Callable[[str, int], Awaitable[None]]
    """Flip one byte inside record ``seq`` of log ``rel`` (the store is closed)."""
    put_frame: Callable[[str, int, bytes], Awaitable[None]]
    """Store a raw frame as record ``seq`` of log ``rel``: in its place, or after the last
    (the store is closed)."""
    break_writes: Callable[[JournalStore], Awaitable[None]]
    """Make the store's next append fail (the store is open)."""
    mend_writes: Callable[[], Awaitable[None]]
    """Let appends succeed again."""
    open_at: Callable[[Clocks], contextlib.AbstractAsyncContextManager[JournalStore]]
    """:attr:`open` with these clocks (a wall clock a test moves days on)."""


class _FileBackend:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.faulty = FaultyFileSystem(OsFileSystem(), armed=False)

    @contextlib.asynccontextmanager
    async def open(self, clocks: Clocks | None = None) -> AsyncIterator[JournalStore]:
        self.faulty.disarm()
        async with open_store(self.root, fs=self.faulty, clocks=clocks) as store:
            yield store

    async def damage(self, rel: str, seq: int) -> None:
        path = self.root / rel
        data = bytearray(await trio.to_thread.run_sync(path.read_bytes))
        frame = next(f for f in scan(bytes(data)).frames if f.first_seq == seq)
        data[frame.offset + HEADER_SIZE + len(frame.body) // 2] ^= 0x40
        await trio.to_thread.run_sync(path.write_bytes, bytes(data))

    async def put_frame(self, rel: str, seq: int, frame: bytes) -> None:
        path = self.root / rel
        data = await trio.to_thread.run_sync(path.read_bytes)
        scanned = scan(data)
        if seq == scanned.next_seq:
            await trio.to_thread.run_sync(path.write_bytes, data + frame)
            return
        old = next(f for f in scanned.frames if f.first_seq == seq)
        spliced = data[: old.offset] + frame + data[old.offset + HEADER_SIZE + len(old.body) :]
        await trio.to_thread.run_sync(path.write_bytes, spliced)

    async def break_writes(self, store: JournalStore) -> None:
        await trio.lowlevel.checkpoint()
        self.faulty.arm(Fault("write", 1, "before", errno.EINVAL))  # not the disk: EINVAL

    async def mend_writes(self) -> None:
        await trio.lowlevel.checkpoint()
        self.faulty.disarm()


def _file(tmp_path: Path) -> Backend:
    files = _FileBackend(tmp_path / "state")
    return Backend(
        "file",
        files.open,
        files.damage,
        files.put_frame,
        files.break_writes,
        files.mend_writes,
        files.open,
    )


class _PgBackend:
    """The PostgreSQL store on a fresh, migrated database (``pg_fixtures.py``): damage is a
    changed byte in the row, a failing write one the server refuses (a raising trigger: a
    dropped connection is not a failed write there, it is reconnected and resolved, PG11)."""

    def __init__(self, dsn: str, root: Path) -> None:
        self.dsn = dsn
        self.root = root

    @contextlib.asynccontextmanager
    async def open(self, clocks: Clocks | None = None) -> AsyncIterator[JournalStore]:
        async with open_pg_store(self.dsn, root=self.root, clocks=clocks) as store:
            yield store

    async def damage(self, rel: str, seq: int) -> None:
        (frame,) = await self._frame(rel, seq)
        data = bytearray(frame)
        data[HEADER_SIZE + (len(data) - HEADER_SIZE) // 2] ^= 0x40
        await self._write(rel, seq, bytes(data))

    async def put_frame(self, rel: str, seq: int, frame: bytes) -> None:
        if await self._frame(rel, seq):
            await self._write(rel, seq, frame)
            return
        await execute(
            self.dsn,
            "INSERT INTO pi_runtime.log_records (log, seq, frame) VALUES (%s, %s, %s)",
            [rel, seq, frame],
        )

    async def break_writes(self, store: JournalStore) -> None:
        """The server refuses every later insert of a record (what a write error is to it)."""
        await execute(
            self.dsn,
            "CREATE OR REPLACE FUNCTION public.refuse_write() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'the test refuses this write'; END $$",
        )
        await execute(
            self.dsn,
            "CREATE TRIGGER refuse BEFORE INSERT ON pi_runtime.log_records "
            "FOR EACH ROW EXECUTE FUNCTION public.refuse_write()",
        )

    async def mend_writes(self) -> None:
        await execute(self.dsn, "DROP TRIGGER IF EXISTS refuse ON pi_runtime.log_records")

    async def _frame(self, rel: str, seq: int) -> list[bytes]:
        rows = await execute(
            self.dsn,
            "SELECT frame FROM pi_runtime.log_records WHERE log = %s AND seq = %s",
            [rel, seq],
        )
        return [bytes(row[0]) for row in rows]

    async def _write(self, rel: str, seq: int, frame: bytes) -> None:
        await execute(
            self.dsn,
            "UPDATE pi_runtime.log_records SET frame = %s WHERE log = %s AND seq = %s",
            [frame, rel, seq],
        )


def _postgresql(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    pg = _PgBackend(request.getfixturevalue("pg_dsn"), tmp_path / "state")
    return Backend(
        "postgresql", pg.open, pg.damage, pg.put_frame, pg.break_writes, pg.mend_writes, pg.open
    )


BACKENDS: Final[dict[str, Callable[[pytest.FixtureRequest, Path], Backend]]] = {
    "file": lambda request, tmp_path: _file(tmp_path),
    "postgresql": _postgresql,
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return BACKENDS[request.param](request, tmp_path)


def test_sc_both_stores_are_journal_stores() -> None:
    """Both stores satisfy the interface the suite speaks (checked by mypy here)."""
    stores: list[Callable[[Store], JournalStore] | Callable[[PgStore], JournalStore]] = [
        lambda store: store,
        lambda store: store,
    ]
    assert len(stores) == 2


# -- J1, J2: durable before acknowledged; reopening gives exactly what was acknowledged ----


async def _fill(store: JournalStore) -> dict[str, list[Record]]:
    """Append to one log of each kind; what each holds after its header."""
    written: dict[str, list[Record]] = {}
    delivery = await store.create_delivery_log("d0")
    lane = await store.open_lane_log("dm:1")
    for journal in (delivery, lane, store.admissions, store.results):
        records: list[Record] = [_action(journal.rel, n) for n in range(3)]
        for record in records:
            seq = await journal.append(record)
            assert seq == journal.next_seq - 1
        written[journal.rel] = records
    await store.close_log(delivery)
    await store.close_log(lane)
    return written


async def test_sc_j1_j2_appends_come_back_exactly_after_reopening(backend: Backend) -> None:
    """J1, J2: every acknowledged append comes back after the store is closed and opened
    again — the same records, in order, under the same sequence numbers (the header is 0)."""
    with trio.fail_after(LIMIT):
        async with backend.open() as store:
            written = await _fill(store)
        async with backend.open() as store:
            for rel, records in written.items():
                contents = await store.read(rel)
                assert isinstance(contents.records[0], Header), rel
                assert list(contents.records[1:]) == records, rel
            reopened = await store.open_delivery_log("d0")
            assert reopened.next_seq == 4
            assert await reopened.append(_action("d0", 9)) == 4
            await store.close_log(reopened)
        async with backend.open() as store:
            assert (await store.read_delivery_log("d0")).records[-1] == _action("d0", 9)


async def test_sc_j2_a_delivery_log_is_created_once(backend: Backend) -> None:
    """J2: creating a delivery log that holds records is refused; opening-or-creating it
    opens what it holds."""
    with trio.fail_after(LIMIT):
        async with backend.open() as store:
            log = await store.create_delivery_log("d0")
            await log.append(_action("d0", 1))
            await store.close_log(log)
            with pytest.raises(FileExistsError):
                await store.create_delivery_log("d0")
            again = await store.open_or_create_delivery_log("d0")
            assert list(again.contents.records[1:]) == [_action("d0", 1)]
            await store.close_log(again)


async def test_sc_j19_a_second_create_of_an_open_log_is_in_use_not_corrupt(
    backend: Backend,
) -> None:
    """J19: creating a delivery's log while it is open (the first create's journal in hand)
    is refused ``journal_in_use`` naming the log — never ``journal_corrupt``, which sends an
    operator looking for a damaged disk when the log is healthy — and the log is left as it
    was: the open journal appends on, and a read finds its records."""
    with trio.fail_after(LIMIT):
        async with backend.open() as store:
            log = await store.create_delivery_log("d0")
            await log.append(_action("d0", 1))
            with pytest.raises(JournalError) as info:
                await store.create_delivery_log("d0")
            assert info.value.code is ReasonCode.JOURNAL_IN_USE
            assert info.value.path == log.rel
            await log.append(_action("d0", 2))
            await store.close_log(log)
            contents = await store.read_delivery_log("d0")
            assert list(contents.records[1:]) == [_action("d0", 1), _action("d0", 2)]


async def test_sc_j2_appends_after_the_store_closed_are_refused(backend: Backend) -> None:
    """J2: once its store is closed, a log takes no more appends (``journal_closed``)."""
    with trio.fail_after(LIMIT):
        async with backend.open() as store:
            log = await store.create_delivery_log("d0")
        with pytest.raises(JournalError) as info:
            await log.append(_action("d0", 1))
        assert info.value.code is ReasonCode.JOURNAL_CLOSED


# -- J4: damage fails closed, with its code ------------------------------------------------


@pytest.mark.parametrize("which", ["middle", "last"])
async def test_sc_j4_a_flipped_byte_fails_closed(backend: Backend, which: str) -> None:
    """J4 (J3): one flipped byte in a stored record — in the middle of the log, or in its
    last, complete record — fails the log closed, ``journal_corrupt`` naming it, on read and
    on open; it is never taken for a torn tail and never skipped."""
    with trio.fail_after(LIMIT):
        async with backend.open() as store:
            await _fill(store)
            rel = store.delivery_rel("d0")
        await backend.damage(rel, 2 if which == "middle" else 3)
        async with backend.open() as store:
            for attempt in (store.read_delivery_log, store.open_delivery_log):
                with pytest.raises(JournalError) as info:
                    await attempt("d0")
                assert info.value.code is ReasonCode.JOURNAL_CORRUPT
                assert rel in str(info.value)


async def test_sc_j4_an_unknown_record_type_is_refused(backend: Backend) -> None:
    """J4: a valid record of a type this version does not know is refused
    ``journal_unknown_record``, never skipped."""
    with trio.fail_after(LIMIT):
        async with backend.open() as store:
            await _fill(store)
            rel = store.delivery_rel("d0")
        await backend.put_frame(rel, 4, encode_frame(4, [b'{"type":"from_the_future","x":1}']))
        async with backend.open() as store:
            with pytest.raises(JournalError) as info:
                await store.read_delivery_log("d0")
            assert info.value.code is ReasonCode.JOURNAL_UNKNOWN_RECORD


async def test_sc_j4_a_sequence_gap_is_refused(backend: Backend) -> None:
    """J4: a record that does not continue the sequence is refused ``journal_sequence_gap``."""
    with trio.fail_after(LIMIT):
        async with backend.open() as store:
            await _fill(store)
            rel = store.delivery_rel("d0")
        await backend.put_frame(rel, 4, encode_frame(6, [encode_record(_action("x", 6))]))
        async with backend.open() as store:
            with pytest.raises(JournalError) as info:
                await store.read_delivery_log("d0")
            assert info.value.code is ReasonCode.JOURNAL_SEQUENCE_GAP


async def test_sc_j4_a_newer_schema_version_is_refused(backend: Backend) -> None:
    """J4: a log whose header names a newer schema than this version knows is refused
    ``journal_version_unsupported``."""
    future = Header(
        schema_version=SCHEMA_VERSION + 1, kind=LogKind.DELIVERY, subject="d0", created_ms=1
    )
    with trio.fail_after(LIMIT):
        async with backend.open() as store:
            await _fill(store)
            rel = store.delivery_rel("d0")
        await backend.put_frame(rel, 0, encode_frame(0, [encode_record(future)]))
        async with backend.open() as store:
            with pytest.raises(JournalError) as info:
                await store.open_delivery_log("d0")
            assert info.value.code is ReasonCode.JOURNAL_VERSION_UNSUPPORTED


# -- J5: a failed write poisons that log, and only that log -------------------------------


async def test_sc_j5_a_failed_append_poisons_only_its_log(backend: Backend) -> None:
    """J5: an append that fails poisons its log: it raises, every later append to that log is
    refused ``journal_poisoned``, the log is refused for appending after a reopen too, and it
    still reads back exactly what was acknowledged before the failure. Another log opened
    afterwards is untouched."""
    with trio.fail_after(LIMIT):
        async with backend.open() as store:
            log = await store.create_delivery_log("d0")
            await log.append(_action("d0", 1))
            await backend.break_writes(store)
            with pytest.raises(JournalError):
                await log.append(_action("d0", 2))
            assert log.poisoned
            with pytest.raises(JournalError) as info:
                await log.append(_action("d0", 3))
            assert info.value.code is ReasonCode.JOURNAL_POISONED
            with contextlib.suppress(JournalError):
                await store.close_log(log)
        await backend.mend_writes()
        async with backend.open() as store:
            with pytest.raises(JournalError) as info:
                await store.open_delivery_log("d0")
            assert info.value.code is ReasonCode.JOURNAL_POISONED
            contents = await store.read_delivery_log("d0")
            assert list(contents.records[1:]) == [_action("d0", 1)]
            other = await store.create_delivery_log("d1")
            assert await other.append(_action("d1", 1)) == 1
            await store.close_log(other)


async def test_sc_j22_a_poisoned_log_removed_by_retention_never_poisons_its_name_again(
    backend: Backend,
) -> None:
    """J22: a poisoned delivery log removed by retention (its result published long ago) goes
    with its poison; a delivery admitted again under the id once it was forgotten gets a new
    log under the same name, which appends, reopens and reads as its own records, never as
    the old log's poison (the file store kept ``<log>.poison``: the new delivery's log read
    as poisoned, cut at the old one's length)."""
    with trio.fail_after(LIMIT):
        async with backend.open() as store:
            log = await store.create_delivery_log("d0")
            for n in range(1, 4):
                await log.append(_action("old", n))
            await backend.break_writes(store)
            with pytest.raises(JournalError):
                await log.append(_action("old", 4))
            assert log.poisoned
            with contextlib.suppress(JournalError):
                await store.close_log(log)
        await backend.mend_writes()
        async with backend.open() as store:
            assert await store.remove_logs([store.delivery_rel("d0")]) == 1
            again = await store.create_delivery_log("d0")
            assert await again.append(_action("new", 1)) == 1
            await store.close_log(again)
        async with backend.open() as store:
            contents = await store.read_delivery_log("d0")
            assert contents.poison is None
            assert list(contents.records[1:]) == [_action("new", 1)]
            reopened = await store.open_delivery_log("d0")
            assert await reopened.append(_action("new", 2)) == 2
            await store.close_log(reopened)


# -- J7: documents are replaced whole ------------------------------------------------------


async def test_sc_j7_documents_are_replaced_whole(backend: Backend) -> None:
    """J7: a document reads back as the last write, whole, after a reopen; a missing one is
    ``None``."""
    with trio.fail_after(LIMIT):
        async with backend.open() as store:
            assert await store.read_document("lanes/state.json") is None
            await store.write_document("lanes/state.json", b"one")
            await store.write_document("lanes/state.json", b"two" * 1000)
        async with backend.open() as store:
            assert await store.read_document("lanes/state.json") == b"two" * 1000


# -- J8: concurrent appends to a shared log ------------------------------------------------


async def test_sc_j8_concurrent_admissions_get_distinct_consecutive_seqs(
    backend: Backend,
) -> None:
    """J8: many producers appending to the shared admission log at once each get their own
    sequence number, the numbers are consecutive, and every record is there after a reopen."""
    seqs: dict[int, Record] = {}
    with trio.fail_after(LIMIT):
        async with backend.open() as store:
            start = store.admissions.next_seq

            async def produce(p: int) -> None:
                for n in range(5):
                    record = _action(f"p{p}", n)
                    seqs[await store.admissions.append(record)] = record

            async with trio.open_nursery() as nursery:
                for p in range(8):
                    nursery.start_soon(produce, p)
        assert sorted(seqs) == list(range(start, start + 40))
        async with backend.open() as store:
            contents = await store.read(store.admissions.rel)
            assert {seq: contents.records[seq] for seq in seqs} == seqs


async def test_sc_j8_next_seq_is_where_the_next_append_lands_with_appends_in_flight(
    backend: Backend,
) -> None:
    """J8: a writer that reads a log's ``next_seq`` and appends at once lands there even while
    other appends to the log are in flight (the gate names a tool intent after the number it
    will get: a lane's own record appended beside it must not take that number)."""
    landed: list[tuple[int, int]] = []
    with trio.fail_after(LIMIT):
        async with backend.open() as store:
            log = await store.open_lane_log("task:seq")

            async def write(n: int) -> None:
                expected = log.next_seq
                landed.append((expected, await log.append(_action("seq", n))))

            async with trio.open_nursery() as nursery:
                for n in range(12):
                    nursery.start_soon(write, n)
            await store.close_log(log)
    assert [expected for expected, _ in landed] == [seq for _, seq in landed]
    assert sorted(seq for _, seq in landed) == list(range(1, 13))


# -- RT4, RT11-RT13: an expired id is held back forget_days from its own time -------------

DAY_MS: Final = 86_400_000
T0: Final = 1_795_000_000_000


def _retention(forget_days: int) -> RetentionConfig:
    return RetentionConfig(journal_days=7, idempotency_days=30, forget_days=forget_days)


async def _expire(store: JournalStore, delivery: str, task: str, since_ms: int, days: int) -> None:
    """Expire ``delivery`` and ``task`` (each since ``since_ms``) as a retention pass of a
    host configured with ``forget_days`` = ``days`` does on this store: the file store's
    filters rewritten; on PostgreSQL a compaction of the shared rows and a task lane's expiry,
    then the pass's letting go of those past their days."""
    forget_ms = days * DAY_MS
    if isinstance(store, Store):
        await store.expire({delivery: since_ms}, forget_ms=forget_ms)
        await store.expire_tasks({task: since_ms}, forget_ms=forget_ms)
        return
    assert isinstance(store, PgStore)
    fence = await store.claim("retention:shared", 60)
    assert fence is not None
    expire = {delivery: since_ms}
    done = await store.compact_shared(
        fence, slim={}, admissions=[], results=[], expire=expire, forget_ms=forget_ms
    )
    assert done is not None
    await store.release(fence)
    fence = await store.claim(f"task:{task}", 60)
    assert fence is not None
    assert await store.expire_task(task, since_ms, forget_ms=forget_ms, fence=fence)
    await store.release(fence)
    await store.forget_expired_tasks()


async def _held(store: JournalStore, delivery: str, task: str) -> tuple[bool, bool]:
    """Whether a duplicate of ``delivery`` and a submission of ``task`` are refused as
    expired now, as the store answers the host's decision: the file store's filters; on
    PostgreSQL what a host that has not seen the expiry asks the database (a ``cancel``, a
    refused admission, a submission whose lane log is absent)."""
    task_key = lane_key(f"task:{task}")
    if isinstance(store, Store):
        now = store.clocks.wall.time_ms()
        return (
            store.expired.holds(delivery_key(delivery), now_ms=now),
            store.expired_tasks.holds(task_key, now_ms=now),
        )
    assert isinstance(store, PgStore)
    return (
        bool(await store.expired_among([delivery])),
        bool(await store.expired_task_keys([task_key])),
    )


@pytest.mark.parametrize(
    ("first_days", "then_days"),
    [(40, 40), (400, 40), (40, 400)],
    ids=["unchanged", "lowered", "raised"],
)
async def test_sc_rt4_rt13_an_expired_id_follows_forget_days_at_once(
    backend: Backend, first_days: int, then_days: int
) -> None:
    """RT4 (file store), RT11 and RT13 (PostgreSQL), same scenario, same answers: a delivery
    and a task published and ended at day 0 are expired at day 31 by a host configured with
    ``forget_days`` = ``first_days``; a host started at day 41 with ``then_days`` asks at
    once, and again at day 62 after it expired another delivery and task (a rewrite, a
    compaction, a pass). Past their ``forget_days`` (40, from day 0) both are let go at
    once; within them (400) both are refused at both times. Before, PostgreSQL kept the
    forget-after time a row was written with and a lookup ignored it: an id past its time
    was still refused until a later compaction or pass, a lowered ``forget_days`` held it to
    the old one, and a raised one let the next compaction or pass forget it at day 40 —
    a duplicate inside the configured window would then run again as new."""
    wall = MockWallClock.reading(T0 + 31 * DAY_MS)  # day 31
    clocks = Clocks(silence=SystemSilenceClock(), wall=wall)
    with trio.fail_after(LIMIT):
        async with backend.open_at(clocks) as store:
            await follow_forget_days(store, _retention(first_days))
            await _expire(store, "a1", "t1", T0, first_days)
            day31 = await _held(store, "a1", "t1")
        wall.advance(10 * DAY_MS / 1000)
        async with backend.open_at(clocks) as store:
            await follow_forget_days(store, _retention(then_days))  # a host's start
            day41 = await _held(store, "a1", "t1")
            wall.advance(21 * DAY_MS / 1000)
            await _expire(store, "a2", "t2", T0 + 31 * DAY_MS, then_days)
            day62 = await _held(store, "a1", "t1")
            others = await _held(store, "a2", "t2")
    assert day31 == (True, True)
    assert others == (True, True)
    if then_days > 62:
        assert (day41, day62) == ((True, True), (True, True))
    else:
        assert (day41, day62) == ((False, False), (False, False))
