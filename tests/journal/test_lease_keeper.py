"""The lease keeper of a host (``runtime/_journal/_leases.py``, docs/design/scale-out.md S12) on
Trio's virtual clock, against a lease store whose renewals the test scripts: when a host
gives a lane up, and never before."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final, NoReturn

import pytest
import trio
import trio.testing

from runtime._errors import DiskFailedError, ReasonCode
from runtime._journal._fence import Fence, Lease
from runtime._journal._leases import MARGIN, LaneLeases

TTL: Final = 9.0


class ScriptedLeases:
    """The lease half of a store: claims always succeed; each renewal does what
    ``renewing`` says (``held``: extended; ``taken``: another host has it; ``down``: the
    database cannot be reached; ``hang``: never answers)."""

    def __init__(self) -> None:
        self.owner = "me"
        self.renewing = "held"
        self.renewals: list[float] = []
        self._epochs = 0

    async def claim(self, lane: str, ttl: float) -> Fence | None:
        await trio.lowlevel.checkpoint()
        self._epochs += 1
        return Fence(f"lanes/{lane}", self.owner, self._epochs)

    async def renew(self, fences: Sequence[Fence], ttl: float) -> set[Fence]:
        self.renewals.append(trio.current_time())
        await trio.lowlevel.checkpoint()
        if self.renewing == "down":
            raise DiskFailedError(ReasonCode.STORE_UNAVAILABLE, "the database is down")
        if self.renewing == "hang":
            await trio.sleep_forever()
        return set(fences) if self.renewing == "held" else set()

    async def release(self, fence: Fence) -> None:
        await trio.lowlevel.checkpoint()

    async def lease(self, lane: str) -> Lease | None:
        raise NotImplementedError

    async def watch_shared(self, changed: Callable[[bool], None], *, poll: float) -> NoReturn:
        raise NotImplementedError


async def _keeper(store: ScriptedLeases, lost: list[tuple[str, float, str]]) -> LaneLeases:
    def on_lost(lane: str, fence: Fence, why: str) -> None:
        lost.append((lane, trio.current_time(), why))

    return LaneLeases(store, ttl=TTL, lost=on_lost)  # type: ignore[arg-type]


@pytest.mark.parametrize("renewing", ["down", "hang"])
async def test_s12_a_host_that_cannot_renew_gives_its_lanes_up_before_the_lease_can_run_out(
    renewing: str, autojump_clock: trio.testing.MockClock
) -> None:
    """S12: renewals every TTL/3; while they succeed the lane is kept. Once they fail (the
    database down) or hang, the lane is given up at (send time of the last successful
    renewal) + TTL * (1 - MARGIN) — before the database's lease can have run out — not before."""
    store, lost = ScriptedLeases(), list[tuple[str, float, str]]()
    leases = await _keeper(store, lost)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(leases.run)
        assert await leases.claim("dm:1") is not None
        await trio.sleep(TTL + 1)  # three renewals, all held
        assert lost == []
        assert store.renewals == pytest.approx([TTL / 3, 2 * TTL / 3, TTL])
        store.renewing = renewing
        last_good = store.renewals[-1]
        await trio.sleep(2 * TTL)
        nursery.cancel_scope.cancel()
    ((lane, at, why),) = lost
    assert lane == "dm:1"
    assert at == pytest.approx(last_good + TTL * (1 - MARGIN))
    assert at < last_good + TTL
    assert "not renewed in time" in why
    assert leases.fence("dm:1") is None


async def test_s12_a_lane_another_host_claimed_is_given_up_at_the_next_renewal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """S12: a renewal that does not return a lease means another host has it: given up
    then, at once."""
    store, lost = ScriptedLeases(), list[tuple[str, float, str]]()
    leases = await _keeper(store, lost)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(leases.run)
        await leases.claim("dm:1")
        store.renewing = "taken"
        await trio.sleep(TTL)
        nursery.cancel_scope.cancel()
    ((lane, at, why),) = lost
    assert lane == "dm:1"
    assert at == pytest.approx(TTL / 3)
    assert "another host" in why


async def test_s12_a_dropped_lease_is_not_renewed_nor_lost_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A lease the host dropped (its lane stopped) is renewed no more and never reported
    lost; a claim again gets a new epoch."""
    store, lost = ScriptedLeases(), list[tuple[str, float, str]]()
    leases = await _keeper(store, lost)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(leases.run)
        first = await leases.claim("dm:1")
        assert first is not None
        leases.drop("dm:1", first)
        await trio.sleep(2 * TTL)
        assert store.renewals == []
        again = await leases.claim("dm:1")
        assert again is not None
        assert again.epoch == first.epoch + 1
        nursery.cancel_scope.cancel()
    assert lost == []
