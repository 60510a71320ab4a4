"""Clocks, injected everywhere.

Three different questions need three different clocks:

* **How long until a deadline / how long to sleep?** Trio's own clock
  (``trio.current_time()``, ``trio.sleep``, ``trio.fail_after``). Tests swap it
  for :class:`trio.testing.MockClock`, so nothing here wraps it.
* **How long has this worker been silent?** A *suspend-aware* clock: Linux
  ``CLOCK_BOOTTIME`` keeps counting while the host is suspended, where
  ``CLOCK_MONOTONIC`` (and so Trio's clock) stops. :class:`SilenceClock` reads
  both, so a caller can tell a suspend gap (``boottime - monotonic`` grew) from
  real silence.
* **What time is it, for a timestamp written into a session or record?** A wall
  clock, :class:`WallClock`.
* **How long did that take, for a metric?** :func:`perf_seconds`, a measurement only:
  nothing is decided on it (``runtime/_metrics.py``).

No other module reads ``time.time()`` or ``time.monotonic()``: every later module
takes a :class:`Clocks` and uses it.

:class:`Backoff` is the one bounded exponential backoff the stores use when they retry (the
receipt store's transient SQLite errors, receipts R8; the PostgreSQL store's broken
connections, postgres-store PG12); its waits are Trio time.

:func:`own_limiter` gives a store its own ``trio.to_thread`` capacity limiter (the receipt
store's and the PostgreSQL store's, one call at a time), registered in :data:`OWN_LIMITERS`
so that virtual time in a test (``runtime.testing.io_aware_autojump_clock``) does not jump
while a call on one is in flight, as it does not for the default limiter's.

The test doubles :class:`MockSilenceClock` and :class:`MockWallClock` derive
their readings from Trio's clock, so a :class:`trio.testing.MockClock` (with or
without autojump) drives them; ``MockSilenceClock.suspend()`` simulates a host
sleep (boot time jumps, monotonic time does not).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import trio

__all__ = [
    "OWN_LIMITERS",
    "Backoff",
    "Clocks",
    "MockSilenceClock",
    "MockWallClock",
    "SilenceClock",
    "SilenceReading",
    "SystemSilenceClock",
    "SystemWallClock",
    "WallClock",
    "own_limiter",
    "perf_seconds",
]

OWN_LIMITERS: weakref.WeakSet[trio.CapacityLimiter] = weakref.WeakSet()
"""Every live capacity limiter :func:`own_limiter` made."""


def own_limiter(total_tokens: int = 1) -> trio.CapacityLimiter:
    """A capacity limiter of a store's own for ``trio.to_thread.run_sync``, registered in
    :data:`OWN_LIMITERS` (the virtual test clock's view of work off the loop)."""
    limiter = trio.CapacityLimiter(total_tokens)
    OWN_LIMITERS.add(limiter)
    return limiter


@dataclass(frozen=True, slots=True)
class SilenceReading:
    """One simultaneous reading of both kernel clocks, in seconds."""

    boottime: float
    """Counts while suspended: use it to measure silence."""
    monotonic: float
    """Stops while suspended: ``boottime - monotonic`` growing reveals a suspend."""

    @property
    def suspended_total(self) -> float:
        """Seconds spent suspended since the clocks' common origin (up to an offset)."""
        return self.boottime - self.monotonic


@runtime_checkable
class SilenceClock(Protocol):
    """A suspend-aware clock for measuring silence."""

    def read(self) -> SilenceReading: ...


@runtime_checkable
class WallClock(Protocol):
    """A wall clock for timestamps written into sessions and records."""

    def time_ms(self) -> int:
        """Milliseconds since the Unix epoch."""
        ...


class SystemSilenceClock:
    """The kernel's ``CLOCK_BOOTTIME`` and ``CLOCK_MONOTONIC`` (Linux only)."""

    def read(self) -> SilenceReading:
        return SilenceReading(
            boottime=time.clock_gettime(time.CLOCK_BOOTTIME),
            monotonic=time.clock_gettime(time.CLOCK_MONOTONIC),
        )


class SystemWallClock:
    """The system's real-time clock."""

    def time_ms(self) -> int:
        return time.time_ns() // 1_000_000


def _trio_now() -> float:
    """Trio's clock, also from a thread Trio started (``trio.to_thread``): the runtime reads
    the wall clock in worker threads (the store's owner record, session writers)."""
    try:
        return trio.current_time()
    except RuntimeError:  # not in the Trio thread: ask it
        return trio.from_thread.run_sync(trio.current_time)


@dataclass
class MockSilenceClock:
    """A silence clock driven by Trio's (mock) clock, with simulated suspends.

    Must be read inside a Trio run (or a thread it started). ``suspend(seconds)``
    makes boot time jump forward without moving Trio's clock, which is what a
    real suspend looks like from inside the process.
    """

    _suspended: float = 0.0

    def read(self) -> SilenceReading:
        now = _trio_now()
        return SilenceReading(boottime=now + self._suspended, monotonic=now)

    def suspend(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a suspend cannot last a negative time")
        self._suspended += seconds


@dataclass
class MockWallClock:
    """A wall clock that starts at ``start_ms`` and follows Trio's clock.

    Time spent in :meth:`MockSilenceClock.suspend` is not seen here; call
    :meth:`advance` to move the wall clock on its own.
    """

    start_ms: int = 1_795_000_000_000
    _offset_ms: int = 0

    @classmethod
    def reading(cls, now_ms: int) -> MockWallClock:
        """One that reads ``now_ms`` at this instant and follows Trio's clock from here (call
        it inside a Trio run). ``start_ms`` is the reading at Trio time 0, and Trio's real
        clock is far from 0 (an uptime plus a random offset of up to 200,000 s), so a clock
        "set back ten days" is ``reading(system_ms - 10 days)``, not ``start_ms=…``."""
        return cls(start_ms=now_ms - int(_trio_now() * 1000))

    def time_ms(self) -> int:
        return self.start_ms + self._offset_ms + int(_trio_now() * 1000)

    def advance(self, seconds: float) -> None:
        self._offset_ms += int(seconds * 1000)


@dataclass(frozen=True)
class Clocks:
    """The injected clocks a module needs besides Trio's own."""

    silence: SilenceClock = field(default_factory=SystemSilenceClock)
    wall: WallClock = field(default_factory=SystemWallClock)

    @classmethod
    def system(cls) -> Clocks:
        return cls()


@dataclass(frozen=True, slots=True, kw_only=True)
class Backoff:
    """A bounded exponential backoff: at most :attr:`attempts` tries in all; the wait before
    retry *n* (1, 2, …) is ``min(max_delay, first_delay * factor ** (n - 1))`` seconds of
    Trio's clock (``trio.sleep``), none after the last try."""

    attempts: int
    first_delay: float
    factor: float = 2.0
    max_delay: float

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"a Backoff needs at least one attempt, not {self.attempts}")
        if not 0 <= self.first_delay <= self.max_delay or self.factor < 1:
            raise ValueError("a Backoff waits 0 <= first_delay <= max_delay, factor >= 1")

    def delay(self, retry: int) -> float:
        """The wait before retry ``retry`` (the first retry is 1)."""
        return min(self.max_delay, self.first_delay * self.factor ** (retry - 1))

    def delays(self) -> Iterator[float]:
        """The waits between the tries, in order (``attempts - 1`` of them)."""
        return (self.delay(retry) for retry in range(1, self.attempts))

    @property
    def total_delay(self) -> float:
        """How long the waits take together when every try fails."""
        return sum(self.delays())


def perf_seconds() -> float:
    """A high-resolution reading for measuring how long something took (metrics): never a
    deadline or a timestamp, so tests need not control it."""
    return time.perf_counter()
