"""The route's breaker against the races around it (docs/design/retention.md PB2, PB4): a host
starting while deliveries are parked, and a probe cancelled as it meets the outage.

Real room workers with Fake-Pi workers against an upstream on loopback (``Outage``), on the
real clock at a scale of seconds, as ``test_room_backoff.py``; each race is made to happen
(a barrier inside the lane or the gateway), never waited for."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest
import trio

from runtime._boundary._gateway import Gateway, _Downstream
from runtime._boundary._http import Request, ResponseWriter
from runtime._clock import Clocks
from runtime._config import BackoffConfig
from runtime._records import Outcome, Parked
from runtime._rooms._lane import Lane
from runtime._rooms._worker import RoomWorker, open_room_worker

from .test_room_backoff import LIMIT, Outage, by_id, config, outage_upstream, parks_of
from .test_room_worker import message, next_results

WALL: Final = Clocks.system().wall


@dataclass
class Watched(Outage):
    """An :class:`Outage` that also notes every request it gets, refused or answered: when
    (Trio's clock, and the wall clock's milliseconds) and for which message; ``asking`` is set
    at the first request for the message ``watch`` names."""

    watch: str = ""
    asking: trio.Event = field(default_factory=trio.Event)
    requests: list[tuple[float, int, str]] = field(default_factory=list)

    async def handle(self, request: Request, response: ResponseWriter) -> None:
        found = re.findall(rb"\(message (m-[^)]*)\)", request.body)  # the last: its own
        asked = found[-1].decode() if found else ""
        self.requests.append((trio.current_time(), WALL.time_ms(), asked))
        if self.watch and asked == self.watch:
            self.asking.set()
        await super().handle(request, response)


@pytest.fixture
def parked(monkeypatch: pytest.MonkeyPatch) -> dict[str, trio.Event]:
    """Per room, an event set once its lane has made a park durable (a barrier after
    ``Lane._parked``)."""
    events: dict[str, trio.Event] = {}
    record = Lane._parked

    async def parking(self: Lane, *args: Any) -> None:
        await record(self, *args)
        events.setdefault(self.room, trio.Event()).set()

    monkeypatch.setattr(Lane, "_parked", parking)
    return events


def parked_in(events: dict[str, trio.Event], room: str) -> trio.Event:
    return events.setdefault(room, trio.Event())


async def test_pb2_a_delivery_admitted_at_start_keeps_to_a_parked_deliverys_schedule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parked: dict[str, trio.Event]
) -> None:
    """PB2: d1 (one room) is parked when its host stops, its next try 4 to 8 s away. The next
    host starts on the same state directory and at once admits d2 for another room, whose
    lane runs before d1's lane has read d1's journal (held here until d2 has either asked the
    provider or parked). d2 must not ask before d1's recorded time: the breaker holds that
    schedule from the start, so d2 parks by the route — going on from the route's recorded
    failures in a row — and both are answered once that time has come, each asked once.
    (Before, the breaker learnt the schedule only when d1's lane read its journal: d2 found it
    closed and asked at once, and the schedule it then set replaced the recorded one.)"""
    outage = Watched(seconds=0, at_least=1, watch="m-d2")  # d1's first try only: up after it
    slow = BackoffConfig(first_seconds=8, max_seconds=8)  # time to start the next host
    with trio.fail_after(LIMIT):
        async with outage_upstream(outage) as url:
            settings = config(url, slow)
            async with open_room_worker(settings, base_dir=tmp_path) as first:
                await first.deliver(message("d1", room="dm:1"))
                await parked_in(parked, "dm:1").wait()
                (park,) = await parks_of(first, "d1")
            stopped_ms = WALL.time_ms()
            went = trio.Event()  # d2 asked the provider, or parked
            run = Lane._run

            async def held(self: Lane, *args: Any) -> Any:
                if self.room == "dm:1":
                    await went.wait()  # d1's lane is slow to read its journal
                return await run(self, *args)

            async def either(event: trio.Event) -> None:
                await event.wait()
                went.set()

            monkeypatch.setattr(Lane, "_run", held)
            async with (
                open_room_worker(settings, base_dir=tmp_path) as second,
                trio.open_nursery() as nursery,
            ):
                nursery.start_soon(either, outage.asking)
                nursery.start_soon(either, parked_in(parked, "dm:2"))
                await second.deliver(message("d2", room="dm:2"))
                results = by_id(await next_results(second, 2))
                waited = await parks_of(second, "d2")
                nursery.cancel_scope.cancel()
    assert stopped_ms < park.next_attempt_ms  # stopped with d1's next try still to come
    after = [(at, asked) for _, at, asked in outage.requests[1:]]
    assert after, outage.requests
    assert all(at >= park.next_attempt_ms for at, _ in after), (park, after)
    assert sorted(asked for _, asked in after) == ["m-d1", "m-d2"]  # each asked once
    assert waited, "d2 asked the provider without waiting for the recorded schedule"
    assert all(p.by_route and p.route_failures == park.route_failures for p in waited), waited
    assert {(r.outcome, r.code) for r in results.values()} == {(Outcome.REPLY, None)}, results


async def test_pb4_a_probe_cancelled_after_it_met_the_outage_counts_the_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parked: dict[str, trio.Event]
) -> None:
    """PB4: d1 (one room) is parked, d2 (another) parks by the route behind it. At the
    half-open breaker one of them probes and the provider answers 503 again; the probe's
    delivery is cancelled just then (after the gateway saw the 503, before the worker has
    ended its turn). The turn ends ``cancelled``, but it did get a word on the route — a
    failure — so the breaker opens again with the next, longer wait (2 to 4 s): the other
    delivery parks by the route again, with the route's two failures in a row, and asks no
    sooner. (Before, a cancelled turn was taken for one that said nothing: the probe passed
    to the other delivery, which asked at once.)"""
    outage = Watched(seconds=0, at_least=2)  # the first try and the first probe are refused
    backoff = BackoffConfig(first_seconds=2, max_seconds=8, deadline_minutes=1.0)
    worker: RoomWorker | None = None
    refuse = Gateway._park

    async def cancelling(self: Gateway, downstream: _Downstream) -> None:
        if len(outage.down) == 2 and worker is not None:  # the probe met the outage
            await worker.cancel(outage.asked[-1].removeprefix("m-"))
        await refuse(self, downstream)

    monkeypatch.setattr(Gateway, "_park", cancelling)
    with trio.fail_after(LIMIT):
        async with (
            outage_upstream(outage) as url,
            open_room_worker(config(url, backoff), base_dir=tmp_path) as worker,
        ):
            await worker.deliver(message("d1", room="dm:1"))
            await parked_in(parked, "dm:1").wait()  # (its next try 1 to 2 s away)
            await worker.deliver(message("d2", room="dm:2"))
            results = by_id(await next_results(worker, 2))
            parks = {d: await parks_of(worker, d) for d in ("d1", "d2")}
    probe = outage.asked[1].removeprefix("m-")
    other = "d2" if probe == "d1" else "d1"
    assert (results[probe].outcome, results[probe].code) == (Outcome.CANCELLED, None)
    assert (results[other].outcome, results[other].code) == (Outcome.REPLY, None)
    failed_at = outage.down[1]
    later = [at for at, _, asked in outage.requests if asked == f"m-{other}" and at > failed_at]
    assert later, outage.requests
    assert later[0] - failed_at >= 2.0, (failed_at, later)  # half the second step, at least
    again: list[Parked] = [p for p in parks[other] if p.by_route and p.route_failures == 2]
    assert again, parks[other]
