"""S7 (docs/design/serve.md): the serve process's heap is kept so that no collection walks the
long-lived state — frozen every period, swept when quiet, swept at the latest on a busy host.

The timing rules run against a recording collector on the virtual clock; one test runs the
real :mod:`gc`: a reference cycle frozen by the keeper outlives a collection and is freed by
the sweep.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field

import trio
import trio.testing

from runtime._config import RoomWorkerConfig, ServerConfig
from runtime._metrics import REGISTRY
from runtime._server._heap import HeapPolicy, keep_heap
from runtime._server._serve import heap_policy

POLICY = HeapPolicy(freeze_seconds=1.0, sweep_seconds=60.0, latest_sweep_seconds=3600.0)


@dataclass
class Recording:
    """A collector that records its calls with the virtual time of each."""

    calls: list[tuple[float, str]] = field(default_factory=list)
    frozen: int = 0

    def _note(self, call: str) -> None:
        self.calls.append((trio.current_time(), call))

    def collect(self) -> int:
        self._note("collect")
        return 0

    def freeze(self) -> None:
        self._note("freeze")
        self.frozen += 1

    def unfreeze(self) -> None:
        self._note("unfreeze")

    def get_freeze_count(self) -> int:
        return self.frozen

    def sweeps(self) -> list[float]:
        return [at for at, call in self.calls if call == "unfreeze"]


class Frames:
    """A frame counter that moves while ``busy_until`` is ahead of the clock."""

    def __init__(self, busy_until: float) -> None:
        self.busy_until = busy_until
        self.count = 0

    def __call__(self) -> int:
        if trio.current_time() <= self.busy_until:
            self.count += 1
        return self.count


async def test_s7_settled_then_frozen_every_period(autojump_clock: trio.testing.MockClock) -> None:
    recording = Recording()
    start = trio.current_time()
    async with keep_heap(POLICY, Frames(busy_until=float("inf")), recording):
        await trio.sleep(5.5)
    calls = [(round(at - start, 3), call) for at, call in recording.calls]
    assert calls[:2] == [(0.0, "collect"), (0.0, "freeze")]  # settled once started
    assert calls[2:7] == [(float(t), "freeze") for t in range(1, 6)]  # then every period
    assert calls[7:] == [(5.5, "unfreeze")]  # the block's end gives the heap back


async def test_s7_a_sweep_waits_for_a_quiet_period(autojump_clock: trio.testing.MockClock) -> None:
    recording = Recording()
    start = trio.current_time()
    async with keep_heap(POLICY, Frames(busy_until=start + 100.5), recording):
        await trio.sleep(200.5)
    sweeps = [at - start for at in recording.sweeps()[:-1]]  # the last: the block's end
    # frames arrived until 100.5: the period ending at 101 is the first quiet one (and 60 s
    # have passed); quiet ever since, the next is due 60 s later
    assert sweeps == [101.0, 161.0]
    first = [call for at, call in recording.calls if at - start == 101.0]
    assert first == ["unfreeze", "collect", "freeze"]


async def test_s7_freezes_every_quarter_second_and_sweeps_after_a_quiet_second(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The defaults: a freeze every 0.25 s (no automatic collection walks more than a quarter
    second's survivors), yet a sweep — a full collection — still waits for a whole second
    with no client frame, not for a quiet quarter."""
    policy = HeapPolicy(sweep_seconds=60.0, latest_sweep_seconds=3600.0)
    assert (policy.freeze_seconds, policy.quiet_seconds) == (0.25, 1.0)
    recording = Recording()
    start = trio.current_time()
    # a frame every 0.8 s, the last at 104.9: many quiet quarters, never a quiet second
    arrivals = [start + 0.1 + 0.8 * k for k in range(132)]

    def frames() -> int:
        return sum(at <= trio.current_time() for at in arrivals)

    async with keep_heap(policy, frames, recording):
        await trio.sleep(110.1)
    freezes = [round(at - start, 3) for at, call in recording.calls if call == "freeze"]
    sweeps = [round(at - start, 3) for at in recording.sweeps()[:-1]]
    assert freezes[:6] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]  # settled, then every quarter
    # the last frame is seen at the look at 105.0; a whole second later it is quiet
    assert sweeps == [106.0]


async def test_s7_no_sweep_sooner_than_sweep_seconds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recording = Recording()
    async with keep_heap(POLICY, Frames(busy_until=0.0), recording):  # always quiet
        await trio.sleep(59.5)
    assert recording.sweeps()[:-1] == []


async def test_s7_a_host_never_quiet_is_swept_at_the_latest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recording = Recording()
    start = trio.current_time()
    async with keep_heap(POLICY, Frames(busy_until=float("inf")), recording):
        await trio.sleep(7300)
    assert [at - start for at in recording.sweeps()[:-1]] == [3600.0, 7200.0]


async def test_s7_off_leaves_the_collector_alone(autojump_clock: trio.testing.MockClock) -> None:
    recording = Recording()
    off = heap_policy(RoomWorkerConfig(server=ServerConfig(heap_freeze_seconds=0)))
    async with keep_heap(off, Frames(busy_until=0.0), recording) as keeper:
        await trio.sleep(4000)
    assert keeper is None
    assert recording.calls == []


class Cycle:
    def __init__(self) -> None:
        self.me = self


async def test_s7_cyclic_garbage_the_keeper_froze_is_freed_by_a_sweep(
    autojump_clock: trio.testing.MockClock,
) -> None:
    policy = HeapPolicy(freeze_seconds=1.0, sweep_seconds=10.0, latest_sweep_seconds=100.0)
    frames = Frames(busy_until=trio.current_time() + 5.0)
    swept = REGISTRY.get_sample_value("pi_runtime_gc_pause_seconds_count", {"kind": "sweep"})
    async with keep_heap(policy, frames) as keeper:
        assert keeper is not None
        cycle = Cycle()
        alive = weakref.ref(cycle)
        await trio.sleep(1.5)  # a period passed: the cycle is frozen
        del cycle
        gc.collect()
        assert alive() is not None  # no collection walks it
        await trio.sleep(9.0)  # the period ending at 10 s is quiet and 10 s have passed
        assert len(keeper.sweeps) == 1
        assert alive() is None  # the sweep freed it
        assert gc.get_freeze_count() > 0  # and froze the rest again
    assert gc.get_freeze_count() == 0  # the block's end gave the heap back
    after = REGISTRY.get_sample_value("pi_runtime_gc_pause_seconds_count", {"kind": "sweep"})
    assert (after or 0) - (swept or 0) == 1
