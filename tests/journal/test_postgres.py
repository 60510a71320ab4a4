"""The PostgreSQL journal store (``runtime/_journal/_postgres.py``,
``docs/design/postgres-store.md``) on a real, throw-away PostgreSQL (``pg_fixtures.py``): its
schema and migrations, how a record is stored, conflicts, poison, an unreachable database, the
DSN's password, ``pi-runtime db migrate``. What both stores must do alike is in
``test_conformance_stores.py``.

No test sleeps on the real clock: a connection broken under the store is terminated by an
admin connection that waits until it is gone (``terminate_backends``); a commit whose outcome
is unknown is made by a trigger that ends its own backend at ``COMMIT``, or by a proxy that
drops the request or the answer and closes the connection (``cutting_proxy``); a database
restart waits on ``pg_ctl`` (``stop_server``, ``start_server``). The store's own retries wait
on Trio's clock, under a fast policy (``FAST``) where a test makes them fail.
"""

from __future__ import annotations

import json
import logging
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
import trio
from psycopg.conninfo import conninfo_to_dict

from runtime._cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from runtime._clock import Backoff
from runtime._errors import DiskFailedError, JournalError, PiRuntimeError, ReasonCode
from runtime._journal._frame import HEADER_SIZE, encode_frame
from runtime._journal._interface import JournalStore, Log
from runtime._journal._journal import encode_record
from runtime._journal._postgres import (
    DEFAULT_RETRY,
    STORE_SCHEMA_VERSION,
    PgStore,
    migrate,
    open_pg_store,
    redact_dsn,
)
from runtime._journal._store import ADMISSIONS, Store
from runtime._records import Header, LogKind, OutboxAction, Record

from .pg_fixtures import (
    PostgresServer,
    admin_dsn,
    cutting_proxy,
    database_name,
    execute,
    start_server,
    stop_server,
    terminate_backends,
)

LIMIT: Final = 30.0
SECRET: Final = "s3cr3t-Pa55"
FAST: Final = Backoff(attempts=5, first_delay=0.001, max_delay=0.01)
"""Retries that end within a few hundredths of a second (the tests that spend them)."""


def _action(n: int) -> OutboxAction:
    return OutboxAction(action_id=f"a:{n}", kind="test", state="done", detail={"n": n})


def _texts(error: BaseException) -> Iterator[str]:
    """The text of ``error`` and of every exception chained to it."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield str(current)
        yield repr(current)
        todo += [current.__cause__, current.__context__]


async def _rows(dsn: str, rel: str) -> list[tuple[int, bytes]]:
    rows = await execute(
        dsn, "SELECT seq, frame FROM pi_runtime.log_records WHERE log = %s ORDER BY seq", [rel]
    )
    return [(int(seq), bytes(frame)) for seq, frame in rows]


def test_the_postgresql_store_is_a_journal_store() -> None:
    """The store satisfies the interface (mypy checks the assignment)."""
    checked: type[JournalStore] = PgStore
    assert checked.delivery_rel("d1") == Store.delivery_rel("d1")
    assert checked.lane_rel("dm:1") == Store.lane_rel("dm:1")


# -- the schema ---------------------------------------------------------------------------


async def test_migrate_is_idempotent_and_versioned(pg_blank_dsn: str) -> None:
    """``migrate`` creates the schema and records its version in a one-row table; run again
    (also by several processes at once) it changes nothing and answers the same version."""
    with trio.fail_after(LIMIT):
        assert await migrate(pg_blank_dsn) == STORE_SCHEMA_VERSION == 7
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(migrate, pg_blank_dsn)
        assert await migrate(pg_blank_dsn) == STORE_SCHEMA_VERSION
        assert await execute(pg_blank_dsn, "SELECT version FROM pi_runtime.schema_version") == [
            (STORE_SCHEMA_VERSION,)
        ]
        tables = await execute(
            pg_blank_dsn,
            "SELECT tablename FROM pg_tables WHERE schemaname = 'pi_runtime' ORDER BY 1",
        )
        assert tables == [
            ("compaction",),
            ("documents",),
            ("expired_deliveries",),
            ("expired_tasks",),
            ("lanes",),
            ("log_poison",),
            ("log_records",),
            ("receipt_documents",),
            ("receipt_revisions",),
            ("receipts",),
            ("retention",),
            ("schema_version",),
            ("task_worktrees",),
        ]


async def test_a_newer_schema_is_refused_and_left_alone(pg_dsn: str, tmp_path: Path) -> None:
    """A database migrated by a newer pi-runtime is refused ``store_schema_newer`` by
    ``open_pg_store`` and by ``migrate``, which leaves it as it is."""
    await execute(pg_dsn, "UPDATE pi_runtime.schema_version SET version = version + 1")
    with trio.fail_after(LIMIT):
        with pytest.raises(JournalError) as opened:
            async with open_pg_store(pg_dsn, root=tmp_path / "state"):
                pass  # pragma: no cover - refused
        assert opened.value.code is ReasonCode.STORE_SCHEMA_NEWER
        assert "upgrade pi-runtime" in str(opened.value)
        with pytest.raises(JournalError) as migrated:
            await migrate(pg_dsn)
        assert migrated.value.code is ReasonCode.STORE_SCHEMA_NEWER
        newer = await execute(pg_dsn, "SELECT version FROM pi_runtime.schema_version")
        assert newer == [(STORE_SCHEMA_VERSION + 1,)]


async def test_a_missing_schema_is_refused(pg_blank_dsn: str, tmp_path: Path) -> None:
    """A database without the schema is refused ``store_schema_missing``, and the message
    says what to run; nothing is created in it."""
    with trio.fail_after(LIMIT):
        with pytest.raises(JournalError) as info:
            async with open_pg_store(pg_blank_dsn, root=tmp_path / "state"):
                pass  # pragma: no cover - refused
    assert info.value.code is ReasonCode.STORE_SCHEMA_MISSING
    assert "pi-runtime db migrate" in str(info.value)
    schemas = await execute(
        pg_blank_dsn, "SELECT nspname FROM pg_namespace WHERE nspname = 'pi_runtime'"
    )
    assert schemas == []


# -- logs and documents -------------------------------------------------------------------


async def test_append_and_reopen_round_trip(pg_dsn: str, tmp_path: Path) -> None:
    """J1, J2 on PostgreSQL: appended records come back after a reopen, in order, under the
    same names as the file store's; each row holds exactly the file store's frame of its one
    record (the header is row 0); the local state directory is made 0700 and holds no log."""
    root = tmp_path / "state"
    written: dict[str, list[Record]] = {}
    with trio.fail_after(LIMIT):
        async with open_pg_store(pg_dsn, root=root) as store:
            delivery = await store.create_delivery_log("d1")
            lane = await store.open_lane_log("dm:1")
            for log in (delivery, lane, store.admissions, store.results):
                written[log.rel] = [_action(n) for n in range(3)]
                for n, record in enumerate(written[log.rel]):
                    assert await log.append(record) == n + 1
                assert log.next_seq == 4
            await store.close_log(delivery)
            await store.close_log(lane)
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        assert list(root.iterdir()) == []
        assert sorted(written) == sorted(
            [
                Store.delivery_rel("d1"),
                Store.lane_rel("dm:1"),
                "admissions/admissions.log",
                "results.log",
            ]
        )
        async with open_pg_store(pg_dsn, root=root) as store:
            for rel, records in written.items():
                contents = await store.read(rel)
                header = contents.records[0]
                assert isinstance(header, Header)
                assert list(contents.records[1:]) == records
                rows = await _rows(pg_dsn, rel)
                assert rows == [
                    (seq, encode_frame(seq, [encode_record(record)]))
                    for seq, record in enumerate(contents.records)
                ]
                assert contents.good_length == sum(len(frame) for _seq, frame in rows)
            assert (await store.read_delivery_log("d1")).header.kind is LogKind.DELIVERY
            reopened = await store.open_delivery_log("d1")
            assert reopened.next_seq == 4
            assert await reopened.append(_action(9)) == 4
            await store.close_log(reopened)
            assert store.admissions.next_seq == 4
            with pytest.raises(FileNotFoundError):
                await store.open_delivery_log("never")
            with pytest.raises(FileNotFoundError):
                await store.read("deliveries/none.log")
            with pytest.raises(FileExistsError):
                await store.create_delivery_log("d1")
            assert store.disk_failure is None


async def test_documents_exists_and_lane_logs(pg_dsn: str, tmp_path: Path) -> None:
    """J7 on PostgreSQL: a document reads back as the last write, whole; a missing one is
    ``None``. ``exists`` tells a created log; ``lane_logs`` lists every lane log, sorted."""
    with trio.fail_after(LIMIT):
        async with open_pg_store(pg_dsn, root=tmp_path / "state") as store:
            assert await store.read_document("cancel-requests.json") is None
            await store.write_document("cancel-requests.json", b"[]")
            await store.write_document("cancel-requests.json", b"\x00\xff" * 5000)
            assert not await store.exists(Store.lane_rel("dm:1"))
            lanes = [await store.open_lane_log(lane) for lane in ("dm:1", "dm:2", "task:t1")]
            await store.create_delivery_log("d1")
            assert await store.exists(Store.lane_rel("dm:1"))
            assert await store.lane_logs() == sorted(log.rel for log in lanes)
        async with open_pg_store(pg_dsn, root=tmp_path / "state") as store:
            assert await store.read_document("cancel-requests.json") == b"\x00\xff" * 5000


async def test_concurrent_appends_to_one_log_are_ordered(pg_dsn: str, tmp_path: Path) -> None:
    """J8 (without group commit): producers appending to one log at once each get their own
    number, the numbers are consecutive and each row holds the record it was given."""
    seqs: dict[int, Record] = {}
    with trio.fail_after(LIMIT):
        async with open_pg_store(pg_dsn, root=tmp_path / "state") as store:
            lane = await store.open_lane_log("dm:1")

            async def produce(p: int) -> None:
                for n in range(4):
                    record = _action(10 * p + n)
                    seqs[await lane.append(record)] = record

            async with trio.open_nursery() as nursery:
                for p in range(5):
                    nursery.start_soon(produce, p)
            contents = await store.read(lane.rel)
    assert sorted(seqs) == list(range(1, 21))
    assert {seq: contents.records[seq] for seq in seqs} == seqs


@pytest.mark.parametrize("damage", ["bit_middle", "bit_last", "cut_last", "seq_mismatch"])
async def test_a_damaged_row_fails_closed(pg_dsn: str, tmp_path: Path, damage: str) -> None:
    """J4 on PostgreSQL: a flipped bit in a row, a last row cut short (a torn tail in a file,
    but a row is never torn), a row whose ``seq`` is not its record's: ``journal_corrupt``,
    naming the log, on read and on open; never a shorter log."""
    root = tmp_path / "state"
    with trio.fail_after(LIMIT):
        async with open_pg_store(pg_dsn, root=root) as store:
            log = await store.create_delivery_log("d1")
            for n in range(3):
                await log.append(_action(n))
        rel = Store.delivery_rel("d1")
        rows = dict(await _rows(pg_dsn, rel))
        if damage == "seq_mismatch":  # the frames still run 0, 1, 2, 3
            await execute(
                pg_dsn,
                "UPDATE pi_runtime.log_records SET seq = 7 WHERE log = %s AND seq = 3",
                [rel],
            )
        else:
            seq = 1 if damage == "bit_middle" else 3
            frame = bytearray(rows[seq])
            if damage == "cut_last":
                frame = frame[:-1]
            else:
                frame[HEADER_SIZE + 5] ^= 0x04
            await execute(
                pg_dsn,
                "UPDATE pi_runtime.log_records SET frame = %s WHERE log = %s AND seq = %s",
                [bytes(frame), rel, seq],
            )
        async with open_pg_store(pg_dsn, root=root) as store:
            for attempt in (store.read_delivery_log, store.open_delivery_log):
                with pytest.raises(JournalError) as info:
                    await attempt("d1")
                assert info.value.code is ReasonCode.JOURNAL_CORRUPT
                assert rel in str(info.value)


# -- another writer -----------------------------------------------------------------------


async def test_a_conflicting_writers_append_is_refused(pg_dsn: str, tmp_path: Path) -> None:
    """Two stores on one database (no leases yet): when both append the same record of a log,
    the second is refused ``journal_conflict`` and appends no more to it (``journal_poisoned``
    in that process only); the first goes on, and nothing is marked poisoned in the
    database."""
    with trio.fail_after(LIMIT):
        async with (
            open_pg_store(pg_dsn, root=tmp_path / "a") as first,
            open_pg_store(pg_dsn, root=tmp_path / "b") as second,
        ):
            mine = await first.create_delivery_log("d1")
            with pytest.raises(FileExistsError):
                await second.create_delivery_log("d1")
            theirs = await second.open_delivery_log("d1")
            assert await mine.append(_action(1)) == 1
            with pytest.raises(JournalError) as info:
                await theirs.append(_action(100))
            assert info.value.code is ReasonCode.JOURNAL_CONFLICT
            assert theirs.poisoned
            with pytest.raises(JournalError) as later:
                await theirs.append(_action(101))
            assert later.value.code is ReasonCode.JOURNAL_POISONED
            assert await mine.append(_action(2)) == 2
            # the shared admission log: each store numbers on from what it read at open
            assert await first.admissions.append(_action(1)) == 1
            with pytest.raises(JournalError) as shared:
                await second.admissions.append(_action(1))
            assert shared.value.code is ReasonCode.JOURNAL_CONFLICT
            assert first.disk_failure is second.disk_failure is None
        assert await execute(pg_dsn, "SELECT log FROM pi_runtime.log_poison") == []
        async with open_pg_store(pg_dsn, root=tmp_path / "a") as store:
            contents = await store.read_delivery_log("d1")
            assert list(contents.records[1:]) == [_action(1), _action(2)]


# -- a broken connection: the outcome resolved (PG5) --------------------------------------


async def _count_inserts(dsn: str, rel: str, seq: int) -> None:
    """Count every row ``(rel, seq)`` the server inserts, committed or not (a sequence is not
    transactional): read it with :func:`_inserts`."""
    await execute(dsn, "CREATE SEQUENCE public.inserts")
    await execute(
        dsn,
        """CREATE FUNCTION public.count_insert() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN PERFORM nextval('public.inserts'); RETURN NULL; END $$""",
    )
    await execute(
        dsn,
        f"""CREATE TRIGGER count_insert AFTER INSERT ON pi_runtime.log_records FOR EACH ROW
            WHEN (NEW.log = '{rel}' AND NEW.seq = {seq})
            EXECUTE FUNCTION public.count_insert()""",
    )


async def _inserts(dsn: str) -> int:
    rows = await execute(
        dsn, "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM public.inserts"
    )
    return int(rows[0][0])


async def _assert_exactly(dsn: str, rel: str, records: list[Record]) -> None:
    """The log ``rel`` holds exactly its header and ``records``, each once at its seq, and
    nothing is poisoned."""
    rows = await _rows(dsn, rel)
    assert [seq for seq, _frame in rows] == list(range(len(records) + 1))
    assert [frame for _seq, frame in rows[1:]] == [
        encode_frame(seq, [encode_record(record)]) for seq, record in enumerate(records, 1)
    ]
    assert await execute(dsn, "SELECT log FROM pi_runtime.log_poison") == []


async def test_a_terminated_connection_is_reconnected_and_the_append_lands_once(
    pg_dsn: str, tmp_path: Path
) -> None:
    """PG5: the store's connections are terminated under it (as by an operator, or a server
    that ends idle sessions); the next append finds its connection broken, cannot know
    whether the server got it, and resolves it on a new connection — it lands exactly once,
    on every log (the shared admission log too), nothing is poisoned, no disk failure, and
    a reopen gives exactly what was acknowledged."""
    root = tmp_path / "state"
    with trio.fail_after(LIMIT):
        async with open_pg_store(pg_dsn, root=root, retry=FAST) as store:
            log = await store.create_delivery_log("d1")
            assert await log.append(_action(1)) == 1
            assert await store.admissions.append(_action(1)) == 1
            assert await terminate_backends(pg_dsn) >= 2
            assert await log.append(_action(2)) == 2
            assert await store.admissions.append(_action(2)) == 2
            assert await log.append(_action(3)) == 3
            assert not log.poisoned
            assert not store.admissions.poisoned
            assert store.disk_failure is None
            await store.close_log(log)
        await _assert_exactly(pg_dsn, log.rel, [_action(1), _action(2), _action(3)])
        await _assert_exactly(pg_dsn, store.admissions.rel, [_action(1), _action(2)])
        async with open_pg_store(pg_dsn, root=root) as store:
            reopened = await store.open_delivery_log("d1")
            assert list(reopened.contents.records[1:]) == [_action(1), _action(2), _action(3)]
            assert await reopened.append(_action(4)) == 4
            assert store.admissions.next_seq == 3


async def test_an_unknown_commit_outcome_is_resolved_on_a_new_connection(
    pg_dsn: str, tmp_path: Path
) -> None:
    """PG5, at ``COMMIT``: the connection dies while the server commits (a deferred trigger
    ends its own backend, once), so the store cannot know whether the record committed. It
    did not (the backend died before its commit record); the store finds the row absent on a
    new connection and inserts it again: the server inserted the row twice (the trigger
    counts), it is there once, the append returns its number, nothing is poisoned."""
    rel = Store.delivery_rel("d1")
    await _count_inserts(pg_dsn, rel, 2)
    await execute(pg_dsn, "CREATE SEQUENCE public.die_once")
    await execute(
        pg_dsn,
        """CREATE FUNCTION public.die_once() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN
               IF nextval('public.die_once') = 1 THEN
                   PERFORM pg_terminate_backend(pg_backend_pid());
               END IF;
               RETURN NULL;
           END $$""",
    )
    await execute(
        pg_dsn,
        f"""CREATE CONSTRAINT TRIGGER die AFTER INSERT ON pi_runtime.log_records
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
            WHEN (NEW.log = '{rel}' AND NEW.seq = 2) EXECUTE FUNCTION public.die_once()""",
    )
    with trio.fail_after(LIMIT):
        async with open_pg_store(pg_dsn, root=tmp_path / "state", retry=FAST) as store:
            log = await store.create_delivery_log("d1")
            assert await log.append(_action(1)) == 1
            assert await log.append(_action(2)) == 2
            assert await _inserts(pg_dsn) == 2  # the first died uncommitted, the second held
            assert await log.append(_action(3)) == 3
            assert not log.poisoned
            assert store.disk_failure is None
        await _assert_exactly(pg_dsn, rel, [_action(1), _action(2), _action(3)])
        async with open_pg_store(pg_dsn, root=tmp_path / "state") as store:
            reopened = await store.open_delivery_log("d1")
            assert list(reopened.contents.records[1:]) == [_action(1), _action(2), _action(3)]


async def test_a_commit_the_client_never_heard_of_is_acknowledged(
    pg_dsn: str, tmp_path: Path
) -> None:
    """PG5, after ``COMMIT``: the server committed the record, and the connection was cut
    before its answer reached the store (a proxy drops the answer and closes the
    connection). The store finds the row, with exactly its bytes, on a new connection and
    acknowledges it without inserting it again: the server inserted it once, the append
    returns its number, the next one follows it, nothing is poisoned."""
    rel = Store.delivery_rel("d1")
    await _count_inserts(pg_dsn, rel, 2)
    with trio.fail_after(LIMIT):
        async with (
            cutting_proxy(pg_dsn) as proxy,
            open_pg_store(proxy.dsn, root=tmp_path / "state", retry=FAST) as store,
        ):
            log = await store.create_delivery_log("d1")
            assert await log.append(_action(1)) == 1
            connections = proxy.connections
            proxy.cut_next("reply")
            assert await log.append(_action(2)) == 2
            assert proxy.cuts == 1
            assert proxy.connections == connections + 1  # resolved on a new connection
            assert await _inserts(pg_dsn) == 1  # found, not inserted again
            assert await log.append(_action(3)) == 3
            assert store.disk_failure is None
        await _assert_exactly(pg_dsn, rel, [_action(1), _action(2), _action(3)])


@pytest.mark.parametrize("found", ["nothing", "this record", "another record"])
async def test_an_unknown_outcome_is_resolved_by_the_row_found(
    pg_dsn: str, tmp_path: Path, found: str
) -> None:
    """PG5, the resolution itself, against a real row: the append's request is lost (a proxy
    drops it and closes the connection: the server never saw it, the store cannot know) and
    the row ``(log, 2)`` is, on the new connection, absent (inserted: acknowledged), present
    with exactly this record's bytes (written by another connection: taken as this append's
    commit, acknowledged, not inserted again), or present with other bytes (another writer's
    record: ``journal_conflict``, the log takes no more appends here, nothing recorded)."""
    rel = Store.delivery_rel("d1")
    theirs = _action(100) if found == "another record" else _action(2)
    with trio.fail_after(LIMIT):
        async with (
            cutting_proxy(pg_dsn) as proxy,
            open_pg_store(proxy.dsn, root=tmp_path / "state", retry=FAST) as store,
        ):
            log = await store.create_delivery_log("d1")
            assert await log.append(_action(1)) == 1
            if found != "nothing":
                await execute(
                    pg_dsn,
                    "INSERT INTO pi_runtime.log_records VALUES (%s, 2, %s)",
                    [rel, encode_frame(2, [encode_record(theirs)])],
                )
            proxy.cut_next("request")
            if found == "another record":
                with pytest.raises(JournalError) as info:
                    await log.append(_action(2))
                assert info.value.code is ReasonCode.JOURNAL_CONFLICT
                assert log.poisoned
            else:
                assert await log.append(_action(2)) == 2
                assert not log.poisoned
            assert proxy.cuts == 1
            assert store.disk_failure is None
        await _assert_exactly(pg_dsn, rel, [_action(1), theirs])


async def test_a_database_restart_under_load_loses_nothing(
    pg_server: PostgresServer, pg_dsn: str, tmp_path: Path
) -> None:
    """Issue #19: the database restarts (``pg_ctl stop -m fast``, then started again) while
    tasks append to a delivery log, a lane log and the shared admission log, every producer
    in the middle of an append while it is down. Every append returns its number (the retry
    policy bridges the restart); afterwards each log holds every acknowledged record exactly
    once at its number and nothing else, nothing is poisoned, the store never failed, and
    the store opens again and takes appends on every log."""
    root = tmp_path / "state"
    policy = Backoff(attempts=400, first_delay=0.005, max_delay=0.1)  # about 40 s
    acked: dict[str, dict[int, Record]] = {}
    inside: set[int] = set()
    every_one_inside = trio.Event()
    enough = trio.Event()
    down = restarted = False
    with trio.fail_after(3 * LIMIT):
        async with open_pg_store(pg_dsn, root=root, retry=policy) as store:
            logs = [
                await store.create_delivery_log("d1"),
                await store.open_lane_log("dm:1"),
                store.admissions,
            ]
            producers = [log for log in logs for _ in range(2)]
            for log in logs:
                acked[log.rel] = {}

            async def produce(p: int, log: Log) -> None:
                after = n = 0
                while after < 5:
                    record = _action(1000 * p + n)
                    n += 1
                    inside.add(p)
                    if down and len(inside) == len(producers):
                        every_one_inside.set()
                    since_restart = restarted
                    seq = await log.append(record)
                    inside.discard(p)
                    assert seq not in acked[log.rel]
                    acked[log.rel][seq] = record
                    after += since_restart
                    if sum(map(len, acked.values())) >= 20:
                        enough.set()

            try:
                async with trio.open_nursery() as nursery:
                    for p, log in enumerate(producers):
                        nursery.start_soon(produce, p, log)
                    await enough.wait()
                    old = await _store_backends(pg_dsn)
                    await stop_server(pg_server)
                    down = True
                    if len(inside) == len(producers):
                        every_one_inside.set()
                    await every_one_inside.wait()
                    await start_server(pg_server)
                    down, restarted = False, True
            finally:
                with trio.CancelScope(shield=True):
                    await start_server(pg_server)  # the next tests need it (a no-op if up)
            assert store.disk_failure is None
            assert not any(log.poisoned for log in logs)
            assert old
            assert old.isdisjoint(await _store_backends(pg_dsn))  # every session was new
        for log in logs:
            records = [acked[log.rel][seq] for seq in sorted(acked[log.rel])]
            assert sorted(acked[log.rel]) == list(range(1, len(records) + 1))
            await _assert_exactly(pg_dsn, log.rel, records)
        async with open_pg_store(pg_dsn, root=root) as store:
            assert store.admissions.next_seq == len(acked[ADMISSIONS]) + 1
            delivery = await store.open_delivery_log("d1")
            lane = await store.open_lane_log("dm:1")
            for log in (delivery, lane, store.admissions):
                assert await log.append(_action(99)) == len(acked[log.rel]) + 1
            assert store.disk_failure is None


async def _store_backends(dsn: str) -> set[int]:
    rows = await execute(
        dsn,
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND application_name = 'pi-runtime'",
    )
    return {int(pid) for (pid,) in rows}


# -- a definite refusal poisons (J5) ------------------------------------------------------


@pytest.mark.parametrize("refusal", ["trigger", "another constraint"])
async def test_a_refused_append_poisons_the_log(pg_dsn: str, tmp_path: Path, refusal: str) -> None:
    """J5 on PostgreSQL: the server refuses an append (a trigger raises; a unique index that
    is not the key refuses it) — a definite answer, not a broken connection, so nothing is
    retried: every later append is refused ``journal_poisoned``, the poison is recorded in
    the database (with the last good record), a reopen refuses the log for appending, and
    reading it gives exactly what was acknowledged. The database is still reachable: other
    logs work, no disk failure."""
    root = tmp_path / "state"
    refuse, named = {
        "trigger": (
            """CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS $$
               BEGIN
                   IF NEW.seq = 2 THEN RAISE EXCEPTION 'the test refuses record 2'; END IF;
                   RETURN NEW;
               END $$;
               CREATE TRIGGER refuse BEFORE INSERT ON pi_runtime.log_records
               FOR EACH ROW EXECUTE FUNCTION public.refuse()""",
            "RaiseException",
        ),
        "another constraint": (
            "CREATE UNIQUE INDEX one_record ON pi_runtime.log_records (log) WHERE seq >= 1",
            "UniqueViolation",
        ),
    }[refusal]
    with trio.fail_after(LIMIT):
        async with open_pg_store(pg_dsn, root=root, retry=FAST) as store:
            log = await store.create_delivery_log("d1")
            assert await log.append(_action(1)) == 1
            await execute(pg_dsn, refuse)
            with pytest.raises(JournalError) as info:
                await log.append(_action(2))
            assert info.value.code is ReasonCode.JOURNAL_POISONED
            assert log.poisoned
            with pytest.raises(JournalError) as later:
                await log.append(_action(3))
            assert later.value.code is ReasonCode.JOURNAL_POISONED
            other = await store.create_delivery_log("d2")
            assert await other.append(_action(1)) == 1
            assert store.disk_failure is None
        poison = await execute(pg_dsn, "SELECT log, good_seq, reason FROM pi_runtime.log_poison")
        assert [(rel, good) for rel, good, _reason in poison] == [(log.rel, 2)]
        assert named in poison[0][2]
        async with open_pg_store(pg_dsn, root=root) as store:
            with pytest.raises(JournalError) as reopened:
                await store.open_delivery_log("d1")
            assert reopened.value.code is ReasonCode.JOURNAL_POISONED
            with pytest.raises(JournalError) as again:
                await store.open_or_create_delivery_log("d1")
            assert again.value.code is ReasonCode.JOURNAL_POISONED
            with pytest.raises(FileExistsError):
                await store.create_delivery_log("d1")
            contents = await store.read_delivery_log("d1")
            assert list(contents.records[1:]) == [_action(1)]
            assert contents.poison is not None
            assert contents.poison.good_length == contents.good_length


# -- an unreachable database --------------------------------------------------------------


async def test_an_unreachable_database_stops_admissions(pg_dsn: str, tmp_path: Path) -> None:
    """The database stops taking connections and the store's are terminated: the next
    append retries under the store's policy (here a fast one) and, once it is spent, raises
    ``store_unavailable``; the store's ``disk_failure`` is set, so the host stops admitting;
    a read is refused with it too, and the log takes no more appends in this process. No
    poison is written (the database cannot be reached, and the row is not there: the log
    reads as what committed). Once the database takes connections again, the store opens
    and the log takes appends. No error names the DSN's password."""
    dsn = f"{pg_dsn}&password={SECRET}"
    admin, database = admin_dsn(pg_dsn), database_name(pg_dsn)
    with trio.fail_after(LIMIT):
        async with open_pg_store(dsn, root=tmp_path / "state", retry=FAST) as store:
            log = await store.open_lane_log("dm:1")
            await execute(admin, f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
            try:
                await terminate_backends(pg_dsn)
                with pytest.raises(DiskFailedError) as info:
                    await log.append(_action(1))
                assert info.value.code is ReasonCode.STORE_UNAVAILABLE
                assert f"in {FAST.attempts} attempts" in str(info.value)
                assert log.poisoned
                failure = store.disk_failure
                assert failure is info.value
                assert "not currently accepting connections" in str(failure)
                with pytest.raises(DiskFailedError) as read:
                    await store.read(log.rel)
                assert read.value.code is ReasonCode.STORE_UNAVAILABLE
                with pytest.raises(JournalError) as later:
                    await log.append(_action(2))
                assert later.value.code is ReasonCode.JOURNAL_POISONED
                errors: list[BaseException] = [info.value, read.value, later.value]
                assert not [text for e in errors for text in _texts(e) if SECRET in text]
            finally:
                await execute(admin, f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
        assert await execute(pg_dsn, "SELECT log FROM pi_runtime.log_poison") == []
        async with open_pg_store(dsn, root=tmp_path / "state") as store:
            reopened = await store.open_lane_log("dm:1")
            assert list(reopened.contents.records[1:]) == []
            assert await reopened.append(_action(1)) == 1


def test_the_retry_policy_is_bounded() -> None:
    """The default policy waits 0.1 s first, doubling up to 5 s, about 21 s in all; a policy
    that would never try or never wait sensibly is refused."""
    assert [DEFAULT_RETRY.delay(n) for n in range(1, DEFAULT_RETRY.attempts)] == [
        0.1,
        0.2,
        0.4,
        0.8,
        1.6,
        3.2,
        5.0,
        5.0,
        5.0,
    ]
    assert DEFAULT_RETRY.total_delay == pytest.approx(21.3)


async def test_connections_are_closed_when_the_block_is_cancelled(
    pg_dsn: str, tmp_path: Path
) -> None:
    """However the block ends — here cancelled — every connection of the store is closed
    (shielded), and its logs take no more appends (``journal_closed``)."""
    with trio.fail_after(LIMIT):
        with trio.CancelScope() as scope:
            async with open_pg_store(pg_dsn, root=tmp_path / "state") as store:
                await store.write_document("x", b"1")
                lane = await store.open_lane_log("dm:1")
                connections = [store._shared, *store._pool]
                drivers = [c._conn for c in connections if c._conn is not None]
                named = await execute(
                    pg_dsn,
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND application_name = 'pi-runtime'",
                )
                assert named == [(len(drivers),)]
                assert len(drivers) >= 2
                scope.cancel()
                await trio.sleep_forever()
        assert scope.cancelled_caught
        assert all(driver.closed for driver in drivers)
        assert all(c._conn is None for c in connections)
        for log in (store.admissions, lane):
            with pytest.raises(JournalError) as info:
                await log.append(_action(1))
            assert info.value.code is ReasonCode.JOURNAL_CLOSED


# -- credentials --------------------------------------------------------------------------


def test_redact_dsn_removes_the_password() -> None:
    shown = redact_dsn(f"host=db user=ann password={SECRET} dbname=x")
    assert conninfo_to_dict(shown) == {"host": "db", "user": "ann", "dbname": "x"}
    shown = redact_dsn(f"postgresql://ann:{SECRET}@db:5433/x?sslpassword={SECRET}")
    assert conninfo_to_dict(shown) == {"host": "db", "port": "5433", "user": "ann", "dbname": "x"}
    assert SECRET not in redact_dsn(f"host=db password='{SECRET} x' junk")
    assert redact_dsn("") == "<the default of the PG* environment>"


@pytest.mark.parametrize(
    "dsn",
    [
        f"host=127.0.0.1 port=1 user=ann password={SECRET} dbname=x",
        f"postgresql://ann:{SECRET}@127.0.0.1:1/x",
        f"host=127.0.0.1 password='{SECRET} x' junk",  # does not parse
    ],
    ids=["keywords", "uri", "unparseable"],
)
async def test_the_password_is_in_no_error(
    dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A database that cannot be reached is ``store_unavailable``, for ``open_pg_store`` and
    for ``migrate``: the message names the database without its password, and neither it,
    nor anything chained to it, nor a log line holds the password."""
    caplog.set_level(logging.DEBUG)
    errors: list[BaseException] = []
    with trio.fail_after(LIMIT):
        with pytest.raises(DiskFailedError) as opened:
            async with open_pg_store(dsn, root=tmp_path / "state", retry=FAST):
                pass  # pragma: no cover - refused
        errors.append(opened.value)
        with pytest.raises(DiskFailedError) as migrated:
            await migrate(dsn)
        errors.append(migrated.value)
    for error in errors:
        assert isinstance(error, PiRuntimeError)
        assert error.code is ReasonCode.STORE_UNAVAILABLE
        assert not [text for text in _texts(error) if SECRET in text]
        if "junk" not in dsn:
            assert "user=ann" in str(error)
            assert "127.0.0.1" in str(error)
    assert SECRET not in caplog.text


async def test_the_password_reaches_no_record_row_or_file(pg_dsn: str, tmp_path: Path) -> None:
    """With a password in the DSN, a store that writes logs, a document and a poison keeps
    it out of every row of its tables and every file of its state directory — even when the
    server's refusal, recorded as the poison's reason, quotes the password."""
    dsn = f"{pg_dsn}&password={SECRET}"
    root = tmp_path / "state"
    with trio.fail_after(LIMIT):
        async with open_pg_store(dsn, root=root) as store:
            log = await store.create_delivery_log("d1")
            await log.append(_action(1))
            await store.write_document("doc", b"1")
            await terminate_backends(pg_dsn)  # reconnected with the password
            await log.append(_action(2))
            await execute(
                pg_dsn,
                f"""CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS $$
                    BEGIN RAISE EXCEPTION 'refused, the password is {SECRET}'; END $$""",
            )
            await execute(
                pg_dsn,
                "CREATE TRIGGER refuse BEFORE INSERT ON pi_runtime.log_records "
                "FOR EACH ROW EXECUTE FUNCTION public.refuse()",
            )
            with pytest.raises(JournalError) as info:
                await log.append(_action(3))
            assert info.value.code is ReasonCode.JOURNAL_POISONED
            assert SECRET not in str(info.value)
    dump = await execute(
        pg_dsn,
        "SELECT string_agg(t::text, ' ') FROM (SELECT log, seq, encode(frame, 'escape') "
        "FROM pi_runtime.log_records) t UNION ALL SELECT string_agg(p::text, ' ') FROM "
        "(SELECT log, reason, encode(document, 'escape') FROM pi_runtime.log_poison) p "
        "UNION ALL SELECT string_agg(d::text, ' ') FROM pi_runtime.documents d",
    )
    text = " ".join(str(value) for (value,) in dump)
    assert "RaiseException" in text
    assert "the password is ***" in text
    assert SECRET not in text
    assert not [p for p in root.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


# -- pi-runtime db migrate ----------------------------------------------------------------


def test_cli_db_migrate_prints_the_schema_version(
    pg_blank_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pi-runtime db migrate DSN`` migrates and prints the version; again, the same; the
    DSN may come from ``$PI_RUNTIME_STORE``."""
    assert main(["db", "migrate", pg_blank_dsn]) == EXIT_OK
    assert capsys.readouterr().out == f"schema version {STORE_SCHEMA_VERSION}\n"
    monkeypatch.setenv("PI_RUNTIME_STORE", pg_blank_dsn)
    assert main(["db", "migrate"]) == EXIT_OK
    assert capsys.readouterr().out == f"schema version {STORE_SCHEMA_VERSION}\n"


def test_cli_db_migrate_refusals(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No DSN anywhere: ``store_not_configured``. An unreachable database:
    ``store_unavailable``, its password nowhere in the output. No psycopg: it says which
    extra to install. ``db`` alone prints its help; both have ``--help``."""
    monkeypatch.delenv("PI_RUNTIME_STORE", raising=False)
    assert main(["db", "migrate"]) == EXIT_FAILED
    assert "store_not_configured" in capsys.readouterr().err
    dsn = f"postgresql://ann:{SECRET}@127.0.0.1:1/x"
    assert main(["db", "migrate", dsn]) == EXIT_FAILED
    out, err = capsys.readouterr()
    assert "store_unavailable" in err
    assert SECRET not in out + err
    assert main(["--log-json", "db", "migrate", dsn]) == EXIT_FAILED
    out, err = capsys.readouterr()
    assert '"code":"store_unavailable"' in err
    assert SECRET not in out + err
    monkeypatch.setitem(sys.modules, "runtime._journal._postgres", None)
    assert main(["db", "migrate", "dbname=x"]) == EXIT_FAILED
    assert "pi-runtime[postgres]" in capsys.readouterr().err
    assert main(["db"]) == EXIT_USAGE
    assert capsys.readouterr().err.startswith("usage: pi-runtime db")
    for command in (["db"], ["db", "migrate"]):
        with pytest.raises(SystemExit) as done:
            main([*command, "--help"])
        assert done.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: pi-runtime {' '.join(command)}")


# -- pi-runtime journal verify / show --store ---------------------------------------------------


def test_cli_journal_verify_and_show_read_the_database(
    pg_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``journal verify --store DSN`` checks every log in the database as it checks files:
    a sound deployment passes; a flipped byte in a delivery's row is a ``journal_corrupt``
    problem (exit 1). ``journal show --store DSN`` prints a delivery's records, one JSON
    object per line, and refuses an unknown one ``delivery_unknown``."""

    async def fill() -> None:
        async with open_pg_store(pg_dsn, root=tmp_path / "host") as store:
            log = await store.create_delivery_log("d1")
            await log.append(_action(1))
            await log.append(_action(2))
            await store.admissions.append(_action(3))

    trio.run(fill)
    assert main(["journal", "verify", "--store", pg_dsn]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == "checked 3 logs: 0 problems"
    assert main(["journal", "show", "--store", pg_dsn, "d1"]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line).get("action_id") for line in lines[1:]] == ["a:1", "a:2"]
    assert main(["journal", "show", "--store", pg_dsn, "nobody"]) == EXIT_FAILED
    assert "delivery_unknown" in capsys.readouterr().err
    rel = Store.delivery_rel("d1")
    trio.run(
        execute,
        pg_dsn,
        "UPDATE pi_runtime.log_records SET frame = overlay(frame placing '\\xff'::bytea "
        f"from {HEADER_SIZE + 3} for 1) WHERE log = %s AND seq = 2",
        [rel],
    )
    assert main(["journal", "verify", "--store", pg_dsn]) == EXIT_FAILED
    out = capsys.readouterr().out
    assert f"problem: {rel}: journal_corrupt" in out
    assert out.strip().splitlines()[-1] == "checked 3 logs: 1 problem"


def test_cli_cancel_store_refuses_an_unknown_delivery(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pi-runtime cancel --store DSN ID`` of a delivery never admitted: ``delivery_unknown``
    (the cancel itself: ``tests/rooms/test_room_hosts.py::test_s26_*``)."""
    assert main(["cancel", "--store", pg_dsn, "nobody"]) == EXIT_FAILED
    assert "delivery_unknown" in capsys.readouterr().err


def test_cli_status_store_reads_the_database(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pi-runtime status --store DSN`` asks no host: it says so, and what the database
    holds (here nothing yet); ``--json`` is one object (the rooms' holders:
    ``tests/rooms/test_room_hosts.py::test_the_deployments_status_is_read_from_its_database``)."""
    assert main(["status", "--store", pg_dsn]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [
        "deployment: read from its database (no host asked)",
        "pending: 0",
        "rooms: 0",
    ]
    assert main(["status", "--store", pg_dsn, "--json"]) == EXIT_OK
    status = json.loads(capsys.readouterr().out)
    assert (status["source"], status["pending"], status["rooms"]) == ("database", 0, [])
