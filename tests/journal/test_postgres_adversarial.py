"""Adversarial tests of the PostgreSQL store and its leases (``docs/design/postgres-store.md``,
``docs/design/scale-out.md``): each tries to make a host act without proof — write under a
lease it no longer holds, take a server's answer for the fate of a record, or read a refusal
into what was only a race — on a real, throw-away PostgreSQL (``pg_fixtures.py``).

No test sleeps on the real clock: a statement is held where the test needs it by a row or an
advisory lock an admin connection holds, and the test waits until the store's backend waits on
it (``pg_stat_activity``) before it lets go; a request is lost by a proxy that cuts it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import psycopg
import psycopg.errors
import pytest
import trio
import trio.lowlevel
import trio.testing

from runtime._boundary import _receipts, _receipts_pg
from runtime._boundary._receipts_pg import PgReceiptStore
from runtime._clock import Backoff
from runtime._errors import JournalError, ReasonCode
from runtime._journal._pg_connection import rolled_back
from runtime._journal._postgres import DEFAULT_RETRY, PgStore, open_pg_store
from runtime._records import OutboxAction

from .pg_fixtures import cutting_proxy, database_name, execute

LIMIT: Final = 30.0
TTL: Final = 30.0
FAST: Final = Backoff(attempts=5, first_delay=0.001, max_delay=0.01)
ONCE: Final = Backoff(attempts=1, first_delay=0.001, max_delay=0.001)
"""No second try: what must succeed the first time."""


def _action(n: int, host: str = "") -> OutboxAction:
    return OutboxAction(action_id=f"{host}a:{n}", kind="test", state="done", detail={"n": n})


@contextlib.asynccontextmanager
async def _host(
    dsn: str, root: Path, name: str, retry: Backoff = DEFAULT_RETRY
) -> AsyncIterator[PgStore]:
    async with open_pg_store(dsn, root=root / name, owner=name, retry=retry) as store:
        yield store


async def _expire(dsn: str, lane_rel: str) -> None:
    """The lease of ``lane_rel`` runs out now (as if its holder had stopped renewing)."""
    await execute(
        dsn,
        "UPDATE pi_runtime.lanes SET lease_until = now() - interval '1 second' WHERE lane = %s",
        [lane_rel],
    )


async def _wait_for(dsn: str, condition: str) -> None:
    """Until a backend of this database waits as ``condition`` says."""
    while not await execute(
        dsn,
        "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND " + condition,
    ):
        await trio.lowlevel.checkpoint()


async def _waiting(
    dsn: str, done: list[int | None], *, other_than: tuple[int, object] | None = None
) -> tuple[int, object]:
    """The backend (pid, the start of its statement) of this database that waits for a lock,
    once one does — another statement than ``other_than`` —, or ``(0, None)`` once ``done``
    is not empty (what should have waited ended instead)."""
    while not done:
        rows = await execute(
            dsn,
            "SELECT pid, query_start FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'",
        )
        rows = [row for row in rows if (row[0], row[1]) != other_than]
        if rows:
            return int(rows[0][0]), rows[0][1]
        await trio.lowlevel.checkpoint()
    return 0, None


@contextlib.asynccontextmanager
async def _row_locked(dsn: str, statement: str, params: list[object]) -> AsyncIterator[None]:
    """``statement`` (an ``UPDATE``) run in a transaction of its own that stays open for the
    block — its rows locked, as a renewal in flight holds them — and committed at its end."""
    locked, commit = threading.Event(), threading.Event()

    def hold() -> None:
        with psycopg.connect(dsn) as conn:  # not autocommit: one open transaction
            conn.execute(statement, params)
            locked.set()
            commit.wait(LIMIT)
            conn.commit()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, hold)
        await trio.to_thread.run_sync(locked.wait, LIMIT)
        try:
            yield
        finally:
            commit.set()


# -- PG4: the sessions' isolation ---------------------------------------------------------


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"])
async def test_pg4_a_server_default_isolation_above_read_committed_does_not_poison_a_fenced_append(
    pg_dsn: str, tmp_path: Path, isolation: str
) -> None:
    """PG4, S11: the database's default isolation is ``repeatable read`` or ``serializable``
    (an operator's choice, ``ALTER DATABASE … SET default_transaction_isolation``). A lane's
    fenced append checks its lease row ``FOR SHARE``; a renewal of that lease (an ``UPDATE``
    of the row, every third of the TTL) is in flight at that moment, so the append waits for
    it. At ``read committed`` the append then re-checks the renewed row — same owner, same
    epoch — and commits; above it, the server refuses the append (``40001``: the row changed
    after its snapshot), and the store takes that for a definite refusal: it poisons the
    delivery's log for good, on a lease it held all along. The append must land, once, at
    its first try (the store allowed no second: a rolled-back try would be retried, PG12,
    but a renewal races appends all the time)."""
    await execute(
        pg_dsn,
        f"ALTER DATABASE {database_name(pg_dsn)} SET default_transaction_isolation = '{isolation}'",
    )
    with trio.fail_after(LIMIT):
        async with _host(pg_dsn, tmp_path, "a", retry=ONCE) as a:
            fence = await a.claim("room-1", TTL)
            assert fence is not None
            log = await a.create_delivery_log("d1", fence=fence)
            assert await log.append(_action(1)) == 1
            landed: list[int] = []

            async def append() -> None:
                landed.append(await log.append(_action(2)))

            renewal = (
                "UPDATE pi_runtime.lanes SET lease_until = now() + interval '30 seconds' "
                "WHERE lane = %s AND owner = %s AND epoch = %s"
            )
            held = [fence.lane, fence.owner, fence.epoch]
            async with trio.open_nursery() as nursery, _row_locked(pg_dsn, renewal, held):
                nursery.start_soon(append)
                await _wait_for(pg_dsn, "wait_event IN ('tuple', 'transactionid')")
            assert landed == [2]
            assert not log.poisoned
            assert await log.append(_action(3)) == 3
            assert a.disk_failure is None
            contents = await a.read_delivery_log("d1")
    assert contents.poison is None
    assert contents.records[1:] == (_action(1), _action(2), _action(3))


# -- S11: an append of unknown outcome under a fence --------------------------------------


async def test_s11_an_unknown_outcome_found_under_the_new_owners_record_is_fenced(
    pg_dsn: str, tmp_path: Path
) -> None:
    """S11, PG11: host A's fenced append is cut on its way to the server (a proxy drops the
    request: it never ran), while host B has claimed the lane and appended its own record at
    that very number. A resolves the unknown outcome on a new connection and finds the row
    holding other bytes — B's. That is not another writer racing A on A's lane (PG6
    ``journal_conflict``: a fault of this log, which a lane reports as a failed delivery);
    it is the lane's new owner, and A's lease is gone: ``lane_fenced``, so A gives the lane
    up and publishes nothing (S11). Nothing of A's is written, B's record stays."""
    with trio.fail_after(LIMIT):
        async with (
            cutting_proxy(pg_dsn) as proxy,
            open_pg_store(proxy.dsn, root=tmp_path / "a", owner="a", retry=FAST) as a,
            _host(pg_dsn, tmp_path, "b") as b,
        ):
            old = await a.claim("room-1", TTL)
            assert old is not None
            log_a = await a.create_delivery_log("d1", fence=old)
            assert await log_a.append(_action(1, "a")) == 1
            await _expire(pg_dsn, old.lane)
            new = await b.claim("room-1", TTL)
            assert new is not None
            log_b = await b.open_delivery_log("d1", fence=new)
            assert await log_b.append(_action(2, "b")) == 2
            proxy.cut_next("request")
            with pytest.raises(JournalError) as refused:
                await log_a.append(_action(2, "a"))
            assert proxy.cuts == 1
            assert refused.value.code is ReasonCode.LANE_FENCED
            with pytest.raises(JournalError) as again:
                await log_a.append(_action(3, "a"))
            assert again.value.code is ReasonCode.LANE_FENCED
            assert a.disk_failure is None
            contents = await b.read_delivery_log("d1")
    assert contents.poison is None
    assert contents.records[1:] == (_action(1, "a"), _action(2, "b"))


# -- PG5, PG12: a statement the server rolled back is not a refusal -----------------------


@pytest.mark.parametrize(
    ("error", "passing"),
    [
        (psycopg.errors.QueryCanceled, True),  # statement_timeout, pg_cancel_backend
        (psycopg.errors.LockNotAvailable, True),  # lock_timeout
        (psycopg.errors.DeadlockDetected, True),
        (psycopg.errors.SerializationFailure, True),
        (psycopg.errors.RaiseException, False),  # a trigger refusing the record
        (psycopg.errors.UniqueViolation, False),  # another constraint (or the key: PG6)
        (psycopg.errors.InsufficientPrivilege, False),
        (psycopg.errors.ReadOnlySqlTransaction, False),
    ],
)
def test_pg5_what_the_server_rolled_back_for_a_passing_reason_is_no_refusal(
    error: type[psycopg.Error], passing: bool
) -> None:
    """PG5: a cancel, a lock timeout, a deadlock, a serialization failure roll the statement
    back and refuse nothing about the record (tried again, PG12); a trigger, a constraint,
    permissions, a read-only server refuse it (the log is poisoned)."""
    assert rolled_back(error("the server's message")) is passing


async def test_pg12_a_cancelled_admission_is_retried_not_poisoned_for_the_deployment(
    pg_dsn: str, tmp_path: Path
) -> None:
    """PG5, PG12, S21: an admission waits for the compaction row (another host's compaction
    holds it, RT11), and the server cancels the waiting statement — an operator's
    ``pg_cancel_backend``, as a ``statement_timeout`` or ``lock_timeout`` would (SQLSTATE
    ``57014``). The server answered, but it refused nothing about the record: the statement
    was rolled back whole and the session lives. Taken for a definite refusal, the store
    records a poison on the shared admission log — every host of the deployment then refuses
    every admission, and no host can even open the store again. It is retried under the
    policy instead and lands once; nothing is poisoned."""
    with trio.fail_after(LIMIT):
        async with _host(pg_dsn, tmp_path, "a") as a:
            landed: list[int | None] = []

            async def admit() -> None:
                landed.append(await a.admissions.try_append(_action(1)))

            compaction = "UPDATE pi_runtime.compaction SET generation = generation"
            async with trio.open_nursery() as nursery, _row_locked(pg_dsn, compaction, []):
                nursery.start_soon(admit)
                first = await _waiting(pg_dsn, landed)
                cancelled = await execute(pg_dsn, "SELECT pg_cancel_backend(%s)", [first[0]])
                assert cancelled == [(True,)]
                await _waiting(pg_dsn, landed, other_than=first)  # tried again, waits
            assert landed == [1]
            assert not a.admissions.poisoned
            assert a.disk_failure is None
            assert await a.admissions.try_append(_action(2)) == 2
        async with _host(pg_dsn, tmp_path, "b") as b:  # the deployment opens and admits
            assert b.admissions.contents.poison is None
            assert b.admissions.contents.records[1:] == (_action(1), _action(2))
            assert await b.admissions.try_append(_action(3)) == 3


async def test_pg4_r9_a_second_write_of_one_intent_sees_the_first_ones_receipt(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PG4, R9 (S24): the database's default isolation is ``repeatable read``. Host A's
    guarded write of an intent holds the intent's lock, uncommitted, while host B's recovery
    of the same intent waits for that lock. A commits; B, granted the lock, must see A's
    receipt and answer its saved result (applied once, both told the same). Above read
    committed, B's snapshot was taken before it waited: it sees no receipt, writes again,
    and the server refuses the second revision — B's agent is told the write failed
    (``receipt_store_failed``) when it applied."""
    await execute(
        pg_dsn,
        f"ALTER DATABASE {database_name(pg_dsn)} "
        "SET default_transaction_isolation = 'repeatable read'",
    )
    apply = _receipts.apply_write
    inside, go_on = threading.Event(), threading.Event()
    calls = 0

    def held_first(*args: Any) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        result = apply(*args)
        if calls == 1:  # host A's: applied, not committed yet, its locks held
            inside.set()
            go_on.wait(LIMIT)
        return result

    monkeypatch.setattr(_receipts_pg, "apply_write", held_first)
    args = {"document_id": "notes", "content": "once", "base_revision_id": None}
    answers: list[dict[str, Any]] = []
    with trio.fail_after(LIMIT):
        async with _host(pg_dsn, tmp_path, "a") as a, _host(pg_dsn, tmp_path, "b") as b:
            receipts_a = PgReceiptStore(a, now_ms=lambda: 1_000)
            receipts_b = PgReceiptStore(b, now_ms=lambda: 2_000)

            async def write(receipts: PgReceiptStore) -> None:
                answers.append(await receipts.write_document("d1:7", args))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(write, receipts_a)
                await trio.to_thread.run_sync(inside.wait, LIMIT)
                nursery.start_soon(write, receipts_b)
                await _wait_for(pg_dsn, "wait_event = 'advisory'")  # B waits for A's lock
                go_on.set()
    assert len(answers) == 2
    assert answers[0] == answers[1]
    assert await execute(pg_dsn, "SELECT count(*) FROM pi_runtime.receipt_revisions") == [(1,)]


# -- S22: a group commit's writer ---------------------------------------------------------


HOLD_MARKED: Final = """CREATE FUNCTION public.hold_marked() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF position('hold-x'::bytea IN NEW.frame) > 0 THEN
            PERFORM pg_advisory_xact_lock_shared(1);
        ELSIF position('hold-y'::bytea IN NEW.frame) > 0 THEN
            PERFORM pg_advisory_xact_lock_shared(2);
        END IF;
        RETURN NEW;
    END $$;
    CREATE TRIGGER hold_marked BEFORE INSERT ON pi_runtime.log_records
    FOR EACH ROW EXECUTE FUNCTION public.hold_marked()"""
"""A trigger that holds a record marked ``hold-x`` (``hold-y``) until the test lets advisory
lock 1 (2) go: the server is slow on that group's statement."""


async def test_s22_an_admission_is_answered_once_its_group_committed_not_after_later_groups(
    pg_dsn: str, tmp_path: Path
) -> None:
    """S22: admission X finds no group being written, so it writes one — its own record —
    and more admissions (Y) queue meanwhile. Once X's group committed, X's client must be
    answered; the records queued after it are written by one of their own callers. Here the
    server is slow on Y's group (as under load, where a queue of admissions never runs dry):
    X's answer must not wait for it — a writer that stays to write every later group is not
    answered while admissions keep coming, though its own record is long durable."""
    await execute(pg_dsn, HOLD_MARKED)
    x_answered = trio.Event()
    answers: dict[str, int | None] = {}
    locked = {1: threading.Event(), 2: threading.Event()}
    unlock = {1: threading.Event(), 2: threading.Event()}

    def hold(key: int) -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", [key])
            locked[key].set()
            unlock[key].wait(LIMIT)

    async def admit(name: str, mark: str) -> None:
        answers[name] = await a.admissions.try_append(_action(0, f"{name}:{mark}:"))
        if name == "x":
            x_answered.set()

    with trio.fail_after(LIMIT):
        async with _host(pg_dsn, tmp_path, "a") as a, trio.open_nursery() as nursery:
            for key in (1, 2):
                nursery.start_soon(trio.to_thread.run_sync, hold, key)
                await trio.to_thread.run_sync(locked[key].wait, LIMIT)
            nursery.start_soon(admit, "x", "hold-x")
            await _wait_for(pg_dsn, "wait_event = 'advisory'")  # X's group is being written
            for n in range(3):
                nursery.start_soon(admit, f"y{n}", "hold-y")
            await trio.testing.wait_all_tasks_blocked()  # queued behind X's group
            unlock[1].set()  # X's group commits; Y's group then waits for lock 2
            with trio.move_on_after(LIMIT / 3):
                await x_answered.wait()
            assert answers.get("x") == 1, "X's record committed, but its client waits for Y's"
            unlock[2].set()
    assert sorted(a for a in answers.values() if a is not None) == [1, 2, 3, 4]
