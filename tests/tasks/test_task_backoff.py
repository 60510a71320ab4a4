"""Task lanes meeting an unavailable provider (docs/design/retention.md PB6): an outage is not
silence. Real worker processes (Fake-Pi and the real Pi 1.6.0) behind the lane's gateway, the
scripted model behind an upstream on loopback that answers 503 (or 401) for a while, the
production policy scaled down as in ``test_task_fence.py`` (soft 1.5 s, hard 4.5 s, grace
0.6 s) and the backoff scaled the same way (a first wait of 0.1 s doubling to 0.8 s): the
outages outlast the soft threshold, so a watchdog that counted them as silence would suspect
the worker, and one that let the worker's own turn fail would end in a completion prompt and a
hold. Nothing sleeps on the real clock to wait: a test waits for the lane's events."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio

from fake_pi._behaviours import Behaviours
from fake_pi.model_server import ReceivedRequest, body_digest
from fake_pi.scenario import Call, HttpError, Scenario, Step, Text, ToolCalls
from runtime._boundary._http import Request, ResponseWriter, serve_http
from runtime._config import BackoffConfig
from runtime._records import ContinuationSent, EpochStarted, OutboxAction, Parked
from runtime._wire import TaskSpec

from ..rooms.test_room_backoff import OVERLOADED, Outage
from .test_task_crash import (
    host,
    kill_when_paused,
    make_worktree,
    outcome,
    records,
    recover,
    task_spec,
)
from .test_task_fence import (
    KINDS,
    LIMIT,
    POLICY,
    TASK,
    DoneOnEveryPrompt,
    FenceRig,
    Pulse,
    Upstream,
    done,
    open_fence_rig,
    until_ended,
)

pytestmark = pytest.mark.slow

BACKOFF: Final = BackoffConfig(first_seconds=0.1, max_seconds=0.8, deadline_minutes=0.5)
FINISHED: Final = Text(text="finished")
NEVER_SILENT: Final = ("Suspect", "HardResumeEligible", "Fencing", "Resuming")


async def parks_of(rig: FenceRig, task_id: str = TASK) -> list[Parked]:
    contents = await rig.store.read(rig.runner.log_rel(task_id))
    return [r for r in contents.records if isinstance(r, Parked)]


@pytest.mark.parametrize("how", ["status", "in-stream"])
@pytest.mark.parametrize("kind", KINDS)
async def test_pb6_an_outage_parks_the_task_it_is_not_silence(
    kind: str, how: str, tmp_path: Path
) -> None:
    """PB6: a task whose provider answers 503 for three seconds — twice the soft threshold —
    is parked, not suspected: its classification is ``Parked`` while it waits (no probe, no
    eligibility, no fence, no replacement epoch charged), each wait is recorded in its lane
    log (``Parked``, its own tries counted), and the same worker is prompted again in the same
    session after each wait (one continuation per try, idempotent by its marker) until the
    provider answers; then the task ends done. Each try is one request upstream: the worker
    does not retry the gateway's parked answer by itself. ``in-stream`` (PB1, G10): the
    provider answers 200 and reports ``overloaded`` in its stream instead, the same."""
    model = DoneOnEveryPrompt()
    # 3 s and 3 refusals, however slow; ``in-stream``: a 200 stream reporting ``overloaded``
    # before any of the answer (PB1, G10), parked as the 503 is
    in_stream = OVERLOADED if how == "in-stream" else None
    outage = Outage(seconds=3.0, at_least=3, model=model, in_stream=in_stream)
    with trio.fail_after(LIMIT):
        async with open_fence_rig(
            tmp_path, kind, model, handler=outage.handle, backoff=BACKOFF
        ) as rig:
            await rig.runner.submit(rig.spec())
            ended = await until_ended(rig)
            records = await rig.records()
            view = rig.runner.show(TASK)
    assert ended.state == "done", ended
    seen = rig.classifications()
    assert "Parked" in seen, seen
    assert not set(seen) & set(NEVER_SILENT), seen
    parks = [r for r in records if isinstance(r, Parked)]
    assert len(parks) == len(outage.down) >= 3  # one try, one request, one park
    assert [p.attempt for p in parks] == list(range(1, len(parks) + 1))
    assert all(p.status == 503 and not p.by_route for p in parks)
    assert len({p.first_failure_ms for p in parks}) == 1
    for park, before in zip(parks[1:], parks, strict=False):  # the waits double (equal jitter)
        assert park.next_attempt_ms > before.next_attempt_ms
    actions = [r for r in records if isinstance(r, OutboxAction)]
    assert not [a for a in actions if a.kind in ("probe", "fence", "reserve")]
    assert [r.epoch for r in records if isinstance(r, EpochStarted)] == [1]
    sent = [r for r in records if isinstance(r, ContinuationSent)]
    assert [s.action_id.rsplit("/", 1)[-1] for s in sent] == [f"unpark{p.attempt}" for p in parks]
    data = await trio.Path(rig.session).read_text()
    for continuation in sent:
        assert data.count(continuation.marker) == 1
    # PB6: the continuation tells what was received, never a status that was not
    told = {
        "status": "(HTTP 503)",
        "in-stream": "(an error of class overloaded_error inside an HTTP 200 stream, "
        "taken for a 503)",
    }
    assert data.count(f"the model provider was unavailable {told[how]}") == len(parks)
    assert how == "status" or "HTTP 503" not in data
    assert view.budget["epochs_used"] == 0
    assert rig.model.request_count >= 2  # after the outage: the task's answer and its reply


@dataclass
class Refusing:
    """An upstream that refuses the requests whose numbers (from 1) it is given as an
    :class:`Outage` does (503), and passes every other to the model."""

    model: Upstream
    refused: frozenset[int]
    asked: int = 0
    outage: Outage = field(init=False)

    def __post_init__(self) -> None:
        self.outage = Outage(seconds=math.inf, model=self.model)

    async def handle(self, request: Request, response: ResponseWriter) -> None:
        self.asked += 1
        down = self.outage if self.asked in self.refused else self.model
        await down.handle(request, response)


async def test_pb6_a_second_outage_in_one_epoch_gets_its_own_continuation(
    tmp_path: Path,
) -> None:
    """PB6, TL5: two outages in one epoch, an answered turn between them (the answer ends
    the first episode, so the second one's tries count from 1 again). The prompt after the
    second outage is a continuation of its own (``e1/unpark2``: numbered over the epoch, not
    by the episode's try), sent — not taken for the first by its marker and dropped, which
    left the live worker parked with nothing to prompt it — and the task ends done."""
    model = Upstream(scenario=Scenario(steps=[Text(text="no lifecycle tool"), done(), FINISHED]))
    upstream = Refusing(model, frozenset({1, 3}))  # the task's prompt; the completion prompt
    with trio.fail_after(LIMIT):
        async with open_fence_rig(
            tmp_path, "fake", model, handler=upstream.handle, backoff=BACKOFF
        ) as rig:
            await rig.runner.submit(rig.spec())
            ended = await until_ended(rig)
            records = await rig.records()
    assert ended.state == "done", ended
    assert [p.attempt for p in records if isinstance(p, Parked)] == [1, 1]
    sent = [r.action_id.rsplit("/", 2)[-2:] for r in records if isinstance(r, ContinuationSent)]
    assert sent == [["e1", "unpark1"], ["e1", "completion"], ["e1", "unpark2"]]
    assert [r.epoch for r in records if isinstance(r, EpochStarted)] == [1]


@pytest.mark.parametrize("kind", ["fake"])
async def test_pb6_past_its_bounds_the_task_is_held_for_the_operator(
    kind: str, tmp_path: Path
) -> None:
    """PB3 for task lanes: past ``deadline_minutes`` since the first failure the task is held
    (``provider_unavailable:model_failed``) — a task ends only by its agent or its operator —
    never fenced or charged; the operator's abort ends it. A definite refusal is no outage:
    a 401 is not parked, and the task settles as before (its completion prompt, then a hold
    for the missing lifecycle call)."""
    short = BackoffConfig(first_seconds=0.1, max_seconds=0.8, deadline_minutes=0.02)
    model = DoneOnEveryPrompt()
    outage = Outage(seconds=3600.0, model=model)
    for name in ("outage", "refusal"):
        (tmp_path / name).mkdir()
    with trio.fail_after(LIMIT):
        async with open_fence_rig(
            tmp_path / "outage", kind, model, handler=outage.handle, backoff=short
        ) as rig:
            await rig.runner.submit(rig.spec())
            await rig.until(lambda: rig.runner.show(TASK).hold_reason is not None)
            view = rig.runner.show(TASK)
            assert view.hold_reason == "provider_unavailable:model_failed"
            assert view.classification == "StalledOperatorRequired"
            asked = len(outage.down)
            parks = await parks_of(rig)
            assert parks
            # every try but the last was parked; the bounds are met either at the last try's
            # failure (held at once: not parked) or at the end of its park's wait (held with
            # no try after it) — which of the two depends on the jittered schedule
            assert asked - 1 <= len(parks) <= asked
            records = await rig.records()
            assert not [
                r for r in records if isinstance(r, OutboxAction) and r.kind in ("fence", "reserve")
            ]
            await rig.runner.abort(TASK, "the provider is gone")
            ended = await rig.runner.wait(TASK)
            assert len(outage.down) == asked  # held: the provider is asked nothing more
    assert ended.state == "aborted"
    assert "Suspect" not in rig.classifications()

    refusal = Outage(seconds=3600.0, status=401, message="invalid api key")
    with trio.fail_after(LIMIT):
        async with open_fence_rig(
            tmp_path / "refusal", kind, DoneOnEveryPrompt(), handler=refusal.handle, backoff=BACKOFF
        ) as rig:
            await rig.runner.submit(rig.spec())
            await rig.until(lambda: rig.runner.show(TASK).hold_reason is not None)
            view = rig.runner.show(TASK)
            assert view.hold_reason == "no_terminal_after_completion_prompt:settled"
            assert await parks_of(rig) == []
            assert len(refusal.down) == 2  # the task's prompt and its completion prompt
            await rig.runner.abort(TASK)


async def test_pb3_pb6_a_retry_after_past_the_deadline_holds_the_task_at_its_deadline(
    tmp_path: Path,
) -> None:
    """PB3, PB6: the provider answers 503 with ``Retry-After: 3600`` (an account limit that
    resets in an hour) and is back at once; the backoff's deadline is 1.2 s. Tries to break:
    the parked task waiting out the whole hour — its bound not a bound — and then asking the
    provider again as the half-open breaker's probe, with no look at the deadline. Expected:
    held ``provider_unavailable:model_failed`` at the deadline, the provider asked once."""
    short = BackoffConfig(first_seconds=0.1, max_seconds=0.8, deadline_minutes=0.02)
    model = DoneOnEveryPrompt()
    outage = Outage(seconds=0.0, at_least=1, retry_after="3600", model=model)
    with trio.fail_after(LIMIT):
        async with open_fence_rig(
            tmp_path, "fake", model, handler=outage.handle, backoff=short
        ) as rig:
            await rig.runner.submit(rig.spec())
            await rig.until(lambda: rig.runner.show(TASK).hold_reason is not None)
            view = rig.runner.show(TASK)
            assert view.hold_reason == "provider_unavailable:model_failed"
            assert len(outage.down) == 1
            assert outage.up == 0  # never asked again past the deadline
            await rig.runner.abort(TASK)
            await rig.runner.wait(TASK)


@dataclass
class WallOutage(Outage):
    """An :class:`Outage` that also notes the wall-clock time of every request (a restarted
    host's schedule is wall-clock time, ``Parked.next_attempt_ms``)."""

    asked_ms: list[int] = field(default_factory=list)

    async def handle(self, request: Request, response: ResponseWriter) -> None:
        self.asked_ms.append(time.time_ns() // 1_000_000)
        await super().handle(request, response)


@contextlib.asynccontextmanager
async def serving(outage: Outage) -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        server = await nursery.start(functools.partial(serve_http, outage.handle))
        yield f"{server.url}/v1"
        nursery.cancel_scope.cancel()


async def test_pb6_a_host_killed_while_parked_waits_out_the_schedule_after_its_restart(
    tmp_path: Path,
) -> None:
    """PB2 for task lanes: a host SIGKILLed right after a task's park is durable; the next
    host finds the park in the lane log and asks the provider nothing before the recorded
    time (the breaker resumes the schedule), counts the next try as the task's second (the
    same first failure: the deadline runs on), and the task ends done once the provider is
    back. The restart itself is charged as any restart is (TL7) — the outage is not."""
    make_worktree(tmp_path)
    outage = WallOutage(seconds=8.0, model=DoneOnEveryPrompt())
    backoff = {"first_seconds": 6.0, "max_seconds": 6.0, "deadline_minutes": 1.0}
    with trio.fail_after(LIMIT):
        async with serving(outage) as url:
            spec = {**task_spec(url), "backoff": backoff}
            await kill_when_paused(tmp_path, spec, "record:parked")
            (first,) = [r for r in records(tmp_path) if isinstance(r, Parked)]
            asked_before = len(outage.asked_ms)
            facts = await recover(tmp_path, spec)
    assert outcome(facts)["ended"]["state"] == "done", facts
    assert first.attempt == 1
    after_restart = outage.asked_ms[asked_before:]
    assert after_restart
    assert after_restart[0] >= first.next_attempt_ms
    found = records(tmp_path)
    parks = [r for r in found if isinstance(r, Parked)]
    assert [p.attempt for p in parks] == list(range(1, len(parks) + 1))
    assert {p.first_failure_ms for p in parks} == {first.first_failure_ms}
    charged = [r for r in found if isinstance(r, OutboxAction) and r.kind == "reserve"]
    assert len(charged) == 1  # the restart's replacement, once; never the outage's
    assert not [r for r in found if isinstance(r, OutboxAction) and r.kind == "fence"]


@pytest.mark.parametrize(
    ("before", "after", "refusals", "held"),
    [
        pytest.param(12, 1, 1, None, id="fewer-attempts"),
        pytest.param(2, 12, 2, "provider_unavailable:model_failed", id="more-attempts"),
    ],
)
async def test_pb7_a_host_killed_while_parked_keeps_the_bounds_after_a_restart_with_new_ones(
    before: int, after: int, refusals: int, held: str | None, tmp_path: Path
) -> None:
    """PB7 for task lanes: a host SIGKILLed right after a task's first park is durable; the
    next host starts on the same state with ``max_attempts`` changed, the provider refusing
    ``refusals`` tries in all. The episode keeps the bounds it parked under: lowered (12 to 1)
    they do not hold the task at the restart — it waits out the schedule and is done once the
    provider answers — and raised (2 to 12) its second refusal holds it
    ``provider_unavailable:model_failed``, as the first host would have, and the provider is
    asked nothing more. (Before, the restarted host's configuration decided: the lowered
    bound held the task at once, the raised one let it try again and end done.)"""
    make_worktree(tmp_path)
    outage = Outage(seconds=0, at_least=refusals, model=DoneOnEveryPrompt())
    # a try every 4 to 8 s: the next host starts before it, and meets the park's wait
    # still running (the bounds are weighed before every try too, PB3)
    pace = {"first_seconds": 8.0, "max_seconds": 8.0, "deadline_minutes": 1.0}
    with trio.fail_after(LIMIT):
        async with serving(outage) as url:
            spec = task_spec(url)
            first_spec = {**spec, "backoff": {**pace, "max_attempts": before}}
            await kill_when_paused(tmp_path, first_spec, "record:parked")
            (first,) = [r for r in records(tmp_path) if isinstance(r, Parked)]
            # the next host: to its end, or stopped (and killed) at a hold — a held task keeps
            # its idle worker for the operator, and the host would follow it for ever
            then_spec = {
                **spec,
                "backoff": {**pace, "max_attempts": after},
                "pause": {"point": "action:hold"},
            }
            async with host(tmp_path, then_spec, "b") as h:
                fact = await h.until(lambda f: "paused" in f or "ended" in f)
                if "paused" in fact:
                    await h.stopped()
                    await h.kill()
    found = records(tmp_path)
    holds = [r.detail["reason"] for r in found if isinstance(r, OutboxAction) and r.kind == "hold"]
    assert first.attempt == 1
    assert holds == ([held] if held else []), found
    assert ("ended" in fact and fact["ended"]["state"] == "done") == (held is None), fact
    assert len(outage.down) == refusals
    assert {p.max_attempts for p in found if isinstance(p, Parked)} == {before}


async def test_pb6_an_operator_abort_ends_a_parked_task_at_once(tmp_path: Path) -> None:
    """Adversarial PB6: the operator aborts a task while it waits out a long backoff (a
    first wait of 30-60 s): it ends ``aborted`` at once, the provider is asked nothing more,
    and nothing was charged or fenced on the way."""
    model = DoneOnEveryPrompt()
    outage = Outage(seconds=3600.0, model=model)
    slow = BackoffConfig(first_seconds=60.0, max_seconds=60.0, deadline_minutes=30.0)
    with trio.fail_after(LIMIT):
        async with open_fence_rig(
            tmp_path, "fake", model, handler=outage.handle, backoff=slow
        ) as rig:
            await rig.runner.submit(rig.spec())
            await rig.until_classification("Parked")
            await rig.runner.abort(TASK, "the operator gave up on the provider")
            ended = await rig.runner.wait(TASK)
            records = await rig.records()
    assert ended.state == "aborted"
    assert len(outage.down) == 1
    parks = [r for r in records if isinstance(r, Parked)]
    assert [p.attempt for p in parks] == [1]
    assert not [
        r for r in records if isinstance(r, OutboxAction) and r.kind in ("fence", "reserve")
    ]


SECOND: Final = "task-2"
PATIENT: Final = dataclasses.replace(
    POLICY, soft_seconds=LIMIT, hard_seconds=dict.fromkeys(POLICY.hard_seconds, 3 * LIMIT)
)
""":data:`POLICY` with no silence the tests below could reach: a held model request is theirs
to release, not the watchdog's to suspect."""


def second_task(tmp_path: Path, prompt: str = "do the second task") -> TaskSpec:
    """A second task, in a worktree of its own, for the rig's runner."""
    worktree = tmp_path / "worktree-2"
    worktree.mkdir()
    (worktree / "README.md").write_text("the second task's worktree\n")
    return TaskSpec(
        task_id=SECOND, prompt=prompt, worktree=str(worktree.resolve()), grants=frozenset({"read"})
    )


async def test_pb4_pb6_a_new_task_asks_nothing_while_the_route_is_open(tmp_path: Path) -> None:
    """PB4, PB6: the first task's provider answers 503 with ``Retry-After: 3600``, so the
    host's route is open for an hour. A second task submitted meanwhile must not ask the
    provider: it waits by the route (a ``Parked`` of no try of its own) and, its deadline
    reached (1.2 s), is held ``provider_unavailable:model_failed``, the provider asked once
    in all. Tries to break: a task with no park of its own prompting its worker at once
    while the route is open — the provider asked again by every new task, which a new room
    delivery never is. (Before, only a task whose own log ended parked looked at the
    breaker before its first prompt.)"""
    short = BackoffConfig(first_seconds=0.1, max_seconds=0.8, deadline_minutes=0.02)
    model = DoneOnEveryPrompt()
    outage = Outage(seconds=3600.0, retry_after="3600", model=model)
    with trio.fail_after(LIMIT):
        async with open_fence_rig(
            tmp_path, "fake", model, handler=outage.handle, backoff=short
        ) as rig:
            await rig.runner.submit(rig.spec())
            await rig.until_classification("Parked")
            await rig.runner.submit(second_task(tmp_path))
            await rig.until(
                lambda: rig.runner.show(SECOND).hold_reason is not None or len(outage.down) > 1
            )
            view = rig.runner.show(SECOND)
            parks = await parks_of(rig, SECOND)
            for task_id in (TASK, SECOND):
                await rig.runner.abort(task_id)
                await rig.runner.wait(task_id)
    assert len(outage.down) == 1, outage.down  # the first task's: no other request was made
    assert view.hold_reason == "provider_unavailable:model_failed", view
    assert parks
    assert all(p.by_route and p.attempt == 0 for p in parks), parks


@dataclass
class ProbeHeld(Upstream):
    """A provider down for its first request (503) and up after it. The first request after
    the outage — the half-open breaker's probe — waits for ``go`` and is answered with a
    ``read`` call; the probe's next request (the tool's result) waits until the other task
    has asked; the rest as :class:`DoneOnEveryPrompt` does. ``asked``: whose each request
    was (``first``, ``second``: by the task's prompt), in order of arrival."""

    go: trio.Event = field(default_factory=trio.Event)
    other_asked: trio.Event = field(default_factory=trio.Event)
    probe: str | None = None
    asked: list[str] = field(default_factory=list)

    @staticmethod
    def whose(body: dict[str, Any]) -> tuple[str, int]:
        """Which task asked (by its prompt), and how many tool results its request carries."""
        messages = body.get("messages") or []
        who = "second" if "do the second task" in str(messages) else "first"
        return who, sum(m.get("role") == "tool" for m in messages)

    async def handle(self, request: Request, response: ResponseWriter) -> None:
        who, results = self.whose(msgspec.json.decode(request.body))
        self.asked.append(who)
        self.arrived.pulse()
        if len(self.asked) > 1:
            if self.probe is None:
                self.probe = who
                await self.go.wait()
            elif who == self.probe and results == 1:
                await self.other_asked.wait()
            elif who != self.probe:
                self.other_asked.set()
        await super().handle(request, response)

    def next_step(self, body: dict[str, Any]) -> Step:
        who, results = self.whose(body)
        step: Step
        if len(self.asked) == 1:
            step = HttpError(status=503, message="the service is overloaded")
        elif who == self.probe and results == 0:
            step = ToolCalls(calls=[Call(name="read", arguments={"path": "README.md"})])
        elif (who == self.probe and results == 1) or (who != self.probe and results == 0):
            step = done()
        else:
            step = FINISHED
        self.requests.append(ReceivedRequest(body, body_digest(body), step))
        return step


async def test_pb4_pb6_the_probes_first_answer_lets_the_other_task_go(tmp_path: Path) -> None:
    """PB4 for task lanes: the first task's first request meets a 503 and it parks; a second
    task arrives while the half-open breaker's probe is under way and waits by the route. The
    provider answers the probe's first request with a tool call, and its next request is held
    until the other task has asked. The other task must go as soon as that first answer is
    journaled — the route is up — not when the probe's turn ends: both tasks end done. (Before,
    a task lane's breaker closed only when the probing turn settled: the other task waited for
    the whole of it, here for ever, and in production until its deadline held it while the
    provider was answering.)"""
    model = ProbeHeld()
    with trio.fail_after(LIMIT):
        async with open_fence_rig(tmp_path, "fake", model, backoff=BACKOFF, policy=PATIENT) as rig:
            await rig.runner.submit(rig.spec("do the first task"))
            await rig.until_classification("Parked")
            await rig.runner.submit(second_task(tmp_path))
            task_of = {"first": TASK, "second": SECOND}

            def probing() -> bool:
                return model.probe is not None and (
                    rig.runner.show(
                        task_of[{"first": "second", "second": "first"}[model.probe]]
                    ).classification
                    == "Parked"
                )

            await rig.until(lambda: probing() or model.asked.count("second") > 0)
            assert model.probe is not None, model.asked
            other = {"first": "second", "second": "first"}[model.probe]
            assert other not in model.asked[1:], model.asked  # it waited by the route
            model.go.set()
            ended = [await rig.runner.wait(task_id) for task_id in (TASK, SECOND)]
            waited = await parks_of(rig, task_of[other])
    assert [e.state for e in ended] == ["done", "done"], ended
    assert model.asked[0] == "first"
    assert any(p.by_route for p in waited), waited
    # the other's first request came after the probe's first answer, while the probe's turn
    # was held (its second request waits for the other's: its third cannot come before)
    probe_at = [n for n, who in enumerate(model.asked) if who == model.probe and n > 0]
    assert probe_at[0] < model.asked.index(other, 1) < probe_at[2], model.asked


async def test_pb6_pb7_an_answer_inside_the_failing_turn_ends_the_episode(tmp_path: Path) -> None:
    """PB6, PB7: the task's first request meets a 503 (parked, try 1); after the wait the
    provider answers the next request (a ``read`` call), and the request after the tool's
    result meets a 503 again, in the same turn. The provider answered in between, so that is
    a new episode: its park is try 1 again, its deadline from its own failure — as a restart
    reads the log (the parks after the last answer). Tries to break: the episode kept across
    an answer in the failing turn (try 2, the first failure's deadline), which a host
    restarted there would count as try 1."""
    read = ToolCalls(calls=[Call(name="read", arguments={"path": "README.md"})])
    model = Upstream(scenario=Scenario(steps=[read, done(), FINISHED]))
    upstream = Refusing(model, frozenset({1, 3}))
    with trio.fail_after(LIMIT):
        async with open_fence_rig(
            tmp_path, "fake", model, handler=upstream.handle, backoff=BACKOFF
        ) as rig:
            await rig.runner.submit(rig.spec())
            ended = await until_ended(rig)
            parks = await parks_of(rig)
    assert ended.state == "done", ended
    assert [p.attempt for p in parks] == [1, 1], parks
    assert parks[1].first_failure_ms > parks[0].first_failure_ms


@dataclass
class HeldUntilReplied(Upstream):
    """The scripted model, its second request held until ``replied`` is set (the operator's
    reply is in before that request's answer ends the turn); each request's wall-clock time
    noted."""

    replied: trio.Event = field(default_factory=trio.Event)
    asked_ms: list[int] = field(default_factory=list)

    async def handle(self, request: Request, response: ResponseWriter) -> None:
        self.asked_ms.append(time.time_ns() // 1_000_000)
        if len(self.asked_ms) == 2:
            await self.replied.wait()
        await super().handle(request, response)


async def test_pb6_lk8_a_turn_ending_on_an_outage_parks_before_a_pending_reply_is_sent(
    tmp_path: Path,
) -> None:
    """PB6, LK8: the agent asks the operator (``task_wait``) and its turn goes on; the
    operator replies, and then the turn's next request meets a 503. At the settle the turn's
    outage is judged first: parked (try 1), the wait kept, and only then is the worker
    prompted — the continuation after the park, then the reply, once. Tries to break: the
    pending reply sent at the settle at once, asking the provider again with no wait and the
    failure never counted (no ``Parked``: the route's breaker blind to it)."""
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="task_wait", arguments={"question": "which one?"})]),
        HttpError(status=503, message="the service is overloaded"),
        Text(text="waited"),
        done(),
        FINISHED,
    ]
    model = HeldUntilReplied(scenario=Scenario(steps=steps))
    with trio.fail_after(LIMIT):
        async with open_fence_rig(tmp_path, "fake", model, backoff=BACKOFF, policy=PATIENT) as rig:
            await rig.runner.submit(rig.spec())
            await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
            await rig.runner.reply(TASK, "the blue one")
            model.replied.set()
            ended = await until_ended(rig)
            records = await rig.records()
    assert ended.state == "done", ended
    parks = [r for r in records if isinstance(r, Parked)]
    assert [p.attempt for p in parks] == [1], parks
    assert model.asked_ms[2] >= parks[0].next_attempt_ms  # the wait was kept
    sent = [r.action_id.rsplit("/", 1)[-1] for r in records if isinstance(r, ContinuationSent)]
    assert sent == ["unpark1", "reply1"], sent
    texts = [
        str(m.get("content"))
        for m in model.requests[-1].body["messages"]
        if m.get("role") == "user"
    ]
    assert sum("the blue one" in t for t in texts) == 1, texts


async def test_pb4_pb6_an_outage_opens_the_route_when_it_is_seen_not_at_the_settle(
    tmp_path: Path,
) -> None:
    """PB4, PB6: the first task's request meets a 503 with ``Retry-After: 3600``, and its
    worker then stops dead before it settles (a Fake-Pi barrier after the model: a worker
    wedged, or killed, between the outage and its settle). The route is down from the moment
    the gateway saw it: a second task submitted meanwhile waits by the route and is held at
    its deadline, the provider asked once in all. Tries to break: a task lane telling its
    breaker of an outage only at the settle — the other task asked the provider at once, and
    a worker that never settles never told the route at all."""
    short = BackoffConfig(first_seconds=0.1, max_seconds=0.8, deadline_minutes=0.02)
    model = DoneOnEveryPrompt()
    outage = Outage(seconds=3600.0, retry_after="3600", model=model)
    wedged = {1: Behaviours(at={"after_model:1": "hang"})}
    refused = trio.Event()
    changed: list[Pulse] = []  # the rig's, once it is open: each refusal wakes its waits

    async def handle(request: Request, response: ResponseWriter) -> None:
        await outage.handle(request, response)
        refused.set()  # the 503 went out whole
        for pulse in changed:
            pulse.pulse()

    with trio.fail_after(LIMIT):
        async with open_fence_rig(
            tmp_path,
            "fake",
            model,
            behaviours=wedged,
            handler=handle,
            backoff=short,
            policy=PATIENT,
        ) as rig:
            changed.append(rig.changed)
            await rig.runner.submit(rig.spec())
            await refused.wait()
            await rig.runner.submit(second_task(tmp_path))
            await rig.until(
                lambda: rig.runner.show(SECOND).hold_reason is not None or len(outage.down) > 1
            )
            view = rig.runner.show(SECOND)
            parks = await parks_of(rig, SECOND)
            first = rig.runner.show(TASK)
            for task_id in (TASK, SECOND):
                await rig.runner.abort(task_id)
                await rig.runner.wait(task_id)
    assert len(outage.down) == 1, outage.down
    assert view.hold_reason == "provider_unavailable:model_failed", view
    assert parks
    assert all(p.by_route and p.attempt == 0 for p in parks), parks
    assert first.classification != "Parked", first  # it never settled: the gateway told it
