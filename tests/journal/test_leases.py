"""Lanes owned under leases, writes fenced by epoch, shared logs with writers on many hosts
(``docs/design/scale-out.md`` S10-S12, S21, S23), on a real, throw-away PostgreSQL.

Each "host" is a :func:`open_pg_store` of its own (its own connections and owner name) on
the same database, as two ``pi-runtime serve`` processes are. No test waits for a lease to
run out on the real clock: a lease is made to have run out by setting ``lease_until`` in the
past with an admin statement, as the passing of time would; the database's clock is still
the one every lease compares with.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Final, Literal

import psycopg
import pytest
import trio
import trio.lowlevel
import trio.testing

from runtime._clock import Clocks, MockWallClock
from runtime._errors import JournalError, ReasonCode
from runtime._journal._fence import Fence
from runtime._journal._postgres import STORE_SCHEMA_VERSION, PgStore, open_pg_store
from runtime._journal._store import ADMISSIONS, RESULTS
from runtime._records import OutboxAction, Record

from .pg_fixtures import cutting_proxy, execute, terminate_backends

LIMIT: Final = 30.0
TTL: Final = 30.0


def _action(n: int, host: str = "") -> OutboxAction:
    return OutboxAction(action_id=f"{host}a:{n}", kind="test", state="done", detail={"n": n})


@contextlib.asynccontextmanager
async def _host(dsn: str, root: Path, name: str) -> AsyncIterator[PgStore]:
    async with open_pg_store(dsn, root=root / name, owner=name) as store:
        yield store


async def _expire(dsn: str, lane_rel: str) -> None:
    """The lease of ``lane_rel`` runs out now (as if its holder had stopped renewing)."""
    await execute(
        dsn,
        "UPDATE pi_runtime.lanes SET lease_until = now() - interval '1 second' WHERE lane = %s",
        [lane_rel],
    )


async def _lease_row(dsn: str, lane_rel: str) -> tuple[str, int, float]:
    rows = await execute(
        dsn,
        "SELECT owner, epoch, extract(epoch FROM lease_until - now()) FROM pi_runtime.lanes "
        "WHERE lane = %s",
        [lane_rel],
    )
    owner, epoch, remaining = rows[0]
    return str(owner), int(epoch), float(remaining)


# -- S10: one owner per lane ----------------------------------------------------------------


async def test_s10_a_lane_has_one_owner_until_its_lease_runs_out(
    pg_dsn: str, tmp_path: Path
) -> None:
    """S10: a claim is refused while another owner's lease runs; once it ran out (or was
    released) the lane is claimed under a higher epoch; an epoch is never reused — not after
    a release either (the row stays) — and a holder claiming again bumps its own epoch."""
    with trio.fail_after(LIMIT):
        async with _host(pg_dsn, tmp_path, "a") as a, _host(pg_dsn, tmp_path, "b") as b:
            first = await a.claim("room-1", TTL)
            assert first == Fence(a.lane_rel("room-1"), "a", 1)
            assert await b.claim("room-1", TTL) is None
            again = await a.claim("room-1", TTL)
            assert again is not None
            assert again.epoch == 2
            await _expire(pg_dsn, again.lane)
            taken = await b.claim("room-1", TTL)
            assert taken == Fence(again.lane, "b", 3)
            assert await a.claim("room-1", TTL) is None
            await b.release(taken)
            back = await a.claim("room-1", TTL)
            assert back == Fence(again.lane, "a", 4)
            lease = await b.lease("room-1")
            assert lease is not None
            assert lease.fence == back
            assert lease.live
            assert await b.lease("room-2") is None


async def test_s10_a_lease_runs_on_the_databases_clock(pg_dsn: str, tmp_path: Path) -> None:
    """S10: the lease's expiry is the database's ``now()`` plus the TTL, whatever the host's
    wall clock says (here: a year ahead)."""
    wall = MockWallClock.reading(Clocks.system().wall.time_ms() + 365 * 86_400_000)
    with trio.fail_after(LIMIT):
        async with open_pg_store(
            pg_dsn, root=tmp_path / "a", owner="a", clocks=Clocks(wall=wall)
        ) as a:
            fence = await a.claim("room-1", TTL)
            assert fence is not None
            owner, _epoch, remaining = await _lease_row(pg_dsn, fence.lane)
            assert owner == "a"
            assert TTL - 5 < remaining <= TTL
            lease = await a.lease("room-1")
            assert lease is not None
            assert lease.live
            assert TTL - 5 < lease.remaining <= TTL


async def test_s32_a_lease_says_how_long_it_has_been_out(pg_dsn: str, tmp_path: Path) -> None:
    """S32: a running lease has been out 0 s; one that ran out, a few seconds at most here;
    a released one forever (given up, not lost: another host may take it at once)."""
    with trio.fail_after(LIMIT):
        async with _host(pg_dsn, tmp_path, "a") as a:
            fence = await a.claim("task:t1", TTL)
            assert fence is not None
            running = await a.lease("task:t1")
            assert running is not None
            assert (running.live, running.expired_for) == (True, 0.0)
            await _expire(pg_dsn, fence.lane)
            out = await a.lease("task:t1")
            assert out is not None
            assert not out.live
            assert 0.0 <= out.expired_for < 5
            assert out.remaining == 0.0
            again = await a.claim("task:t1", TTL)
            assert again is not None
            await a.release(again)
            released = await a.lease("task:t1")
            assert released is not None
            assert not released.live
            assert released.expired_for == float("inf")
            assert released.remaining == 0.0


# -- S11: every write fenced ----------------------------------------------------------------


async def test_s11_a_write_after_a_takeover_is_refused_and_nothing_is_written(
    pg_dsn: str, tmp_path: Path
) -> None:
    """S11: a host whose lane was claimed by another has its next append to the lane's logs
    refused ``lane_fenced`` — nothing written, the log takes no more appends from it — while
    the new owner opens the same log under its fence, sees what the old owner wrote before,
    and appends after it. The shared results log, fenced per append, refuses only the old
    owner's write for that lane and goes on for others; a fenced document is not replaced."""
    with trio.fail_after(LIMIT):
        async with _host(pg_dsn, tmp_path, "a") as a, _host(pg_dsn, tmp_path, "b") as b:
            old = await a.claim("room-1", TTL)
            other = await a.claim("room-2", TTL)
            assert old is not None
            assert other is not None
            log_a = await a.open_or_create_delivery_log("d1", fence=old)
            await log_a.append(_action(1))
            await a.write_document("sessions/room-1", b"v1", fence=old)

            await _expire(pg_dsn, old.lane)
            new = await b.claim("room-1", TTL)
            assert new is not None
            assert new.epoch == old.epoch + 1

            with pytest.raises(JournalError) as refused:
                await log_a.append(_action(2))
            assert refused.value.code is ReasonCode.LANE_FENCED
            with pytest.raises(JournalError) as again:
                await log_a.append(_action(3))
            assert again.value.code is ReasonCode.LANE_FENCED

            log_b = await b.open_delivery_log("d1", fence=new)
            assert log_b.contents.records[1:] == (_action(1),)
            assert await log_b.append(_action(4)) == 2

            with pytest.raises(JournalError) as stale_result:
                await a.results.append(_action(5), fence=old)
            assert stale_result.value.code is ReasonCode.LANE_FENCED
            assert await a.results.append(_action(6), fence=other) == 1
            with pytest.raises(JournalError) as stale_document:
                await a.write_document("sessions/room-1", b"v2", fence=old)
            assert stale_document.value.code is ReasonCode.LANE_FENCED

            # the old owner, opening the log again under its stale fence, reads the truth
            # and is still refused
            reread = await a.open_delivery_log("d1", fence=old)
            assert reread.contents.records[1:] == (_action(1), _action(4))
            with pytest.raises(JournalError) as stale_reopen:
                await reread.append(_action(7))
            assert stale_reopen.value.code is ReasonCode.LANE_FENCED

        async with _host(pg_dsn, tmp_path, "c") as c:
            contents = await c.read_delivery_log("d1")
            assert contents.records[1:] == (_action(1), _action(4))
            results = await c.read(RESULTS)
            assert results.records[1:] == (_action(6),)
            assert await c.read_document("sessions/room-1") == b"v1"


async def test_s11_a_claim_waits_for_a_fenced_write_in_flight(pg_dsn: str, tmp_path: Path) -> None:
    """S11: a fenced append holds the lease row for share from its check until it commits,
    so a claim cannot slip between the two: the claim waits for the append, and the new
    owner then sees it. (The append is held between its check and its commit by a trigger
    that waits for an advisory lock the test holds.)"""
    hold = 4242
    with trio.fail_after(LIMIT):
        async with _host(pg_dsn, tmp_path, "a") as a, _host(pg_dsn, tmp_path, "b") as b:
            fence = await a.claim("room-1", TTL)
            assert fence is not None
            log = await a.create_delivery_log("d1", fence=fence)
            await _expire(pg_dsn, fence.lane)  # claimable as soon as nothing holds the row
            await execute(
                pg_dsn,
                f"""CREATE FUNCTION pi_runtime.held() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN PERFORM pg_advisory_xact_lock_shared({hold}); RETURN NEW; END $$""",
            )
            await execute(
                pg_dsn,
                "CREATE TRIGGER held BEFORE INSERT ON pi_runtime.log_records "
                "FOR EACH ROW EXECUTE FUNCTION pi_runtime.held()",
            )
            locked = threading.Event()
            unlock = threading.Event()

            def hold_the_lock() -> None:
                with psycopg.connect(pg_dsn, autocommit=True) as conn:
                    conn.execute("SELECT pg_advisory_lock(%s)", [hold])
                    locked.set()
                    unlock.wait(LIMIT)

            claimed: list[Fence | None] = []
            appended: list[int] = []

            async def append() -> None:
                appended.append(await log.append(_action(1)))

            async def claim() -> None:
                claimed.append(await b.claim("room-1", TTL))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, hold_the_lock)
                await trio.to_thread.run_sync(locked.wait, LIMIT)
                nursery.start_soon(append)
                await _wait_for(pg_dsn, "wait_event = 'advisory'")  # checked, not committed
                nursery.start_soon(claim)
                await _wait_for(pg_dsn, "wait_event IN ('tuple', 'transactionid')", claimed)
                assert claimed == []  # the claim waits for the append
                assert appended == []
                unlock.set()
            assert appended == [1]  # committed under the old epoch, before the claim
            assert claimed[0] is not None
            assert claimed[0].epoch == fence.epoch + 1
            assert (await b.read_delivery_log("d1")).records[1:] == (_action(1),)


async def _wait_for(dsn: str, condition: str, done: list[Fence | None] | None = None) -> None:
    """Until a backend of this database waits as ``condition`` says (or ``done`` is not
    empty: what should have waited did not)."""
    while not await execute(
        dsn,
        "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND " + condition,
    ):
        if done:
            return
        await trio.lowlevel.checkpoint()


# -- S12: renewals ----------------------------------------------------------------------------


async def test_s12_a_renewal_extends_only_the_leases_still_held(
    pg_dsn: str, tmp_path: Path
) -> None:
    """S12: one renewal extends every lease the host still holds at its epoch and returns
    them; a lease another host claimed, and one that ran out (even unclaimed), are not
    renewed — a lease that ran out is claimed again, under a new epoch."""
    with trio.fail_after(LIMIT):
        async with _host(pg_dsn, tmp_path, "a") as a, _host(pg_dsn, tmp_path, "b") as b:
            fences = [await a.claim(f"room-{n}", 5.0) for n in range(3)]
            assert all(fence is not None for fence in fences)
            held, taken, lapsed = (fence for fence in fences if fence is not None)
            await _expire(pg_dsn, taken.lane)
            assert await b.claim("room-1", TTL) is not None
            await _expire(pg_dsn, lapsed.lane)
            assert await a.renew([held, taken, lapsed], TTL) == {held}
            _owner, _epoch, remaining = await _lease_row(pg_dsn, held.lane)
            assert remaining > TTL - 5
            assert await b.renew([held], TTL) == set()  # not b's to renew
            again = await a.claim("room-2", TTL)
            assert again is not None
            assert again.epoch == lapsed.epoch + 1


async def test_s12_a_renewal_of_two_epochs_of_one_lane_holds_only_the_newest(
    pg_dsn: str, tmp_path: Path
) -> None:
    """S12: a renewal answers by lane and epoch — given an older epoch of a lane beside the
    one the database holds (a claim made again by this host), only the newer is held. (The
    answer was matched by lane alone: the spent epoch came back as held.)"""
    with trio.fail_after(LIMIT):
        async with _host(pg_dsn, tmp_path, "a") as a:
            old = await a.claim("room-0", TTL)
            new = await a.claim("room-0", TTL)
            assert old is not None
            assert new is not None
            assert new.epoch == old.epoch + 1
            assert await a.renew([old, new], TTL) == {new}
            assert await a.renew([old], TTL) == set()


# -- S21: shared logs with many writers ----------------------------------------------------------


async def _append_all(store: PgStore, host: str, count: int, seen: list[Record]) -> None:
    """Append ``count`` records to the admission log as a host does: on losing the race for
    a number, learn what was written and try again."""
    for n in range(count):
        record = _action(n, host)
        while (await store.admissions.try_append(record)) is None:
            seen.extend(await store.admissions.refresh())
        seen.append(record)
        await trio.lowlevel.checkpoint()


@contextlib.asynccontextmanager
async def _three_hosts_and_a_reader(
    dsn: str, root: Path
) -> AsyncIterator[tuple[tuple[PgStore, PgStore, PgStore], PgStore]]:
    async with (
        _host(dsn, root, "a") as a,
        _host(dsn, root, "b") as b,
        _host(dsn, root, "c") as c,
        _host(dsn, root, "reader") as reader,
    ):
        yield (a, b, c), reader


async def _read_while(reader: PgStore, write: Callable[[trio.Nursery], None]) -> int:
    """Run the writers ``write`` starts while ``reader`` reads the admission log again and
    again (a gap would raise ``journal_corrupt``); how often it read."""
    reads = 0
    done = trio.Event()

    async def read_meanwhile() -> None:
        nonlocal reads
        while not done.is_set():
            await reader.read(ADMISSIONS)
            reads += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_meanwhile)
        async with trio.open_nursery() as writers:
            write(writers)
        done.set()
    return reads


async def test_s21_many_hosts_append_to_one_shared_log_gap_free(
    pg_dsn: str, tmp_path: Path
) -> None:
    """S21: three hosts appending to the shared admission log at once: each record lands
    exactly once, the numbers are gap-free, and each host's view (what it wrote and what it
    refreshed) is exactly the log; a reader polling meanwhile never sees a gap (a row at
    number k is written only by a host that saw k - 1 committed)."""
    count = 40
    views: dict[str, list[Record]] = {name: [] for name in "abc"}
    with trio.fail_after(LIMIT * 2):
        async with _three_hosts_and_a_reader(pg_dsn, tmp_path) as (hosts, reader):

            def write(writers: trio.Nursery) -> None:
                for name, store in zip("abc", hosts, strict=True):
                    writers.start_soon(_append_all, store, name, count, views[name])

            reads = await _read_while(reader, write)
            for name, store in zip("abc", hosts, strict=True):
                views[name].extend(await store.admissions.refresh())
            final = (await reader.read(ADMISSIONS)).records[1:]
    assert len(final) == 3 * count
    assert len({r.action_id for r in final if isinstance(r, OutboxAction)}) == 3 * count
    for view in views.values():
        assert tuple(view) == final
    assert reads > 0


async def test_s21_the_file_store_has_one_writer(tmp_path: Path) -> None:
    """S21 on the file store: ``try_append`` always lands, ``refresh`` has nothing to learn."""
    from runtime._journal._store import open_store

    async with open_store(tmp_path / "state") as store:
        assert await store.admissions.try_append(_action(1)) == 1
        assert await store.admissions.refresh() == []


# -- S23: announcements --------------------------------------------------------------------------


async def test_s23_an_append_to_a_shared_log_is_announced_to_other_hosts(
    pg_dsn: str, tmp_path: Path
) -> None:
    """S23: a host watching the shared logs is told of another host's append at its commit
    (long before its poll interval), and after its listening connection was cut it
    reconnects and is told again (it may have missed one); a lease given up is announced
    as a release (a lane may be claimed now)."""
    with trio.fail_after(LIMIT):
        async with _host(pg_dsn, tmp_path, "a") as a, _host(pg_dsn, tmp_path, "b") as b:
            calls = 0
            changed = trio.Event()

            releases = 0

            def on_change(released: bool) -> None:
                nonlocal calls, changed, releases
                calls += 1
                releases += released
                changed.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: a.watch_shared(on_change, poll=3600))
                await changed.wait()  # the first connection: told to look once
                changed = trio.Event()
                await b.admissions.append(_action(1))
                await changed.wait()
                assert (await a.admissions.refresh()) == [_action(1)]
                changed = trio.Event()
                await terminate_backends(pg_dsn)
                await changed.wait()
                changed = trio.Event()
                await b.results.append(_action(2))
                await changed.wait()
                fence = await b.claim("room-1", TTL)
                assert fence is not None
                before = releases
                changed = trio.Event()
                await b.release(fence)  # announced too: a lane may be claimed now
                await changed.wait()
                nursery.cancel_scope.cancel()
            assert calls >= 5
            assert releases > before


async def test_the_lease_schema_is_version_2(pg_dsn: str) -> None:
    """The lease table and the announcement trigger are migration 2 (3 adds the receipt
    store's tables, receipts.md R9; 4 the shared logs' compaction, retention.md RT11; 5 the
    expired task lanes, RT13; 6 the tasks' worktrees, S33; 7 the expired ids' own times and
    the forget_days they count with, RT4)."""
    assert STORE_SCHEMA_VERSION == 7
    triggers = await execute(
        pg_dsn,
        "SELECT tgname FROM pg_trigger WHERE tgrelid = 'pi_runtime.log_records'::regclass "
        "AND NOT tgisinternal",
    )
    assert triggers == [("shared_append",)]


async def test_a_version_1_database_is_refused_until_migrated(pg_dsn: str, tmp_path: Path) -> None:
    """A database at store schema 1 (the single-host slice) is refused by this pi-runtime
    until ``migrate`` added migrations 2 to 7, which keep what version 1 held."""
    from runtime._journal._postgres import migrate

    async with open_pg_store(pg_dsn, root=tmp_path / "a") as store:
        await store.admissions.append(_action(1))
    for statement in (
        "DROP TRIGGER shared_append ON pi_runtime.log_records",
        "DROP FUNCTION pi_runtime.announce_shared_append()",
        "DROP TABLE pi_runtime.lanes",
        "DROP TABLE pi_runtime.receipt_documents, pi_runtime.receipt_revisions, "
        "pi_runtime.receipts",
        "DROP TABLE pi_runtime.compaction, pi_runtime.expired_deliveries",
        "DROP TABLE pi_runtime.expired_tasks, pi_runtime.task_worktrees",
        "DROP TABLE pi_runtime.retention",
        "UPDATE pi_runtime.schema_version SET version = 1",
    ):
        await execute(pg_dsn, statement)
    with trio.fail_after(LIMIT):
        with pytest.raises(JournalError) as refused:
            async with open_pg_store(pg_dsn, root=tmp_path / "a"):
                pass  # pragma: no cover - refused
        assert refused.value.code is ReasonCode.STORE_SCHEMA_MISSING
        assert "store schema 1" in str(refused.value)
        assert await migrate(pg_dsn) == STORE_SCHEMA_VERSION == 7
        async with open_pg_store(pg_dsn, root=tmp_path / "a") as store:
            assert store.admissions.contents.records[1:] == (_action(1),)
            assert await store.claim("room-1", TTL) is not None


# S22: concurrent unfenced appends to a shared log (admissions) are group-committed.


async def _produce(
    store: PgStore, host: str, producer: int, count: int, landed: dict[int, Record]
) -> None:
    """One of a host's concurrent producers (clients being admitted at once): on a lost race
    the host learns what was written and tries again; each record's number is kept."""
    log = store.admissions
    for n in range(count):
        record = _action(producer * 1000 + n, host)
        while (seq := await log.try_append(record)) is None:
            await log.refresh()
        assert seq not in landed, f"number {seq} handed out twice"
        landed[seq] = record


async def test_s22_concurrent_admissions_are_group_committed_and_each_lands_once(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Three hosts, 16 producers each, at once: every record lands exactly once, at the
    number its append returned, gap-free; each host made far fewer commits than it
    appended records (groups of concurrent appends, one statement each); a reader polling
    meanwhile never sees a gap."""
    producers, count = 16, 5
    landed: dict[int, Record] = {}
    with trio.fail_after(LIMIT * 2):
        async with _three_hosts_and_a_reader(pg_dsn, tmp_path) as (hosts, reader):

            def write(writers: trio.Nursery) -> None:
                for name, store in zip("abc", hosts, strict=True):
                    for p in range(producers):
                        writers.start_soon(_produce, store, name, p, count, landed)

            reads = await _read_while(reader, write)
            final = (await reader.read(ADMISSIONS)).records
            commits = [s.admissions.commits for s in hosts]
    total = 3 * producers * count
    assert len(final) == total + 1  # and the header
    assert sorted(landed) == list(range(1, total + 1))
    for seq, record in landed.items():
        assert final[seq] == record
    assert sum(commits) < total / 2, commits
    assert reads > 0


async def test_s22_a_group_that_loses_the_race_writes_none_of_its_records(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A group is one statement: when another host took one of its numbers first, none of
    its records is written (no record at a number its appends were not told of); each
    append is told so (``None``), learns what was written and lands on the next try."""
    with trio.fail_after(LIMIT):
        async with _host(pg_dsn, tmp_path, "a") as a, _host(pg_dsn, tmp_path, "b") as b:
            await b.admissions.refresh()
            await b.admissions.try_append(_action(0, "b"))  # B takes number 1
            tries: list[int | None] = []
            before = a.admissions.commits

            async def one(n: int) -> None:
                tries.append(await a.admissions.try_append(_action(n, "a")))

            async with trio.open_nursery() as nursery:
                for n in range(5):
                    nursery.start_soon(one, n)
            assert tries == [None] * 5
            assert a.admissions.commits == before
            await a.admissions.refresh()
            async with trio.open_nursery() as nursery:
                for n in range(5):
                    nursery.start_soon(one, n)
            final = (await b.read(ADMISSIONS)).records[1:]
    assert sorted(t for t in tries if t is not None) == [2, 3, 4, 5, 6]
    assert final[0] == _action(0, "b")
    assert {r.action_id for r in final[1:] if isinstance(r, OutboxAction)} == {
        f"aa:{n}" for n in range(5)
    }


@pytest.mark.parametrize("where", ["request", "reply"])
async def test_s22_a_group_whose_outcome_is_unknown_is_resolved_once(
    pg_dsn: str, tmp_path: Path, where: Literal["request", "reply"]
) -> None:
    """The connection is cut under a group's statement: before the server saw it
    (``request``: inserted again) or after it committed (``reply``: found, not inserted
    again). Either way every record is in the log once, at the number its append returned."""
    landed: dict[int, Record] = {}
    with trio.fail_after(LIMIT):
        async with (
            cutting_proxy(pg_dsn) as proxy,
            open_pg_store(proxy.dsn, root=tmp_path / "a") as a,
        ):
            await a.admissions.try_append(_action(999, "a"))  # a connection, in use
            proxy.cut_next(where)
            async with trio.open_nursery() as nursery:
                for p in range(8):
                    nursery.start_soon(_produce, a, "a", p, 1, landed)
            assert proxy.cuts == 1
            final = (await a.read(ADMISSIONS)).records
    assert len(final) == 1 + 1 + 8
    for seq, record in landed.items():
        assert final[seq] == record


async def test_s21_an_append_decides_after_every_refresh_before_it(
    pg_dsn: str, tmp_path: Path
) -> None:
    """S21, the race of one delivery sent to two hosts: while A's refresh reads B's record
    (and takes it in, ``on_records``, under the log's lock), A's ``try_append`` of the same
    delivery waits; it then decides on what the refresh learned (``unless``) and writes
    nothing — without this, A's append would land after B's, a second admission."""
    learned: list[Record] = []
    with trio.fail_after(LIMIT):
        async with _host(pg_dsn, tmp_path, "a") as a, _host(pg_dsn, tmp_path, "b") as b:
            await b.admissions.try_append(_action(1, "b"))  # B admits it first
            a.admissions.on_records = learned.extend
            answers: list[int | None] = []

            async def append() -> None:
                answers.append(
                    await a.admissions.try_append(_action(1, "a"), unless=lambda: bool(learned))
                )

            async with trio.open_nursery() as nursery:
                nursery.start_soon(a.admissions.refresh)
                await trio.testing.wait_all_tasks_blocked()  # the refresh holds the lock
                nursery.start_soon(append)
            final = (await b.read(ADMISSIONS)).records[1:]
    assert learned == [_action(1, "b")]
    assert answers == [None]
    assert final == (_action(1, "b"),)


REFUSE_MARKED: Final = """CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF position('refuse-me'::bytea IN NEW.frame) > 0 THEN
            RAISE EXCEPTION 'the test refuses this record';
        END IF;
        RETURN NEW;
    END $$;
    CREATE TRIGGER refuse BEFORE INSERT ON pi_runtime.log_records
    FOR EACH ROW EXECUTE FUNCTION public.refuse()"""
"""A trigger by which the server refuses (a definite refusal) every record marked ``refuse-me``."""


async def test_s21_a_refused_shared_append_hides_no_other_hosts_acknowledged_records(
    pg_dsn: str, tmp_path: Path
) -> None:
    """S21, PG5: host A's admission is refused by the server (a definite refusal) while its
    view of the shared log is behind: host B appended records after A last read it, and B's
    appends were acknowledged. A's poison refuses the log on every host, but hides none of
    B's records from any read (A poisoned the log at the number it knew, so every read
    stopped there and B's acknowledged admissions vanished)."""
    with trio.fail_after(LIMIT):
        async with _host(pg_dsn, tmp_path, "a") as a, _host(pg_dsn, tmp_path, "b") as b:
            await a.admissions.refresh()
            acknowledged = [await b.admissions.try_append(_action(n, "b")) for n in range(3)]
            assert acknowledged == [1, 2, 3]
            await execute(pg_dsn, REFUSE_MARKED)
            with pytest.raises(JournalError):
                await a.admissions.try_append(_action(0, "refuse-me"))
            for host in (a, b):
                contents = await host.read(ADMISSIONS)
                assert contents.poison is not None  # every host learns the log is poisoned
                assert list(contents.records[1:]) == [_action(n, "b") for n in range(3)]


async def test_s11_a_poison_recorded_after_a_takeover_hides_nothing_the_new_owner_wrote(
    pg_dsn: str, tmp_path: Path
) -> None:
    """S11, PG5: host A's fenced append is refused by the server, and the poison it then
    records is held up (a connection retried, a slow server: here a trigger waiting for an
    advisory lock the test holds) while host B claims the lane and appends to the same log,
    acknowledged. Every record B was told is durable must still be read; the poison of a
    host that no longer holds the lane bounds nothing (it was recorded at A's stale number,
    after B's records, so every read stopped there)."""
    hold = 4343
    slow_poison = f"""CREATE FUNCTION public.held() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN PERFORM pg_advisory_xact_lock_shared({hold}); RETURN NEW; END $$;
                CREATE TRIGGER held BEFORE INSERT ON pi_runtime.log_poison
                FOR EACH ROW EXECUTE FUNCTION public.held()"""
    acked: list[tuple[int, Record]] = []
    refused: list[ReasonCode] = []
    with trio.fail_after(LIMIT):
        async with _host(pg_dsn, tmp_path, "a") as a, _host(pg_dsn, tmp_path, "b") as b:
            old = await a.claim("room-1", TTL)
            assert old is not None
            log_a = await a.open_or_create_delivery_log("d1", fence=old)
            assert await log_a.append(_action(1, "a")) == 1
            await execute(pg_dsn, REFUSE_MARKED)
            await execute(pg_dsn, slow_poison)
            await _expire(pg_dsn, old.lane)  # A's lease runs out: B may claim the lane
            locked, unlock = threading.Event(), threading.Event()

            def hold_the_lock() -> None:
                with psycopg.connect(pg_dsn, autocommit=True) as conn:
                    conn.execute("SELECT pg_advisory_lock(%s)", [hold])
                    locked.set()
                    unlock.wait(LIMIT)

            async def refused_append() -> None:
                with pytest.raises(JournalError):
                    await log_a.append(_action(2, "refuse-me"))

            async def take_over() -> None:
                new = await b.claim("room-1", TTL)
                assert new is not None
                try:
                    log_b = await b.open_delivery_log("d1", fence=new)
                except JournalError as error:
                    refused.append(error.code)
                    return
                for n in (2, 3):
                    record = _action(n, "b")
                    acked.append((await log_b.append(record), record))

            done: list[Fence | None] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, hold_the_lock)
                await trio.to_thread.run_sync(locked.wait, LIMIT)
                nursery.start_soon(refused_append)
                await _wait_for(pg_dsn, "wait_event = 'advisory'")  # A's poison held up

                async def b_takes_over() -> None:
                    await take_over()
                    done.append(None)

                nursery.start_soon(b_takes_over)
                # until B is done, or waits behind A's poison
                await _wait_for(pg_dsn, "wait_event IN ('tuple', 'transactionid')", done)
                unlock.set()
            contents = await b.read_delivery_log("d1")
    assert acked or refused == [ReasonCode.JOURNAL_POISONED]
    for seq, record in acked:
        assert seq < len(contents.records)
        assert contents.records[seq] == record
