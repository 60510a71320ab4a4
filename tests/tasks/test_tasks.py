"""Task lanes in-process (issue #8): Fake-Pi as a task of this Trio run, virtual time.

Every test runs on ``autojump_clock``: a 20-minute stall takes milliseconds, and nothing
sleeps on the real clock. The numbered invariants (WD…, LK…, TL…) are in
``docs/design/watchdog.md``.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from fake_pi._behaviours import Behaviours
from fake_pi.scenario import Call, Hang, HttpError, Step, Text, ToolCalls
from runtime._boundary._calls import GateCall
from runtime._clock import Clocks, MockSilenceClock
from runtime._errors import ReasonCode, TaskError
from runtime._pi._rpc_protocol import Event
from runtime._records import (
    ContinuationSent,
    EpochStarted,
    LifecycleReceipt,
    ModelRequestIntent,
    ModelResponse,
    OutboxAction,
    Record,
    TaskReply,
    TaskSubmitted,
)
from runtime._tasks import _epoch
from runtime._tasks._lane import TaskLane
from runtime._tasks._lifecycle import LifecycleKernel, TaskState
from runtime._tasks._lifecycle_tools import lifecycle_tools
from runtime._tasks._session import session_size
from runtime._tasks._state import inference_costs, read_lane, submitted_record
from runtime._tasks._view import view_row
from runtime._tasks._watchdog import Watchdog, WatchdogPolicy
from runtime._wire import TaskSpec

from .._cancelling import cancelled_once
from ..task_harness import ROUTE, TASK, done, effect, fail, open_rig, say, wait

pytestmark = pytest.mark.trio

HELD = "StalledOperatorRequired"


async def test_tl1_done_needs_the_whole_tuple_and_hands_back_a_candidate(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, clocks, [effect("write-file"), done(), say("finished")]) as rig:
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        assert ended.manifest_digest is not None
        assert ended.candidate is not None
        assert ended.candidate["manifest_digest"] == ended.manifest_digest
        view = rig.runner.show(TASK)
        assert view.state == "done"
        receipts = [r for r in await rig.records() if isinstance(r, LifecycleReceipt)]
        assert [(r.kind, r.accepted) for r in receipts] == [("done", True)]
        assert len(rig.effects()) == 1


async def test_lk1_fail_is_final_and_not_done(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, clocks, [fail("no way"), done(), say()]) as rig:
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        assert ended.state == "failed"
        assert ended.candidate is None
        receipts = [r for r in await rig.records() if isinstance(r, LifecycleReceipt)]
        assert receipts[0].kind == "fail"
        assert receipts[0].accepted


async def test_wd3_a_wedged_provider_is_fenced_after_hard_and_grace_and_resumed_in_the_same_session(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """The first request hangs with no output (provider phase): Suspect at 300 s with one
    probe, nothing at 899 s, fenced only after 900 + 120 s, resumed on the same session with
    one continuation prompt, and the task ends on an explicit done."""
    steps: list[Step] = [Hang(seconds=10_000), done(), say("finished")]
    async with open_rig(tmp_path, clocks, steps) as rig:
        start = trio.current_time()
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        records = await rig.records()
        fence = next(r for r in records if isinstance(r, OutboxAction) and r.kind == "fence")
        assert fence is not None
        assert rig.classifications()[:4] == ["Active", "Suspect", "HardResumeEligible", "Fencing"]
        assert "Resuming" in rig.classifications()
        markers = [r for r in records if isinstance(r, ContinuationSent)]
        assert len(markers) == 1
        assert sum(isinstance(r, OutboxAction) and r.kind == "reserve" for r in records) == 1
        probes = [r for r in records if isinstance(r, OutboxAction) and r.kind == "probe"]
        assert [p.detail["purpose"] for p in probes] == ["soft", "fence"]
        assert trio.current_time() - start >= 900 + 120
        assert rig.workers.launched == [1, 2]
        view = rig.runner.show(TASK)
        assert view.budget["epochs_used"] == 1


async def test_wd8_settled_without_a_terminal_gets_one_completion_prompt_at_once(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, clocks, [say("I think I am done"), done(), say()]) as rig:
        start = trio.current_time()
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        assert trio.current_time() - start < 300  # no waiting for the soft threshold
        records = await rig.records()
        assert len([r for r in records if isinstance(r, ContinuationSent)]) == 1
        assert "NeedsFinalization" in rig.classifications()
        assert rig.workers.launched == [1]


async def test_lk5_wait_parks_and_only_the_reply_wakes(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, clocks, [wait(), say("asked"), done(), say()]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        await trio.sleep(3 * 3600)  # hours of waiting: nothing happens
        view = rig.runner.show(TASK)
        assert view.state == "waiting"
        assert view.classification == "WaitingUser"
        assert view.process is None  # parked: no worker
        with pytest.raises(TaskError) as refused:
            await rig.runner.reply(TASK, "the blue one", correlation="not-the-wait")
        assert refused.value.code == ReasonCode.TASK_NOT_WAITING
        await rig.runner.reply(TASK, "the blue one")
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        assert rig.workers.launched == [1, 2]


async def test_wd4_unknown_silence_in_a_tool_is_held_never_fenced(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    behaviours = {1: Behaviours(at={"before_tool:1": "hang"})}
    async with open_rig(
        tmp_path, clocks, [effect("k"), done(), say()], behaviours=behaviours
    ) as rig:
        await rig.runner.submit(rig.spec())
        await trio.sleep(4 * 3600)
        view = rig.runner.show(TASK)
        assert view.classification == "StalledOperatorRequired"
        assert rig.workers.launched == [1]
        await rig.runner.abort(TASK, "operator gave up")
        ended = await rig.ended(TASK)
        assert ended.state == "aborted"


async def test_wd2_a_slow_first_token_is_suspect_then_recovers_without_a_fence(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    steps: list[Step] = [Text(text="slow but fine", first_token_delay=600), done(), say()]
    async with open_rig(tmp_path, clocks, steps) as rig:
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        assert "Suspect" in rig.classifications()
        assert rig.workers.launched == [1]
        assert rig.runner.show(TASK).telemetry["false_suspects"] >= 1
        records = await rig.records()
        assert not any(isinstance(r, OutboxAction) and r.kind == "fence" for r in records)
        assert sum(isinstance(r, EpochStarted) for r in records) == 0  # in-process: no pid


# ------------------------------------------------------------------ the clocks, end to end


async def test_wd2_wd3_exact_times_suspect_at_300_eligible_only_after_900_plus_grace(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    steps: list[Step] = [Hang(seconds=10_000), done(), say()]
    async with open_rig(tmp_path, clocks, steps) as rig:
        start = trio.current_time()
        await rig.runner.submit(rig.spec())
        await rig.ended(TASK)
        suspect = rig.first("Suspect")
        eligible = rig.first("HardResumeEligible")
        fencing = rig.first("Fencing")
        assert suspect is not None
        assert eligible is not None
        assert fencing is not None
        assert suspect - start == pytest.approx(300, abs=5)  # one tick of overshoot at most
        assert eligible - start == pytest.approx(1020, abs=5)
        assert fencing >= eligible


async def test_wd1_a_20_minute_run_with_a_token_every_4_minutes_is_never_suspect(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    slow = Text(text="one two three four five six", delay=240)  # 20 minutes of tokens
    async with open_rig(tmp_path, clocks, [slow, done(), say()]) as rig:
        start = trio.current_time()
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        assert trio.current_time() - start >= 20 * 60
        assert "Suspect" not in rig.classifications()
        assert rig.runner.show(TASK).telemetry["max_inter_token_gap_seconds"] == pytest.approx(240)


async def test_wd6_a_suspend_makes_it_suspect_at_once_but_hard_time_counts_awake_after_wake(
    tmp_path: Path,
    clocks: Clocks,
    silence_clock: MockSilenceClock,
    io_autojump_clock: trio.testing.MockClock,
) -> None:
    steps: list[Step] = [Hang(seconds=10_000), done(), say()]
    async with open_rig(tmp_path, clocks, steps) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).phase == "generation")
        await trio.sleep(10)
        silence_clock.suspend(1500)  # the host sleeps 25 minutes
        wake = trio.current_time()
        await rig.until(lambda: rig.first("Suspect") is not None)
        suspect = rig.first("Suspect")
        assert suspect is not None
        assert suspect - wake <= 5
        await rig.ended(TASK)
        eligible = rig.first("HardResumeEligible")
        assert eligible is not None
        assert eligible - wake >= 1020


# ---------------------------------------------------------------- provider lifecycle, exits


async def test_wd8_a_provider_retry_is_not_settled_and_gets_no_completion_prompt(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, clocks, [HttpError(), done(), say()]) as rig:
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        assert not [r for r in await rig.records() if isinstance(r, ContinuationSent)]
        assert "NeedsFinalization" not in rig.classifications()


@pytest.mark.parametrize("action", ["exit:0", "exit:3", "kill"])
async def test_wd8_an_exit_without_a_terminal_resumes_the_same_session_at_once(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock, action: str
) -> None:
    """The exit code decides nothing: 0, 3 and a kill all enter NeedsFinalization and get one
    completion prompt in a replacement epoch, without waiting for the soft threshold."""
    behaviours = {1: Behaviours(at={"after_model:1": action})}
    steps: list[Step] = [say("working on it"), done(), say()]
    async with open_rig(tmp_path, clocks, steps, behaviours=behaviours) as rig:
        start = trio.current_time()
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        assert trio.current_time() - start < 300
        assert rig.workers.launched == [1, 2]
        assert "NeedsFinalization" in rig.classifications()
        records = await rig.records()
        assert len([r for r in records if isinstance(r, ContinuationSent)]) == 1
        view = rig.runner.show(TASK)
        assert (view.attempt, view.generation) == (1, 1)  # domain isolation: same attempt
        assert view.budget["epochs_used"] == 1


# ------------------------------------------------------------------------ budget, operator


async def test_wd11_budget_exhaustion_holds_and_a_grant_charges_once(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    wedged = Behaviours(at={"before_model:1": "hang"})
    behaviours = dict.fromkeys(range(1, 5), wedged)  # epochs 1-4 wedge before asking
    async with open_rig(tmp_path, clocks, [done(), say()], behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(
            lambda: (
                (rig.runner.show(TASK).hold_reason or "").startswith("budget_exhausted")
                or "budget" in (rig.runner.show(TASK).hold_reason or "")
            )
        )
        view = rig.runner.show(TASK)
        assert view.classification == "StalledOperatorRequired"
        assert view.budget["epochs_used"] == 3
        assert view.budget["epochs_left"] == 0
        assert rig.workers.launched == [1, 2, 3, 4]
        await rig.runner.grant(TASK, epochs=1, reason="one more try")
        rig.workers.behaviours = {}
        rig.runner.resume(TASK)
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        records = await rig.records()
        grants = [r for r in records if isinstance(r, OutboxAction) and r.kind == "grant"]
        assert len(grants) == 1
        assert rig.runner.show(TASK).budget["epochs_used"] == 4


async def test_wd11_a_hold_for_spent_recovery_seconds_ends_the_recovery_a_resume_needs_a_grant(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """WD11: the relaunched worker never progresses, so its recovery outlasts the seconds
    left and the task holds ``budget_exhausted:recovery_seconds`` with that worker alive.
    The hold ends the recovery: its seconds are charged at once (``task show`` says so), so
    the operator's resume is refused by the budget guard (``guard:budget_left``) — nothing
    launched, nothing charged, no overdue recovery handed to a new worker — until a grant;
    then the resume starts a recovery of its own and the task ends done."""
    behaviours = {
        1: Behaviours(at={"before_model:1": "hang"}),  # fenced after hard + grace
        2: Behaviours(at={"agent_start:1": "hang"}),  # relaunched, never progresses
    }
    async with open_rig(tmp_path, clocks, [done(), say()], behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        spent = "budget_exhausted:recovery_seconds"
        await rig.until(lambda: rig.runner.show(TASK).hold_reason == spent)
        view = rig.runner.show(TASK)
        assert rig.runner.lane(TASK).live  # holding never kills (TL9)
        assert view.budget["seconds_left"] == 0
        records = await rig.records()
        (charged,) = [
            r for r in records if isinstance(r, OutboxAction) and r.kind == "recovery_time"
        ]
        assert charged.detail["seconds"] >= 1800
        rig.runner.resume(TASK)
        await rig.until(lambda: rig.runner.show(TASK).hold_reason == "guard:budget_left")
        await trio.sleep(3600)
        assert rig.workers.launched == [1, 2]
        assert rig.runner.show(TASK).budget["epochs_used"] == 1
        await rig.runner.grant(TASK, seconds=600, reason="one more look")
        rig.runner.resume(TASK)
        ended = await rig.ended(TASK)
    assert ended.state == "done"
    assert rig.workers.launched == [1, 2, 3]


async def test_wd11_a_restart_after_its_recovery_ran_out_holds_before_it_charges_or_launches(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """WD11, TL7: a worker is fenced and its replacement runs without progress; the host stops
    and is down longer than the recovery's seconds (the time it was down is recovery time).
    Tries to break: the restart taken as one more replacement of an overdue recovery — an
    epoch of the budget charged, a worker launched only to be held at its first tick, and the
    operator's resume then killing it and charging again. Expected: the restarted host holds
    the task ``budget_exhausted:recovery_seconds`` at once, nothing charged (one reserve: the
    fence's), nothing launched; the recovery charged from the fence's reserve; a grant and a
    resume then finish the task on one more epoch."""
    behaviours = {
        1: Behaviours(at={"before_model:1": "hang"}),  # fenced after hard + grace
        2: Behaviours(at={"agent_start:1": "hang"}),  # relaunched, never progresses
    }
    async with open_rig(tmp_path, clocks, [done(), say()], behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.workers.launched == [1, 2] and rig.runner.lane(TASK).live)
    await trio.sleep(2000)  # (virtual time) the host is down past the 1800 s
    spent = "budget_exhausted:recovery_seconds"
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        await rig.until(lambda: rig.runner.show(TASK).hold_reason == spent)
        await trio.sleep(60)  # (virtual time) anything the lane would do after the hold, done
        records = await rig.records()
        view = rig.runner.show(TASK)
        assert rig.workers.launched == []
        reserves = [r for r in records if isinstance(r, OutboxAction) and r.kind == "reserve"]
        assert len(reserves) == 1, reserves
        assert view.budget["epochs_used"] == 1
        (charged,) = [
            r for r in records if isinstance(r, OutboxAction) and r.kind == "recovery_time"
        ]
        assert charged.detail["from_ms"] == reserves[0].detail["at_ms"]
        await rig.runner.grant(TASK, seconds=600, reason="back after the outage")
        rig.runner.resume(TASK)
        ended = await rig.ended(TASK)
    assert ended.state == "done"
    assert rig.workers.launched == [3]


async def test_wd11_a_charge_made_while_a_grant_is_written_is_not_refunded(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WD11: a grant adds to the budget as it is once recorded. The lane charges recovery
    time while the grant's record is being written (its own ``_end_recovery``): that charge
    stays — a grant applied to the budget read before its write would refund it — and two
    grants at once are two actions, both counted."""
    record_action = TaskLane.record_action

    async def charged_meanwhile(
        lane: TaskLane, action_id: str, kind: str, state: str, detail: Any = None
    ) -> None:
        if kind == "grant":
            lane.recovery.budget = lane.recovery.budget.charge_seconds(5.0)
        await record_action(lane, action_id, kind, state, detail)

    async with open_rig(tmp_path, clocks, [wait(), say("asked")]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        monkeypatch.setattr(TaskLane, "record_action", charged_meanwhile)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: rig.runner.grant(TASK, epochs=1, reason="one"))
            nursery.start_soon(lambda: rig.runner.grant(TASK, seconds=60, reason="two"))
        budget = rig.runner.show(TASK).budget
        records = await rig.records()
    assert budget["seconds_used"] == 10.0  # the two charges made meanwhile, kept
    assert (budget["granted_epochs"], budget["granted_seconds"]) == (1, 60.0)
    grants = [r for r in records if isinstance(r, OutboxAction) and r.kind == "grant"]
    assert sorted(g.detail["reason"] for g in grants) == ["one", "two"]


async def test_wd11_a_session_append_seen_by_a_probe_ends_the_recovery(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WD11: the recovery ends at the resumed worker's first progress, whichever way the
    progress is seen. Here the resumed worker says nothing for 400 s after its prompt, and
    its session grows while the soft probe runs: that append is its first progress (WD1),
    and the recovery is charged once. (Found by scripts/flake-hunt: a crash test's resumed
    worker, slow under load, was first seen alive by a probe; the recovery was never
    charged and never ended.)"""
    slow_start = Behaviours(at={"agent_start:1": "delay:400"})
    steps: list[Step] = [Hang(seconds=10_000), done(), say("finished")]
    grown = 0

    async def size(path: Path) -> int:
        nonlocal grown
        if rig.workers.launched[-1] == 2:  # the resumed epoch: its session grows meanwhile
            grown += 1
        return await session_size(path) + grown

    monkeypatch.setattr(_epoch, "session_size", size)
    async with open_rig(tmp_path, clocks, steps, behaviours={2: slow_start}) as rig:
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        records = await rig.records()
        relaunch = next(i for i, r in enumerate(records) if isinstance(r, ContinuationSent))
        probes = [r for r in records[relaunch:] if isinstance(r, OutboxAction)]
        assert any(r.kind == "probe" and r.detail["evidence"] for r in probes)
        charges = [r for r in records if isinstance(r, OutboxAction) and r.kind == "recovery_time"]
        assert len(charges) == 1, charges
        assert rig.runner.show(TASK).telemetry["resume_latency_seconds"], "it never ended"


async def test_wd11_a_terminal_read_before_the_resumed_workers_events_ends_the_recovery(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WD11: the resumed worker's task_done reaches the gate before the runtime has read any
    of its stdout events (a loaded host reads its pipe late): that call is its first
    progress, and the recovery is charged once. (Found by scripts/flake-hunt under load,
    after the probe's case was fixed.)"""
    steps: list[Step] = [Hang(seconds=10_000), done(), say("finished")]
    see = _epoch.EpochWatch._see

    async def late(watch: _epoch.EpochWatch, event: Event) -> _epoch.EpochEnd | None:
        lane = watch.lane
        if rig.workers.launched[-1] == 2:  # the resumed epoch: its events wait for the gate
            await rig.until(lambda: lane.kernel.state is not TaskState.OPEN)
        return await see(watch, event)

    monkeypatch.setattr(_epoch.EpochWatch, "_see", late)
    async with open_rig(tmp_path, clocks, steps) as rig:
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        records = await rig.records()
        charges = [r for r in records if isinstance(r, OutboxAction) and r.kind == "recovery_time"]
        assert len(charges) == 1, charges
        assert rig.runner.show(TASK).telemetry["resume_latency_seconds"], "it never ended"


async def test_wd11_read_lane_keeps_the_open_recovery_and_its_charges() -> None:
    """The lane's durable state: a reserve starts a recovery (its ``at_ms``), a later reserve
    does not restart it, a charge ends it; the budget adds every charge."""
    policy = WatchdogPolicy()
    submitted = submitted_record(
        TaskSpec(task_id=TASK, prompt="p", worktree="/"), route=ROUTE, policy=policy, now_ms=0
    )

    def reserve(n: int, at_ms: int) -> OutboxAction:
        detail = {"epochs": 1, "at_ms": at_ms}
        return OutboxAction(
            action_id=f"t/c{n}/reserve", kind="reserve", state="done", detail=detail
        )

    def charge(n: int, seconds: float) -> OutboxAction:
        detail = {"seconds": seconds}
        return OutboxAction(action_id=f"t/r{n}", kind="recovery_time", state="done", detail=detail)

    state = read_lane(submitted, [reserve(1, 1_000), reserve(2, 5_000)], policy)
    assert (state.recovery_started_ms, state.recoveries) == (1_000, 0)
    state = read_lane(submitted, [reserve(1, 1_000), charge(1, 30.0), reserve(2, 9_000)], policy)
    assert (state.recovery_started_ms, state.recoveries) == (9_000, 1)
    assert state.budget.used_seconds == 30.0
    assert state.budget.used_epochs == 2
    state = read_lane(submitted, [reserve(1, 1_000), charge(1, 30.0), charge(2, 12.5)], policy)
    assert (state.recovery_started_ms, state.recoveries) == (None, 2)
    assert state.budget.used_seconds == 42.5


async def test_tl10_inference_costs_keep_the_task_and_its_continuations_apart() -> None:
    """Domain isolation: answers after a continuation prompt are the continuation's until the
    user's next reply; a step asked again without an answer, or never answered, is counted
    as a request without answer (possibly paid); replays write no response, never counted."""

    def usage(prompt: int, completion: int) -> str:
        return json.dumps({"choices": [], "usage": {"prompt_tokens": prompt,
                                                    "completion_tokens": completion}})  # fmt: skip

    def ask(step: int) -> ModelRequestIntent:
        return ModelRequestIntent(step=step, request_digest=f"d{step}", epoch=1)

    def answer(step: int, *chunks: str) -> ModelResponse:
        return ModelResponse(step=step, request_digest=f"d{step}", chunks=list(chunks), epoch=1)

    marker = ContinuationSent(epoch=1, action_id="c1", marker="m", prompt_version=1)
    records: list[Record] = [
        ask(0), answer(0, '{"choices": []}', usage(10, 5)),
        marker,
        ask(1), ask(1), answer(1, usage(20, 7)),
        TaskReply(correlation="w", text="yes"),
        ask(2), answer(2, "not json", '{"choices": []}'),
        ask(3),
    ]  # fmt: skip
    assert inference_costs(records) == {
        "task": {"answers": 2, "prompt_tokens": 10, "completion_tokens": 5},
        "continuation": {"answers": 1, "prompt_tokens": 20, "completion_tokens": 7},
        "requests_without_answer": 2,
    }


async def test_wd4_an_operator_resume_of_a_held_task_fences_and_resumes_once(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    behaviours = {1: Behaviours(at={"before_tool:1": "hang"})}
    async with open_rig(
        tmp_path, clocks, [effect("k"), done(), say()], behaviours=behaviours
    ) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).classification == "StalledOperatorRequired")
        rig.runner.resume(TASK)
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        assert rig.workers.launched == [1, 2]
        records = await rig.records()
        assert len([r for r in records if isinstance(r, ContinuationSent)]) == 1
        with pytest.raises(TaskError) as refused:
            rig.runner.resume(TASK)
        assert refused.value.code == ReasonCode.TASK_ENDED


# ------------------------------------------------------------------- outcomes and evidence


async def test_lk3_lk1_a_second_lifecycle_call_is_late_evidence(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    both = ToolCalls(
        calls=[
            Call(name="task_done", arguments={"summary": "first"}),
            Call(name="task_fail", arguments={"reason": "second"}),
        ]
    )
    async with open_rig(tmp_path, clocks, [both, say()]) as rig:
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        receipts = [r for r in await rig.records() if isinstance(r, LifecycleReceipt)]
        assert [(r.kind, r.accepted, r.verdict) for r in receipts] == [
            ("done", True, "accepted"),
            ("fail", False, "late_terminal"),
        ]


async def test_lk4_a_failing_validation_keeps_the_task_from_done(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    check = (sys.executable, "-c", "import sys; sys.exit(4)")
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        await rig.runner.submit(rig.spec(validation=check))
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        view = rig.runner.show(TASK)
        assert view.state == "success_intent"  # held, not ended: the operator decides (LK10)
        assert view.hold_reason == "finalization_incomplete:validation"
        (attempt,) = [a for a in await rig.records() if isinstance(a, OutboxAction)
                      and a.kind == "finalize"]  # fmt: skip
        assert attempt.detail["code"] == ReasonCode.TASK_NOT_DONE
        assert attempt.detail["validation"]["exit_status"] == 4
        assert attempt.detail["candidate"] is not None  # it survives for the operator


async def test_lk4_a_passing_validation_is_part_of_done(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    check = (sys.executable, "-c", "import pathlib; assert pathlib.Path('README.md').exists()")
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        await rig.runner.submit(rig.spec(validation=check))
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        assert ended.validation is not None
        assert ended.validation["manifest_digest"] == ended.manifest_digest


async def test_tl1_the_validation_timeout_is_part_of_the_task(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """The validation's bound is the submitter's (default 600 s), recorded with the task; the
    same id with another bound is another task."""
    async with open_rig(tmp_path, clocks, [wait(), say()]) as rig:
        await rig.runner.submit(rig.spec(validation=("true",), validation_timeout=42.5))
        (submitted,) = [r for r in await rig.records() if isinstance(r, TaskSubmitted)]
        assert submitted.validation_timeout == 42.5
        with pytest.raises(TaskError) as conflict:
            await rig.runner.submit(rig.spec(validation=("true",), validation_timeout=60))
        assert conflict.value.code == ReasonCode.TASK_CONFLICT
        assert rig.spec().validation_timeout == 600.0


async def test_tl9_an_ended_task_keeps_only_its_view_and_its_end(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """A long-lived runner lets an ended task's lane go (its kernel, watchdog, journals):
    show, tasks, wait, a duplicate submit and a refused control are answered from its last
    view and its end record."""
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        await rig.until(lambda: TASK not in rig.runner.lanes)
        gc.collect()
        assert not [o for o in gc.get_objects() if isinstance(o, TaskLane)]
        assert rig.runner.ended[TASK].ended == ended
        assert rig.runner.show(TASK).state == "done"
        assert [view.task_id for view in rig.runner.tasks()] == [TASK]
        assert await rig.ended(TASK) == ended
        assert (await rig.runner.submit(rig.spec())).state == "done"
        with pytest.raises(TaskError) as late:
            await rig.runner.abort(TASK)
        assert late.value.code == ReasonCode.TASK_ENDED
        with pytest.raises(TaskError) as conflict:
            await rig.runner.submit(rig.spec(prompt="another task"))
        assert conflict.value.code == ReasonCode.TASK_CONFLICT


async def test_tl1_submission_is_idempotent_and_refuses_bad_input(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, clocks, [wait(), say()]) as rig:
        first = await rig.runner.submit(rig.spec())
        again = await rig.runner.submit(rig.spec())
        assert first.task_id == again.task_id
        assert len([r for r in await rig.records() if type(r).__name__ == "TaskSubmitted"]) == 1
        with pytest.raises(TaskError) as conflict:
            await rig.runner.submit(rig.spec(prompt="another task"))
        assert conflict.value.code == ReasonCode.TASK_CONFLICT
        bad: list[tuple[dict[str, Any], str]] = [
            ({"task_id": "../x", "prompt": "p", "worktree": str(rig.worktree)}, "task_invalid"),
            ({"task_id": "t2", "prompt": " ", "worktree": str(rig.worktree)}, "task_invalid"),
            ({"task_id": "t3", "prompt": "p", "worktree": "relative"}, "task_invalid"),
            ({"task_id": "t4", "prompt": "p", "worktree": str(tmp_path / "nope")},
             "worktree_missing"),
            ({"task_id": "t5", "prompt": "p", "worktree": str(rig.worktree), "x": 1},
             "task_invalid"),
            ({"task_id": "t6", "prompt": "p", "worktree": str(rig.worktree),
              "grants": ["rm_rf"]}, "task_invalid"),
            *(({"task_id": "t7", "prompt": "p", "worktree": str(rig.worktree),
                "validation_timeout": seconds}, "task_invalid")
              for seconds in (0, -1.0, float("inf"), float("nan"), 86_401)),
        ]  # fmt: skip
        for spec, code in bad:
            with pytest.raises(TaskError) as refused:
                await rig.runner.submit(spec)
            assert refused.value.code == code, spec
        with pytest.raises(TaskError) as unknown:
            rig.runner.show("nobody")
        assert unknown.value.code == ReasonCode.TASK_UNKNOWN


async def test_a_task_row_is_its_views_overview_at_every_stage(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """``TaskRunner.rows()`` (the operator page's table, built without the views) says what
    ``view_row(show())`` says — silent and suspect, waiting, held by an operator's abort —
    and so do ``rows(task_ids)`` and ``ends()``, which the page builds its state from (OP6)."""

    def same() -> None:  # no await between the two: the clocks stand still
        rows = rig.runner.rows()
        assert rows == [view_row(view) for view in rig.runner.tasks()]
        # what the page orders by (OP6), and the rows of the tasks it names, say the same
        assert rig.runner.ends() == {row["task_id"]: row["ended"] is not None for row in rows}
        assert rig.runner.rows([TASK, "nobody"]) == rows

    async with open_rig(tmp_path, clocks, [Hang(seconds=3600), wait(), say("asked")]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).classification == "Suspect")
        row = rig.runner.rows()[0]
        assert row["silence_seconds"] >= row["soft_seconds"] > 0
        same()
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        same()
        await rig.runner.abort(TASK, "enough")
        await rig.ended(TASK)
        same()
        assert rig.runner.rows()[0]["ended"] == "aborted"


# ------------------------------------------- LK1: a decided terminal is durable, whoever cancels


class _HeldOwner:
    """A lane as the lifecycle tools see it, whose appends wait for ``release``."""

    def __init__(self, writing: trio.Event, release: trio.Event) -> None:
        self.kernel = LifecycleKernel(TASK)
        assert self.kernel.begin_epoch(1, fenced=False)
        self.watchdog = Watchdog(policy=WatchdogPolicy())
        self.records: list[Record] = []
        self._writing, self._release = writing, release

    def gate_epoch(self) -> int:
        return 1

    async def append(self, record: Record) -> int:
        self._writing.set()
        await self._release.wait()  # the call is cancelled meanwhile
        self.records.append(record)
        return len(self.records)

    async def resumed_progress(self) -> None:
        await trio.lowlevel.checkpoint()

    def changed(self) -> None:
        pass


async def test_lk1_a_terminal_accepted_as_its_call_is_cancelled_is_still_recorded() -> None:
    """LK1: the kernel accepts the worker's ``task_done`` — the task's state is decided — and
    its receipt is written next. A call cancelled during that write (its epoch ending: the
    gate's requests with it) must not leave the kernel terminal with no receipt in the log, a
    state a restart would not find: the receipt is written whole."""
    writing, release = trio.Event(), trio.Event()
    owner = _HeldOwner(writing, release)
    tool = lifecycle_tools(owner)["task_done"]
    call = GateCall("c1", "task_done", {"summary": "all tests pass"})
    await cancelled_once(writing, lambda: tool(call, "intent-1"), then=release)
    assert owner.kernel.state is TaskState.SUCCESS_INTENT
    assert [type(r) for r in owner.records] == [LifecycleReceipt]


# -------------------------------- LK9: a quiesce stands on what the kernel says after its write


class _QuiescingLane:
    """A lane as the epoch's LK9 look sees it: the user's reply accepted and not yet heard by
    the worker; the prompt carrying it reaches the worker while the quiesce is written."""

    def __init__(self) -> None:
        self.kernel = LifecycleKernel(TASK)
        assert self.kernel.begin_epoch(1, fenced=False)
        self.kernel.reply_pending = True  # as ``reply`` leaves it (LK8)
        self.policy = WatchdogPolicy(grace_seconds=0.0)
        self.actions: list[str] = []

    def epoch_action_id(self, kind: str) -> str:
        return f"e1/{kind}"

    async def record_action(
        self, action_id: str, kind: str, state: str, detail: dict[str, Any] | None = None
    ) -> None:
        await trio.lowlevel.checkpoint()
        self.kernel.reply_heard()  # the epoch's other task sent the reply's prompt meanwhile
        self.actions.append(action_id)


async def test_lk9_a_reply_heard_while_its_quiesce_is_written_calls_the_quiesce_off() -> None:
    """LK9, LK8: the worker has not settled to receive the user's reply past the grace, so the
    epoch decides to stop it and writes the quiesce. Meanwhile the reply's prompt reaches the
    worker: it is working on the reply now. The decision is read again after the write, and
    the worker is not stopped."""
    lane = _QuiescingLane()
    watch = _epoch.EpochWatch(lane, None)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        watch._nursery = nursery
        quiesced = await watch._quiesced(0.0)
    assert lane.actions == ["e1/quiesce"]
    assert not quiesced
    assert watch.end is None
