"""Task-lane fencing with real processes on the real clock (issue #8, Tests: "Real processes,
real clock, short bounds"; ``docs/design/watchdog.md`` WD3, WD10, WD11, LK4, TL4, TL5).

Each test runs a :class:`~runtime._tasks._workers.ProcessWorkers` lane — the real Pi or Fake-Pi
as a subprocess behind the lane's gateway and gate, one pair of servers per epoch — against
the scripted model on loopback, with the production policy divided by :data:`FACTOR` (``soft``
1.5 s, ``hard`` 4.5 s, ``grace`` 0.6 s), a short TERM grace and every test bounded by
``trio.fail_after``. Nothing sleeps on the real clock to wait for something: a test waits for
the lane's :class:`~runtime._tasks._runner.TaskEvent`\\ s (or the model's requests) and then looks.

How a worker is wedged:

* Fake-Pi ``hang`` at a ``before_model`` barrier (``$FAKE_PI_CONFIG`` for that epoch only):
  the agent stops before its model request while its RPC loop still answers — a provider phase
  with no output and a quiet probe;
* a model endpoint that accepts the request and never sends a byte (the scripted model's
  ``Hang``; the gateway's upstream inactivity is set past the test): the same for the real Pi,
  which has no barriers;
* SIGSTOP: a stopped worker answers no probe, so the fence probe is *unknown* and the lane holds
  (WD3, WD10: only a quiet answer leads to the guards); the operator's resume then stops it —
  TERM stays pending on a stopped process, and the KILL after the bound ends it.

What survives is looked for the way a host would: every process whose ``/proc/<pid>/environ``
carries the epoch's nonce (``tests/_procs.py``), and the recorded pid itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio

from fake_pi._behaviours import Behaviours, FakeConfig
from fake_pi.model_server import ReceivedRequest, ScriptedModel, body_digest
from fake_pi.scenario import Call, Hang, Scenario, Step, Text, ToolCalls
from runtime._boundary._gateway import GatewayConfig
from runtime._boundary._http import Handler, serve_http
from runtime._clock import Clocks
from runtime._config import BackoffConfig
from runtime._journal._store import Store, open_store, runtime_dir
from runtime._linux._proc import process_start_time
from runtime._linux._proctree import is_alive_pid, new_nonce
from runtime._pi._launch import ModelRoute, RetrySettings, WorkerProgram
from runtime._pi._session_files import aread_session
from runtime._records import (
    ContinuationSent,
    EpochFenced,
    EpochStarted,
    LifecycleReceipt,
    OutboxAction,
    Record,
    TaskEnded,
)
from runtime._tasks._lane import TaskLane
from runtime._tasks._runner import TaskRunner, open_task_runner
from runtime._tasks._watchdog import WatchdogPolicy
from runtime._tasks._workers import ProcessWorkers
from runtime._wire import TaskEvent, TaskSpec

from .._pi import real_pi
from .._procs import alive_with_nonce

pytestmark = pytest.mark.slow

KINDS: Final = ("fake", "pi")
FACTOR: Final = 200.0
"""The unsafe test time scale: soft 1.5 s, hard 4.5 s, grace 0.6 s."""
POLICY: Final = dataclasses.replace(
    WatchdogPolicy().scaled(FACTOR),
    probe_timeout_seconds=3.0,  # a loaded machine still answers a get_state within this
    recovery_seconds=60.0,  # launching the real Pi on a loaded machine is not what is tested
    term_grace_seconds=1.0,
    kill_bound_seconds=5.0,
)
LIMIT: Final = 60.0
ROUTE: Final = ModelRoute(provider="fake", model="fake-model")
TASK: Final = "task-1"
SILENT: Final = Hang(seconds=3600)
"""A model response that starts and then never sends a byte (the test ends it)."""
WEDGED_BEFORE_FIRST_REQUEST: Final = {1: Behaviours(at={"before_model:1": "hang"})}
FENCED_PATH: Final = ["Active", "Suspect", "HardResumeEligible", "Fencing", "Resuming", "Active"]


def done(summary: str = "did it") -> ToolCalls:
    return ToolCalls(calls=[Call(name="task_done", arguments={"summary": summary})])


def marker_of(action_id: str) -> str:
    return f"[pi-runtime continuation v1 {action_id}]"


class Pulse:
    """Wakes every waiter each time it is pulsed."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def pulse(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()


@dataclass
class Upstream(ScriptedModel):
    """The scripted model (served on loopback), pulsing ``arrived`` as it records a request."""

    arrived: Pulse = field(default_factory=Pulse)

    def next_step(self, body: dict[str, Any]) -> Step:
        step = super().next_step(body)
        self.arrived.pulse()
        return step


@dataclass
class DoneOnEveryPrompt(Upstream):
    """Answers each prompt with a ``task_done`` call and each tool result with a text, for
    any number of lanes at once."""

    def next_step(self, body: dict[str, Any]) -> Step:
        messages = body.get("messages") or [{}]
        step: Step = Text(text="finished") if messages[-1].get("role") == "tool" else done()
        self.requests.append(ReceivedRequest(body, body_digest(body), step))
        self.arrived.pulse()
        return step


@dataclass
class FenceRig:
    """A task runner on process workers and what the tests look at."""

    runner: TaskRunner
    store: Store
    workers: ProcessWorkers
    model: Upstream
    worktree: Path
    events: list[TaskEvent] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    """The runner's log lines (shown when a test fails)."""
    changed: Pulse = field(default_factory=Pulse)

    def saw(self, event: TaskEvent) -> None:
        self.events.append(event)
        self.changed.pulse()

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Wait (on the lane's change events, never on time) until ``predicate()`` holds."""
        while not predicate():
            await self.changed.wait()

    async def until_classification(self, classification: str) -> None:
        await self.until(lambda: classification in self.classifications())

    async def until_model_requests(self, count: int) -> None:
        while self.model.request_count < count:
            await self.model.arrived.wait()

    @property
    def lane(self) -> TaskLane:
        """The task's live lane (``task_ended`` once it has ended)."""
        return self.runner.lane(TASK)

    @property
    def session(self) -> Path:
        return self.store.root / self.runner.show(TASK).session_path

    def spec(self, prompt: str = "do the task", grants: Sequence[str] = ("read",)) -> TaskSpec:
        return TaskSpec(
            task_id=TASK, prompt=prompt, worktree=str(self.worktree), grants=frozenset(grants)
        )

    def classifications(self) -> list[str]:
        seen: list[str] = []
        for event in self.events:
            if event.task_id == TASK and (not seen or seen[-1] != event.classification):
                seen.append(event.classification)
        return seen

    async def records(self) -> list[Record]:
        contents = await self.store.read(self.runner.log_rel(TASK))
        return list(contents.records)

    def epoch(self, number: int) -> EpochStarted:
        """The true identity of epoch ``number`` (whatever the lane was told)."""
        (record,) = [r for r in self.workers.launched if r.epoch == number]
        return record


@contextlib.asynccontextmanager
async def open_fence_rig(
    tmp_path: Path,
    kind: str,
    steps: Sequence[Step] | Upstream,
    *,
    behaviours: Mapping[int, Behaviours] | None = None,
    identity_override: Callable[[EpochStarted], EpochStarted] | None = None,
    handler: Handler | None = None,
    backoff: BackoffConfig | None = None,
    policy: WatchdogPolicy = POLICY,
) -> AsyncIterator[FenceRig]:
    """A runner whose lanes run the real Pi (``kind == "pi"``) or Fake-Pi as subprocesses,
    the scripted model ``steps`` (or a given model) upstream; ``behaviours`` per epoch number
    (Fake-Pi only). ``handler``: what serves the upstream instead of the model's own handler
    (an outage in front of it); ``backoff``: an unavailable provider parks the turn (PB6);
    ``policy``: the watchdog's, :data:`POLICY` unless a test's silences are not under test."""
    epoch_env: dict[int, dict[str, str]] = {}
    for number, wanted in (behaviours or {}).items():
        assert kind == "fake", "behaviour barriers are Fake-Pi's"
        path = tmp_path / f"fake-pi-epoch{number}.json"
        path.write_bytes(msgspec.json.encode(FakeConfig(behaviours=wanted)))
        epoch_env[number] = {"FAKE_PI_CONFIG": str(path)}
    program = WorkerProgram.pi(real_pi()) if kind == "pi" else WorkerProgram.fake_pi()
    worktree = tmp_path / "worktree"
    worktree.mkdir()
    (worktree / "README.md").write_text("a task's worktree\n")
    worktree = worktree.resolve()
    clocks = Clocks.system()
    state = tmp_path / "state"
    model = steps if isinstance(steps, Upstream) else Upstream(scenario=Scenario(steps=list(steps)))
    async with open_store(state, clocks=clocks) as store, trio.open_nursery() as servers:
        server = await servers.start(functools.partial(serve_http, handler or model.handle))
        url = f"{server.url}/v1"
        upstream = GatewayConfig(
            upstream_url=url, upstream_inactivity=600.0, park_unavailable=backoff is not None
        )
        workers = ProcessWorkers(
            program=program,
            route=ROUTE,
            upstream=upstream,
            socket_dir=runtime_dir(state),
            state_dir=state,
            retry=RetrySettings(max_retries=0),
            epoch_env=epoch_env,
            identity_override=identity_override,
        )
        async with open_task_runner(
            store,
            workers=workers,
            route=ROUTE,
            policy=policy,
            clocks=clocks,
            work_root=tmp_path / "work",
            backoff=backoff,
        ) as runner:
            rig = FenceRig(runner, store, workers, model, worktree)
            runner.host.log = rig.lines.append
            async with runner.events(buffer=10_000) as events, trio.open_nursery() as nursery:

                async def collect() -> None:
                    async for event in events:
                        rig.saw(event)

                nursery.start_soon(collect)
                try:
                    yield rig
                finally:
                    print("\n".join(rig.lines))
                    print(f"stop reports: {rig.workers.reports}")
                nursery.cancel_scope.cancel()
        servers.cancel_scope.cancel()


def tree_gone(record: EpochStarted) -> bool:
    """Nothing of the epoch's tree is alive: no process carries its nonce, and its pid is
    dead or someone else's now."""
    same_pid_alive = (
        is_alive_pid(record.pid) and process_start_time(record.pid) == record.start_time
    )
    return not alive_with_nonce(record.nonce) and not same_pid_alive


async def until_ended(rig: FenceRig) -> TaskEnded:
    """Wait for the task's end; a hold on the way fails the test at once (with its reason)
    instead of waiting out the test's bound."""
    held_before = rig.runner.show(TASK).hold_reason
    await rig.until(
        lambda: (
            rig.runner.has_ended(TASK)
            or rig.runner.show(TASK).hold_reason not in (None, held_before)
        )
    )
    view = rig.runner.show(TASK)
    assert rig.runner.has_ended(TASK), f"held: {view.hold_reason}; {view.classification}"
    return await rig.runner.wait(TASK)


async def session_id(session: Path) -> str:
    return (await aread_session(session)).session.id


async def assert_fenced_and_resumed_once(rig: FenceRig, first_session_id: str) -> None:
    """What every automatic fence leaves behind: one fence, one reserve, one continuation
    prompt (in the log and in the session, once), the same session and worktree, two epochs,
    an explicit done with its candidate."""
    ended = await until_ended(rig)
    assert ended.state == "done", ended
    assert ended.candidate is not None
    records = await rig.records()
    actions = [r for r in records if isinstance(r, OutboxAction)]
    assert sum(a.kind == "fence" for a in actions) == 1
    assert sum(a.kind == "reserve" for a in actions) == 1
    assert [a.detail["clean"] for a in actions if a.kind == "reap"] == [True]
    assert [r.reason for r in records if isinstance(r, EpochFenced)] == ["fence", "terminal"]
    (sent,) = [r for r in records if isinstance(r, ContinuationSent)]
    assert sent.epoch == 2
    data = await trio.Path(rig.session).read_bytes()
    assert data.count(json.dumps(sent.marker)[1:-1].encode()) == 1
    assert sent.marker == marker_of(sent.action_id)
    assert await session_id(rig.session) == first_session_id
    assert rig.runner.show(TASK).session_id == first_session_id  # the attested session
    started = [r for r in records if isinstance(r, EpochStarted)]
    assert [r.epoch for r in started] == [1, 2]
    assert started[0].nonce != started[1].nonce
    receipts = [r for r in records if isinstance(r, LifecycleReceipt)]
    assert [(r.kind, r.accepted, r.epoch) for r in receipts] == [("done", True, 2)]
    for request in rig.model.requests:  # every epoch worked in the same worktree
        assert str(rig.worktree) in json.dumps(request.body["messages"][0])
    view = rig.runner.show(TASK)
    assert view.session_path == rig.runner.ended[TASK].task.session_path
    assert view.worktree == str(rig.worktree)
    assert view.budget["epochs_used"] == 1
    assert classifications_prefix(rig) == FENCED_PATH
    assert tree_gone(rig.epoch(1))
    assert tree_gone(rig.epoch(2))
    # WD11: recovery time runs from the fence to the resumed worker's first progress; it is
    # charged to the budget and reported as the resume latency
    assert len(view.telemetry["resume_latency_seconds"]) == 1
    assert view.budget["seconds_used"] > 0


def classifications_prefix(rig: FenceRig) -> list[str]:
    return rig.classifications()[: len(FENCED_PATH)]


# ------------------------------------------------------------------------------ fencing


async def test_a_wedged_fake_pi_subprocess_is_fenced_and_resumed_in_the_same_session(
    tmp_path: Path,
) -> None:
    """Fake-Pi hangs before its first model request (provider phase, no output, its RPC still
    answering): Suspect at the soft threshold, HardResumeEligible after hard + grace, a quiet
    fence probe, every guard holds → Fencing; the old epoch's whole tree is gone before the
    new epoch runs on the same session and worktree with one continuation prompt; the task
    ends on an explicit task_done."""
    with trio.fail_after(LIMIT):
        async with open_fence_rig(
            tmp_path,
            "fake",
            [done(), Text(text="finished")],
            behaviours=WEDGED_BEFORE_FIRST_REQUEST,
        ) as rig:
            await rig.runner.submit(rig.spec())
            await rig.until_classification("Suspect")
            first = rig.epoch(1)
            assert os.readlink(f"/proc/{first.pid}/cwd") == str(rig.worktree)
            assert rig.model.request_count == 0  # wedged before asking
            first_session = await session_id(rig.session)
            await rig.until_classification("Resuming")
            assert tree_gone(first)  # stopped, killed and reaped before the resume
            assert rig.workers.reports[1].clean
            await assert_fenced_and_resumed_once(rig, first_session)
    assert rig.model.request_count == 2


async def test_wd8_a_worker_process_that_exits_before_it_answers_its_prompt_is_replaced(
    tmp_path: Path,
) -> None:
    """WD8, TL2, TL11 with a real process: Fake-Pi reads the task's prompt and exits before it
    answers. That is an exit (a replacement, charged, its tree proven gone first), never the
    lane's failure; the task ends done with epochs 1 and 2."""
    with trio.fail_after(LIMIT):
        async with open_fence_rig(
            tmp_path,
            "fake",
            [done(), Text(text="finished")],
            behaviours={1: Behaviours(at={"prompt:1": "exit:1"})},
        ) as rig:
            await rig.runner.submit(rig.spec())
            ended = await until_ended(rig)
            records = await rig.records()
    assert ended.state == "done", ended
    assert [r.epoch for r in records if isinstance(r, EpochStarted)] == [1, 2]
    assert rig.workers.reports[1].clean
    assert sum(isinstance(r, OutboxAction) and r.kind == "reserve" for r in records) == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_a_worker_waiting_on_a_silent_model_is_fenced_and_resumed(
    kind: str, tmp_path: Path
) -> None:
    """The model accepts the first request and never sends a byte (the gateway's own
    inactivity bound is longer than the test): the real Pi and Fake-Pi alike are fenced after
    hard + grace and resumed on the same session; the silent request is not answered later."""
    with trio.fail_after(LIMIT):
        async with open_fence_rig(tmp_path, kind, [SILENT, done(), Text(text="finished")]) as rig:
            await rig.runner.submit(rig.spec())
            await rig.until_model_requests(1)
            await rig.until_classification("Suspect")
            first = rig.epoch(1)
            first_session = await session_id(rig.session)
            await rig.until_classification("Resuming")
            assert tree_gone(first)
            await assert_fenced_and_resumed_once(rig, first_session)
    assert rig.model.request_count == 3


async def test_a_worker_that_ignores_sigterm_is_killed_after_the_bound_with_its_descendants(
    tmp_path: Path,
) -> None:
    """Fake-Pi ignores SIGTERM; its bash tool left a background ``sleep`` (a descendant that
    outlives the tool) before the worker wedged: the stop waits the TERM grace, KILLs the whole
    tree, reaps it; the fence completes and nothing of the old epoch survives."""
    sleeper = tmp_path / "sleeper.pid"
    background = ToolCalls(
        calls=[
            Call(
                name="bash",
                arguments={"command": f"sleep 300 >/dev/null 2>&1 & echo $! > {sleeper}"},
            )
        ]
    )
    behaviours = {1: Behaviours(at={"before_model:2": "hang"}, ignore_sigterm=300.0)}
    with trio.fail_after(LIMIT):
        async with open_fence_rig(
            tmp_path, "fake", [background, done(), Text(text="finished")], behaviours=behaviours
        ) as rig:
            await rig.runner.submit(rig.spec(grants=("read", "bash")))
            await rig.until_classification("Suspect")
            first = rig.epoch(1)
            sleep_pid = int(sleeper.read_text())
            assert sleep_pid in alive_with_nonce(first.nonce)  # a live descendant of epoch 1
            assert first.pid in alive_with_nonce(first.nonce)
            first_session = await session_id(rig.session)
            await rig.until_classification("Resuming")
            report = rig.workers.reports[1]
            assert not report.graceful  # TERM was ignored: the tree was KILLed after the bound
            assert report.exit_status == -signal.SIGKILL
            assert report.clean
            assert tree_gone(first)
            assert not is_alive_pid(sleep_pid)
            await assert_fenced_and_resumed_once(rig, first_session)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_stopped_worker_is_held_then_the_operators_resume_kills_it(
    kind: str, tmp_path: Path
) -> None:
    """SIGSTOP while the model request is in flight: the stopped worker answers no probe, so
    the fence probe is unknown and the lane holds (``probe_unanswered``) instead of fencing.
    The operator's resume stops it — TERM stays pending on a stopped process; the KILL after
    the bound ends it — and the task resumes in the same session and ends done."""
    with trio.fail_after(LIMIT):
        async with open_fence_rig(tmp_path, kind, [SILENT, done(), Text(text="finished")]) as rig:
            await rig.runner.submit(rig.spec())
            await rig.until_model_requests(1)
            first = rig.epoch(1)
            os.kill(first.pid, signal.SIGSTOP)
            first_session = await session_id(rig.session)
            await rig.until(lambda: rig.runner.show(TASK).hold_reason is not None)
            view = rig.runner.show(TASK)
            assert view.classification == "StalledOperatorRequired"
            assert view.hold_reason == "probe_unanswered"
            assert rig.classifications() == [
                "Active",
                "Suspect",
                "HardResumeEligible",
                "StalledOperatorRequired",
            ]
            assert first.pid in alive_with_nonce(first.nonce)  # held: nothing was signalled
            rig.runner.resume(TASK)
            ended = await until_ended(rig)
            assert ended.state == "done", ended
            report = rig.workers.reports[1]
            assert not report.graceful
            assert report.exit_status == -signal.SIGKILL
            assert report.clean
            assert tree_gone(first)
            records = await rig.records()
            assert [r.reason for r in records if isinstance(r, EpochFenced)] == [
                "fence",
                "terminal",
            ]
            assert len([r for r in records if isinstance(r, ContinuationSent)]) == 1
            assert await session_id(rig.session) == first_session
            assert tree_gone(rig.epoch(2))


# ----------------------------------------------------------------------- proof holds


async def assert_held_on_identity_then_aborted(rig: FenceRig) -> None:
    """The guards fail on ``process_identity``: the lane holds, the worker is alive and was
    not signalled (it still answers), nothing was fenced; the operator's abort ends the task
    and the epoch's tree is stopped as the lane leaves it."""
    await rig.runner.submit(rig.spec())
    await rig.until(lambda: rig.runner.show(TASK).hold_reason is not None)
    view = rig.runner.show(TASK)
    assert view.classification == "StalledOperatorRequired"
    assert view.hold_reason is not None
    assert view.hold_reason.startswith("guard:")
    assert "process_identity" in view.hold_reason.removeprefix("guard:").split(",")
    true = rig.epoch(1)
    assert true.pid in alive_with_nonce(true.nonce)
    worker = rig.lane.worker
    assert worker is not None
    state = await worker.rpc.request({"type": "get_state"})  # alive and not stopped
    assert state is not None
    records = await rig.records()
    actions = [r for r in records if isinstance(r, OutboxAction)]
    assert not any(a.kind in ("fence", "signal", "reap", "reserve") for a in actions)
    assert not any(isinstance(r, EpochFenced) for r in records)
    assert "Fencing" not in rig.classifications()
    assert 1 not in rig.workers.reports  # never stopped
    await rig.runner.abort(TASK, "the operator gave up")
    ended = await rig.runner.wait(TASK)
    assert ended.state == "aborted"
    assert rig.workers.reports[1].clean
    assert tree_gone(true)
    assert rig.workers.launched == [true]  # no replacement epoch


@pytest.mark.parametrize("kind", KINDS)
async def test_a_start_time_mismatch_holds_instead_of_killing(kind: str, tmp_path: Path) -> None:
    """PID reuse: the recorded start time is not the live process's, so the recorded pid may
    be someone else's now — the lane must hold, never signal it."""

    def reused(record: EpochStarted) -> EpochStarted:
        return msgspec.structs.replace(record, start_time=record.start_time + 1)

    with trio.fail_after(LIMIT):
        async with open_fence_rig(
            tmp_path, kind, [SILENT, done()], identity_override=reused
        ) as rig:
            await assert_held_on_identity_then_aborted(rig)


async def test_a_stale_wrapper_report_with_another_nonce_holds(tmp_path: Path) -> None:
    """The record names the right pid (and start time) but another epoch's nonce — a stale
    report: the process is not proven to be this epoch's, so the lane holds."""

    def stale(record: EpochStarted) -> EpochStarted:
        return msgspec.structs.replace(record, nonce=new_nonce())

    with trio.fail_after(LIMIT):
        async with open_fence_rig(
            tmp_path,
            "fake",
            [done()],
            behaviours=WEDGED_BEFORE_FIRST_REQUEST,
            identity_override=stale,
        ) as rig:
            await assert_held_on_identity_then_aborted(rig)


# --------------------------------------------------------------------------- many lanes


async def test_two_lanes_on_one_runner_each_have_their_own_gate(tmp_path: Path) -> None:
    """Two tasks at once on one runner (one socket directory): each lane's gate has its own
    socket, so each worker's task_done reaches its own lane and both end done at once."""
    tasks = ("task-a", "task-b")
    with trio.fail_after(LIMIT):
        async with open_fence_rig(tmp_path, "fake", DoneOnEveryPrompt()) as rig:
            for task_id in tasks:
                worktree = tmp_path / task_id  # one live task per worktree (TL13)
                worktree.mkdir()
                spec = msgspec.structs.replace(
                    rig.spec(prompt=f"do {task_id}"), task_id=task_id, worktree=str(worktree)
                )
                await rig.runner.submit(spec)
            for task_id in tasks:
                ended = await rig.runner.wait(task_id)
                assert ended.state == "done", (task_id, ended)
                records = (await rig.store.read(rig.runner.log_rel(task_id))).records
                receipts = [r for r in records if isinstance(r, LifecycleReceipt)]
                assert [(r.kind, r.accepted, r.epoch) for r in receipts] == [("done", True, 1)]
                assert not any(isinstance(r, ContinuationSent) for r in records)
    assert len(rig.workers.launched) == 2
