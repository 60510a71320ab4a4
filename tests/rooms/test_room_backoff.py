"""Durable backoff for an unavailable provider (docs/design/retention.md PB1-PB4): a real room
worker with Fake-Pi workers, its model an upstream on loopback that answers 503 (or 401) until
a given time, then answers as the scripted model does.

A scale model of the outage: the room worker's lanes do not run under the virtual autojump
clock (their worker launches are real), so the backoff's times are scaled down — a first
wait of 0.1 s doubling to 0.8 s, outages of seconds, a deadline of 3 s — and the runtime
waits them out on the real clock; no test sleeps itself. The rules are the same at 5 s, 5 min
and 30 min: ``test_room_outage_virtual.py`` runs them at the shipped sizes, on virtual time."""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio

from fake_pi.model_server import ScriptedModel
from fake_pi.scenario import Call, Scenario, Text, ToolCalls
from runtime._boundary._http import Request, ResponseWriter, serve_http
from runtime._clock import Clocks
from runtime._config import BackoffConfig, ModelConfig, RoomWorkerConfig
from runtime._journal._store import lane_key
from runtime._records import Outcome, Parked, StepAbandoned
from runtime._rooms._lane import Lane
from runtime._rooms._worker import RoomWorker, open_room_worker
from runtime._wire import DeliveryResult, TextUpdate, Typing

from .test_room_worker import collecting, message, next_results
from .test_room_worker import config as worker_config

LIMIT: Final = 120.0
FIRST: Final = 0.1
MAX: Final = 0.8


@dataclass
class Outage:
    """An upstream that answers ``status`` (and ``Retry-After``) for ``seconds`` from the
    first request it gets (Trio's clock) and until it has refused ``at_least`` requests,
    then as a scripted model does: each refused request recorded with its time and the
    message it carried. (A count, not only a time: each try launches a worker, and on a
    loaded machine one launch can outlast a short outage — a test that needs the turn
    parked twice says so by count.)"""

    seconds: float
    at_least: int = 0
    status: int = 503
    retry_after: str | None = None
    message: str = "the service is overloaded"
    in_stream: dict[str, Any] | None = None
    """When set, the outage is reported inside a 200 stream instead of by ``status``: the
    role (nothing of the answer), then ``{"error": in_stream}``, then ``[DONE]`` (G10)."""
    model: ScriptedModel = field(default_factory=ScriptedModel)
    down: list[float] = field(default_factory=list)
    """When each request refused for the outage arrived."""
    asked: list[str] = field(default_factory=list)
    """The message id each refused request answered (``m-<delivery>``)."""
    until: float | None = None

    @property
    def up(self) -> int:
        return self.model.request_count

    async def handle(self, request: Request, response: ResponseWriter) -> None:
        if self.until is None:
            self.until = trio.current_time() + self.seconds
        if trio.current_time() < self.until or len(self.down) < self.at_least:
            self.down.append(trio.current_time())
            found = re.findall(rb"\(message (m-[^)]*)\)", request.body)  # the last: its own
            self.asked.append(found[-1].decode() if found else "")
            if self.in_stream is not None:
                await self._fail_in_stream(response, self.in_stream)
                return
            headers = [("content-type", "application/json")]
            if self.retry_after is not None:
                headers.append(("retry-after", self.retry_after))
            body = msgspec.json.encode({"error": {"message": self.message}})
            await response.start(self.status, [*headers, ("content-length", str(len(body)))])
            await response.send(body)
            await response.end()
            return
        await self.model.handle(request, response)

    @staticmethod
    async def _fail_in_stream(response: ResponseWriter, error: dict[str, Any]) -> None:
        base = {"id": "chatcmpl-down", "object": "chat.completion.chunk", "model": "fake-model"}
        role = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        await response.start(200, [("content-type", "text/event-stream")])
        for payload in (msgspec.json.encode(role), msgspec.json.encode({"error": error})):
            await response.send(b"data: " + payload + b"\n\n")
        await response.send(b"data: [DONE]\n\n")
        await response.end()


OVERLOADED: Final = {"type": "overloaded_error", "message": "Overloaded"}
"""A provider's outage as it reports it inside a 200 stream (Anthropic's class)."""
CONTEXT_TOO_LONG: Final = {
    "message": "This model's maximum context length is 8192 tokens",
    "type": "invalid_request_error",
    "code": "context_length_exceeded",
}
"""An error inside a 200 stream that is the request's own fault."""


@contextlib.asynccontextmanager
async def outage_upstream(outage: Outage) -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        server = await nursery.start(functools.partial(serve_http, outage.handle))
        yield f"{server.url}/v1"
        nursery.cancel_scope.cancel()


@pytest.fixture
def parked(monkeypatch: pytest.MonkeyPatch) -> trio.Event:
    """Set once a lane has made a delivery's park durable (a barrier in ``Lane._parked``)."""
    event = trio.Event()
    record = Lane._parked

    async def parking(self: Lane, *args: Any) -> None:
        await record(self, *args)
        event.set()

    monkeypatch.setattr(Lane, "_parked", parking)
    return event


BACKOFF: Final = BackoffConfig(first_seconds=FIRST, max_seconds=MAX, deadline_minutes=0.05)


def clocks() -> Clocks:
    return Clocks.system()


def config(url: str, backoff: BackoffConfig = BACKOFF) -> RoomWorkerConfig:
    return RoomWorkerConfig(model=ModelConfig(base_url=url), backoff=backoff)


async def parks_of(worker: RoomWorker, delivery_id: str) -> list[Parked]:
    if not await worker.store.exists(worker.store.delivery_rel(delivery_id)):
        return []
    records = (await worker.store.read_delivery_log(delivery_id)).records
    return [r for r in records if isinstance(r, Parked)]


def by_id(results: list[DeliveryResult]) -> dict[str, DeliveryResult]:
    return {r.delivery_id: r for r in results}


@pytest.mark.parametrize("how", ["status", "in-stream"])
@pytest.mark.parametrize("kind", ["fake", "pi"])
async def test_pb1_pb2_a_turn_meeting_an_outage_is_parked_and_answered_after_it(
    kind: str, how: str, tmp_path: Path
) -> None:
    """PB1: a provider answering 503 for a while parks the turn — a ``Parked`` record with
    the next attempt's time in its journal, the worker stopped — and the same turn is tried
    again at that time, until the provider answers: one reply, no ``model_failed``. PB2: the
    waits double from ``first_seconds`` up to ``max_seconds`` (equal jitter: at least half),
    and each try is one request upstream (the worker adds no retries of its own: the real
    Pi 1.6.0 does not retry the gateway's parked message either); PB4: the route's breaker
    counts each failure and the answer closes it. ``in-stream`` (G10): the provider answers
    200 and reports ``overloaded`` inside its stream, before any of the answer — an outage
    exactly as the 503 is (the status of the error's class)."""
    outage = Outage(seconds=3, at_least=2, in_stream=OVERLOADED if how == "in-stream" else None)
    backoff = BackoffConfig(first_seconds=FIRST, max_seconds=MAX)
    with trio.fail_after(LIMIT):
        async with (
            outage_upstream(outage) as url,
            open_room_worker(
                worker_config(kind, url, backoff=backoff), base_dir=tmp_path, clocks=clocks()
            ) as worker,
        ):
            await worker.deliver(message("d1"))
            (result,) = await next_results(worker, 1)
            parks = await parks_of(worker, "d1")
            answered_at = trio.current_time()
            breaker = worker._host.breaker
    assert (result.outcome, result.code) == (Outcome.REPLY, None)
    assert outage.until is not None
    assert answered_at >= outage.until
    assert len(outage.down) == len(parks) >= 2  # one request per try
    assert [p.attempt for p in parks] == list(range(1, len(parks) + 1))
    assert all(p.status == 503 and not p.by_route for p in parks)
    assert [p.route_failures for p in parks] == list(range(1, len(parks) + 1))  # PB4
    tries = outage.down
    for n, (a, b) in enumerate(itertools.pairwise(tries), start=1):
        full = min(MAX, FIRST * 2 ** (n - 1))
        assert b - a >= full / 2, (n, tries)  # never sooner than the schedule
    assert outage.up == 1
    assert breaker is not None
    assert (breaker.open_until_ms, breaker.failures) == (None, 0)  # the answer closed it


@pytest.mark.parametrize("kind", ["fake", "pi"])
async def test_pb1_pb3_an_error_of_the_requests_own_inside_a_200_stream_is_not_parked(
    kind: str, tmp_path: Path
) -> None:
    """PB3, G10: an error inside a 200 stream that is the request's own fault (its context
    too long) is not an outage: never parked, the route's breaker left closed. G10 relays it
    as it came and cuts the stream, so the worker's own retry rules decide: Fake-Pi retries
    a cut (here answered), the real Pi does not retry a context error (``model_failed``)."""
    refusal = Outage(seconds=0, at_least=1, in_stream=CONTEXT_TOO_LONG)
    with trio.fail_after(LIMIT):
        async with (
            outage_upstream(refusal) as url,
            open_room_worker(
                worker_config(kind, url, backoff=BACKOFF), base_dir=tmp_path, clocks=clocks()
            ) as worker,
        ):
            await worker.deliver(message("d1"))
            (result,) = await next_results(worker, 1)
            parks = await parks_of(worker, "d1")
            breaker = worker._host.breaker
    assert parks == []
    assert len(refusal.down) == 1
    assert breaker is not None
    assert (breaker.open_until_ms, breaker.failures) == (None, 0)
    if kind == "fake":
        assert (result.outcome, result.code, refusal.up) == (Outcome.REPLY, None, 1)
    else:
        assert (result.outcome, result.code, refusal.up) == (Outcome.FAILED, "model_failed", 0)


async def test_pb3_an_outage_past_the_deadline_ends_as_before_and_a_refusal_at_once(
    tmp_path: Path,
) -> None:
    """PB3: past ``deadline_minutes`` after its first failure (here 3 s, the outage longer)
    the delivery ends ``model_failed`` as before; a ``Retry-After`` is honoured (no try
    sooner); a definite refusal (401) is never parked and asked once."""
    long = Outage(seconds=60, retry_after="0.5")
    with trio.fail_after(LIMIT):
        async with (
            outage_upstream(long) as url,
            open_room_worker(config(url), base_dir=tmp_path / "a", clocks=clocks()) as worker,
        ):
            began = trio.current_time()
            await worker.deliver(message("d1"))
            (ended,) = await next_results(worker, 1)
            took = trio.current_time() - began
            parks = await parks_of(worker, "d1")
        refused = Outage(seconds=60, status=401, message="Incorrect API key provided")
        async with (
            outage_upstream(refused) as url,
            open_room_worker(config(url), base_dir=tmp_path / "b", clocks=clocks()) as worker,
        ):
            await worker.deliver(message("d1"))
            (unauthorized,) = await next_results(worker, 1)
            unparked = await parks_of(worker, "d1")
    assert (ended.outcome, ended.code) == (Outcome.FAILED, "model_failed")
    assert 3.0 <= took < 3.0 + 10
    assert parks
    assert all(b - a >= 0.5 for a, b in itertools.pairwise(long.down)), long.down
    assert long.up == 0
    assert (unauthorized.outcome, unauthorized.code) == (Outcome.FAILED, "model_failed")
    assert unparked == []
    assert len(refused.down) == 1


async def test_pb4_an_outage_during_a_burst_on_three_rooms(tmp_path: Path) -> None:
    """PB4: three rooms, two messages each, the provider down meanwhile: after the first
    failures the route's breaker lets one turn probe per backoff step (the others park by
    the route, asking nothing); once it is back every message is answered, exactly once,
    and nothing answered is asked again."""
    # long enough for several probes, each a worker launch; at least two more refusals than
    # there are messages, so that two of them are a turn tried again
    outage = Outage(seconds=8, at_least=8)
    rooms = ("dm:1", "dm:2", "dm:3")
    backoff = BackoffConfig(first_seconds=FIRST, max_seconds=MAX)
    with trio.fail_after(LIMIT):
        async with (
            outage_upstream(outage) as url,
            open_room_worker(config(url, backoff), base_dir=tmp_path, clocks=clocks()) as worker,
        ):
            for room in rooms:
                for n in (1, 2):
                    await worker.deliver(message(f"{room}-{n}", room=room))
            results = await next_results(worker, 6)
            parks = {r.delivery_id: await parks_of(worker, r.delivery_id) for r in results}
    assert {r.delivery_id for r in results} == {f"{room}-{n}" for room in rooms for n in (1, 2)}
    assert all(r.outcome in (Outcome.REPLY, Outcome.ABSORBED) for r in results), results
    # each delivery's first try may have begun before any failure was known; every later
    # try was let through by the breaker: one per half-open
    seen: set[str] = set()
    probes = []
    for at, asked in zip(outage.down, outage.asked, strict=True):
        if asked in seen:
            probes.append(at)
        seen.add(asked)
    assert len(probes) >= 2, outage.asked
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    tries = list(zip(outage.down, outage.asked, strict=True))
    assert all(gap >= FIRST / 2 for gap in gaps), tries  # one probe per half-open
    assert any(p.by_route for ps in parks.values() for p in ps)
    assert outage.up <= 6  # each turn asked once when the provider was back


async def test_pb2_the_schedule_survives_a_restart(tmp_path: Path, parked: trio.Event) -> None:
    """PB2: a host stopped while a delivery is parked leaves its schedule in the journal;
    the next host resumes it at that time — not before, not charged a recovery attempt —
    and answers it once the provider is back."""
    outage = Outage(seconds=10, at_least=2)  # the next host is refused at least once
    slow = BackoffConfig(first_seconds=2, max_seconds=2)  # a try every 1 to 2 s
    with trio.fail_after(LIMIT):
        async with outage_upstream(outage) as url:
            settings = config(url, slow)
            async with open_room_worker(settings, base_dir=tmp_path) as worker:
                await worker.deliver(message("d1"))
                await parked.wait()
                (first,) = await parks_of(worker, "d1")
            stopped_at = Clocks.system().wall.time_ms()
            async with open_room_worker(settings, base_dir=tmp_path) as worker:
                (result,) = await next_results(worker, 1)
                records = (await worker.store.read_delivery_log("d1")).records
    resumed = outage.down[1:]
    assert stopped_at < first.next_attempt_ms
    assert resumed  # the outage outlasted the first host; the next one tried again
    assert resumed[0] >= outage.down[0] + (first.next_attempt_ms - first.first_failure_ms) / 1000
    assert (result.outcome, result.code) == (Outcome.REPLY, None)
    assert not any(isinstance(r, StepAbandoned) for r in records)  # not charged (L19)
    assert sum(isinstance(r, Parked) for r in records) >= 2


def slow(max_attempts: int, deadline_minutes: float) -> BackoffConfig:
    """A try every 2 to 4 s: the first host is stopped long before its delivery's next try."""
    return BackoffConfig(
        first_seconds=4, max_seconds=4, max_attempts=max_attempts, deadline_minutes=deadline_minutes
    )


@pytest.mark.parametrize(
    ("before", "after", "refusals", "ends"),
    [
        pytest.param(slow(12, 1.0), slow(1, 1.0), 1, (Outcome.REPLY, None), id="fewer-attempts"),
        pytest.param(
            slow(2, 1.0), slow(12, 1.0), 2, (Outcome.FAILED, "model_failed"), id="more-attempts"
        ),
        pytest.param(
            slow(12, 1.0), slow(12, 1e-6), 1, (Outcome.REPLY, None), id="shorter-deadline"
        ),
        pytest.param(
            slow(12, 0.01),
            slow(12, 30.0),
            2,
            (Outcome.FAILED, "model_failed"),
            id="longer-deadline",
        ),
    ],
)
async def test_pb7_a_restart_with_new_bounds_keeps_the_bounds_a_delivery_parked_under(
    before: BackoffConfig,
    after: BackoffConfig,
    refusals: int,
    ends: tuple[Outcome, str | None],
    tmp_path: Path,
    parked: trio.Event,
) -> None:
    """PB7: a delivery parks under one ``[backoff]`` (its first try refused), the host stops,
    and the next host starts on the same state directory with the bounds changed, the
    provider refusing ``refusals`` tries in all. The delivery keeps the bounds it parked
    under: lowered (``max_attempts`` 12 to 1, the deadline from a minute to a blink) they do
    not end it — it is tried again at its recorded time and answered — and raised (2 to 12
    tries, 0.6 s to 30 minutes) they do not keep it longer than it was promised: it ends
    ``model_failed`` as the first host would have ended it, never answered by a try past its
    bounds. Each of its parks names the bounds it parked under. (Before, every decision read
    the configuration of the host making it: the lowered bounds failed the delivery at the
    restart, the raised ones tried it again and answered it.)"""
    outage = Outage(seconds=0, at_least=refusals)
    with trio.fail_after(LIMIT):
        async with outage_upstream(outage) as url:
            async with open_room_worker(config(url, before), base_dir=tmp_path) as worker:
                await worker.deliver(message("d1"))
                await parked.wait()
                (first,) = await parks_of(worker, "d1")
            async with open_room_worker(config(url, after), base_dir=tmp_path) as worker:
                (result,) = await next_results(worker, 1)
                parks = await parks_of(worker, "d1")
    assert first.attempt == 1
    assert (result.outcome, result.code) == ends
    assert {(p.max_attempts, p.deadline_minutes) for p in parks} == {
        (before.max_attempts, before.deadline_minutes)
    }
    answered = ends[0] is Outcome.REPLY
    assert outage.up == (1 if answered else 0)  # nothing answered past its bounds
    # every refusal was a try — but past the longer deadline's 0.6 s, which ends it at the
    # restart or at the end of a wait cut to it (PB3), never by a try after it
    tries = 1 if before.deadline_minutes < after.deadline_minutes else refusals
    assert len(outage.down) == tries, outage.down


async def test_pb1_a_usage_limit_with_a_reset_time_is_waited_for(tmp_path: Path) -> None:
    """PB1: a 429 account limit that says when it resets (``Retry-After``) parks the turn
    until then — never sooner — and it is answered after; parked, it would end
    ``usage_limit_reached`` (its recorded code). One without a reset time still ends
    ``usage_limit_reached`` at once (``test_l7_provider_failures_carry_only_the_code``)."""
    quota = "You exceeded your current quota, please check your plan and billing details."
    limited = Outage(seconds=1.5, status=429, retry_after="0.6", message=quota)
    with trio.fail_after(LIMIT):
        async with (
            outage_upstream(limited) as url,
            open_room_worker(config(url), base_dir=tmp_path, clocks=clocks()) as worker,
        ):
            await worker.deliver(message("d1"))
            (result,) = await next_results(worker, 1)
            parks = await parks_of(worker, "d1")
    assert (result.outcome, result.code) == (Outcome.REPLY, None)
    assert parks
    assert {p.code for p in parks} == {"usage_limit_reached"}
    assert all(b - a >= 0.6 for a, b in itertools.pairwise(limited.down)), limited.down


async def test_pb1_a_provider_with_no_listener_is_an_outage_too(tmp_path: Path) -> None:
    """PB1: nothing listening at the provider's address (connection refused) parks the turn
    like a 503 — its ``Parked`` records carry no status — until its tries are spent (PB3:
    ``max_attempts``, three tries here, rather than a deadline of seconds a slow worker launch could
    outlast), when it ends ``model_failed``."""
    probe = trio.socket.socket()
    await probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    url = f"http://127.0.0.1:{port}/v1"
    tries = BackoffConfig(first_seconds=FIRST, max_seconds=MAX, max_attempts=3)
    with trio.fail_after(LIMIT):
        async with open_room_worker(
            config(url, tries), base_dir=tmp_path, clocks=clocks()
        ) as worker:
            await worker.deliver(message("d1"))
            (result,) = await next_results(worker, 1)
            parks = await parks_of(worker, "d1")
    assert (result.outcome, result.code) == (Outcome.FAILED, "model_failed")
    assert [p.attempt for p in parks] == [1, 2]  # three tries: two parked, the last ends it
    assert {p.status for p in parks} == {None}


async def test_pb5_the_room_is_told_once_and_typing_waits_for_the_answer(tmp_path: Path) -> None:
    """PB5: with ``[backoff] notify`` the room gets one ``text_update`` (threaded on the
    message) when the delivery first parks, however often it parks; no ``typing`` is sent
    while it is parked — the first comes with the answer's text."""
    outage = Outage(seconds=0, at_least=3)  # parked three times, however long tries take
    notice = "Our model provider is down; hold on."
    backoff = BackoffConfig(first_seconds=FIRST, max_seconds=MAX, notify=True, notify_text=notice)
    with trio.fail_after(LIMIT):
        async with (
            outage_upstream(outage) as url,
            open_room_worker(config(url, backoff), base_dir=tmp_path, clocks=clocks()) as worker,
            collecting(worker) as events,
        ):
            await worker.deliver(message("d1"))
            (result,) = await next_results(worker, 1)
            parks = await parks_of(worker, "d1")
    updates = [e for e in events if isinstance(e, TextUpdate)]
    assert result.outcome is Outcome.REPLY
    assert len(parks) == 3
    assert [(u.delivery_id, u.reply_to, u.text) for u in updates] == [("d1", "m-d1", notice)]
    first_typing = next(i for i, e in enumerate(events) if isinstance(e, Typing))
    assert events.index(updates[0]) < first_typing


async def test_pb1_a_parked_delivery_is_cancelled_at_once_and_the_next_message_waits(
    tmp_path: Path, parked: trio.Event
) -> None:
    """A ``cancel`` of a parked delivery ends it ``cancelled`` without waiting for its next
    try; a message of the same room that arrived while it was parked was queued (there is
    no live run to steer into) and is answered once the provider is back."""
    outage = Outage(seconds=6)
    backoff = BackoffConfig(first_seconds=2, max_seconds=2)
    with trio.fail_after(LIMIT):
        async with (
            outage_upstream(outage) as url,
            open_room_worker(config(url, backoff), base_dir=tmp_path, clocks=clocks()) as worker,
        ):
            await worker.deliver(message("d1"))
            while not await parks_of(worker, "d1"):
                with trio.move_on_after(0.05):
                    await parked.wait()  # (never set: looked at again every 50 ms)
            queued = await worker.deliver(message("d2"))
            began = trio.current_time()
            await worker.cancel("d1")
            (cancelled,) = await next_results(worker, 1)
            took = trio.current_time() - began
            (answered,) = await next_results(worker, 1, after=cancelled.seq)
    assert queued.disposition == "queued"
    assert (cancelled.delivery_id, cancelled.outcome) == ("d1", Outcome.CANCELLED)
    assert took < 1.0  # not its next try, 1 to 2 s away
    assert (answered.delivery_id, answered.outcome) == ("d2", Outcome.REPLY)


async def test_pb3_a_usage_limit_past_the_deadline_ends_usage_limit_reached(
    tmp_path: Path,
) -> None:
    """PB3: an account limit that resets later than the deadline ends the delivery with its
    own code, ``usage_limit_reached`` — not the ``model_failed`` the worker saw while the
    gateway kept the limit from it."""
    quota = "You exceeded your current quota, please check your plan and billing details."
    limited = Outage(seconds=60, status=429, retry_after="0.5", message=quota)
    with trio.fail_after(LIMIT):
        async with (
            outage_upstream(limited) as url,
            open_room_worker(config(url), base_dir=tmp_path, clocks=clocks()) as worker,
        ):
            await worker.deliver(message("d1"))
            (result,) = await next_results(worker, 1)
    assert (result.outcome, result.code) == (Outcome.FAILED, "usage_limit_reached")
    assert len(limited.down) >= 2


async def test_pb4_a_probe_refused_before_it_asks_passes_the_probe_on(
    tmp_path: Path, parked: trio.Event
) -> None:
    """PB4, L18: d1 is parked, and while it waits its room's session loses its header. At
    the half-open breaker d1 is the one probe; it ends ``recovery_refused:session`` before
    asking anything (its session cannot be branched back). That is no word on the route, so
    the probe passes on: another room's d2, after it, asks the provider — up again — and is
    answered. The breaker must not stay held by a turn that ended (every later turn would
    park by the route, asking nothing, until its deadline)."""
    outage = Outage(seconds=0.5, at_least=1)
    backoff = BackoffConfig(first_seconds=2, max_seconds=2, deadline_minutes=0.1)
    session = tmp_path / "state" / "lanes" / lane_key("dm:100") / "session.jsonl"
    with trio.fail_after(LIMIT):
        async with (
            outage_upstream(outage) as url,
            open_room_worker(config(url, backoff), base_dir=tmp_path, clocks=clocks()) as worker,
        ):
            await worker.deliver(message("d1"))
            await parked.wait()  # (before its next try: 1 to 2 s away)
            lines = (await trio.to_thread.run_sync(session.read_bytes)).split(b"\n")
            lines[0] = b'{"type":"not-a-session-header"' + b" " * 8
            await trio.to_thread.run_sync(session.write_bytes, b"\n".join(lines))
            (refused,) = await next_results(worker, 1)
            await worker.deliver(message("d2", room="dm:200"))
            (answered,) = await next_results(worker, 1, after=refused.seq)
    assert (refused.delivery_id, refused.outcome, refused.code) == (
        "d1",
        Outcome.FAILED,
        "recovery_refused:session",
    )
    assert (answered.delivery_id, answered.outcome, answered.code) == ("d2", Outcome.REPLY, None)
    assert outage.up == 1


async def test_pb4_the_probes_first_answer_lets_the_others_go(
    tmp_path: Path, parked: trio.Event
) -> None:
    """PB4: d1 (one room) is parked; d2 (another room) arrives while it waits and parks by
    the route. At the half-open breaker one of them probes; the provider is back and answers
    its first request (a tool call) at once, but its turn goes on for seconds (the answer
    after the tool streams slowly). The other waits for the route's answer, not for the
    probe's turn: it goes on once that first request is answered — within its 9 s deadline
    — and both are answered. (Before, the breaker closed only when the probe's turn ended:
    the other waited for the whole of it and ended ``model_failed`` at its deadline while the
    provider was answering.)"""
    slow_answer = Text(text=" ".join(f"w{n}" for n in range(24)), delay=0.5)  # 12 s
    looking = Call(name="send_text_update", arguments={"text": "looking"})
    model = ScriptedModel(scenario=Scenario(steps=[ToolCalls(calls=[looking]), slow_answer]))
    outage = Outage(seconds=0, at_least=1, model=model)
    backoff = BackoffConfig(first_seconds=2, max_seconds=2, deadline_minutes=0.15)
    with trio.fail_after(LIMIT):
        async with (
            outage_upstream(outage) as url,
            open_room_worker(config(url, backoff), base_dir=tmp_path, clocks=clocks()) as worker,
        ):
            await worker.deliver(message("d1", room="dm:1"))
            await parked.wait()  # (its next try 1 to 2 s away)
            await worker.deliver(message("d2", room="dm:2"))
            results = by_id(await next_results(worker, 2))
            waited = await parks_of(worker, "d2")
    assert (len(outage.down), outage.asked) == (1, ["m-d1"])  # d2 never met the outage
    assert waited  # it waited by the route
    assert all(p.by_route for p in waited)
    assert {(r.outcome, r.code) for r in results.values()} == {(Outcome.REPLY, None)}, results
