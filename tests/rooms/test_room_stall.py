"""The turn stall backstop at the lane level (docs/design/lanes.md "Turn stall backstop", §6.3;
issue #5
item 6): the real room worker (``open_room_worker``), Fake-Pi as a real subprocess, a scripted
model on loopback, the brief's thresholds (300 s of silence, a 5 s tick, the gateway's 270 s
upstream inactivity) — under virtual time. ``tests/rooms/test_stall.py`` tests the watch alone.

How time passes here
--------------------
The tests run on ``MockClock(rate=1)``: Trio's clock follows real time, and the test moves it
on with :meth:`MockClock.jump` — to the next timer and no further, and only while the system is
*quiet*: everything the scripted model streamed has reached the lane as worker events (or, in a
tool, the tool is running). So a timer never fires while the subprocess is still working on
something, and nothing depends on how fast the machine is.

Autojump is not used (docs/design/clocks.md keeps it for in-process tests): it jumps whenever
every task *in this process* has been blocked for its threshold, and a task waiting on the
subprocess's pipe is blocked. While a turn runs its 5 s tick is always pending, so every
threshold's worth of real work in Fake-Pi (a chunk, a retry wait, a slow machine) would age the
turn by up to 5 s of virtual time, and each timer costs a threshold of real time (minutes for a
20-minute turn). A frozen clock (``rate=0``) does not work either: the runtime polls Trio's
clock while a worker launches (``_environ_after_exec``), which would never return.

What runs on which clock: the lane, its watch and tick, the gateway (keepalive, upstream
inactivity), the gate and the runtime's own tools, and the scripted model (its delays) run in
this process, on Trio's (mock) clock; the silence clock is :class:`MockSilenceClock`, which
follows it. Fake-Pi runs on real time: its retry waits and its ``bash`` are real. The waits in
real time (for the subprocess) are bounded by ``trio.move_on_after`` — meaningful here, since
no jump happens while the test waits — and every advance is bounded in virtual time.

Instrumentation, test-only (``monkeypatch``): the lane's :class:`StallWatch` is replaced by a
subclass that records every event, lease and check, and ``_Turn._see`` by a wrapper that
records each worker event's type and time as the lane saw it; for L20, ``RpcChannel.abort`` and
``Slot.fence`` are wrapped to record when they were called, and Fake-Pi gets a behaviour
(``abort:1``) through ``--fake-config`` on its command line. The clocks are the shipped
``clocks`` / ``silence_clock`` fixtures (``runtime.testing``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio
import trio.testing

from fake_pi._behaviours import Behaviours, FakeConfig
from fake_pi.model_server import ScriptedModel
from fake_pi.scenario import Call, Hang, Scenario, Step, Text, ToolCalls
from runtime._boundary import _gateway
from runtime._boundary._http import Request, ResponseWriter, serve_http
from runtime._clock import Clocks, MockSilenceClock
from runtime._config import ModelConfig, RoomConfig, RoomWorkerConfig, Thresholds
from runtime._errors import ReasonCode
from runtime._journal._store import lane_key
from runtime._pi._launch import WorkerProgram
from runtime._pi._rpc import RpcChannel
from runtime._pi._rpc_protocol import Event
from runtime._records import EpochFenced, EpochStarted, Outcome, StepAbandoned
from runtime._rooms import _slot, _turn, _worker
from runtime._rooms._stall import StallWatch
from runtime._rooms._worker import RoomWorker, open_room_worker
from runtime._wire import DeliveryResult

ROOM: Final = "dm:100"
MINUTE: Final = 60.0
LIMIT: Final = 300.0
"""The brief's silence limit (``Thresholds().stall_seconds``), asserted below."""
TICK: Final = 5.0
GRACE: Final = 30.0
"""How long the stall backstop's abort may go unanswered (``Thresholds().abort_grace_seconds``)."""
LEASE_MAX: Final = 600.0
"""The longest tool lease (``Thresholds().tool_lease_max_seconds``)."""
REAL_WAIT: Final = 30.0
"""Seconds of real time any one wait for the subprocess may take."""
DRIFT: Final = 0.25
"""Slack for the real time that passes between jumps (``rate=1``): milliseconds in practice."""
_json = msgspec.json.Encoder()


def test_the_thresholds_are_the_briefs() -> None:
    """These tests run on the defaults: 300 s of silence, a 5 s tick, and the gateway's 270 s
    of upstream inactivity, which is below the silence limit (docs/design/lanes.md, watchdog.md)."""
    thresholds = Thresholds()
    assert (thresholds.stall_seconds, thresholds.tick_seconds) == (LIMIT, TICK)
    assert thresholds.upstream_inactivity_seconds == 270.0 < LIMIT
    assert (thresholds.abort_grace_seconds, thresholds.tool_lease_max_seconds) == (
        GRACE,
        LEASE_MAX,
    )


# ------------------------------------------------------------------------------ the probe


@dataclass(frozen=True, slots=True)
class Seen:
    """A worker event as the lane saw it."""

    at: float
    """Trio time."""
    boottime: float
    type: str
    detail: str
    """``assistantMessageEvent.type`` of a ``message_update``, the role of a ``message_*``,
    the tool of a ``tool_execution_*``."""


@dataclass(frozen=True, slots=True)
class Check:
    """One check of the watch (``watch_turn``'s tick)."""

    at: float
    boottime: float
    stalled: bool


@dataclass
class Probe:
    """What the lane's watch and turn did, and a wake-up for whoever waits on it."""

    seen: list[Seen] = field(default_factory=list)
    events: list[float] = field(default_factory=list)
    """Every ``StallWatch.event(now)`` (boottime), releases included."""
    leases: list[tuple[float, float]] = field(default_factory=list)
    """``(boottime when taken, deadline)`` of every lease."""
    checks: list[Check] = field(default_factory=list)
    _changed: trio.Event | None = None

    def notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
        self._changed = trio.Event()

    async def changed(self) -> None:
        if self._changed is None:
            self._changed = trio.Event()
        await self._changed.wait()

    def count(self, kind: str, detail: str | None = None) -> int:
        return sum(s.type == kind and (detail is None or s.detail == detail) for s in self.seen)

    def first(self, kind: str, detail: str | None = None) -> Seen:
        return next(
            s for s in self.seen if s.type == kind and (detail is None or s.detail == detail)
        )

    def stall(self) -> Check | None:
        """The check that found the turn stalled, if one did."""
        return next((c for c in self.checks if c.stalled), None)

    def last_event_before(self, check: Check) -> float:
        return max(e for e in self.events if e <= check.boottime)


def _detail(event: Event) -> str:
    record = event.record
    if event.type == "message_update":
        return str((record.get("assistantMessageEvent") or {}).get("type", ""))
    if event.type.startswith("message_"):
        message = record.get("message")
        return str(message.get("role", "")) if isinstance(message, dict) else ""
    if event.type.startswith("tool_execution_"):
        return str(record.get("toolName", ""))
    return ""


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> Probe:
    """Record what every lane turn's watch and event loop do (test-only instrumentation)."""
    found = Probe()

    class RecordingWatch(StallWatch):
        def event(self, now: float) -> None:
            found.events.append(now)
            super().event(now)

        def lease(self, key: str, deadline: float) -> None:
            found.leases.append((found.events[-1] if found.events else -1.0, deadline))
            super().lease(key, deadline)

        def stalled(self, now: float) -> bool:
            stalled = super().stalled(now)
            found.checks.append(Check(trio.current_time(), now, stalled))
            found.notify()
            return stalled

    see = _turn.Turn._see

    def seeing(turn: _turn.Turn, event: Event) -> bool:
        boottime = turn.host.clocks.silence.read().boottime
        found.seen.append(Seen(trio.current_time(), boottime, event.type, _detail(event)))
        found.notify()
        return see(turn, event)

    monkeypatch.setattr(_turn, "StallWatch", RecordingWatch)
    monkeypatch.setattr(_turn.Turn, "_see", seeing)
    return found


@pytest.fixture
def virtual_clock() -> trio.testing.MockClock:
    """Trio's clock for these tests (pytest-trio runs the test on it): real time, plus jumps."""
    return trio.testing.MockClock(rate=1.0)


# ------------------------------------------------------------------------ the upstream model


@dataclass(frozen=True, slots=True)
class Alive:
    """A model that starts its answer and then says nothing, while its connection stays
    visibly alive: an SSE comment every ``every`` seconds (a proxy's or provider's keepalive)
    for ``seconds``, then the connection drops. The gateway counts comments as upstream
    activity (G10) and forwards none, so the worker hears nothing at all."""

    seconds: float = 3600.0
    every: float = 60.0
    then: str | None = None
    """Answer this after ``seconds`` (a model that was only very slow) instead of dropping."""


@dataclass
class CountingModel(ScriptedModel):
    """The scripted model, counting what it streamed: answers started and content tokens."""

    probe: Probe | None = None
    started: int = 0
    tokens: int = 0
    sent_at: float = 0.0
    """Trio time of the last chunk streamed."""

    async def stream(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        async with contextlib.aclosing(super().stream(body)) as chunks:
            async for chunk in chunks:
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    self.started += "role" in delta
                    self.tokens += bool(delta.get("content"))
                self.sent_at = trio.current_time()
                if self.probe is not None:
                    self.probe.notify()
                yield chunk


class Upstream:
    """The upstream model on loopback: ``plan[n]`` answers the ``n``-th chat request (a
    scenario step, or :class:`Alive`); it counts requests, answers started and tokens."""

    def __init__(self, plan: Sequence[Step | Alive], probe: Probe) -> None:
        self.plan = list(plan)
        self.probe = probe
        steps = [s for s in plan if not isinstance(s, Alive)]
        self.model = CountingModel(scenario=Scenario(steps=steps), probe=probe)
        self.bodies: list[dict[str, Any]] = []
        self.alive_started = 0
        self.alive_answered = 0
        self.url = ""

    @property
    def arrived(self) -> int:
        return len(self.bodies)

    @property
    def started(self) -> int:
        return self.model.started + self.alive_started

    @property
    def tokens(self) -> int:
        return self.model.tokens

    async def handle(self, request: Request, response: ResponseWriter) -> None:
        if request.method == "POST" and request.target.rstrip("/").endswith("/chat/completions"):
            self.bodies.append(msgspec.json.decode(request.body))
            self.probe.notify()
            step = self.plan[len(self.bodies) - 1] if len(self.bodies) <= len(self.plan) else None
            if isinstance(step, Alive):
                await self._alive(step, response)
                return
        await self.model.handle(request, response)

    async def _alive(self, step: Alive, response: ResponseWriter) -> None:
        first = {
            "id": f"chatcmpl-alive-{self.arrived}",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": self.model.model_id,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ],
        }
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await response.start(
                200, [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
            )
            await response.send(b"data: " + _json.encode(first) + b"\n\n")
            self.alive_started += 1
            self.probe.notify()
            for _ in range(int(step.seconds // step.every)):
                await trio.sleep(step.every)
                await response.send(b": still thinking\n\n")
            if step.then is not None:
                answer = {"index": 0, "delta": {"content": step.then}, "finish_reason": "stop"}
                last = {**first, "choices": [answer]}
                await response.send(b"data: " + _json.encode(last) + b"\n\n")
                await response.send(b"data: [DONE]\n\n")
                await response.end()
                self.alive_answered += 1
                self.probe.notify()
        # returning without ending the response drops the connection

    def streamed_reached_lane(self) -> bool:
        """Every answer started and every token streamed has reached the lane as an event."""
        probe = self.probe
        return (
            probe.count("message_start", "assistant") >= self.started
            and probe.count("message_update", "text_delta") >= self.tokens
        )


@contextlib.asynccontextmanager
async def serving(plan: Sequence[Step | Alive], probe: Probe) -> AsyncIterator[Upstream]:
    upstream = Upstream(plan, probe)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(functools.partial(serve_http, upstream.handle))
        upstream.url = f"{server.url}/v1"
        yield upstream
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------------ the room worker


def message(delivery_id: str, text: str, room: str = ROOM) -> dict[str, Any]:
    return {
        "delivery_id": delivery_id,
        "room": room,
        "author": {"id": "u1", "name": "Ann"},
        "message_id": f"m-{delivery_id}",
        "text": text,
    }


@contextlib.asynccontextmanager
async def room_worker(
    upstream: Upstream,
    tmp_path: Path,
    clocks: Clocks,
    probe: Probe,
    grants: frozenset[str] = frozenset({"send_text_update"}),
    on_result: Callable[[DeliveryResult], None] | None = None,
    others: Sequence[str] = (),
) -> AsyncIterator[tuple[RoomWorker, list[DeliveryResult]]]:
    """The room worker on Fake-Pi (a subprocess) with the default thresholds; its results
    are collected as they are published (``on_result`` sees each one first). ``others``:
    more rooms it serves, with the default grants."""
    config = RoomWorkerConfig(
        agent="fake",
        model=ModelConfig(base_url=upstream.url),
        rooms={ROOM: RoomConfig(grants=grants), **{room: RoomConfig() for room in others}},
    )
    results: list[DeliveryResult] = []
    async with (
        open_room_worker(config, base_dir=tmp_path, clocks=clocks) as worker,
        trio.open_nursery() as nursery,
    ):

        async def collect() -> None:
            async for result in worker.results():
                if on_result is not None:
                    on_result(result)
                results.append(result)
                probe.notify()

        nursery.start_soon(collect)
        yield worker, results
        nursery.cancel_scope.cancel()


# ----------------------------------------------------------------------- moving time on


def _never() -> bool:
    return False


@dataclass
class Driver:
    """Moves the mock clock on, one timer at a time, while the system is quiet."""

    clock: trio.testing.MockClock
    probe: Probe
    jumps: int = 0

    async def wait_for(self, ready: Callable[[], bool], what: str) -> None:
        """Wait in real time (nothing jumps meanwhile) until ``ready()``."""
        with trio.move_on_after(REAL_WAIT):
            while not ready():
                await self.probe.changed()
            return
        raise AssertionError(f"waited {REAL_WAIT} s of real time for {what}")

    async def advance(
        self,
        seconds: float,
        *,
        quiet: Callable[[], bool],
        stop: Callable[[], bool] = _never,
    ) -> None:
        """Let ``seconds`` of virtual time pass, jumping to each next timer in turn, but only
        while ``quiet()`` (else wait, in real time, until it is); return early once
        ``stop()``. Bounded: every jump moves the clock on by at least a millisecond."""
        end = trio.current_time() + seconds
        for _ in range(100_000):
            await trio.testing.wait_all_tasks_blocked()
            if stop():
                return
            if not quiet():
                await self.wait_for(lambda: quiet() or stop(), "the worker to catch up")
                continue
            now = trio.current_time()
            if now >= end:
                return
            ahead = trio.lowlevel.current_statistics().seconds_to_next_deadline
            self.clock.jump(min(max(ahead, 0.001), end - now))
            self.jumps += 1
        raise AssertionError("the clock would not move on")


@pytest.fixture
def driver(virtual_clock: trio.testing.MockClock, probe: Probe) -> Driver:
    return Driver(virtual_clock, probe)


def _stalled(probe: Probe) -> Callable[[], bool]:
    return lambda: probe.stall() is not None


async def _until_stalled(driver: Driver, upstream: Upstream, probe: Probe) -> Check:
    """Virtual time on, timer by timer, while the streamed answer sits in the lane, until a
    check finds the turn stalled: that check."""
    await driver.advance(30 * MINUTE, quiet=upstream.streamed_reached_lane, stop=_stalled(probe))
    stall = probe.stall()
    assert stall is not None, "the turn was never found stalled"
    return stall


async def _until_fenced(driver: Driver, upstream: Upstream, aborts: Aborts) -> None:
    """Virtual time on past the abort's grace, until the wedged epoch is fenced."""
    await driver.advance(
        10 * MINUTE, quiet=upstream.streamed_reached_lane, stop=lambda: bool(aborts.fenced)
    )


# ------------------------------------------------------------------------------- the cases


async def test_a_silent_model_stalls_the_turn_at_300_to_305_s_and_the_lane_goes_on(
    virtual_clock: trio.testing.MockClock,
    driver: Driver,
    probe: Probe,
    clocks: Clocks,
    tmp_path: Path,
) -> None:
    """docs/design/lanes.md: 300 s with no worker event aborts the turn as ``failed`` /
    ``turn_stalled``, caught on the first tick at or after the limit (300 to 305 s after the last
    event); the lane then serves the room's next delivery in the same worker.

    The model starts its answer and then says nothing while keeping its connection alive
    (:class:`Alive`): the gateway cannot tell it from a slow model, so only the backstop can
    end the turn. (A model that goes *quiet* — :class:`Hang` — is the gateway's to abort
    first, at 270 s: see the next test.)"""
    async with (
        serving([Alive(), Text(text="back again")], probe) as upstream,
        room_worker(upstream, tmp_path, clocks, probe) as (worker, results),
    ):
        await worker.deliver(message("d1", "are you there?"))
        await driver.wait_for(
            lambda: upstream.started == 1 and upstream.streamed_reached_lane(),
            "the answer to start",
        )
        stall = await _until_stalled(driver, upstream, probe)
        await driver.wait_for(lambda: len(results) == 1, "the stalled turn's result")
        (stalled,) = results
        assert (stalled.delivery_id, stalled.outcome, stalled.code, stalled.text) == (
            "d1",
            Outcome.FAILED,
            str(ReasonCode.TURN_STALLED),
            None,
        )
        # caught on the first tick at or after 300 s of silence
        silence = stall.boottime - probe.last_event_before(stall)
        assert LIMIT <= silence <= LIMIT + TICK + DRIFT
        before = [c for c in probe.checks if c.at < stall.at]
        assert before
        assert not any(c.stalled for c in before)
        assert before[-1].boottime - probe.last_event_before(before[-1]) < LIMIT
        # the last event was the answer's start: nothing came after it
        last_seen = max(s.at for s in probe.seen if s.at <= stall.at)
        assert probe.first("message_start", "assistant").at == last_seen
        # the lane serves the next delivery, in the same worker
        await worker.deliver(message("d2", "hello again"))
        await driver.wait_for(lambda: len(results) == 2, "the next delivery's result")
        nxt = results[1]
        assert (nxt.delivery_id, nxt.outcome, nxt.text) == ("d2", Outcome.REPLY, "back again")
        lane_log = await worker.store.read(f"lanes/{lane_key(ROOM)}/lane.log")
        assert sum(isinstance(r, EpochStarted) for r in lane_log.records) == 1
    assert upstream.arrived == 2
    assert "hello again" in str(upstream.bodies[1]["messages"][-1])


async def test_g14_a_stalled_turns_late_answer_does_not_reach_the_next_delivery(
    virtual_clock: trio.testing.MockClock,
    driver: Driver,
    probe: Probe,
    clocks: Clocks,
    tmp_path: Path,
) -> None:
    """The stalled turn's model answers after all, 8 minutes in, once the room's next
    delivery has its log attached: the late answer is not journaled into that delivery (it
    asked nothing with that digest) and the room worker goes on serving — before G14 the
    error stopped it."""
    plan: list[Step | Alive] = [
        Alive(seconds=8 * MINUTE, then="too late"),
        Text(text="second"),
        Text(text="third"),
    ]
    async with (
        serving(plan, probe) as upstream,
        room_worker(upstream, tmp_path, clocks, probe) as (worker, results),
    ):
        await worker.deliver(message("d1", "hi"))
        await driver.wait_for(
            lambda: upstream.started == 1 and upstream.streamed_reached_lane(), "d1 to start"
        )
        await driver.advance(
            30 * MINUTE, quiet=upstream.streamed_reached_lane, stop=_stalled(probe)
        )
        await driver.wait_for(lambda: len(results) == 1, "d1's result")
        await worker.deliver(message("d2", "again"))  # the gateway now serves d2's log
        await driver.wait_for(lambda: len(results) == 2, "d2's result")
        await driver.advance(  # only d1's silent stream is left, on virtual timers
            5 * MINUTE, quiet=lambda: True, stop=lambda: upstream.alive_answered == 1
        )
        assert upstream.alive_answered == 1  # d1's model answered, 8 minutes in
        await worker.deliver(message("d3", "third?"))
        await driver.wait_for(lambda: len(results) == 3, "d3's result")
    assert [(r.delivery_id, r.outcome) for r in results] == [
        ("d1", Outcome.FAILED),
        ("d2", Outcome.REPLY),
        ("d3", Outcome.REPLY),
    ]
    assert (results[1].text, results[2].text) == ("second", "third")


async def test_a_hung_upstream_is_the_gateways_to_abort_not_the_backstops(
    virtual_clock: trio.testing.MockClock,
    driver: Driver,
    probe: Probe,
    clocks: Clocks,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Remedies are layered (docs/design/watchdog.md): a model stream that goes quiet
    (:class:`Hang`) is
    aborted by the gateway after 270 s of upstream inactivity (G10), below the 300 s limit;
    the worker retries in-process (its ``auto_retry_start`` is an event), the retry is
    answered, and the turn ends ``reply`` — the backstop never fires. So with the brief's
    thresholds a hung model does not end ``turn_stalled``; a silent one that keeps its
    connection alive does (previous test)."""
    aborts: list[float] = []
    message_for = _gateway.inactivity_message

    def counting(seconds: float) -> str:
        aborts.append(trio.current_time())
        probe.notify()
        return message_for(seconds)

    monkeypatch.setattr(_gateway, "inactivity_message", counting)
    async with (
        serving([Hang(seconds=3600.0), Text(text="recovered")], probe) as upstream,
        room_worker(upstream, tmp_path, clocks, probe) as (worker, results),
    ):
        await worker.deliver(message("d1", "are you there?"))
        await driver.wait_for(
            lambda: upstream.started == 1 and upstream.streamed_reached_lane(),
            "the answer to start",
        )
        quiet_since = upstream.model.sent_at  # the upstream's last byte: its first chunk

        def quiet() -> bool:
            return upstream.streamed_reached_lane() and len(aborts) == 0

        retried = lambda: probe.count("auto_retry_start") >= 1  # noqa: E731
        await driver.advance(30 * MINUTE, quiet=quiet, stop=retried)
        # the worker waits (real time) before it retries; no virtual time is moved meanwhile
        await driver.wait_for(lambda: len(results) == 1, "the retried turn's result")
        (result,) = results
        assert (result.outcome, result.text) == (Outcome.REPLY, "recovered")
    assert upstream.arrived == 2
    assert len(aborts) == 1
    # 270 s after the upstream's last byte (its answer's first chunk)
    assert 270.0 <= aborts[0] - quiet_since <= 270.0 + DRIFT
    assert probe.stall() is None
    gaps = _gaps(probe.events)
    assert max(gaps) < LIMIT


async def test_a_20_minute_turn_streaming_every_4_minutes_is_never_aborted(
    virtual_clock: trio.testing.MockClock,
    driver: Driver,
    probe: Probe,
    clocks: Clocks,
    tmp_path: Path,
) -> None:
    """docs/design/lanes.md: any worker event resets the silence; nothing caps a turn's duration.
    Six tokens four minutes apart (below both the 300 s limit and the gateway's 270 s): the turn
    runs 20 minutes and ends ``reply``."""
    words = "one two three four five six"
    async with (
        serving([Text(text=words, delay=4 * MINUTE)], probe) as upstream,
        room_worker(upstream, tmp_path, clocks, probe) as (worker, results),
    ):
        await worker.deliver(message("d1", "take your time"))
        await driver.wait_for(
            lambda: upstream.tokens == 1 and upstream.streamed_reached_lane(),
            "the first token",
        )
        await driver.advance(
            30 * MINUTE,
            quiet=upstream.streamed_reached_lane,
            stop=lambda: _stalled(probe)() or probe.count("message_update", "text_delta") == 6,
        )
        await driver.wait_for(lambda: len(results) == 1, "the turn's result")
        (result,) = results
        assert (result.outcome, result.text) == (Outcome.REPLY, words)
    assert probe.stall() is None
    assert len(probe.checks) >= 20 * MINUTE / TICK  # the watch ticked all along
    deltas = [s.at for s in probe.seen if s.detail == "text_delta"]
    assert deltas[-1] - deltas[0] >= 20 * MINUTE - DRIFT
    assert all(4 * MINUTE - DRIFT <= b - a <= 4 * MINUTE + DRIFT for a, b in _pairs(deltas))
    assert max(_gaps(probe.events)) < LIMIT
    assert upstream.arrived == 1  # never aborted, never retried


async def test_a_6_minute_tool_within_its_lease_is_never_aborted(
    virtual_clock: trio.testing.MockClock,
    driver: Driver,
    probe: Probe,
    clocks: Clocks,
    tmp_path: Path,
) -> None:
    """docs/design/lanes.md: a tool running under the gate holds a lease for its deadline; a shell
    tool that names none gets 600 s. A real ``bash`` call (Fake-Pi runs it; it waits for a file this
    test creates) runs for 6 minutes of virtual time with no event at all — longer than the 300 s
    limit — and the turn is not aborted; it ends ``reply``.

    The tool's last sign of life is the empty ``tool_execution_update`` Pi sends as the
    command starts; time moves on only once the lane has seen it."""
    release = tmp_path / "release"
    command = f"while [ ! -e {release} ]; do sleep 0.02; done; echo finished"
    plan: list[Step | Alive] = [
        ToolCalls(calls=[Call(name="bash", arguments={"command": command}, id="call_long")]),
        Text(text="done"),
    ]
    async with (
        serving(plan, probe) as upstream,
        room_worker(
            upstream, tmp_path, clocks, probe, grants=frozenset({"bash", "send_text_update"})
        ) as (worker, results),
    ):
        await worker.deliver(message("d1", "run the long job"))
        await driver.wait_for(
            lambda: probe.count("tool_execution_update", "bash") == 1, "the command to start"
        )
        running = probe.first("tool_execution_update", "bash")
        await driver.advance(6 * MINUTE, quiet=lambda: True, stop=_stalled(probe))
        assert probe.stall() is None
        released = trio.current_time()
        release.touch()
        await driver.wait_for(lambda: len(results) == 1, "the turn's result")
        (result,) = results
        assert (result.outcome, result.text) == (Outcome.REPLY, "done")
    assert probe.stall() is None
    start = probe.first("tool_execution_start", "bash")
    end = probe.first("tool_execution_end", "bash")
    assert start.at < running.at < released < end.at
    assert released - running.at >= 6 * MINUTE > LIMIT
    between = [s for s in probe.seen if running.at < s.at < released]
    assert between == []  # six minutes without a single worker event
    ((taken, deadline),) = probe.leases
    assert deadline == pytest.approx(taken + LEASE_MAX, abs=DRIFT)  # clock: rate 1
    assert upstream.arrived == 2
    assert "finished" in str(upstream.bodies[1]["messages"][-1])


async def test_a_20_minute_host_suspend_is_caught_on_the_first_tick_after_wake(
    virtual_clock: trio.testing.MockClock,
    driver: Driver,
    probe: Probe,
    clocks: Clocks,
    silence_clock: MockSilenceClock,
    tmp_path: Path,
) -> None:
    """docs/design/clocks.md: silence is measured on the suspend-aware clock, re-read every tick;
    time the host spent asleep is silence, so a turn that was healthy (a token a minute) is aborted
    ``turn_stalled`` on the first tick after a 20-minute suspend — before its next token is due —
    having overshot by at most one tick of awake time."""
    words = " ".join(f"w{i}" for i in range(10))
    async with (
        serving([Text(text=words, delay=MINUTE)], probe) as upstream,
        room_worker(upstream, tmp_path, clocks, probe) as (worker, results),
    ):
        await worker.deliver(message("d1", "keep talking"))
        await driver.wait_for(lambda: upstream.tokens == 1, "the first token")
        deltas = functools.partial(probe.count, "message_update", "text_delta")
        await driver.advance(
            10 * MINUTE, quiet=upstream.streamed_reached_lane, stop=lambda: deltas() == 3
        )
        await driver.advance(20.0, quiet=upstream.streamed_reached_lane)  # between tokens
        assert probe.stall() is None
        assert deltas() == 3
        silence_clock.suspend(20 * MINUTE)  # the host slept; Trio's clock did not move
        wake = trio.current_time()
        await driver.advance(
            10 * MINUTE, quiet=upstream.streamed_reached_lane, stop=_stalled(probe)
        )
        await driver.wait_for(lambda: len(results) == 1, "the turn's result")
        (result,) = results
        assert (result.outcome, result.code) == (Outcome.FAILED, str(ReasonCode.TURN_STALLED))
    stall = probe.stall()
    assert stall is not None
    after_wake = [c for c in probe.checks if c.at >= wake]
    assert after_wake[0] == stall  # the first tick after the wake
    assert wake <= stall.at <= wake + TICK + DRIFT
    assert not any(c.stalled for c in probe.checks if c.at < wake)
    assert stall.boottime - probe.last_event_before(stall) >= 20 * MINUTE
    assert upstream.tokens == 3  # the next token (due 40 s after the wake) never came


# ------------------------------------------------------- L20: the backstop's own bounds


def _behaving(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, behaviours: Behaviours) -> None:
    """Every Fake-Pi epoch the room worker starts runs with ``behaviours`` (``--fake-config``;
    the worker's environment is allow-listed, so ``$FAKE_PI_CONFIG`` would not reach it)."""
    path = tmp_path / "fake-config.json"
    path.write_bytes(msgspec.json.encode(FakeConfig(behaviours=behaviours)))
    program = WorkerProgram.fake_pi()
    configured = dataclasses.replace(
        program, command=(*program.command, "--fake-config", str(path))
    )
    monkeypatch.setattr(_worker, "worker_program", lambda config: configured)


@dataclass
class Aborts:
    """When the lane sent ``abort`` and when it fenced an epoch (Trio time; test-only)."""

    sent: list[float] = field(default_factory=list)
    fenced: list[float] = field(default_factory=list)
    """When :meth:`Slot.fence` was called."""


@pytest.fixture
def aborts(monkeypatch: pytest.MonkeyPatch, probe: Probe) -> Aborts:
    found = Aborts()
    abort, fence = RpcChannel.abort, _slot.Slot.fence

    async def aborting(channel: RpcChannel) -> None:
        found.sent.append(trio.current_time())
        probe.notify()
        await abort(channel)

    async def fencing(slot: _slot.Slot) -> None:
        found.fenced.append(trio.current_time())
        probe.notify()
        await fence(slot)

    monkeypatch.setattr(RpcChannel, "abort", aborting)
    monkeypatch.setattr(_slot.Slot, "fence", fencing)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _epochs(worker: RoomWorker) -> list[EpochStarted | EpochFenced]:
    contents = await worker.store.read(f"lanes/{lane_key(ROOM)}/lane.log")
    return [r for r in contents.records if isinstance(r, EpochStarted | EpochFenced)]


async def test_l20_a_worker_that_ignores_the_stall_abort_is_fenced_after_the_grace(
    virtual_clock: trio.testing.MockClock,
    driver: Driver,
    probe: Probe,
    aborts: Aborts,
    clocks: Clocks,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L20: a silent model stalls the turn and the backstop sends ``abort``; the worker is
    wedged (Fake-Pi ``abort:1 = hang``: it neither aborts nor answers, its run goes on). Once
    ``abort_grace_seconds`` (30 s) passed after the abort with no ``agent_settled``, the epoch
    is fenced — its process is gone by the time the result is published — and the delivery
    ends ``failed turn_stalled``, never replayed (the model was asked once for it). The lane
    serves the room's next delivery on a new epoch."""
    _behaving(monkeypatch, tmp_path, Behaviours(at={"abort:1": "hang"}))
    alive_at_result: list[bool] = []
    wedged: list[int] = []
    async with (
        serving([Alive(), Text(text="back again")], probe) as upstream,
        room_worker(
            upstream,
            tmp_path,
            clocks,
            probe,
            on_result=lambda _: alive_at_result.extend(_alive(pid) for pid in wedged),
        ) as (worker, results),
    ):
        await worker.deliver(message("d1", "are you there?"))
        await driver.wait_for(
            lambda: upstream.started == 1 and upstream.streamed_reached_lane(),
            "the answer to start",
        )
        (first,) = await _epochs(worker)
        assert isinstance(first, EpochStarted)
        wedged.append(first.pid)
        stall = await _until_stalled(driver, upstream, probe)
        await driver.wait_for(lambda: len(aborts.sent) == 1, "the backstop's abort")
        assert _alive(first.pid)
        # the worker answers nothing: virtual time runs on, timer by timer, past the grace
        await _until_fenced(driver, upstream, aborts)
        await driver.wait_for(lambda: len(results) == 1, "the stalled turn's result")
        (stalled,) = results
        assert (stalled.delivery_id, stalled.outcome, stalled.code, stalled.text) == (
            "d1",
            Outcome.FAILED,
            str(ReasonCode.TURN_STALLED),
            None,
        )
        assert alive_at_result == [False]  # killed before its result was published
        # fenced once the grace was over, not before: the grace runs from the stall (the
        # abort is sent from another task, a scheduling step after the grace began)
        (fenced_at,) = aborts.fenced
        assert GRACE <= fenced_at - stall.at <= GRACE + DRIFT
        # the room's next delivery is answered, by a new epoch
        await worker.deliver(message("d2", "hello again"))
        await driver.wait_for(lambda: len(results) == 2, "the next delivery's result")
        assert (results[1].delivery_id, results[1].outcome, results[1].text) == (
            "d2",
            Outcome.REPLY,
            "back again",
        )
        epochs = await _epochs(worker)
        d1_log = await worker.store.read_delivery_log("d1")
    assert [(type(r).__name__, r.epoch) for r in epochs] == [
        ("EpochStarted", 1),
        ("EpochFenced", 1),
        ("EpochStarted", 2),
    ]
    assert isinstance(epochs[1], EpochFenced)
    assert epochs[1].reason == "fenced"
    assert not any(isinstance(r, StepAbandoned) for r in d1_log.records)  # never replayed
    assert upstream.arrived == 2  # d1 asked once, d2 once
    assert "hello again" in str(upstream.bodies[1]["messages"][-1])


async def test_l20_a_worker_that_never_answers_its_prompt_is_fenced_too(
    virtual_clock: trio.testing.MockClock,
    driver: Driver,
    probe: Probe,
    aborts: Aborts,
    clocks: Clocks,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L20: the backstop watches from the prompt on. A worker that never answers the turn's
    ``prompt`` (Fake-Pi ``prompt:1 = hang``: no run, no command handled after it) is found
    stalled once the limit passed, sent the abort, and fenced after the grace; the delivery
    ends ``failed turn_stalled`` without the model ever being asked, and is never replayed."""
    _behaving(monkeypatch, tmp_path, Behaviours(at={"prompt:1": "hang"}))
    async with (
        serving([Text(text="never asked")], probe) as upstream,
        room_worker(upstream, tmp_path, clocks, probe) as (worker, results),
    ):
        await worker.deliver(message("d1", "are you there?"))
        await driver.wait_for(lambda: bool(probe.checks), "the backstop to watch the prompt")
        await driver.advance(30 * MINUTE, quiet=lambda: True, stop=_stalled(probe))
        stall = probe.stall()
        assert stall is not None, "the turn was never found stalled"
        await driver.advance(10 * MINUTE, quiet=lambda: True, stop=lambda: bool(aborts.fenced))
        await driver.wait_for(lambda: len(results) == 1, "the stalled turn's result")
        (stalled,) = results
        epochs = await _epochs(worker)
        d1_log = await worker.store.read_delivery_log("d1")
    assert (stalled.delivery_id, stalled.outcome, stalled.code) == (
        "d1",
        Outcome.FAILED,
        str(ReasonCode.TURN_STALLED),
    )
    (fenced_at,) = aborts.fenced
    assert GRACE <= fenced_at - stall.at <= GRACE + DRIFT  # the grace runs from the stall
    assert [(type(r).__name__, r.epoch) for r in epochs] == [
        ("EpochStarted", 1),
        ("EpochFenced", 1),
    ]
    assert not any(isinstance(r, StepAbandoned) for r in d1_log.records)  # never replayed
    assert upstream.arrived == 0


async def test_l20_a_worker_that_dies_on_the_stall_abort_is_not_replayed(
    virtual_clock: trio.testing.MockClock,
    driver: Driver,
    probe: Probe,
    aborts: Aborts,
    clocks: Clocks,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L20: a stalled turn ends ``failed turn_stalled`` whatever the worker does after the
    abort: one that exits on it (Fake-Pi ``abort:1 = exit:3``) is fenced, and the turn is not
    replayed as a worker death (L9) would be — the model, silent for the limit, is not asked
    again. The room's next delivery is answered by a new epoch."""
    _behaving(monkeypatch, tmp_path, Behaviours(at={"abort:1": "exit:3"}))
    async with (
        serving([Alive(), Text(text="back again")], probe) as upstream,
        room_worker(upstream, tmp_path, clocks, probe) as (worker, results),
    ):
        await worker.deliver(message("d1", "are you there?"))
        await driver.wait_for(
            lambda: upstream.started == 1 and upstream.streamed_reached_lane(),
            "the answer to start",
        )
        await _until_stalled(driver, upstream, probe)
        await driver.wait_for(lambda: len(results) == 1, "the stalled turn's result")
        (stalled,) = results
        assert (stalled.delivery_id, stalled.outcome, stalled.code) == (
            "d1",
            Outcome.FAILED,
            str(ReasonCode.TURN_STALLED),
        )
        assert upstream.arrived == 1  # not replayed
        assert len(aborts.fenced) == 1
        await worker.deliver(message("d2", "hello again"))
        await driver.wait_for(lambda: len(results) == 2, "the next delivery's result")
        assert (results[1].outcome, results[1].text) == (Outcome.REPLY, "back again")
        epochs = await _epochs(worker)
        d1_log = await worker.store.read_delivery_log("d1")
    assert [r.epoch for r in epochs if isinstance(r, EpochStarted)] == [1, 2]
    assert not any(isinstance(r, StepAbandoned) for r in d1_log.records)
    assert upstream.arrived == 2


async def test_l20_a_cancel_the_wedged_worker_ignores_ends_cancelled_once_it_is_fenced(
    virtual_clock: trio.testing.MockClock,
    driver: Driver,
    probe: Probe,
    aborts: Aborts,
    clocks: Clocks,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L20 with L13: a running delivery is cancelled, but its worker ignores that abort and the
    backstop's too (Fake-Pi ``abort:1`` and ``abort:2 = hang``). The canceller's call returns
    once the grace has passed unanswered; the silence still stalls the turn; 30 s after the
    backstop's abort the epoch is fenced, the delivery ends ``cancelled`` (as it was asked to),
    and the next delivery is answered."""
    _behaving(monkeypatch, tmp_path, Behaviours(at={"abort:1": "hang", "abort:2": "hang"}))
    cancelled = trio.Event()
    async with (
        serving([Alive(), Text(text="back again")], probe) as upstream,
        room_worker(upstream, tmp_path, clocks, probe) as (worker, results),
        trio.open_nursery() as nursery,
    ):
        await worker.deliver(message("d1", "are you there?"))
        await driver.wait_for(
            lambda: upstream.started == 1 and upstream.streamed_reached_lane(),
            "the answer to start",
        )

        async def cancel() -> None:
            await worker.cancel("d1")
            cancelled.set()
            probe.notify()

        nursery.start_soon(cancel)
        await driver.wait_for(lambda: len(aborts.sent) == 1, "the cancel's abort")
        stall = await _until_stalled(driver, upstream, probe)
        await driver.wait_for(lambda: len(aborts.sent) == 2, "the backstop's abort")
        assert cancelled.is_set()  # the cancel returned after the grace, unanswered
        assert not results  # but the delivery is not over until its worker is fenced
        await _until_fenced(driver, upstream, aborts)
        await driver.wait_for(
            lambda: len(results) == 1 and cancelled.is_set(), "the cancelled turn's result"
        )
        (result,) = results
        assert (result.delivery_id, result.outcome, result.code) == ("d1", Outcome.CANCELLED, None)
        (fenced_at,) = aborts.fenced
        assert GRACE <= fenced_at - stall.at <= GRACE + DRIFT  # the grace runs from the stall
        await worker.deliver(message("d2", "hello again"))
        await driver.wait_for(lambda: len(results) == 2, "the next delivery's result")
        assert (results[1].outcome, results[1].text) == (Outcome.REPLY, "back again")
    assert upstream.arrived == 2


async def test_l13_l20_a_cancel_while_launching_then_a_stall_aborts_twice_and_ends_cancelled(
    virtual_clock: trio.testing.MockClock,
    driver: Driver,
    probe: Probe,
    aborts: Aborts,
    clocks: Clocks,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L13 with L20: a delivery cancelled while its worker launches is aborted by its turn
    once the prompt is in; the worker ignores that abort (Fake-Pi ``abort:1 = hang``) and
    then the model is silent, so the backstop aborts the same turn a second time (ignored
    too). Two aborts of one turn are two commands, each dropped when the turn ends — the
    second must not kill the host: the epoch is fenced after the grace, the delivery ends
    ``cancelled``, and another room is answered."""
    _behaving(monkeypatch, tmp_path, Behaviours(at={"abort:1": "hang", "abort:2": "hang"}))
    launching, go = trio.Event(), trio.Event()
    ensure_live = _slot.Slot.ensure_live

    async def held(slot: _slot.Slot, nursery: trio.Nursery) -> Any:
        if not go.is_set():
            launching.set()
            await go.wait()  # the cancel comes in meanwhile: no worker to abort yet
        return await ensure_live(slot, nursery)

    monkeypatch.setattr(_slot.Slot, "ensure_live", held)
    other = "dm:200"
    async with (
        serving([Alive(), Text(text="other room")], probe) as upstream,
        room_worker(upstream, tmp_path, clocks, probe, others=[other]) as (worker, results),
    ):
        await worker.deliver(message("d1", "are you there?"))
        await launching.wait()
        await worker.cancel("d1")
        go.set()
        await driver.wait_for(lambda: len(aborts.sent) == 1, "the turn's own abort")
        await driver.wait_for(
            lambda: upstream.started == 1 and upstream.streamed_reached_lane(),
            "the answer to start",
        )
        await _until_stalled(driver, upstream, probe)
        await driver.wait_for(lambda: len(aborts.sent) == 2, "the backstop's abort")
        await _until_fenced(driver, upstream, aborts)
        await driver.wait_for(lambda: len(results) == 1, "the cancelled turn's result")
        await worker.deliver(message("e1", "hello", room=other))
        await driver.wait_for(lambda: len(results) == 2, "the other room's result")
    assert [(r.delivery_id, r.outcome, r.text) for r in results] == [
        ("d1", Outcome.CANCELLED, None),
        ("e1", Outcome.REPLY, "other room"),
    ]
    assert len(aborts.fenced) == 1


async def test_l20_a_bash_timeout_above_the_cap_leases_only_the_cap(
    virtual_clock: trio.testing.MockClock,
    driver: Driver,
    probe: Probe,
    clocks: Clocks,
    tmp_path: Path,
) -> None:
    """L20: a tool's lease is its own ``timeout`` capped at ``tool_lease_max_seconds`` (600 s).
    A ``bash`` call asking for 23 days (a valid Pi timeout) that then runs silently leases
    600 s only, so the turn stalls at the cap plus the silence limit — 900 to 905 s after the
    command started — instead of never; the abort kills the command and the turn ends
    ``failed turn_stalled``."""
    release = tmp_path / "release"  # never created: the command runs until it is killed
    command = f"while [ ! -e {release} ]; do sleep 0.02; done; echo finished"
    days = 2_000_000
    plan: list[Step | Alive] = [
        ToolCalls(
            calls=[
                Call(
                    name="bash",
                    arguments={"command": command, "timeout": days},
                    id="call_forever",
                )
            ]
        ),
        Text(text="never asked"),
    ]
    async with (
        serving(plan, probe) as upstream,
        room_worker(
            upstream, tmp_path, clocks, probe, grants=frozenset({"bash", "send_text_update"})
        ) as (worker, results),
    ):
        await worker.deliver(message("d1", "run it for ever"))
        await driver.wait_for(
            lambda: probe.count("tool_execution_update", "bash") == 1, "the command to start"
        )
        await driver.advance(30 * MINUTE, quiet=lambda: True, stop=_stalled(probe))
        stall = probe.stall()
        assert stall is not None, "the turn was never found stalled: the lease was not capped"
        await driver.wait_for(lambda: len(results) == 1, "the stalled turn's result")
        (result,) = results
        assert (result.outcome, result.code) == (Outcome.FAILED, str(ReasonCode.TURN_STALLED))
    ((taken, deadline),) = probe.leases
    assert deadline == pytest.approx(taken + LEASE_MAX, abs=DRIFT)  # not taken + 23 days
    # silence counted from the capped lease's end: the first tick at or after 600 + 300 s
    assert LIMIT <= stall.boottime - deadline <= LIMIT + TICK + DRIFT
    assert not release.exists()
    assert probe.count("tool_execution_end", "bash") == 1  # the abort ended the command
    assert upstream.arrived == 1


def _pairs(values: Sequence[float]) -> list[tuple[float, float]]:
    return list(itertools.pairwise(values))


def _gaps(values: Sequence[float]) -> list[float]:
    ordered = sorted(values)
    return [b - a for a, b in _pairs(ordered)]
