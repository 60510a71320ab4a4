"""Injected clocks (runtime._clock) and their MockClock-driven doubles."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
import trio.testing

from runtime import Clocks, MockSilenceClock, MockWallClock, SystemSilenceClock
from runtime._clock import Backoff, SystemWallClock
from runtime._pi._pijson import iso_timestamp


def test_iso_timestamp_matches_pi() -> None:
    """Pi writes entry timestamps as ISO 8601 UTC with milliseconds and a Z."""
    assert iso_timestamp(1795978324855) == "2026-11-29T18:52:04.855Z"
    assert iso_timestamp(1795978324005) == "2026-11-29T18:52:04.005Z"


def test_system_clocks_read_the_kernel() -> None:
    reading = SystemSilenceClock().read()
    assert reading.boottime >= reading.monotonic - 0.01  # boot time counts suspend too
    assert SystemWallClock().time_ms() > 1_700_000_000_000
    assert isinstance(Clocks.system().silence, SystemSilenceClock)


async def test_mock_silence_clock_follows_trio_time(autojump_clock: trio.testing.MockClock) -> None:
    """A 20-minute sleep takes no real time and moves both readings."""
    clock = MockSilenceClock()
    before = clock.read()
    await trio.sleep(1200)
    after = clock.read()
    assert after.boottime - before.boottime == 1200
    assert after.monotonic - before.monotonic == 1200
    assert after.suspended_total == before.suspended_total


async def test_simulated_suspend_moves_only_boottime(mock_clock: trio.testing.MockClock) -> None:
    """A suspend is visible as boottime - monotonic growing (docs/design/clocks.md)."""
    clock = MockSilenceClock()
    before = clock.read()
    clock.suspend(1200)
    after = clock.read()
    assert after.monotonic == before.monotonic
    assert after.boottime - before.boottime == 1200
    assert after.suspended_total - before.suspended_total == 1200


async def test_mock_wall_clock(autojump_clock: trio.testing.MockClock) -> None:
    wall = MockWallClock(start_ms=1_000_000)
    assert wall.time_ms() == 1_000_000
    await trio.sleep(2.5)
    assert wall.time_ms() == 1_002_500
    wall.advance(10)
    assert wall.time_ms() == 1_012_500


async def test_a_mock_wall_clock_set_back_on_trios_real_clock_reads_what_it_was_set_to() -> None:
    """On Trio's real clock (an uptime plus a random offset of up to 200,000 s from 0) a
    clock built with ``start_ms`` reads days more than that; ``reading(ms)`` reads ``ms`` now.
    Two retention tests set the wall clock back ten and forty days with ``start_ms`` and
    failed about one run in eight when the offset pushed the results under their cutoff."""
    ten_days_ago = SystemWallClock().time_ms() - 10 * 86_400_000
    wall = MockWallClock.reading(ten_days_ago)
    assert abs(wall.time_ms() - ten_days_ago) < 60_000  # a minute: a slow machine, no more
    assert MockWallClock(start_ms=ten_days_ago).time_ms() - ten_days_ago > 9_000_000


def test_backoff_waits_grow_by_the_factor_up_to_the_cap_and_are_bounded() -> None:
    """``Backoff``, the one bounded backoff of the stores (receipts R8, postgres-store PG12):
    ``attempts - 1`` waits, growing by ``factor`` up to ``max_delay``; a backoff that would
    never try, or wait a negative or uncapped time, or shrink, is refused."""
    backoff = Backoff(attempts=6, first_delay=0.5, factor=3.0, max_delay=4.0)
    assert list(backoff.delays()) == [0.5, 1.5, 4.0, 4.0, 4.0]
    assert backoff.delay(1) == 0.5
    assert backoff.total_delay == 14.0
    assert list(Backoff(attempts=1, first_delay=0.1, max_delay=1.0).delays()) == []
    bad: list[Callable[[], Backoff]] = [
        lambda: Backoff(attempts=0, first_delay=0.1, max_delay=1.0),
        lambda: Backoff(attempts=3, first_delay=-1.0, max_delay=1.0),
        lambda: Backoff(attempts=3, first_delay=2.0, max_delay=1.0),
        lambda: Backoff(attempts=3, first_delay=0.1, factor=0.5, max_delay=1.0),
    ]
    for make in bad:
        with pytest.raises(ValueError, match="a Backoff"):
            make()
