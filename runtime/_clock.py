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

No other module reads ``time.time()`` or ``time.monotonic()``: every later module
takes a :class:`Clocks` and uses it.

The test doubles :class:`MockSilenceClock` and :class:`MockWallClock` derive
their readings from Trio's clock, so a :class:`trio.testing.MockClock` (with or
without autojump) drives them; ``MockSilenceClock.suspend()`` simulates a host
sleep (boot time jumps, monotonic time does not).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import trio

__all__ = [
    "Clocks",
    "MockSilenceClock",
    "MockWallClock",
    "SilenceClock",
    "SilenceReading",
    "SystemSilenceClock",
    "SystemWallClock",
    "WallClock",
]


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
