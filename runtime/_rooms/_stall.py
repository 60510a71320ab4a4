"""The room turn stall backstop (docs/design/lanes.md "Turn stall backstop", clocks.md).

A turn takes as long as its work takes; only *silence* is bounded. :class:`StallWatch` is the
pure core: it is told about worker events and tool leases, takes ``now`` as an argument and
answers whether the turn has stalled. :func:`watch_turn` is the Trio shell: it re-reads the
suspend-aware clock every tick and returns when the turn has stalled; the lane then aborts the
turn and records it as ``failed`` / ``turn_stalled``.

All times given to :class:`StallWatch` (``now``, lease deadlines) are on the **boottime axis**
of a :class:`~runtime._clock.SilenceClock` (``clock.read().boottime``), which keeps counting
while the host is suspended: time the host spent asleep is silence. A deadline the gate holds
in Trio time converts as ``reading.boottime + (deadline - trio.current_time())``.

Invariants (tests ``test_st<N>_*`` in ``tests/rooms/test_stall.py`` cite them):

1. **Silence stalls.** A turn stalls once ``limit`` seconds (default 300) have passed on the
   boottime axis since the later of its last worker event and the latest deadline of a lease
   it holds (ST1).
2. **Any event resets the clock.** Every worker event — a token, a tool call, a retry, any sign
   of life — restarts the silence; events arriving out of order never move it backwards (ST2).
3. **Nothing caps a turn's duration.** A turn whose events keep arriving less than ``limit``
   apart never stalls, however long it runs (ST3).
4. **A lease holds silence off until its deadline.** While any lease's deadline is in the
   future the turn cannot stall; once every lease has expired, silence counts from
   ``max(last event, latest lease deadline)``. Taking a lease again under the same key replaces
   its deadline (ST4).
5. **Releasing a lease is a sign of life.** A tool ends by releasing its lease; silence then
   counts from the release (it is an event), so a long tool that released before its deadline
   is not reported as silent for the time it ran. Releasing an unknown key only counts as the
   event (ST5).
6. **A suspend is silence.** Time the host spends suspended counts (boottime axis), so a host
   that slept past the limit stalls the turn on the first check after it wakes. The watch
   knows no suspend gaps, only silence: an event the worker sends after the wake and before
   that check is a sign of life like any other (ST6).
7. **Overshoot is at most one tick.** :func:`watch_turn` re-reads the clock every ``tick``
   seconds of Trio time (default 5 s) rather than trusting one long timer, so it returns at most
   one tick of awake time after :meth:`StallWatch.overdue_at` (ST7).
8. **The watch starts when watching starts.** A :class:`StallWatch` that has seen no event has
   no silence to measure (:meth:`~StallWatch.overdue_at` is infinite); :func:`watch_turn`
   counts its own start as the first event when nothing came before (ST8).
"""

from __future__ import annotations

import math

import trio

from .._clock import SilenceClock

__all__ = ["DEFAULT_STALL_LIMIT", "DEFAULT_STALL_TICK", "StallWatch", "watch_turn"]

DEFAULT_STALL_LIMIT = 300.0
"""Seconds of silence after which a room turn is aborted as ``turn_stalled``
(docs/design/lanes.md)."""
DEFAULT_STALL_TICK = 5.0
"""Seconds of Trio time between two reads of the suspend-aware clock (docs/design/lanes.md,
clocks.md)."""


class StallWatch:
    """The silence clock of one room turn, with tool leases. Pure: no I/O, no clock reads.

    Times are seconds on the boottime axis of a suspend-aware clock (see the module doc).
    """

    def __init__(self, *, limit: float = DEFAULT_STALL_LIMIT) -> None:
        if not limit > 0:
            raise ValueError(f"a stall limit must be positive, not {limit!r}")
        self.limit = limit
        self._last_event: float | None = None
        self._leases: dict[str, float] = {}

    @property
    def last_event(self) -> float | None:
        """When the last worker event was seen, or ``None`` before the first."""
        return self._last_event

    def event(self, now: float) -> None:
        """A worker event at ``now``: the silence starts again (invariant 2)."""
        if self._last_event is None or now > self._last_event:
            self._last_event = now

    def lease(self, key: str, deadline: float) -> None:
        """A gated tool ``key`` runs until at most ``deadline``; silence does not count before
        it (invariant 4). Leasing ``key`` again replaces its deadline."""
        self._leases[key] = deadline

    def release(self, key: str, now: float) -> None:
        """The tool ``key`` ended at ``now``: drop its lease and count an event (invariant 5)."""
        self._leases.pop(key, None)
        self.event(now)

    def overdue_at(self) -> float:
        """When the turn stalls if nothing more happens (``inf`` before the first event)."""
        if self._last_event is None:
            return math.inf
        floor = max([self._last_event, *self._leases.values()])
        return floor + self.limit

    def stalled(self, now: float) -> bool:
        """Whether ``limit`` seconds of silence have passed by ``now`` (invariant 1)."""
        return now >= self.overdue_at()


async def watch_turn(
    watch: StallWatch, clock: SilenceClock, *, tick: float = DEFAULT_STALL_TICK
) -> None:
    """Return when ``watch`` reports the turn stalled, checking every ``tick`` seconds.

    Each check re-reads ``clock`` (its boottime), so a host that slept through the limit is
    caught on the first tick after it wakes (invariants 6, 7). If ``watch`` has seen no event
    yet, the silence starts now (invariant 8). Runs until cancelled otherwise: start it beside
    the turn and cancel it when the turn settles.

    It *returns* rather than raising, so the caller decides what a stall does — the lane
    aborts the turn and records ``turn_stalled`` — without unwrapping an exception group.
    """
    if not tick > 0:
        raise ValueError(f"a tick must be positive, not {tick!r}")
    if watch.last_event is None:
        watch.event(clock.read().boottime)
    # Polling on purpose: a single long timer runs on Trio's clock, which stops while the host
    # is suspended, so it would fire late by however long the host slept (invariant 7).
    while True:
        if watch.stalled(clock.read().boottime):
            return
        await trio.sleep(tick)
