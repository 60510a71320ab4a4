"""Task lanes under races (an adversarial review): each test puts one event — an operator's
control, a park's wait — in the window of one await of the lane and checks that the branch
after it acts only on proof read after that await (``docs/design/watchdog.md``, WD10, WD11,
WD13, LK6, LK8; ``docs/design/retention.md`` PB6). In-process Fake-Pi on virtual time
(``io_autojump_clock``); a host restart is a second runner on the same state directory.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from fake_pi._behaviours import Behaviours
from fake_pi.scenario import Call, Hang, Step, ToolCalls
from runtime._boundary._calls import GateCall
from runtime._boundary._tools import EffectLedger
from runtime._clock import Clocks
from runtime._config import BackoffConfig
from runtime._pi._rpc import RpcChannel
from runtime._pi._session import parse_session
from runtime._records import (
    EpochFenced,
    OutboxAction,
    Parked,
    Record,
    ToolIntent,
    ToolOutcome,
)
from runtime._tasks import _epoch
from runtime._tasks._lane import TaskLane
from runtime._tasks._lifecycle import TaskState
from runtime._tasks._runner import open_task_runner
from runtime._tasks._session import marker_in_session

from .. import task_harness
from ..task_harness import TASK, done, effect, open_rig, say, wait

pytestmark = pytest.mark.trio

HELD = "StalledOperatorRequired"


def actions(records: list[Record], kind: str) -> list[OutboxAction]:
    return [r for r in records if isinstance(r, OutboxAction) and r.kind == kind]


def user_texts(requests: list[Any]) -> list[str]:
    """Every user message of every model request, in order."""
    return [
        str(message.get("content"))
        for request in requests
        for message in request.body.get("messages", [])
        if message.get("role") == "user"
    ]


def applied_then_hangs(calls: list[str]) -> Callable[..., Awaitable[Any]]:
    """The ``effect`` tool's ledger that applies the first call's effect and then hangs
    before its outcome (for ever); each call's intent id goes into ``calls``."""
    ledger_call = EffectLedger.__call__

    async def applied(ledger: EffectLedger, call: GateCall, intent_id: str) -> Any:
        calls.append(intent_id)
        result = await ledger_call(ledger, call, intent_id)
        if len(calls) == 1:
            await trio.sleep_forever()  # the effect is applied; its outcome never comes
        return result

    return applied


async def decided_meanwhile(lane: TaskLane, nursery: trio.Nursery, reason: str) -> None:
    """Start the operator's abort of ``lane``'s task and return once the kernel has decided
    it — its receipt is still being written, so the watchdog has not been told yet."""
    nursery.start_soon(functools.partial(lane.abort, reason))
    while lane.kernel.state is TaskState.OPEN:
        await trio.lowlevel.checkpoint()


# ------------------------------------------ WD10: the fence's guards, read after its last await


async def test_wd10_an_abort_decided_during_the_fences_last_guard_read_stops_the_fence(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WD10 (no terminal reservation), TL8: a wedged worker is eligible, every guard held and
    the reserve is written; while the guards are read again (the session and the route: a
    read off the loop), the operator aborts the task. The kernel has decided — its receipt is
    being written — when the read returns: the fence must stand on the kernel as it is then,
    not on the one read before that await. The task ends aborted and nothing is fenced."""
    route_problem = TaskLane.route_problem
    reads: list[int] = []

    async def abort_during_the_second_read(lane: TaskLane) -> str | None:
        problem = await route_problem(lane)
        reads.append(1)
        if len(reads) == 2:  # the guards read again after the reserve: the last await
            await decided_meanwhile(lane, nursery, "the operator gave up")
        return problem

    monkeypatch.setattr(TaskLane, "route_problem", abort_during_the_second_read)
    steps: list[Step] = [Hang(seconds=100_000), done(), say("finished")]
    async with open_rig(tmp_path, clocks, steps) as rig, trio.open_nursery() as nursery:
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        records = await rig.records()
    assert len(reads) >= 2
    assert ended.state == "aborted"
    assert actions(records, "fence") == []  # never fenced on the stale "no terminal"
    assert [(r.epoch, r.reason) for r in records if isinstance(r, EpochFenced)] == [(1, "terminal")]
    assert rig.workers.launched == [1]


# ------------------------------ PB6, WD11: a park's wait after a restart is not recovery time


async def test_pb6_wd11_a_restart_while_parked_charges_the_restart_never_the_outages_wait(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PB6, WD11: a host dies while its task is parked on an unavailable provider, the next
    try due in 250 s. The restarted host charges its replacement (TL7) and waits out the
    recorded schedule before it prompts the new worker (PB2) — that wait is the outage's, not
    recovery: the recovery time charged is the restart's own (seconds), not the 250 s the
    worker was made to wait for the provider."""
    async with open_rig(tmp_path, clocks, [Hang(seconds=100_000)]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until_logged(lambda log: any(a.state == "done" for a in actions(log, "launch")))
        now = clocks.wall.time_ms()
        park = Parked(attempt=1, first_failure_ms=now, next_attempt_ms=now + 250_000,
                      status=503, code="model_failed", route_failures=1)  # fmt: skip
        await rig.runner.lane(TASK).park(park)  # (the gateway's park, as its turn settled)
    backoff = BackoffConfig(first_seconds=5.0, max_seconds=300.0)
    monkeypatch.setattr(
        task_harness, "open_task_runner", functools.partial(open_task_runner, backoff=backoff)
    )
    restarted = trio.current_time()
    async with open_rig(tmp_path, clocks, [done(), say("finished")]) as rig:  # the host restarts
        ended = await rig.ended(TASK)
        records = await rig.records()
        view = rig.runner.show(TASK)
    assert ended.state == "done"
    assert trio.current_time() - restarted >= 250  # the schedule was kept (PB2)
    assert len(actions(records, "reserve")) == 1  # the restart's replacement (TL7)
    charged = [a.detail["seconds"] for a in actions(records, "recovery_time")]
    assert charged, records
    assert sum(charged) < 10, charged  # never the 250 s of the outage
    assert view.budget["seconds_used"] < 10


# --------------------------------- LK6: a live worker of an ended task is prompted no more


async def test_lk6_an_abort_during_a_completion_prompts_marker_check_prompts_nothing(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LK6, TL8: the worker settles without a lifecycle call, so its completion prompt is
    due (WD8); while the lane looks for that prompt's marker in the session (a read off the
    loop, the last await before the prompt), the operator aborts the task. The task is over:
    the live worker must not be prompted — its next model request would be paid for a task
    nobody runs any more, and the prompt would arm the watchdog of an ended task again."""
    aborted: list[bool] = []

    async def aborted_meanwhile(
        session: Path, action_id: str, *, wants: bool = False
    ) -> bool | None:
        present = await marker_in_session(session, action_id, wants=wants)
        if action_id.endswith("/completion") and not aborted:
            aborted.append(True)
            await rig.runner.abort(TASK, "the operator gave up")
        return present

    prompt = RpcChannel.prompt
    prompts: list[str] = []

    async def counted(channel: RpcChannel, message: str, **kwargs: Any) -> Any:
        prompts.append(message)
        return await prompt(channel, message, **kwargs)

    monkeypatch.setattr(_epoch, "marker_in_session", aborted_meanwhile)
    monkeypatch.setattr(RpcChannel, "prompt", counted)
    async with open_rig(tmp_path, clocks, [say("I think I am done"), done(), say()]) as rig:
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        records = await rig.records()
    assert aborted == [True]
    assert ended.state == "aborted"
    assert prompts == ["do the task"]  # the task's own prompt; no completion prompt after
    assert actions(records, "hold") == []  # and no hold of an ended task


# ------------------------------------ LK8, TL5: a reply whose marker cannot be read holds


async def test_lk8_a_reply_to_a_live_worker_whose_marker_cannot_be_read_holds_and_is_kept(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LK8, TL5, WD12: the user replies while the worker's turn still runs; at its settle the
    lane would send the reply to the live worker, but the session cannot be read to look for
    the reply's marker (an I/O error). Whether the worker has it is unknown: the task holds
    ``prompt_marker_unknown:<the reply's action>`` — and stays held, the reply kept for the
    operator's resume — instead of taking the reply for sent: it was not, and the next
    worker's continuation would not carry it (the reply lost), nor the watchdog of a worker
    that was asked nothing run on to fence it."""
    reply_id = f"{TASK}/g1/a1/reply1"

    async def unreadable_for_the_reply(
        session: Path, action_id: str, *, wants: bool = False
    ) -> bool | None:
        if action_id == reply_id:
            return None  # the session cannot say
        return await marker_in_session(session, action_id, wants=wants)

    monkeypatch.setattr(_epoch, "marker_in_session", unreadable_for_the_reply)
    behaviours = {1: Behaviours(at={"after_tool:1": "delay:30"})}
    steps: list[Step] = [wait(), say("I asked"), done(), say()]
    async with open_rig(tmp_path, clocks, steps, behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        await rig.runner.reply(TASK, "the blue one")
        await trio.sleep(2 * 3600)  # hours: it stays held, nothing is fenced or relaunched
        view = rig.runner.show(TASK)
        records = await rig.records()
        assert (view.state, view.classification, view.hold_reason) == (
            "open",
            HELD,
            f"prompt_marker_unknown:{reply_id}",
        )
        assert actions(records, "fence") == []
        assert rig.workers.launched == [1]
        assert not any("the blue one" in t for t in user_texts(rig.model.requests))
        rig.runner.resume(TASK)  # the operator's resume: the next worker carries the reply
        ended = await rig.ended(TASK)
    assert ended.state == "done"
    assert rig.workers.launched == [1, 2]
    assert len({t for t in user_texts(rig.model.requests) if "the blue one" in t}) == 1


# ------------- WD13, T12: a resumed epoch's runtime tool in flight (the carried "409" item)


async def test_wd13_a_runtime_effect_in_flight_when_its_epoch_is_resumed_is_never_run_again(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WD13, T12 (the carried "a fenced epoch's tool call answered 409"): the runtime's
    ``effect`` tool has applied its effect and hangs before its outcome; the silent tool
    phase holds, and the operator resumes the live worker. The epoch's servers end with it,
    so the call in flight is cancelled, never answered late to anyone; the effect applied
    once, and a replacement holds for it (WD13: the operator resumed a silent tool, not a
    possibly-run effect); the operator's second resume continues on the same charged
    reserve, the call settled "possibly ran" — one outcome, recorded once — and the task
    ends done without running it again."""
    calls: list[str] = []
    monkeypatch.setattr(EffectLedger, "__call__", applied_then_hangs(calls))
    async with open_rig(tmp_path, clocks, [effect("k"), done(), say()]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        assert rig.runner.show(TASK).hold_reason == "silent_in_tool_phase"
        rig.runner.resume(TASK)  # the live worker is stopped; its effect may have run:
        await rig.until(  # WD13 holds for the operator's look at it
            lambda: rig.runner.show(TASK).hold_reason == "effect_possibly_ran:effect"
        )
        rig.runner.resume(TASK)  # the operator continues: the call is settled "possibly ran"
        ended = await rig.ended(TASK)
        records = await rig.records()
    assert ended.state == "done"
    assert len(calls) == 1  # applied once, never again
    assert len(rig.effects()) == 1
    (intent,) = [r for r in records if isinstance(r, ToolIntent) and r.name == "effect"]
    outcomes = [r for r in records if isinstance(r, ToolOutcome)]
    (mine,) = [o for o in outcomes if o.intent_id == intent.intent_id]  # recorded once
    assert mine.is_error
    assert "possibly ran" in json.dumps(mine.content)
    assert len(actions(records, "reserve")) == 1  # one replacement, charged once
    assert rig.workers.launched == [1, 2]


# ------------ TL8, WD13: a resume asked again while the first is carried out is no consent


async def test_tl8_a_resume_asked_again_while_the_live_worker_is_stopped_is_no_consent(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TL8, WD13 (a control racing the lane's own decision): the ``effect`` tool applied its
    effect and hangs; the silent tool phase holds and the operator resumes the live worker.
    While that resume is carried out — the worker's tree being stopped, the task still shown
    held ``silent_in_tool_phase`` — the operator's client asks again (a retry). That second
    resume was asked of the hold the first one is resolving, never of the
    ``effect_possibly_ran`` hold the replacement then decides: it must not be taken for the
    operator's look at the possibly-run effect (before, it was answered, left its wake-up,
    and the lane parked on the new hold only to find it and continue past the effect, forced,
    with nobody having seen that hold). The task holds ``effect_possibly_ran:effect`` until
    a resume asked of that hold."""
    calls: list[str] = []

    record_action = TaskLane.record_action
    retried: list[bool] = []

    async def retried_during_the_stop(
        lane: TaskLane, action_id: str, kind: str, state: str, detail: Any = None
    ) -> None:
        if kind == "signal" and state == "reserved":  # the first resume is carried out
            retried.append(lane.resume())  # the client's retry: answered True before
        await record_action(lane, action_id, kind, state, detail)

    monkeypatch.setattr(EffectLedger, "__call__", applied_then_hangs(calls))
    monkeypatch.setattr(TaskLane, "record_action", retried_during_the_stop)
    async with open_rig(tmp_path, clocks, [effect("k"), done(), say()]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        assert rig.runner.show(TASK).hold_reason == "silent_in_tool_phase"
        rig.runner.resume(TASK)  # the live worker is stopped; its effect may have run
        await trio.sleep(2 * 3600)  # hours: the possibly-run effect stays held
        view = rig.runner.show(TASK)
        assert retried == [False]  # the retry is not a second resume
        assert (view.classification, view.hold_reason) == (HELD, "effect_possibly_ran:effect")
        assert rig.workers.launched == [1]
        rig.runner.resume(TASK)  # the operator's look at the effect: continue, possibly ran
        ended = await rig.ended(TASK)
    assert ended.state == "done"
    assert len(calls) == 1  # applied once, never again
    assert len(rig.effects()) == 1
    assert rig.workers.launched == [1, 2]


# ---------- LK8, TL5: a marker counts only in the prompt that carries it, never in a quote


async def test_lk8_a_marker_quoted_by_a_tool_result_is_not_the_reply_delivered(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LK8, TL5 (an adversary's session): the worktree holds a file that quotes a reply
    marker — this project's own tests and docs do — and the worker reads it in the turn
    that asks the user. The user replies mid-turn; at the settle the lane looks for the
    reply's marker before it sends the reply. The quote, inside a tool's result, is not the
    prompt that carries the reply: the worker was never sent it. Before, any entry holding
    the marker's text counted, the reply was taken for delivered and never sent — the task
    ended done without the user's answer. The reply reaches the worker once."""
    reply_id = f"{TASK}/g1/a1/reply1"
    behaviours = {1: Behaviours(at={"after_tool:2": "delay:30"})}
    steps: list[Step] = [
        ToolCalls(calls=[Call(name="read", arguments={"path": "NOTES.md"})]),
        wait(),
        say("I asked"),
        done(),
        say(),
    ]
    async with open_rig(tmp_path, clocks, steps, behaviours=behaviours) as rig:
        quote = f"a prompt begins [pi-runtime reply v1 {reply_id}]\n"
        (rig.worktree / "NOTES.md").write_text(quote)
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        await rig.runner.reply(TASK, "the blue one")
        ended = await rig.ended(TASK)
    assert ended.state == "done"
    assert len({t for t in user_texts(rig.model.requests) if "the blue one" in t}) == 1


# ------------- WD1, WD10: a session grown during the fence's guard check is progress, no hold


async def test_wd10_a_session_append_during_the_fences_guard_check_is_progress_not_a_hold(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WD1, WD10: a wedged worker is eligible and its quiet fence probe asked for the guards;
    while they are read (the session and route, off the loop), the worker appends to its
    session — its event still in the pipe. A grown session is progress (WD1: the probe
    counts it so); it proves the worker is not stalled: no fence, and no hold either — a
    working worker is no operator's case. Before, the grown session was a failed guard
    (``guard:session_unchanged``): the task was held, its clocks stopped, an operator called
    for a worker that was working. Here the worker wedges for good after the append, so its
    next eligibility fences it and the task ends done."""
    route_problem = TaskLane.route_problem
    grown: list[int] = []

    async def the_worker_appends_during_the_first_read(lane: TaskLane) -> str | None:
        if not grown:
            grown.append(1)
            with lane.session.open("ab") as f:  # what the worker wrote (a whole entry)
                session = parse_session(lane.session.read_bytes()).require_clean()
                entry = session.new_entry({"type": "custom", "customType": "note"}, time_ms=1)
                f.write(entry.raw_line + b"\n")
        return await route_problem(lane)

    monkeypatch.setattr(TaskLane, "route_problem", the_worker_appends_during_the_first_read)
    steps: list[Step] = [Hang(seconds=100_000), done(), say("finished")]
    async with open_rig(tmp_path, clocks, steps) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until_logged(lambda log: bool(actions(log, "fence") or actions(log, "hold")))
        assert actions(await rig.records(), "hold") == []  # never held: it was working
        ended = await rig.ended(TASK)
        records = await rig.records()
    assert grown == [1]
    assert ended.state == "done"
    assert actions(records, "hold") == []
    assert len(actions(records, "fence")) == 1  # the second eligibility's
    assert rig.workers.launched == [1, 2]
