"""Durable backoff for an unavailable provider (docs/design/retention.md PB1-PB4): the
route's breaker and each parked delivery's schedule.

A room turn whose model provider is unavailable (no response, 408, 429, 5xx, or such an
outage reported inside a 200 stream — seen by the gateway,
:class:`~runtime._boundary._stream.UpstreamFailure`) is *parked*, not failed: its
lane records a :class:`~runtime._records.Parked` with the next attempt's time in the
delivery's journal, stops its worker, waits, and runs the same turn again from the journal
(the steps answered before are not asked again). One :class:`RouteBreaker` per host — a host
has one model route — makes the other deliveries on it park too, without each asking the
provider: open after a failure, half-open at the next attempt time, when exactly one
delivery (the first to ask) probes; its success closes the breaker (every parked delivery
goes on), its failure opens it again with the next, longer wait.

The waits: ``first_seconds * 2 ** (n - 1)`` for the route's ``n``-th failure in a row, at
most ``max_seconds``, with equal jitter (half of it fixed, half uniform), and never sooner
than the provider's ``Retry-After``. A delivery ends with its provider's failure code once
``deadline_minutes`` passed since its first failure or after ``max_attempts`` tries of its
own (PB3) — the bounds in force at that first failure, which every park of the episode
records (PB7): a restart with another ``[backoff]`` changes the pace of the tries (the
route's schedule), never when an episode already parked gives up.

And the wait of a lane whose host has no file descriptor left (docs/design/lanes.md L21):
:class:`DescriptorWait` and :func:`patiently`, shared by room and task lanes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

import trio

from ._boundary._stream import UpstreamFailure
from ._clock import Clocks
from ._config import BackoffConfig
from ._errors import ReasonCode, descriptors_exhausted
from ._records import Parked

__all__ = [
    "Admit",
    "DescriptorWait",
    "RouteBreaker",
    "episode_bounds",
    "failure_park",
    "give_up_ms",
    "past_bounds",
    "patiently",
    "route_park",
    "sleeping",
]

MINUTE_MS: Final = 60_000
SLACK_MS: Final = 1_000
"""How far behind Trio's clock the wall clock may fall before the breaker's time is moved
back with it (a slewing clock, rounding)."""


@dataclass(frozen=True, slots=True)
class Admit:
    """What the breaker says to a turn about to start: go (``until_ms`` None), or wait
    until ``until_ms`` (or until the breaker changes, whichever comes first)."""

    until_ms: int | None = None
    probe: object | None = None
    """This turn is the half-open breaker's one probe: its token
    (:meth:`RouteBreaker.abandoned`)."""


class RouteBreaker:
    """The breaker of this host's model route (PB4). Trio-only; not thread-safe."""

    def __init__(
        self, config: BackoffConfig, clocks: Clocks, *, rng: random.Random | None = None
    ) -> None:
        self.config = config
        self._clocks = clocks
        self._rng = rng or random.Random()
        self.open_until_ms: int | None = None
        """Closed when ``None``; else no turn asks the provider before this time (on the
        wall clock: what a park records)."""
        self._open_until_trio = 0.0
        """The same time on Trio's clock, which this process measures the wait by: a wall
        clock set back meanwhile does not lengthen it (:meth:`_open_until`)."""
        self.failures = 0
        """The route's failures in a row (the next wait's exponent)."""
        self.down_since_ms: int | None = None
        """When the route's failures in a row began, on the wall clock: the first this process
        saw, or the earliest first failure of the parks it resumed (PB2); ``None`` once it
        answered. A delivery that waited for it before it could park — queued behind a
        parked delivery of its room — waited from then at the earliest (PB3)."""
        self._probing: object | None = None
        """The token of the turn probing the half-open breaker."""
        self._seen = False
        """Whether a turn of this process has said anything about the route yet."""
        self._resumed_ms = 0
        """The latest recorded time :meth:`resume` took: a lane's own look at the same park
        (after the start's, PB2) opens nothing again."""
        self._counted: tuple[UpstreamFailure, int] | None = None
        """The last failure counted, and the time it opened the breaker until: told again
        (by the gateway at once, then at its turn's end, PB4), it is not counted twice."""
        self._changed = trio.Event()

    def resume(self, parked: Parked) -> None:
        """A delivery this process found parked (PB2): until a turn of this process says
        otherwise, its recorded schedule is the route's.

        The wait left is the recorded time less the wall clock now — but never counted from
        before the episode's first failure (clocks.md C5): the park was written after it, so
        a wall clock that reads earlier was set back since, and the wait is then at most what
        the park recorded from the first failure on. Before, a host restarted with its clock
        set back an hour waited that hour more before it asked again (set back a year, a
        year), whatever the episode's deadline."""
        if self._seen:
            return
        first, since = parked.first_failure_ms, self.down_since_ms
        self.down_since_ms = first if since is None else min(since, first)
        if parked.next_attempt_ms <= max(self.open_until_ms or 0, self._resumed_ms):
            return
        self._resumed_ms = parked.next_attempt_ms
        # to the millisecond the park says (PB2), its wait counted from its first failure at
        # the earliest (C5)
        self._open(until_ms=parked.next_attempt_ms, not_before_ms=first)
        self.failures = max(self.failures, parked.route_failures or parked.attempt)

    def admit(self) -> Admit:
        """Whether a turn may start now (and ask the provider)."""
        if self.open_until_ms is None:
            return Admit()
        until = self._open_until()
        if until is not None:
            return Admit(until_ms=until)
        if self._probing is not None:  # half-open, and one is probing: wait for its outcome
            return Admit(until_ms=self._clocks.wall.time_ms() + self._wait_ms(None))
        self._probing = object()
        return Admit(probe=self._probing)

    def failed(self, failure: UpstreamFailure, probe: object | None = None) -> int:
        """A turn met the provider unavailable: the breaker opens (again); the time of the
        next attempt. A failure while it is already open for longer changes nothing. Only
        the probing turn (``probe``, its token) ends the probe: a turn that began before the
        breaker opened and fails meanwhile leaves the probe running, so two never overlap.
        The same failure told again (the gateway tells it as it comes, the turn's end once
        more, PB4) is counted once: the time it opened the breaker until, whatever the
        breaker did since (half-open after a short wait, closed by an answer)."""
        self._seen = True
        if probe is not None and probe is self._probing:
            self._probing = None
        if self._counted is not None and self._counted[0] is failure:
            return self._counted[1]
        if self.down_since_ms is None:
            self.down_since_ms = self._clocks.wall.time_ms()
        until = self._open_until()
        if until is None:
            self.failures += 1
            until = self._open(wait_ms=self._wait_ms(failure.retry_after))
        self._counted = (failure, until)
        self._wake()
        return until

    def succeeded(self) -> None:
        """A turn got through (or failed for a reason of its own): the route is up."""
        self._seen = True
        self.down_since_ms = None
        if self.open_until_ms is None and self._probing is None:
            return
        self.open_until_ms, self.failures, self._probing = None, 0, None
        self._wake()

    def abandoned(self, probe: object) -> None:
        """The turn that probed with ``probe`` ended with no word on the route (cancelled,
        its worker died, nothing asked upstream): the next turn to ask probes instead."""
        if probe is not None and self._probing is probe:
            self._probing = None
            self._wake()

    async def wait(self, until_ms: int, cancelled: trio.Event) -> None:
        """Sleep until ``until_ms`` on the wall clock, the breaker changes, or ``cancelled``."""
        changed = self._changed
        delay = max(0.0, (until_ms - self._clocks.wall.time_ms()) / 1000)
        # never past the breaker's own wait, measured on Trio's clock (_open_until): while it
        # is open, its end; half-open, one full step (a wait for a probe's outcome is less)
        left = self._open_until_trio - trio.current_time()
        delay = min(delay, left if left > 0 else self._full_seconds())
        with trio.move_on_after(delay):
            async with trio.open_nursery() as nursery:

                async def on(event: trio.Event) -> None:
                    await event.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(on, changed)
                nursery.start_soon(on, cancelled)

    def _open(
        self, *, wait_ms: int | None = None, until_ms: int | None = None, not_before_ms: int = 0
    ) -> int:
        """Open the breaker for ``wait_ms`` from now, or until ``until_ms`` on the wall clock;
        the wall-clock time it opens until. The wall clock is read once: a tick between two
        reads would move a recorded time on (PB2). The wait is measured on Trio's clock from
        ``not_before_ms`` when the wall clock reads earlier (set back since that time, C5):
        :meth:`_open_until` then moves the time given for a record back with the clock."""
        now = self._clocks.wall.time_ms()
        until = now + (wait_ms or 0) if until_ms is None else until_ms
        self.open_until_ms = until
        self._open_until_trio = trio.current_time() + max(0, until - max(now, not_before_ms)) / 1000
        return until

    def _open_until(self) -> int | None:
        """The wall-clock time the breaker is open until, or ``None`` when it is not open
        (closed, or half-open). The wait is measured on Trio's clock: a wall clock set back
        since it opened (by more than a second) neither lengthens it nor leaves a park to
        record a time that far ahead — the time moves back with the clock. A wall clock set
        forward ends it early, as it always did."""
        until = self.open_until_ms
        now = self._clocks.wall.time_ms()
        if until is None or now >= until:
            return None
        left_ms = math.ceil((self._open_until_trio - trio.current_time()) * 1000)
        if left_ms <= 0:
            return None
        if until - now > left_ms + SLACK_MS:  # the wall clock was set back meanwhile
            self.open_until_ms = until = now + left_ms
        return until

    def _full_seconds(self) -> float:
        """The next wait before its jitter: ``first_seconds`` doubled per failure of the
        route in a row but the first, at most ``max_seconds``."""
        config = self.config
        doublings = max(0, self.failures - 1)
        # max_seconds is reached after log2(max / first) doublings, and kept: a route down
        # for days counts a thousand failures in a row, and 2.0 ** 1024 overflows
        if doublings < math.log2(config.max_seconds / config.first_seconds):
            return math.ldexp(config.first_seconds, doublings)
        return config.max_seconds

    def _wait_ms(self, retry_after: float | None) -> int:
        full = self._full_seconds()
        wait = full / 2 + self._rng.uniform(0, full / 2)
        return int(max(wait, retry_after or 0.0) * 1000)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


def episode_bounds(config: BackoffConfig, parks: Sequence[Parked]) -> tuple[float, int]:
    """PB7: the ``(deadline_minutes, max_attempts)`` an episode parked ``parks`` so far gives up
    by — those its first park recorded (the configuration in force at its first failure), not
    the configuration of the host deciding now; ``config``'s for a new episode. An episode
    begun by a version that recorded none takes the first it records from then on, and
    ``config``'s until it has one (as that version did)."""
    for park in parks:
        if park.deadline_minutes is not None and park.max_attempts is not None:
            return park.deadline_minutes, park.max_attempts
    return config.deadline_minutes, config.max_attempts


def past_bounds(
    config: BackoffConfig, parks: Sequence[Parked], now_ms: int, *, since_ms: int | None = None
) -> bool:
    """PB3: whether a delivery parked ``parks`` so far has waited long enough — its own tries
    reached ``max_attempts``, or ``deadline_minutes`` passed since its first failure: the
    episode's bounds (:func:`episode_bounds`, PB7). Before its first park, ``since_ms``: when
    it began to wait for the route's outage, if it did (queued behind a parked delivery of
    its room), from which its deadline runs."""
    if not parks:
        return since_ms is not None and now_ms - since_ms >= config.deadline_minutes * MINUTE_MS
    deadline_minutes, max_attempts = episode_bounds(config, parks)
    if parks[-1].attempt >= max_attempts:
        return True
    return now_ms - parks[0].first_failure_ms >= deadline_minutes * MINUTE_MS


def give_up_ms(config: BackoffConfig, parks: Sequence[Parked]) -> int | None:
    """PB3: when, on the wall clock, an episode parked ``parks`` so far reaches its deadline
    (the episode's, :func:`episode_bounds`); ``None`` before its first park. No wait of a
    parked delivery outlasts it — neither the route's step nor a ``Retry-After`` past it."""
    if not parks:
        return None
    deadline_minutes, _ = episode_bounds(config, parks)
    return parks[0].first_failure_ms + math.ceil(deadline_minutes * MINUTE_MS)


def failure_park(
    config: BackoffConfig,
    parks: Sequence[Parked],
    failure: UpstreamFailure,
    *,
    next_attempt_ms: int,
    now_ms: int,
    code: str,
    route_failures: int,
    since_ms: int | None = None,
) -> Parked:
    """The park of a try that met ``failure`` after ``parks`` (PB1): its own try counted, the
    deadline running from the first failure — or, for a first park, from ``since_ms``, when
    the delivery began to wait for the route's outage if it did before (PB3) — the episode's
    bounds recorded (PB7); ``code`` what it ends with past its bounds
    (``usage_limit_reached`` instead for an account limit)."""
    deadline_minutes, max_attempts = episode_bounds(config, parks)
    return Parked(
        attempt=(parks[-1].attempt if parks else 0) + 1,
        first_failure_ms=_first_ms(parks, now_ms, since_ms),
        next_attempt_ms=next_attempt_ms,
        status=failure.status,
        code=str(ReasonCode.USAGE_LIMIT_REACHED if failure.account_limit else code),
        route_failures=route_failures,
        deadline_minutes=deadline_minutes,
        max_attempts=max_attempts,
    )


def route_park(
    config: BackoffConfig,
    parks: Sequence[Parked],
    *,
    until_ms: int,
    now_ms: int,
    route_failures: int,
    since_ms: int | None = None,
) -> Parked:
    """A park the route's open breaker decided (PB4): no try of its own, so the count
    repeats; ``model_failed`` past its bounds unless a park of its own said otherwise; the
    deadline running from the first park — or from ``since_ms``, as for
    :func:`failure_park`; the episode's bounds recorded (PB7)."""
    deadline_minutes, max_attempts = episode_bounds(config, parks)
    return Parked(
        attempt=parks[-1].attempt if parks else 0,
        first_failure_ms=_first_ms(parks, now_ms, since_ms),
        next_attempt_ms=until_ms,
        by_route=True,
        code=parks[-1].code if parks else str(ReasonCode.MODEL_FAILED),
        route_failures=route_failures,
        deadline_minutes=deadline_minutes,
        max_attempts=max_attempts,
    )


def _first_ms(parks: Sequence[Parked], now_ms: int, since_ms: int | None) -> int:
    """When an episode began: its first park's, or for a first park ``since_ms`` (the delivery
    waited for the outage before it could park, PB3) — never later than ``now_ms``."""
    if parks:
        return parks[0].first_failure_ms
    return now_ms if since_ms is None else min(since_ms, now_ms)


# ---------------------------------------- out of file descriptors (docs/design/lanes.md L21)

DESCRIPTORS_FIRST: Final = 0.25
DESCRIPTORS_MOST: Final = 30.0
"""L21: the first and the longest wait before a lane tries again what a want of file
descriptors refused (seconds)."""

_T = TypeVar("_T")


class DescriptorWait:
    """One lane's wait for file descriptors (L21): doubling from :data:`DESCRIPTORS_FIRST`
    up to :data:`DESCRIPTORS_MOST` for each want in a row, reset by the next try that works."""

    __slots__ = ("wants",)

    def __init__(self) -> None:
        self.wants = 0
        """Wants met in a row since the last try that worked."""

    def next(self) -> float:
        """The wait before the next try (seconds), counting one more want."""
        self.wants += 1
        return min(DESCRIPTORS_MOST, DESCRIPTORS_FIRST * 2.0 ** min(self.wants - 1, 16))

    def met(self) -> None:
        """A try worked: the next want waits :data:`DESCRIPTORS_FIRST` again."""
        self.wants = 0


_Pause = Callable[[BaseException, float], Awaitable[None]]
"""How :func:`patiently` waits between tries (and says why): it may raise, to give up."""


async def patiently(
    work: Callable[[], Awaitable[_T]],
    wait: DescriptorWait,
    pause: _Pause,
) -> _T:
    """``work()``, tried again each time it meets a want of file descriptors, after
    ``pause(error, delay)`` (``delay``: ``wait``'s next), for as long as that lasts — or until
    ``pause`` raises, to give up; any other error is raised. Only for work that can be tried
    again as it is (L21)."""
    while True:
        try:
            done = await work()
        except Exception as error:
            if not descriptors_exhausted(error):
                raise
            await pause(error, wait.next())
            continue
        wait.met()
        return done


def sleeping(say: Callable[[BaseException, float], None]) -> _Pause:
    """A :func:`patiently` pause that says the want (``say(error, delay)``) and sleeps."""

    async def pause(error: BaseException, delay: float) -> None:
        say(error, delay)
        await trio.sleep(delay)

    return pause
