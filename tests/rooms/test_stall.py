"""The room turn stall backstop (runtime._rooms._stall): tests named after its numbered invariants.

The pure core is tested with plain numbers; the shell under virtual time, with
:class:`MockSilenceClock` following Trio's MockClock and ``suspend()`` standing in for a host
that sleeps (boot time jumps, Trio's clock does not).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from runtime._clock import MockSilenceClock
from runtime._rooms._stall import DEFAULT_STALL_LIMIT, DEFAULT_STALL_TICK, StallWatch, watch_turn

MINUTE = 60.0

# --- the pure core ---------------------------------------------------------------------------


def test_defaults_follow_the_brief() -> None:
    """docs/design/lanes.md: 300 s of silence, a 5 s tick."""
    assert DEFAULT_STALL_LIMIT == 300.0
    assert DEFAULT_STALL_TICK == 5.0
    assert StallWatch().limit == 300.0


@pytest.mark.parametrize("limit", [0.0, -1.0, math.nan])
def test_limit_must_be_positive(limit: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        StallWatch(limit=limit)


def test_st1_silence_stalls_at_the_limit() -> None:
    watch = StallWatch()
    watch.event(1000.0)
    assert watch.overdue_at() == 1300.0
    assert not watch.stalled(1299.9)
    assert watch.stalled(1300.0)
    assert watch.stalled(5000.0)


def test_st1_limit_is_configurable() -> None:
    watch = StallWatch(limit=10.0)
    watch.event(0.0)
    assert not watch.stalled(9.0)
    assert watch.stalled(10.0)


def test_st2_any_event_resets_the_clock() -> None:
    watch = StallWatch()
    watch.event(0.0)
    watch.event(299.0)
    assert not watch.stalled(300.0)
    assert watch.overdue_at() == 599.0
    assert watch.last_event == 299.0


def test_st2_a_late_event_never_moves_the_clock_back() -> None:
    watch = StallWatch()
    watch.event(500.0)
    watch.event(100.0)
    assert watch.last_event == 500.0
    assert watch.overdue_at() == 800.0


def test_st3_a_long_turn_with_steady_events_never_stalls() -> None:
    """An hour-long turn with an event every 299 s is never stalled."""
    watch = StallWatch()
    watch.event(0.0)
    now = 0.0
    while now < 3600.0:
        now += 299.0
        assert not watch.stalled(now)
        watch.event(now)


def test_st4_a_lease_holds_silence_off_until_its_deadline() -> None:
    watch = StallWatch()
    watch.event(0.0)
    watch.lease("call_1", deadline=600.0)
    assert not watch.stalled(300.0)
    assert not watch.stalled(599.9)
    assert not watch.stalled(899.9)  # silence counts from the deadline
    assert watch.stalled(900.0)
    assert watch.overdue_at() == 900.0


def test_st4_events_during_a_lease() -> None:
    """Silence after an expired lease counts from the later of the deadline and the last event."""
    watch = StallWatch()
    watch.event(0.0)
    watch.lease("call_1", deadline=600.0)
    watch.event(500.0)  # during the lease: the deadline is still later
    assert watch.overdue_at() == 900.0
    watch.event(700.0)  # after the deadline: the event is later
    assert watch.overdue_at() == 1000.0
    assert not watch.stalled(999.0)
    assert watch.stalled(1000.0)


def test_st4_a_lease_that_already_expired_still_marks_its_deadline() -> None:
    """A tool that outlives its own deadline without a word: silence from the deadline."""
    watch = StallWatch()
    watch.event(0.0)
    watch.lease("call_1", deadline=100.0)
    assert not watch.stalled(399.0)
    assert watch.stalled(400.0)


def test_st4_the_latest_of_several_leases_counts() -> None:
    watch = StallWatch()
    watch.event(0.0)
    watch.lease("a", deadline=200.0)
    watch.lease("b", deadline=900.0)
    assert watch.overdue_at() == 1200.0


def test_st4_leasing_a_key_again_replaces_its_deadline() -> None:
    watch = StallWatch()
    watch.event(0.0)
    watch.lease("call_1", deadline=900.0)
    watch.lease("call_1", deadline=100.0)
    assert watch.overdue_at() == 400.0


def test_st5_release_is_an_event() -> None:
    """A 6-minute tool leased for an hour releases at 360 s: silence counts from then."""
    watch = StallWatch()
    watch.event(0.0)
    watch.lease("call_1", deadline=3600.0)
    watch.release("call_1", 360.0)
    assert watch.last_event == 360.0
    assert watch.overdue_at() == 660.0
    assert not watch.stalled(659.0)
    assert watch.stalled(660.0)


def test_st5_release_keeps_other_leases() -> None:
    watch = StallWatch()
    watch.event(0.0)
    watch.lease("a", deadline=1000.0)
    watch.lease("b", deadline=2000.0)
    watch.release("b", 50.0)
    assert watch.overdue_at() == 1300.0


def test_st5_releasing_an_unknown_key_is_only_an_event() -> None:
    watch = StallWatch()
    watch.event(0.0)
    watch.release("never_leased", 100.0)
    watch.release("never_leased", 100.0)
    assert watch.overdue_at() == 400.0


def test_st6_time_suspended_is_silence() -> None:
    """Readings from a suspend-aware clock: boottime jumps by the suspend, so does silence."""
    clock_boottime = 0.0
    watch = StallWatch()
    watch.event(clock_boottime)
    clock_boottime += 12.0 + 1200.0  # 12 s awake, then 20 minutes suspended
    assert watch.stalled(clock_boottime)


def test_st8_no_event_no_silence() -> None:
    watch = StallWatch()
    assert watch.last_event is None
    assert watch.overdue_at() == math.inf
    assert not watch.stalled(1e12)
    watch.lease("call_1", deadline=10.0)  # a lease alone does not start the clock
    assert watch.overdue_at() == math.inf


# --- the Trio shell under virtual time -------------------------------------------------------

Turn = Callable[[StallWatch, MockSilenceClock], Awaitable[None]]


async def _run(
    turn: Turn, *, watch: StallWatch | None = None, tick: float = DEFAULT_STALL_TICK
) -> tuple[MockSilenceClock, float | None]:
    """Run ``turn`` beside :func:`watch_turn`, the way a lane does; the Trio time (from the
    start) at which the watch reported a stall, or ``None`` if the turn finished first."""
    clock = MockSilenceClock()
    watch = watch if watch is not None else StallWatch()
    start = trio.current_time()
    stalled_at: float | None = None

    async with trio.open_nursery() as nursery:

        async def watcher() -> None:
            nonlocal stalled_at
            await watch_turn(watch, clock, tick=tick)
            stalled_at = trio.current_time() - start
            nursery.cancel_scope.cancel()  # the lane aborts the turn

        nursery.start_soon(watcher)
        await turn(watch, clock)
        nursery.cancel_scope.cancel()  # the turn settled: stop watching
    return clock, stalled_at


def _event(watch: StallWatch, clock: MockSilenceClock) -> None:
    watch.event(clock.read().boottime)


async def test_st1_300_s_of_silence_stalls_within_one_tick(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def turn(watch: StallWatch, clock: MockSilenceClock) -> None:
        _event(watch, clock)  # the prompt went out
        await trio.sleep(2.5)  # off the tick grid
        _event(watch, clock)  # one token, then the stream dies
        await trio.sleep_forever()

    _, stalled_at = await _run(turn)
    assert stalled_at is not None
    assert 302.5 <= stalled_at <= 302.5 + DEFAULT_STALL_TICK


async def test_st1_st7_plain_silence_stalls_at_300_to_305_s(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """docs/design/lanes.md: nothing at all after the prompt; caught at 300 to 305 s."""

    async def turn(watch: StallWatch, clock: MockSilenceClock) -> None:
        _event(watch, clock)
        await trio.sleep_forever()

    _, stalled_at = await _run(turn)
    assert stalled_at is not None
    assert 300.0 <= stalled_at <= 305.0


async def test_st2_st3_a_20_minute_turn_streaming_every_4_minutes_is_never_aborted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issue #5 item 6: one token every 4 minutes for 20 minutes, then the reply ends."""

    async def turn(watch: StallWatch, clock: MockSilenceClock) -> None:
        _event(watch, clock)
        for _ in range(5):
            await trio.sleep(4 * MINUTE)
            _event(watch, clock)

    _, stalled_at = await _run(turn)
    assert stalled_at is None
    assert trio.current_time() >= 20 * MINUTE


async def test_st3_a_two_hour_turn_with_events_is_never_aborted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Nothing caps a turn's total duration."""

    async def turn(watch: StallWatch, clock: MockSilenceClock) -> None:
        _event(watch, clock)
        for _ in range(24):
            await trio.sleep(295.0)
            _event(watch, clock)

    _, stalled_at = await _run(turn)
    assert stalled_at is None


async def test_st4_st5_a_6_minute_tool_within_its_lease_is_never_aborted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issue #5 item 6: a gated tool with a 10-minute deadline runs 6 silent minutes."""

    async def turn(watch: StallWatch, clock: MockSilenceClock) -> None:
        _event(watch, clock)  # prompt
        await trio.sleep(3.0)
        _event(watch, clock)  # tool_execution_start
        watch.lease("call_1", deadline=clock.read().boottime + 10 * MINUTE)
        await trio.sleep(6 * MINUTE)  # the tool prints nothing
        watch.release("call_1", clock.read().boottime)
        await trio.sleep(20.0)
        _event(watch, clock)  # the final reply streams
        await trio.sleep(10.0)

    _, stalled_at = await _run(turn)
    assert stalled_at is None


async def test_st4_a_lease_that_expires_then_300_s_of_silence_stalls(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A tool hangs past its 2-minute deadline: silence counts from the deadline."""

    async def turn(watch: StallWatch, clock: MockSilenceClock) -> None:
        _event(watch, clock)
        watch.lease("call_1", deadline=clock.read().boottime + 2 * MINUTE)
        await trio.sleep_forever()

    _, stalled_at = await _run(turn)
    assert stalled_at is not None
    assert 420.0 <= stalled_at <= 425.0


async def test_st4_events_during_a_lease_then_silence(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Events inside a 10-minute lease do not shorten it; one after it extends the turn."""

    async def turn(watch: StallWatch, clock: MockSilenceClock) -> None:
        _event(watch, clock)
        watch.lease("call_1", deadline=clock.read().boottime + 10 * MINUTE)
        await trio.sleep(4 * MINUTE)
        _event(watch, clock)  # tool_execution_update at 240 s
        await trio.sleep(7 * MINUTE)
        _event(watch, clock)  # at 660 s, past the deadline
        await trio.sleep_forever()

    _, stalled_at = await _run(turn)
    assert stalled_at is not None
    assert 960.0 <= stalled_at <= 965.0


async def test_st5_a_released_lease_stops_holding(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A tool leased for an hour ends at 100 s; the worker then goes silent: 300 s later."""

    async def turn(watch: StallWatch, clock: MockSilenceClock) -> None:
        _event(watch, clock)
        watch.lease("call_1", deadline=clock.read().boottime + 60 * MINUTE)
        await trio.sleep(100.0)
        watch.release("call_1", clock.read().boottime)
        await trio.sleep_forever()

    _, stalled_at = await _run(turn)
    assert stalled_at is not None
    assert 400.0 <= stalled_at <= 405.0


async def test_st6_st7_a_20_minute_suspend_is_caught_on_the_first_tick_after_wake(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issue #5 item 6 (ADR 0118's 22-minute hang): the host sleeps 20 minutes mid-stream."""
    woke_at = math.nan

    async def turn(watch: StallWatch, clock: MockSilenceClock) -> None:
        nonlocal woke_at
        _event(watch, clock)
        await trio.sleep(12.0)
        _event(watch, clock)  # a token, then the host suspends
        clock.suspend(20 * MINUTE)
        woke_at = trio.current_time()
        await trio.sleep_forever()  # the provider stream died with the suspend

    clock, stalled_at = await _run(turn)
    assert stalled_at is not None
    assert woke_at <= stalled_at <= woke_at + DEFAULT_STALL_TICK
    # awake time barely moved, yet the silence exceeds the limit by the suspend
    assert clock.read().suspended_total == 20 * MINUTE


async def test_st6_a_suspend_inside_a_lease_past_its_deadline_stalls_on_wake(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The lease's deadline is on the boottime axis: a 20-minute sleep outlasts it."""
    woke_at = math.nan

    async def turn(watch: StallWatch, clock: MockSilenceClock) -> None:
        nonlocal woke_at
        _event(watch, clock)
        watch.lease("call_1", deadline=clock.read().boottime + 10 * MINUTE)
        await trio.sleep(60.0)
        clock.suspend(20 * MINUTE)
        woke_at = trio.current_time()
        await trio.sleep_forever()

    _, stalled_at = await _run(turn)
    assert stalled_at is not None
    assert woke_at <= stalled_at <= woke_at + DEFAULT_STALL_TICK


async def test_st6_a_short_suspend_between_events_does_not_stall(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two minutes asleep plus two minutes awake is still under the limit."""

    async def turn(watch: StallWatch, clock: MockSilenceClock) -> None:
        _event(watch, clock)
        await trio.sleep(60.0)
        clock.suspend(2 * MINUTE)
        await trio.sleep(60.0)
        _event(watch, clock)
        await trio.sleep(60.0)

    _, stalled_at = await _run(turn)
    assert stalled_at is None


@pytest.mark.parametrize("tick", [1.0, 7.0, 30.0])
async def test_st7_overshoot_is_at_most_one_tick(
    autojump_clock: trio.testing.MockClock, tick: float
) -> None:
    async def turn(watch: StallWatch, clock: MockSilenceClock) -> None:
        await trio.sleep(3.3)
        _event(watch, clock)
        await trio.sleep_forever()

    watch = StallWatch(limit=100.0)
    watch.event(0.0)  # started before the turn, so the turn's event decides
    _, stalled_at = await _run(turn, watch=watch, tick=tick)
    assert stalled_at is not None
    assert 103.3 <= stalled_at <= 103.3 + tick


async def test_st8_watching_starts_the_clock(autojump_clock: trio.testing.MockClock) -> None:
    """A watch with no event yet measures silence from when watch_turn starts."""
    clock = MockSilenceClock()
    watch = StallWatch()
    await trio.sleep(50.0)
    start = trio.current_time()
    await watch_turn(watch, clock)
    assert watch.last_event == start
    assert 300.0 <= trio.current_time() - start <= 305.0


async def test_watch_turn_returns_at_once_when_already_stalled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    clock = MockSilenceClock()
    watch = StallWatch()
    watch.event(clock.read().boottime - 1000.0)
    start = trio.current_time()
    await watch_turn(watch, clock)
    assert trio.current_time() == start


@pytest.mark.parametrize("tick", [0.0, -5.0])
async def test_tick_must_be_positive(tick: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        await watch_turn(StallWatch(), MockSilenceClock(), tick=tick)
