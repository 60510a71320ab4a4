"""A provider outage at its real length, in virtual time (docs/design/retention.md PB1-PB4).

The scale-model tests (``test_room_backoff.py``) run the backoff's rules at 0.1 s; these run the
shipped defaults — a first wait of 5 s doubling to 300 s, a deadline of 30 minutes, 12 tries —
against a **20-minute** outage. The room worker is real (real Fake-Pi worker processes, real
journal files with fsync, a real upstream on loopback); Trio's clock is
:func:`runtime.testing.io_aware_autojump_clock`, which jumps only while no worker process
lives and no journal write is in flight — exactly while every delivery is parked (a parked
delivery keeps no worker, PB1). The breaker's waits are the wall clock's, a
:class:`MockWallClock` that follows Trio's. So the twenty minutes take a few seconds of real
time, spent launching the workers that probe. So do the deadline's cases (PB3): an account
limit that resets past it, a host restarted after it.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Final

import pytest
import trio
import trio.testing

from runtime._clock import Clocks, MockWallClock
from runtime._config import BackoffConfig, ModelConfig, RoomWorkerConfig
from runtime._records import Outcome, StepAbandoned
from runtime._rooms._worker import open_room_worker
from runtime.testing import io_aware_autojump_clock

from .test_room_backoff import Outage, outage_upstream, parks_of
from .test_room_backoff import parked as parked
from .test_room_worker import message, next_results

MINUTES: Final = 20
DEFAULTS: Final = BackoffConfig()
"""The shipped backoff: 5 s doubling to 300 s, equal jitter, 30 minutes, 12 tries."""
ROOMS: Final = ("dm:1", "dm:2", "dm:3")


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return io_aware_autojump_clock(follow_children=True)


def settings(url: str) -> RoomWorkerConfig:
    return RoomWorkerConfig(model=ModelConfig(base_url=url), backoff=DEFAULTS)


def tries(outage: Outage) -> tuple[list[float], list[float]]:
    """The refused requests' times, split: the first wave (the deliveries' first tries up to
    the first second try — they may begin before any failure is known) and the probes
    (every try after: once the breaker is open, a try is the half-open breaker's probe)."""
    seen: set[str] = set()
    wave: list[float] = []
    probes: list[float] = []
    for at, asked in zip(outage.down, outage.asked, strict=True):
        (wave if not probes and asked not in seen else probes).append(at)
        seen.add(asked)
    return wave, probes


def step(n: int) -> float:
    """The full wait after the route's ``n``-th failure in a row: ``min(max, first·2^(n-1))``;
    equal jitter draws the real one from its upper half."""
    return float(min(DEFAULTS.max_seconds, DEFAULTS.first_seconds * 2 ** (n - 1)))


LAUNCH: Final = 30.0
"""Slack for a probe's worker launch and turn, virtual seconds at the real rate (a Fake-Pi
launch takes under a second here)."""


def check_one_probe_per_step(outage: Outage) -> list[float]:
    """PB4's schedule, from the upstream's own log: after the first wave (the route's first
    failure) every refused try is a probe; the ``n``-th comes after the wait that follows
    failure ``n`` — at least its jitter's floor (half the step), at most the step plus a
    launch — so never two in one step, and none skipped. The breaker opens at the wave's
    first failure, which a later try of the wave may follow (it began before that failure
    was known): the first probe's floor counts from the wave's first try, its ceiling from
    its last."""
    wave, probes = tries(outage)
    assert probes, outage.down
    assert step(1) / 2 <= probes[0] - min(wave), (1, wave, probes)
    assert probes[0] - max(wave) <= step(1) + LAUNCH, (1, wave, probes)
    for n, (a, b) in enumerate(itertools.pairwise(probes), start=2):
        assert step(n) / 2 <= b - a <= step(n) + LAUNCH, (n, wave, probes)
    return probes


async def test_pb4_a_twenty_minute_outage_during_a_burst_on_three_rooms(
    tmp_path: Path, clock: trio.testing.MockClock, clocks: Clocks
) -> None:
    """PB1-PB4 at the shipped defaults: three rooms, two messages each, the provider down
    for 20 minutes from the first request. Every message is answered after it, exactly once;
    the route is probed once per backoff step (the others park by the route, asking
    nothing); nothing answered is asked again, and no delivery was charged a recovery
    attempt."""
    outage = Outage(seconds=MINUTES * 60)
    with trio.fail_after(MINUTES * 60 * 2):  # virtual: a hang fails, it does not wait
        async with (
            outage_upstream(outage) as url,
            open_room_worker(settings(url), base_dir=tmp_path, clocks=clocks) as worker,
        ):
            for room in ROOMS:
                for n in (1, 2):
                    await worker.deliver(message(f"{room}-{n}", room=room))
            results = await next_results(worker, 6)
            answered_at = trio.current_time()
            parks = {r.delivery_id: await parks_of(worker, r.delivery_id) for r in results}
            logs = [(await worker.store.read_delivery_log(d)).records for d in parks if parks[d]]
    assert outage.until is not None
    assert answered_at >= outage.until  # nobody was answered during it
    ids = sorted(r.delivery_id for r in results)
    assert ids == sorted(f"{room}-{n}" for room in ROOMS for n in (1, 2))  # each once
    assert all(r.outcome in (Outcome.REPLY, Outcome.ABSORBED) for r in results), results
    probes = check_one_probe_per_step(outage)
    assert len(probes) >= 8, probes  # 20 minutes hold at least 8 steps of 5 s doubling to 300
    assert any(p.by_route for ps in parks.values() for p in ps)  # the others asked nothing
    assert outage.up <= 6  # each turn asked once when the provider was back: none re-billed
    assert not any(isinstance(r, StepAbandoned) for log in logs for r in log)


async def test_pb2_a_host_restarted_during_a_twenty_minute_outage_keeps_its_schedule(
    tmp_path: Path, clock: trio.testing.MockClock, clocks: Clocks
) -> None:
    """PB2 at the shipped defaults: the host is stopped 7 minutes into a 20-minute outage,
    with every delivery parked, and a new one started on the same state directory a minute
    later. The new host asks the provider nothing before the schedule its predecessor
    recorded; it goes on with the route's wait from there (the recorded attempt count, not a
    fresh 5 s), answers every message once after the outage, and charges no delivery a
    recovery attempt (nothing ran since its park)."""
    outage = Outage(seconds=MINUTES * 60)
    with trio.fail_after(MINUTES * 60 * 2):
        async with outage_upstream(outage) as url:
            async with open_room_worker(settings(url), base_dir=tmp_path, clocks=clocks) as first:
                for room in ROOMS:
                    await first.deliver(message(f"{room}-1", room=room))
                await trio.sleep(7 * 60)  # virtual time: the outage goes on
                before = len(outage.down)
                # each delivery's last park is its schedule (an earlier one may name a later
                # time: a wait for a probe's outcome, which the probe's failure replaced)
                parks = [(await parks_of(first, f"{room}-1"))[-1] for room in ROOMS]
                schedule = max(p.next_attempt_ms for p in parks)
            stopped_ms = clocks.wall.time_ms()
            await trio.sleep(60)
            async with open_room_worker(settings(url), base_dir=tmp_path, clocks=clocks) as second:
                results = await next_results(second, 3)
                logs = [
                    (await second.store.read_delivery_log(f"{room}-1")).records for room in ROOMS
                ]
    assert stopped_ms < schedule  # the first host stopped with a try still to come
    later = outage.down[before:]
    assert later, outage.down  # the outage outlasted the first host; the second tried again
    wall = clocks.wall
    assert isinstance(wall, MockWallClock)
    first_try_ms = wall.start_ms + int(later[0] * 1000)
    assert first_try_ms >= schedule - 1, (first_try_ms, schedule)  # not before the record
    # the route's wait goes on growing from its recorded failures in a row, not from 5 s:
    # the k-th later try comes at least half the (recorded + k)-th step after the one before
    recorded = max(p.route_failures for p in parks)
    assert recorded >= 5, parks
    for k, (a, b) in enumerate(itertools.pairwise(later), start=1):
        assert b - a >= step(recorded + k) / 2, (recorded, later)
    assert sorted(r.delivery_id for r in results) == sorted(f"{room}-1" for room in ROOMS)
    assert all(r.outcome is Outcome.REPLY for r in results), results
    assert not any(isinstance(r, StepAbandoned) for log in logs for r in log)


QUOTA: Final = "You exceeded your current quota, please check your plan and billing details."
DEADLINE: Final = DEFAULTS.deadline_minutes * 60


async def test_pb3_a_reset_later_than_the_deadline_ends_the_delivery_at_its_deadline(
    tmp_path: Path, clock: trio.testing.MockClock, clocks: Clocks
) -> None:
    """PB3 at the shipped defaults: the provider refuses the first try with an account limit
    that resets in an hour (429, ``Retry-After: 3600``) — later than the delivery's 30-minute
    deadline — and is back after 40 minutes. The delivery ends ``usage_limit_reached`` at its
    deadline, the provider asked once: it is not held an hour and then answered by a try past
    its bounds. (Before, the wait ran to the breaker's time, past the deadline, and the try
    after a wait was not weighed against the bounds: it was answered an hour after its first
    failure.)"""
    limited = Outage(seconds=40 * 60, status=429, retry_after="3600", message=QUOTA)
    with trio.fail_after(3 * 60 * 60):  # virtual: a hang fails, it does not wait
        async with (
            outage_upstream(limited) as url,
            open_room_worker(settings(url), base_dir=tmp_path, clocks=clocks) as worker,
        ):
            await worker.deliver(message("d1"))
            (result,) = await next_results(worker, 1)
            ended_at = trio.current_time()
            parks = await parks_of(worker, "d1")
    assert (result.outcome, result.code) == (Outcome.FAILED, "usage_limit_reached")
    assert (len(limited.down), limited.up) == (1, 0)
    assert parks[0].next_attempt_ms - parks[0].first_failure_ms >= 3599 * 1000  # the reset
    first = limited.down[0]
    assert first + DEADLINE <= ended_at <= first + DEADLINE + LAUNCH, (first, ended_at)


async def test_pb3_pb7_a_host_restarted_past_the_deadline_ends_the_delivery_asking_nothing(
    tmp_path: Path, clock: trio.testing.MockClock, clocks: Clocks, parked: trio.Event
) -> None:
    """PB3, PB7: the host is stopped while d1 is parked (its first try refused, the next a
    few seconds away), and the next one starts on the same state directory 31 minutes later,
    the provider back. Past its 30-minute deadline d1 ends ``model_failed`` at the restart,
    the provider asked nothing more and nothing recorded. (Before, the restart found the
    recorded next attempt gone by and the breaker half-open: d1, its one probe, asked and was
    answered half an hour late — the bounds were weighed only while the breaker was open.)"""
    outage = Outage(seconds=0, at_least=1)
    with trio.fail_after(3 * 60 * 60):
        async with outage_upstream(outage) as url:
            async with open_room_worker(settings(url), base_dir=tmp_path, clocks=clocks) as first:
                await first.deliver(message("d1"))
                await parked.wait()
                (park,) = await parks_of(first, "d1")
            await trio.sleep(31 * 60)  # virtual time: no host runs
            async with open_room_worker(settings(url), base_dir=tmp_path, clocks=clocks) as second:
                (result,) = await next_results(second, 1)
                parks = await parks_of(second, "d1")
    assert clocks.wall.time_ms() - park.first_failure_ms >= DEADLINE * 1000
    assert (result.outcome, result.code) == (Outcome.FAILED, "model_failed")
    assert (len(outage.down), outage.up) == (1, 0)
    assert parks == [park]


async def test_pb3_messages_queued_behind_a_parked_delivery_wait_one_deadline_not_one_each(
    tmp_path: Path, clock: trio.testing.MockClock, clocks: Clocks
) -> None:
    """PB3 at the shipped defaults: the provider is down for two hours. d1 parks at once; d2,
    d3 and d4 come for the same room a minute apart and queue behind it (there is no live run
    to steer into). d1 ends ``model_failed`` at its 30-minute deadline, and each queued
    message at the latest 30 minutes after it was admitted — its wait on the route's outage
    began then, as a message to an idle room would park at once — not 30 minutes after the
    one before it ended: the room is done with the outage half an hour after its last
    message, not after four deadlines in a row, and the provider is asked no sooner than the
    route's schedule allows throughout. (Before, each queued message began a fresh deadline
    when it reached the head of its queue: d4 ended two hours in.)"""
    outage = Outage(seconds=2 * 60 * 60)
    ids = ("d1", "d2", "d3", "d4")
    admitted: dict[str, float] = {}
    ended: dict[str, tuple[float, Outcome, str | None]] = {}
    with trio.fail_after(4 * 60 * 60):  # virtual: a hang fails, it does not wait
        async with (
            outage_upstream(outage) as url,
            open_room_worker(settings(url), base_dir=tmp_path, clocks=clocks) as worker,
        ):
            for n, delivery_id in enumerate(ids):
                if n:
                    await trio.sleep(60)  # virtual time: the outage goes on
                admitted[delivery_id] = trio.current_time()
                await worker.deliver(message(delivery_id))
            async for result in worker.results():
                ended[result.delivery_id] = (trio.current_time(), result.outcome, result.code)
                if len(ended) == len(ids):
                    break
    assert {d: (o, c) for d, (_, o, c) in ended.items()} == dict.fromkeys(
        ids, (Outcome.FAILED, "model_failed")
    )
    for delivery_id in ids:
        waited = ended[delivery_id][0] - admitted[delivery_id]
        assert waited <= DEADLINE + LAUNCH, (delivery_id, waited, ended)
    for n, (a, b) in enumerate(itertools.pairwise(outage.down), start=1):
        assert b - a >= step(n) / 2, (n, outage.down)  # never sooner than the schedule
