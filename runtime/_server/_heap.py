"""The serving process's heap: no collector pause over a few ms while frames arrive
(docs/design/serve.md S7; measured in docs/design/performance.md "Garbage collection").

CPython's full collection walks every object the collector tracks, with the Trio loop stopped
(165 ns an object on the 2026-12 benchmark machine: 30-40 ms with 25,000 deliveries pending).
What the runtime keeps alive for long — lanes and their tasks, pending deliveries, the admission
index — is what makes that walk long, and it is not garbage. So, in the process ``serve`` owns:

* once started (recovery done), one collection and :func:`gc.freeze` of what is alive
  (:func:`settle_heap`);
* then, every ``freeze_seconds`` (0.25 s), :func:`gc.freeze` again: what survived the period
  leaves the generations the collector walks (a freeze moves lists, it walks nothing), so an
  automatic collection walks at most what one period allocated and kept;
* cyclic garbage frozen that way is not collected until a **sweep** (unfreeze, one full
  collection, freeze), which runs once no client frame arrived for ``quiet_seconds`` (1 s), at most
  every ``sweep_seconds``; a host that is never quiet is swept anyway ``latest_sweep_seconds``
  after its previous sweep, so the garbage it can hold is at most that long's.

Objects that die by reference count (nearly all) are freed at once, frozen or not. Every
collection's pause is observed into ``pi_runtime_gc_pause_seconds`` by kind (``young``,
``full``, ``sweep``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import trio

from .._clock import perf_seconds
from .._logs import fields
from .._metrics import GC_PAUSE_SECONDS, labelled

__all__ = ["HeapKeeper", "HeapPolicy", "keep_heap", "settle_heap"]

logger = logging.getLogger("runtime.heap")


class Collector(Protocol):
    """The four calls of :mod:`gc` the keeper makes (a test passes a recording double)."""

    def collect(self) -> int: ...
    def freeze(self) -> None: ...
    def unfreeze(self) -> None: ...
    def get_freeze_count(self) -> int: ...


@dataclass(frozen=True, slots=True)
class HeapPolicy:
    """When the keeper freezes and sweeps, in seconds of the Trio clock."""

    freeze_seconds: float = 0.25
    """Between two freezes: an automatic collection walks at most what this long allocated
    and kept. 0 turns the keeper off: Python's collector as it is (``[server]
    heap_freeze_seconds``)."""
    quiet_seconds: float = 1.0
    """A sweep waits until no client frame arrived for at least this long (seen at the
    freezes' looks)."""
    sweep_seconds: float = 60.0
    """At least this long between two sweeps."""
    latest_sweep_seconds: float = 3600.0
    """A host never quiet is swept this long after its previous sweep."""


@dataclass(slots=True)
class HeapKeeper:
    """The keeper's state: what a bench or the operator reads."""

    policy: HeapPolicy
    frames: Callable[[], int]
    """A count of client frames received so far: unchanged over a period means quiet."""
    collector: Collector
    sweeping: bool = False
    """A sweep's collection is under way (the pause callback labels it ``sweep``)."""
    sweeps: list[tuple[float, int]] = field(default_factory=list)
    """Each sweep's pause in seconds and the unreachable objects it found, oldest first
    (the last :data:`KEPT_SWEEPS`)."""

    def sweep(self) -> None:
        """Unfreeze, collect everything, freeze again: the frozen cyclic garbage is freed."""
        started = perf_seconds()
        self.sweeping = True
        try:
            self.collector.unfreeze()
            found = self.collector.collect()
        finally:
            self.collector.freeze()
            self.sweeping = False
        pause = perf_seconds() - started
        self.sweeps = [*self.sweeps[-(KEPT_SWEEPS - 1) :], (pause, found)]
        logger.debug(
            "heap swept in %.1f ms: %d unreachable, %d frozen",
            pause * 1e3,
            found,
            self.collector.get_freeze_count(),
            extra=fields("heap_swept"),
        )

    async def run(self) -> None:
        """Freeze every period; sweep after a quiet one when due (module docstring)."""
        policy = self.policy
        last_sweep = heard = trio.current_time()
        seen = self.frames()
        while True:
            await trio.sleep(policy.freeze_seconds)
            now, frames = trio.current_time(), self.frames()
            if frames != seen:
                seen, heard = frames, now  # a frame arrived since the last look
            quiet = now - heard >= policy.quiet_seconds
            since = now - last_sweep
            if (quiet and since >= policy.sweep_seconds) or since >= policy.latest_sweep_seconds:
                self.sweep()
                last_sweep = now
            else:
                self.collector.freeze()


KEPT_SWEEPS: Final = 16


def settle_heap(collector: Collector = gc) -> None:
    """Once started (recovery done): collect once, then freeze what is alive — the modules,
    the configuration, what recovery rebuilt — so later collections walk only what is new."""
    collector.collect()
    collector.freeze()


@contextlib.asynccontextmanager
async def keep_heap(
    policy: HeapPolicy, frames: Callable[[], int], collector: Collector = gc
) -> AsyncIterator[HeapKeeper | None]:
    """Settle the heap, then keep it (module docstring) until the block ends, which gives the
    heap back to Python's collector (unfrozen); with ``freeze_seconds`` 0, nothing (``None``).
    Collection pauses are observed meanwhile."""
    if policy.freeze_seconds <= 0:
        yield None
        return
    keeper = HeapKeeper(policy, frames, collector)
    watch = _PauseWatch(keeper)
    gc.callbacks.append(watch)
    try:
        settle_heap(collector)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keeper.run)
            yield keeper
            nursery.cancel_scope.cancel()
    finally:
        gc.callbacks.remove(watch)
        collector.unfreeze()


class _PauseWatch:
    """A :data:`gc.callbacks` entry: each collection's pause into the histogram."""

    __slots__ = ("keeper", "started")

    def __init__(self, keeper: HeapKeeper) -> None:
        self.keeper = keeper
        self.started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.started = perf_seconds()
            return
        if self.keeper.sweeping:
            kind = "sweep"
        elif info["generation"] == 2:
            kind = "full"
        else:
            kind = "young"
        labelled(GC_PAUSE_SECONDS, kind).observe(perf_seconds() - self.started)
