"""The watchdog under a host that suspends again and again (docs/design/watchdog.md WD3, WD6;
docs/design/clocks.md C1).

Pure core, plain numbers, as ``test_watchdog.py``: a :class:`Tick` carries the boottime reading
(counts a suspend) and the monotonic one (does not). A suspend gives a worker a fresh hard
clock in awake time (WD6) — once per silence: a host that sleeps more often than the hard
threshold and its grace must not hide a wedged worker for ever.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from runtime._tasks._watchdog import (
    Action,
    CheckGuards,
    Classification,
    Phase,
    Probe,
    ProbeAnswered,
    Progress,
    Prompted,
    Tick,
    Watchdog,
    WatchdogPolicy,
)

HARD = 900.0
GRACE = 120.0
TICK = 5.0
SLEEP = 60.0
"""Each suspend lasts a minute."""


def napping(
    wd: Watchdog, *, start: float, stop: float, awake_between: float, asleep: float
) -> Iterator[tuple[float, list[Action]]]:
    """Tick every 5 awake seconds from ``start`` to ``stop``; the host suspends for a minute
    after every ``awake_between`` awake seconds (``asleep``: the seconds slept before
    ``start``). Yields each tick's awake time and actions; a fence probe is answered quiet at
    once (a wedged worker says nothing new)."""
    awake = start
    while awake <= stop:
        slept = asleep + SLEEP * (awake // awake_between)
        actions: list[Action] = wd.feed(Tick(awake + slept, awake))
        yield awake, actions
        if Probe("fence") in actions:
            yield awake, wd.feed(ProbeAnswered("fence", False))
        awake += TICK


def prompted() -> Watchdog:
    wd = Watchdog(policy=WatchdogPolicy())
    wd.feed(Prompted(0.0, 0.0))
    assert wd.phase is Phase.PROVIDER
    return wd


@pytest.mark.parametrize("awake_between", [60.0, 300.0, 600.0, 1000.0])
def test_wd6_a_host_that_suspends_every_few_minutes_still_fences_a_wedged_worker(
    awake_between: float,
) -> None:
    """WD6, C1: a worker wedged in its provider phase on a laptop that sleeps a minute after
    every few minutes awake. Each suspend is evidence, not silence to fence on — but it
    restarts the hard clock only once per silence: the guards are asked for no later than
    the first wake plus ``hard + grace`` of awake time. Before, every wake restarted the
    hard clock and its grace, so a host awake less than 1020 s at a time never let it run
    out: the worker stayed ``Suspect`` for ever, one soft probe sent, never fenced."""
    wd = prompted()
    first_wake = awake_between
    fenced_at = None
    for awake, actions in napping(
        wd, start=TICK, stop=6 * 3600.0, awake_between=awake_between, asleep=0.0
    ):
        if CheckGuards() in actions:
            fenced_at = awake
            break
    assert fenced_at is not None, "a wedged worker was never fenced"
    assert fenced_at <= first_wake + HARD + GRACE + TICK
    assert wd.classification is Classification.HARD_RESUME_ELIGIBLE


def test_wd6_a_wake_still_gives_a_working_worker_a_fresh_hard_clock() -> None:
    """WD6 as before for the first wake after the last progress: 800 s of awake silence, a
    suspend, and the worker has a whole ``hard + grace`` of awake time after the wake; a
    token after it starts a new silence, and the next wake gives that one its fresh clock
    again."""
    wd = prompted()
    for _awake, actions in napping(wd, start=TICK, stop=800.0, awake_between=10_000.0, asleep=0.0):
        assert CheckGuards() not in actions
        assert Probe("fence") not in actions
    # a suspend after 800 s awake, seen at the next tick; nothing until then + 1020
    for awake, actions in napping(
        wd, start=805.0, stop=1820.0, awake_between=10_000.0, asleep=SLEEP
    ):
        assert Probe("fence") not in actions, awake
    assert wd.wake_awake == 805.0
    assert Probe("fence") in wd.feed(Tick(1825.0 + SLEEP, 1825.0))
    # the worker speaks: a new silence; a wake in it restarts its hard clock
    wd.feed(Progress(1830.0 + SLEEP, 1830.0, Phase.GENERATION, "token"))
    assert wd.classification is Classification.ACTIVE
    for awake, actions in napping(
        wd, start=1835.0, stop=2000.0, awake_between=10_000.0, asleep=SLEEP
    ):
        assert actions == [], awake
    wd.feed(Tick(2005.0 + 2 * SLEEP, 2005.0))  # the second suspend, in the new silence
    assert wd.wake_awake == 2005.0
    later = [
        awake
        for awake, actions in napping(
            wd, start=2010.0, stop=4000.0, awake_between=10_000.0, asleep=2 * SLEEP
        )
        if Probe("fence") in actions
    ]
    assert later[0] == 2005.0 + HARD + GRACE
