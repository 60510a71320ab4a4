"""Adversarial tests of lane leases (``docs/design/scale-out.md`` S10-S12): each tries to make
a host act on a lease without proof — hold two epochs of one lane, keep a lease a late
renewal answered for, write under an epoch a takeover ended, take the lane with another host
at the same moment, or reuse a fence after a restart under the same name.

The lease keeper's tests run on Trio's virtual clock against a lease store the test scripts;
the store's run on a real, throw-away PostgreSQL (``pg_fixtures.py``). No test sleeps on the
real clock: a statement is held where the test needs it by a row or an advisory lock an admin
connection holds, and the test waits until the store's backend waits on it
(``pg_stat_activity``) before it lets go.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Final, NoReturn

import pytest
import trio
import trio.lowlevel
import trio.testing

from runtime._clock import Backoff, Clocks, MockWallClock
from runtime._errors import DiskFailedError, JournalError, ReasonCode
from runtime._journal._fence import Fence, Lease
from runtime._journal._leases import MARGIN, LaneLeases
from runtime._journal._postgres import DEFAULT_RETRY, PgStore, open_pg_store
from runtime._records import OutboxAction

from .pg_fixtures import cutting_proxy, execute
from .test_leases import _expire, _lease_row
from .test_postgres_adversarial import _row_locked

LIMIT: Final = 30.0
TTL: Final = 30.0
KEEPER_TTL: Final = 9.0
ONCE: Final = Backoff(attempts=1, first_delay=0.001, max_delay=0.001)


def _action(n: int, host: str = "") -> OutboxAction:
    return OutboxAction(action_id=f"{host}a:{n}", kind="test", state="done", detail={"n": n})


# -- the lease keeper (virtual clock) ----------------------------------------------------------


class SlowLeases:
    """The lease half of a store whose every claim is committed (its epoch taken, one above
    the last) when it is called, and answered ``claim_delays`` seconds later, one delay per
    call in order; each renewal is answered ``renew_delay`` seconds after it is sent, with
    the fences of the newest epoch of each lane (the database's truth)."""

    def __init__(self) -> None:
        self.owner = "me"
        self.claim_delays: list[float] = []
        self.renew_delay = 0.0
        self.epochs: dict[str, int] = {}
        self.renewed: list[Fence] = []

    async def claim(self, lane: str, ttl: float) -> Fence | None:
        self.epochs[lane] = self.epochs.get(lane, 0) + 1
        fence = Fence(f"lanes/{lane}", self.owner, self.epochs[lane])
        await trio.sleep(self.claim_delays.pop(0) if self.claim_delays else 0.0)
        return fence

    async def renew(self, fences: Sequence[Fence], ttl: float) -> set[Fence]:
        await trio.sleep(self.renew_delay)
        held = {f for f in fences if self.epochs[f.lane.removeprefix("lanes/")] == f.epoch}
        self.renewed.extend(held)
        return held

    async def release(self, fence: Fence) -> None:
        await trio.lowlevel.checkpoint()

    async def lease(self, lane: str) -> Lease | None:
        raise NotImplementedError

    async def watch_shared(self, changed: Callable[[bool], None], *, poll: float) -> NoReturn:
        raise NotImplementedError


def _keeper(store: SlowLeases, lost: list[tuple[Fence, float, str]]) -> LaneLeases:
    def on_lost(lane: str, fence: Fence, why: str) -> None:
        lost.append((fence, trio.current_time(), why))

    return LaneLeases(store, ttl=KEEPER_TTL, lost=on_lost)  # type: ignore[arg-type]


async def test_s12_a_claim_answered_after_a_later_claim_of_its_lane_does_not_displace_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """S12: two claims of one lane by this host at once; the database commits the first
    (epoch 1), then the second (epoch 2), but the first's answer comes last (its connection
    retried, a slow thread). The keeper must keep the newest epoch — the only one the
    database still honours — renew it and watch its deadline; the superseded claim proves
    nothing now and is answered ``None``. Kept instead, epoch 1 is renewed in vain and
    reported lost, while epoch 2, the one the database holds for this host, is renewed by
    nobody and watched by nobody: its lane runs on after its lease ran out."""
    store, lost = SlowLeases(), list[tuple[Fence, float, str]]()
    store.claim_delays = [2.0, 0.0]
    leases = _keeper(store, lost)
    answers: dict[str, Fence | None] = {}

    async def claim(name: str) -> None:
        answers[name] = await leases.claim("dm:1")

    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(leases.run)
            async with trio.open_nursery() as claims:
                claims.start_soon(claim, "first")
                await trio.sleep(0.5)  # the first is committed (epoch 1), not answered
                claims.start_soon(claim, "second")
            newest = Fence("lanes/dm:1", "me", 2)
            assert answers == {"first": None, "second": newest}
            assert leases.fence("dm:1") == newest
            await trio.sleep(3 * KEEPER_TTL)
            assert leases.fence("dm:1") == newest  # renewed all along
            nursery.cancel_scope.cancel()
    assert lost == []
    assert set(store.renewed) == {newest}


async def test_s12_a_claim_again_ends_the_epoch_it_supersedes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """S12: this host claims a lane it holds (the database moves the epoch on, S10): the
    earlier epoch is refused by the database from that moment, so whatever runs under it is
    told at once (``lost``) rather than at its next write, and only the new epoch is kept."""
    store, lost = SlowLeases(), list[tuple[Fence, float, str]]()
    leases = _keeper(store, lost)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(leases.run)
            first = await leases.claim("dm:1")
            second = await leases.claim("dm:1")
            assert first is not None
            assert second is not None
            assert second.epoch == first.epoch + 1
            assert leases.fence("dm:1") == second
            await trio.sleep(2 * KEEPER_TTL)
            nursery.cancel_scope.cancel()
    assert [fence for fence, _at, _why in lost] == [first]
    assert set(store.renewed) == {second}


async def test_s12_a_renewal_answered_after_its_deadline_does_not_bring_the_lane_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """S12: a renewal the database extends, but whose answer comes after the lease's
    deadline: the lane was given up at the deadline (its workers stopped) and stays given
    up — the late answer does not hand back a lease nothing runs under, it is lost once,
    and it is not renewed again."""
    store, lost = SlowLeases(), list[tuple[Fence, float, str]]()
    leases = _keeper(store, lost)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(leases.run)
            fence = await leases.claim("dm:1")
            assert fence is not None
            store.renew_delay = KEEPER_TTL  # the first renewal, sent at TTL/3, answers late
            await trio.sleep(3 * KEEPER_TTL)
            assert leases.fence("dm:1") is None
            nursery.cancel_scope.cancel()
    ((gone, at, why),) = lost
    assert gone == fence
    assert at == pytest.approx(KEEPER_TTL * (1 - MARGIN))  # the claim's deadline, not later
    assert "not renewed in time" in why
    assert store.renewed == [fence]  # extended in the database once, never again


# -- the store (a real PostgreSQL) -------------------------------------------------------------


@contextlib.asynccontextmanager
async def _host(
    dsn: str, root: Path, name: str, retry: Backoff = DEFAULT_RETRY, clocks: Clocks | None = None
) -> AsyncIterator[PgStore]:
    async with open_pg_store(
        dsn, root=root / name, owner=name, retry=retry, clocks=clocks
    ) as store:
        yield store


async def _lock_waiters(dsn: str) -> int:
    rows = await execute(
        dsn,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock'",
    )
    return int(rows[0][0])


async def _until_waiting(dsn: str, count: int) -> None:
    """Until ``count`` backends of this database wait for a lock."""
    while await _lock_waiters(dsn) < count:
        await trio.lowlevel.checkpoint()


@pytest.mark.parametrize("lane_was", ["expired", "never claimed"])
async def test_s10_hosts_taking_over_one_lane_at_once_leave_it_one_owner(
    pg_dsn: str, tmp_path: Path, lane_was: str
) -> None:
    """S10: four hosts claim one lane at the same moment — its dead holder's lease run out,
    or a lane nobody ever claimed (their inserts race). The claims are queued on the row (an
    admin transaction holds it: the dead holder's expiry, or the lane's first row, not yet
    committed) and all let go at once: exactly one host gets the lane, one epoch above the
    last, and every other is answered ``None``; no epoch is handed out twice."""
    names = ["b", "c", "d", "e"]
    with trio.fail_after(LIMIT):
        async with contextlib.AsyncExitStack() as stack:
            a = await stack.enter_async_context(_host(pg_dsn, tmp_path, "a"))
            hosts = [await stack.enter_async_context(_host(pg_dsn, tmp_path, n)) for n in names]
            rel = a.lane_rel("room-1")
            if lane_was == "expired":
                dead = await a.claim("room-1", TTL)
                assert dead is not None
                hold = (
                    "UPDATE pi_runtime.lanes SET lease_until = now() - interval '1 second' "
                    "WHERE lane = %s"
                )
                before = dead.epoch
            else:
                hold = (
                    "INSERT INTO pi_runtime.lanes (lane, owner, epoch, lease_until) "
                    "VALUES (%s, 'nobody', 1, '-infinity')"
                )
                before = 1
            answers: list[Fence | None] = []

            async def claim(host: PgStore) -> None:
                answers.append(await host.claim("room-1", TTL))

            # the transaction commits as its block ends (first), then the claims are waited for
            async with trio.open_nursery() as nursery, _row_locked(pg_dsn, hold, [rel]):
                for host in hosts:
                    nursery.start_soon(claim, host)
                await _until_waiting(pg_dsn, len(hosts))
            # committed: the four claims, all waiting on the row, go on together
            owner, epoch, _remaining = await _lease_row(pg_dsn, rel)
    won = [fence for fence in answers if fence is not None]
    assert len(answers) == len(names)
    assert len(won) == 1
    (fence,) = won
    assert fence.epoch == before + 1
    assert (owner, epoch) == (fence.owner, fence.epoch)


@pytest.mark.parametrize("taker", ["b", "a"])
async def test_s11_s12_an_append_and_a_renewal_racing_a_takeover_that_came_first_are_refused(
    pg_dsn: str, tmp_path: Path, taker: str
) -> None:
    """S11, S12: a claim of A's lane has updated the lease row and not yet committed (held
    by a trigger waiting for an advisory lock the test holds) when A's last append and A's
    renewal arrive — the claim of host B once A's lease ran out, or of A's successor under
    its name (a process started again) while A's lease runs. The append waits for the row,
    and so does the renewal where it still sees the lease live (the successor). The claim
    commits first, so the lane is the taker's: A's append, re-checking the row, is refused
    ``lane_fenced`` — nothing written, not silently applied under the old epoch — and takes
    no more; A's renewal renews nothing (lost, never extended under the new epoch). The
    taker reads nothing of A's second record."""
    hold = 4545
    with trio.fail_after(LIMIT):
        async with (
            _host(pg_dsn, tmp_path, "a") as a,
            open_pg_store(pg_dsn, root=tmp_path / "taker", owner=taker) as taking,
        ):
            old = await a.claim("room-1", TTL)
            assert old is not None
            log_a = await a.open_or_create_delivery_log("d1", fence=old)
            assert await log_a.append(_action(1, "a")) == 1
            await execute(
                pg_dsn,
                f"""CREATE FUNCTION public.held() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN PERFORM pg_advisory_xact_lock_shared({hold}); RETURN NEW; END $$;
                CREATE TRIGGER held AFTER UPDATE ON pi_runtime.lanes
                FOR EACH ROW WHEN (NEW.epoch <> OLD.epoch) EXECUTE FUNCTION public.held()""",
            )
            if taker == "b":
                await _expire(pg_dsn, old.lane)
            claimed: list[Fence | None] = []
            renewed: list[set[Fence]] = []
            refused: list[ReasonCode] = []

            async def take_over() -> None:
                claimed.append(await taking.claim("room-1", TTL))

            async def last_append() -> None:
                with pytest.raises(JournalError) as error:
                    await log_a.append(_action(2, "a"))
                refused.append(error.value.code)

            answered = trio.Event()

            async def renew() -> None:
                renewed.append(await a.renew([old], TTL))
                answered.set()

            async with (
                trio.open_nursery() as nursery,
                _row_locked(pg_dsn, "SELECT pg_advisory_lock(%s)", [hold]),
            ):
                nursery.start_soon(take_over)
                await _until_waiting(pg_dsn, 1)  # the claim: its row updated, held
                nursery.start_soon(last_append)
                await _until_waiting(pg_dsn, 2)  # the append, behind it
                nursery.start_soon(renew)
                if taker == "a":  # it sees the lease live, so it waits for the row
                    await _until_waiting(pg_dsn, 3)
                else:  # it sees the lease run out: nothing to renew, at once
                    await answered.wait()
                assert (claimed, refused) == ([], [])
            new = claimed[0]
            assert new == Fence(old.lane, taker, old.epoch + 1)
            assert refused == [ReasonCode.LANE_FENCED]
            assert renewed == [set()]
            with pytest.raises(JournalError) as again:
                await log_a.append(_action(3, "a"))
            assert again.value.code is ReasonCode.LANE_FENCED
            log_new = await taking.open_delivery_log("d1", fence=new)
            assert log_new.contents.records[1:] == (_action(1, "a"),)
            owner, epoch, remaining = await _lease_row(pg_dsn, old.lane)
            assert (owner, epoch) == (taker, new.epoch)
            assert remaining <= TTL


async def test_s10_a_fence_of_a_process_started_again_under_its_name_is_spent(
    pg_dsn: str, tmp_path: Path
) -> None:
    """S10, S11, S12: a host started again under the same name (``[store] host_name``)
    claims its lane back at once, under the next epoch, while the first process — paused,
    not dead — still holds its fence. That fence is spent for every use: the old process's
    append is refused, its renewal renews nothing (it extends neither its own epoch nor the
    new one), its release gives nothing up (the new epoch's lease runs on), and no later
    claim hands its epoch out again."""
    with trio.fail_after(LIMIT):
        async with _host(pg_dsn, tmp_path, "a") as first:
            old = await first.claim("room-1", TTL)
            assert old is not None
            log_old = await first.open_or_create_delivery_log("d1", fence=old)
            assert await log_old.append(_action(1)) == 1
            async with open_pg_store(pg_dsn, root=tmp_path / "a2", owner="a") as again:
                new = await again.claim("room-1", 60.0)
                assert new == Fence(old.lane, "a", old.epoch + 1)
                _owner, _epoch, before = await _lease_row(pg_dsn, old.lane)
                assert await first.renew([old], 3 * TTL) == set()
                await first.release(old)
                owner, epoch, after = await _lease_row(pg_dsn, old.lane)
                assert (owner, epoch) == ("a", new.epoch)
                assert 0 < after <= before  # neither extended nor released
                with pytest.raises(JournalError) as refused:
                    await log_old.append(_action(2))
                assert refused.value.code is ReasonCode.LANE_FENCED
                log_new = await again.open_delivery_log("d1", fence=new)
                assert await log_new.append(_action(3)) == 2
                await again.release(new)
            back = await first.claim("room-1", TTL)
            assert back is not None
            assert back.epoch == new.epoch + 1


@pytest.mark.parametrize("where", ["request", "reply"])
async def test_s12_a_renewal_whose_connection_drops_is_never_taken_as_held_unproven(
    pg_dsn: str, tmp_path: Path, where: str
) -> None:
    """S12: the connection drops under a renewal — before the server saw it (``request``),
    or after it committed and before its answer came (``reply``). With a retry left, the
    renewal is sent again on a new connection and answers what the database holds: held,
    the same epoch, extended once more (a renewal is idempotent). With none left it raises
    ``store_unavailable`` — neither "held" (the keeper's deadline stays at its last proven
    renewal) nor "lost" (nobody claimed it) — and does not fail the host's store."""
    fast = Backoff(attempts=3, first_delay=0.001, max_delay=0.001)
    with trio.fail_after(LIMIT):
        async with cutting_proxy(pg_dsn) as proxy:
            async with _host(proxy.dsn, tmp_path, "a", retry=fast) as a:
                fence = await a.claim("room-1", 5.0)
                assert fence is not None
                proxy.cut_next(where)  # type: ignore[arg-type]
                assert await a.renew([fence], TTL) == {fence}
                assert proxy.cuts == 1
                owner, epoch, remaining = await _lease_row(pg_dsn, fence.lane)
                assert (owner, epoch) == ("a", fence.epoch)
                assert TTL - 5 < remaining <= TTL
            async with _host(proxy.dsn, tmp_path, "a", retry=ONCE) as a:
                proxy.cut_next(where)  # type: ignore[arg-type]
                with pytest.raises(DiskFailedError) as down:
                    await a.renew([fence], 2 * TTL)
                assert down.value.code is ReasonCode.STORE_UNAVAILABLE
                assert a.disk_failure is None  # the keeper's to decide, not the host's
                owner, epoch, _remaining = await _lease_row(pg_dsn, fence.lane)
                assert (owner, epoch) == ("a", fence.epoch)


@pytest.mark.parametrize("skew_days", [-365, 365])
async def test_s10_a_host_clock_ahead_or_behind_the_databases_moves_no_lease(
    pg_dsn: str, tmp_path: Path, skew_days: int
) -> None:
    """S10: a host whose wall clock is a year ahead of the database's, or a year behind,
    claims, renews and is refused exactly as one in step: every lease time is the
    database's ``now()`` — its lease is TTL long, another host's live lease is not taken
    by it, and its own is taken by another host only once it ran out."""
    wall = MockWallClock.reading(Clocks.system().wall.time_ms() + skew_days * 86_400_000)
    with trio.fail_after(LIMIT):
        async with (
            _host(pg_dsn, tmp_path, "skewed", clocks=Clocks(wall=wall)) as skewed,
            _host(pg_dsn, tmp_path, "b") as b,
        ):
            held_by_b = await b.claim("room-b", TTL)
            assert held_by_b is not None
            assert await skewed.claim("room-b", TTL) is None
            fence = await skewed.claim("room-1", TTL)
            assert fence is not None
            assert await skewed.renew([fence], TTL) == {fence}
            _owner, _epoch, remaining = await _lease_row(pg_dsn, fence.lane)
            assert TTL - 5 < remaining <= TTL
            assert await b.claim("room-1", TTL) is None
            await _expire(pg_dsn, fence.lane)
            assert await skewed.renew([fence], TTL) == set()
            taken = await b.claim("room-1", TTL)
            assert taken is not None
            assert taken.epoch == fence.epoch + 1
