"""The wall clock steps (docs/design/clocks.md C5): NTP, an operator or a bad clock source
moves it back or forward, also between a host's stop and its next start. A decision taken on
wall time may be moved by the step — bounded, and said in clocks.md — but never made to wait
for ever, nor to give up on admitted work it promised to keep.

Pure rules on virtual time (``autojump_clock``), each host's clock a
:class:`~runtime._clock.MockWallClock`; the room worker's own test of the same on real files
and a real restart is ``tests/rooms/test_room_clock_steps.py``.
"""

from __future__ import annotations

import random
from typing import Final

import pytest
import trio
import trio.testing

from runtime._backoff import RouteBreaker, give_up_ms, past_bounds
from runtime._boundary._stream import UpstreamFailure
from runtime._clock import Clocks, MockSilenceClock, MockWallClock
from runtime._config import BackoffConfig
from runtime._records import Parked

CONFIG: Final = BackoffConfig(
    first_seconds=5, max_seconds=300, deadline_minutes=30, max_attempts=12
)
HOUR_MS: Final = 3_600_000
YEAR_MS: Final = 365 * 24 * HOUR_MS


def host(now_ms: int) -> tuple[RouteBreaker, MockWallClock]:
    """A host whose wall clock reads ``now_ms`` at this instant."""
    wall = MockWallClock.reading(now_ms)
    return RouteBreaker(
        CONFIG, Clocks(silence=MockSilenceClock(), wall=wall), rng=random.Random(1)
    ), wall


async def waited_before_asking(
    route: RouteBreaker, wall: MockWallClock, parks: list[Parked]
) -> tuple[float, object]:
    """As a lane waits for the route (PB3, PB4): weighed by its bounds before every try, the
    breaker asked, each wait cut to the episode's deadline; how long (Trio time) until it may
    ask, and its probe token. It must be let ask: past its bounds is a failure of the test."""
    started = trio.current_time()
    for _ in range(1_000):  # a wait that comes back at once, again and again, fails too
        assert not past_bounds(CONFIG, parks, wall.time_ms()), "gave up without a try"
        admit = route.admit()
        if admit.until_ms is None:
            return trio.current_time() - started, admit.probe
        ends = give_up_ms(CONFIG, parks)
        await route.wait(
            admit.until_ms if ends is None else min(admit.until_ms, ends), trio.Event()
        )
    raise AssertionError("the breaker never let it ask")


@pytest.mark.parametrize("back_ms", [HOUR_MS, YEAR_MS], ids=["an-hour", "a-year"])
async def test_c5_pb2_a_park_read_after_the_clock_went_back_waits_no_longer_than_it_recorded(
    back_ms: int, autojump_clock: trio.testing.MockClock
) -> None:
    """C5, PB2: a delivery parked by one host (its first try refused: next try in 5 s); the
    next host starts with its wall clock an hour (a year) behind. Its breaker resumes the
    park, and the delivery asks again 5 s after the start at the latest — the park was
    written after its first failure, so a clock reading before that was set back. Before,
    the wait was the recorded time less the clock now: an hour and 5 s (a year), far past
    the episode's 30-minute deadline, with nothing asked."""
    _, then = host(1_795_000_000_000)
    first = then.time_ms()
    park = Parked(
        attempt=1,
        first_failure_ms=first,
        next_attempt_ms=first + 5_000,
        status=503,
        code="model_failed",
        route_failures=1,
        deadline_minutes=30,
        max_attempts=12,
    )
    route, wall = host(first - back_ms)
    route.resume(park)
    route.resume(park)  # the lane's own look at it changes nothing (PB2)
    assert (await waited_before_asking(route, wall, [park]))[0] <= 5.0


async def test_c5_pb2_a_later_park_read_after_the_clock_went_back_waits_at_most_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """C5, PB3: the same for a park written 25 minutes into its episode (the route's 7th
    failure, a 5-minute step): a clock set back a day cannot tell when in the episode the park
    was written, so the wait is counted from its first failure — at most the episode's
    deadline (30 minutes), never the day."""
    first = 1_795_000_000_000
    park = Parked(
        attempt=7,
        first_failure_ms=first,
        next_attempt_ms=first + 30 * 60_000,
        status=503,
        code="model_failed",
        route_failures=7,
        deadline_minutes=30,
        max_attempts=12,
    )
    route, wall = host(first - 24 * HOUR_MS)
    route.resume(park)
    assert (await waited_before_asking(route, wall, [park]))[0] <= 30 * 60


async def test_c5_pb2_a_park_read_with_the_clock_as_it_was_keeps_its_time_to_the_millisecond(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """C5 leaves PB2 as it was when the clock did not go back: the breaker holds the
    recorded time exactly, and a clock set back by less than the episode's age (nothing
    proves it) waits the recorded time less the clock — the step, at most the deadline."""
    first = 1_795_000_000_000
    park = Parked(
        attempt=2,
        first_failure_ms=first,
        next_attempt_ms=first + 70_000,
        status=503,
        code="model_failed",
        route_failures=2,
        deadline_minutes=30,
        max_attempts=12,
    )
    route, wall = host(first + 60_000)
    route.resume(park)
    assert route.admit().until_ms == park.next_attempt_ms
    assert (await waited_before_asking(route, wall, [park]))[0] == pytest.approx(10.0, abs=0.01)
    route, wall = host(first + 30_000)  # set back 30 s since the park was written
    route.resume(park)
    assert (await waited_before_asking(route, wall, [park]))[0] == pytest.approx(40.0, abs=0.01)


async def test_c5_pb3_a_clock_set_forward_across_a_restart_ends_the_episode_asking_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """C5, PB3 (bounded, explained): a clock set forward past the episode's deadline across
    a restart cannot be told from a host that was down that long — the delivery ends with
    its failure code before asking anything more (it has a result: nothing is lost), as
    ``test_pb3_pb7_a_host_restarted_past_the_deadline_ends_the_delivery_asking_nothing``
    says of a real stop. The breaker, asked, would let it go at once: it never waits."""
    first = 1_795_000_000_000
    park = Parked(
        attempt=1,
        first_failure_ms=first,
        next_attempt_ms=first + 5_000,
        status=503,
        code="model_failed",
        route_failures=1,
        deadline_minutes=30,
        max_attempts=12,
    )
    route, wall = host(first + HOUR_MS)
    route.resume(park)
    assert past_bounds(CONFIG, [park], wall.time_ms())
    assert route.admit().probe is not None


async def test_c5_pb4_a_clock_set_back_during_an_open_breaker_keeps_its_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """C5, PB4 in one process, both ways: set back a day during a wait, the breaker still
    lets the next try go at the schedule's time (Trio's clock measures it); set forward a
    day, the wait ends at once — one try sooner than the schedule, then the next failure
    opens it for the next step as ever: bounded by the step, never a wait for ever."""
    route, wall = host(1_795_000_000_000)
    until = route.failed(UpstreamFailure(503))
    step = (until - wall.time_ms()) / 1000
    await trio.sleep(1)
    wall.advance(-24 * 3600)
    waited, probe = await waited_before_asking(route, wall, [])
    assert waited <= step
    route.failed(UpstreamFailure(503), probe)
    wall.advance(2 * 24 * 3600)
    assert (await waited_before_asking(route, wall, []))[0] == 0
