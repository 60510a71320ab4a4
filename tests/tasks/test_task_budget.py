"""The replacement budget is charged for what happened (WD11 of ``docs/design/watchdog.md``):
each test tries to make a lane charge a replacement epoch or recovery time for a launch that
never came, or leave one that did uncharged. In-process Fake-Pi on virtual time
(``io_autojump_clock``); a host restart (or a crash: the state directory as it was at one
instant) is a second runner on the same state directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import trio

from fake_pi._behaviours import Behaviours
from fake_pi.scenario import Step
from runtime._boundary._calls import GateCall
from runtime._boundary._tools import EffectLedger
from runtime._clock import Clocks
from runtime._journal._store import open_store
from runtime._linux._proctree import new_nonce
from runtime._records import ContinuationSent, EpochStarted, OutboxAction, Record
from runtime._tasks import _replacement
from runtime._tasks._lane import TaskLane
from runtime._tasks._watchdog import WatchdogPolicy
from runtime._tasks._workers import Stopped

from ..task_harness import TASK, done, effect, open_rig, say, wait

pytestmark = pytest.mark.trio

HELD = "StalledOperatorRequired"


def actions(records: list[Record], kind: str) -> list[OutboxAction]:
    return [r for r in records if isinstance(r, OutboxAction) and r.kind == kind]


async def append_lane_record(tmp_path: Path, clocks: Clocks, rel: str, record: Record) -> None:
    async with open_store(tmp_path / "state", clocks=clocks) as store:
        subject = (await store.read(rel)).header.subject
        log = await store.open_lane_log(subject)
        await log.append(record)
        await store.close_log(log)


def recorded_epoch(epoch: int) -> EpochStarted:
    """A record of ``epoch``'s tree, as a process worker leaves one (the in-process double
    leaves none): what a resume kills from (TL12)."""
    return EpochStarted(
        epoch=epoch, pid=1, start_time=1, boot_id="b", nonce=new_nonce(), started_ms=0
    )


# ------------------------------------- WD11, TL12: a resume that launches nothing charges nothing


async def test_wd11_resuming_a_waiting_task_held_for_survivors_charges_nothing(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WD11, TL12, LK5: the worker asks (``task_wait``) and runs on; after the LK9 grace it
    is stopped, and its stop leaves survivors, so the waiting task holds ``survivors:<pids>``.
    The host restarts; the operator resumes, and the kill from the epoch's record proves the
    tree gone. The task waits for its reply — no worker is launched, so nothing may be
    charged: no ``reserve``, no recovery time, the budget untouched (before, the resume
    prepared a replacement of the waiting worker: one epoch charged, a recovery started and
    charged, and no launch — the reply's epoch was never a replacement). The reply then
    wakes an epoch of its own, uncharged (TL9), and the task ends done."""
    steps: list[Step] = [wait(), say("I asked"), done(), say()]
    behaviours = {1: Behaviours(at={"after_tool:1": "hang"})}  # the turn runs on after the wait
    async with open_rig(
        tmp_path, clocks, steps, behaviours=behaviours, survivors={1: (4242,)}
    ) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        view = rig.runner.show(TASK)
        assert (view.state, view.hold_reason) == ("waiting", "survivors:4242")
        log = rig.runner.log_rel(TASK)
    await append_lane_record(tmp_path, clocks, log, recorded_epoch(1))

    async def the_kill_proves_it_gone(lane: TaskLane, record: EpochStarted) -> Stopped:
        return Stopped(True, ())

    monkeypatch.setattr(TaskLane, "_kill_leftovers", the_kill_proves_it_gone)
    async with open_rig(tmp_path, clocks, steps[1:]) as rig:
        assert rig.runner.show(TASK).hold_reason == "survivors:4242"  # WD12
        rig.runner.resume(TASK)
        await rig.until(lambda: rig.runner.show(TASK).classification != HELD, within=60)
        await trio.sleep(3600)  # an hour on: still waiting, nothing launched or charged
        view = rig.runner.show(TASK)
        records = await rig.records()
        assert (view.state, view.classification) == ("waiting", "WaitingUser")
        assert rig.workers.launched == []
        assert actions(records, "reserve") == []
        assert actions(records, "recovery_time") == []
        assert (view.budget["epochs_used"], view.budget["seconds_used"]) == (0, 0)
        assert view.continuation_epoch == 0
        await rig.runner.reply(TASK, "the blue one")
        ended = await rig.ended(TASK)
        records = await rig.records()
        view = rig.runner.show(TASK)
    assert ended.state == "done"
    assert rig.workers.launched == [2]  # the reply's epoch, once
    assert actions(records, "reserve") == []
    assert view.budget["epochs_used"] == 0


async def held_for_survivors_with_the_budget_spent(
    tmp_path: Path, clocks: Clocks, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Step], WatchdogPolicy]:
    """A task whose one replacement epoch is spent (epoch 1 exited, epoch 2 replaced it), whose
    epoch 2 asks (``task_wait``) and whose stop leaves survivors: it holds ``survivors:4242``,
    waiting. Its host stopped; for the next start, the kill of the leftovers proves the tree
    gone. The steps and policy the next start runs with (from ``steps[2:]``)."""
    steps: list[Step] = [say("working"), wait(), say("I asked"), done(), say()]
    behaviours = {
        1: Behaviours(at={"after_model:1": "exit:0"}),
        2: Behaviours(at={"after_tool:1": "hang"}),
    }
    policy = WatchdogPolicy(max_replacements=1)
    async with open_rig(
        tmp_path, clocks, steps, policy=policy, behaviours=behaviours, survivors={2: (4242,)}
    ) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        view = rig.runner.show(TASK)
        assert (view.state, view.hold_reason) == ("waiting", "survivors:4242")
        assert view.budget["epochs_left"] == 0
        log = rig.runner.log_rel(TASK)
    await append_lane_record(tmp_path, clocks, log, recorded_epoch(2))

    async def the_kill_proves_it_gone(lane: TaskLane, record: EpochStarted) -> Stopped:
        return Stopped(True, ())

    monkeypatch.setattr(TaskLane, "_kill_leftovers", the_kill_proves_it_gone)
    return steps, policy


async def test_wd11_a_waiting_task_whose_budget_is_spent_is_not_held_for_budget_by_a_resume(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WD11, TL12, LK5: the task's one replacement epoch is spent (epoch 1 exited, epoch 2
    replaced it), then epoch 2 asks and runs on, and its stop leaves survivors: the waiting
    task holds ``survivors:<pids>``. After a restart the operator resumes it and the kill
    proves the tree gone. Nothing is to be replaced, so the spent budget is no reason to
    hold: the task waits for its reply, and the reply's epoch launches uncharged (before,
    the resume prepared a replacement and held the task ``budget_exhausted:epochs`` — a
    hold for a charge nothing needed, which only a grant would have lifted)."""
    steps, policy = await held_for_survivors_with_the_budget_spent(tmp_path, clocks, monkeypatch)
    async with open_rig(tmp_path, clocks, steps[2:], policy=policy) as rig:
        rig.runner.resume(TASK)
        await rig.until(lambda: rig.runner.show(TASK).hold_reason != "survivors:4242", within=60)
        view = rig.runner.show(TASK)
        assert (view.state, view.classification, view.hold_reason) == (
            "waiting",
            "WaitingUser",
            None,
        )
        await rig.runner.reply(TASK, "the blue one")
        ended = await rig.ended(TASK)
        records = await rig.records()
        view = rig.runner.show(TASK)
    assert ended.state == "done"
    assert rig.workers.launched == [3]
    assert len(actions(records, "reserve")) == 1  # epoch 2's, the one replacement
    assert view.budget["epochs_used"] == 1


# ------------------------------- WD11, LK6: an abort during a replacement's preparation


@pytest.mark.parametrize(
    ("read", "charged"),
    [
        pytest.param(1, 0, id="before_the_reserve"),
        pytest.param(2, 1, id="after_the_reserve"),
    ],
)
async def test_wd11_an_abort_while_a_replacement_is_prepared_charges_only_a_reserve_made_open(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    read: int,
    charged: int,
) -> None:
    """WD11, LK6, TL8: epoch 1 exits without a terminal, so a replacement is prepared; while
    the lane reads the route and session (``route_problem``, a read off the loop) the
    operator aborts the task. Before the reserve (the first read, the last await before the
    charge) the abort means no launch will ever be attempted: nothing may be charged — no
    ``reserve``, the budget untouched (before, the reserve was written after the abort was
    decided: the ended task showed a replacement epoch spent on a launch nobody would make).
    After the reserve (the second read) the charge was made while the task was open, before
    its launch, and stands — never refunded: a refund would be a second write a crash could
    cut. Either way the preparation stops there: nothing more is written for the ended task
    (no attestation, no hold) and no worker is launched."""
    reads: list[int] = []
    route_problem = _replacement.route_problem

    async def aborted_during(lane: Any) -> str | None:
        problem = await route_problem(lane)
        reads.append(1)
        if len(reads) == read:
            await rig.runner.abort(TASK, "the operator gave up")
        return problem

    monkeypatch.setattr(_replacement, "route_problem", aborted_during)
    behaviours = {1: Behaviours(at={"after_model:1": "exit:0"})}
    async with open_rig(
        tmp_path, clocks, [say("working"), done(), say()], behaviours=behaviours
    ) as rig:
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        records = await rig.records()
        view = rig.runner.show(TASK)
    assert ended.state == "aborted"
    assert len(reads) == read  # no read after the abort: the preparation stopped there
    assert rig.workers.launched == [1]
    assert len(actions(records, "reserve")) == charged
    assert view.budget["epochs_used"] == charged
    assert [a.action_id for a in actions(records, "attest")] == ["task-1/g1/a1/e1/attest"]
    assert actions(records, "hold") == []
    assert actions(records, "recovery_time") == []


# --------------------------- WD11, TL6: a crash between any two writes is still charged

CRASHES = [
    # (when the operator aborts: the route read of the preparation, or never;
    #  the write after which the host crashes: record tag or action:kind:state, its pass)
    pytest.param(None, "epoch_fenced", 1, id="no_abort-after_the_exit"),
    pytest.param(None, "action:reserve:done", 1, id="no_abort-after_the_reserve"),
    pytest.param(None, "action:attest:done", 2, id="no_abort-after_the_attestation"),
    pytest.param(None, "action:launch:reserved", 2, id="no_abort-after_the_launch_reserved"),
    pytest.param(None, "action:launch:done", 2, id="no_abort-after_the_launch"),
    pytest.param(1, "lifecycle_receipt", 1, id="abort_before_the_reserve-after_its_receipt"),
    pytest.param(2, "action:reserve:done", 1, id="abort_after_the_reserve-after_the_reserve"),
    pytest.param(2, "lifecycle_receipt", 1, id="abort_after_the_reserve-after_its_receipt"),
]


@pytest.mark.parametrize(("abort_at", "point", "nth"), CRASHES)
async def test_wd11_a_crash_between_any_two_writes_of_a_replacement_charges_it_once(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    abort_at: int | None,
    point: str,
    nth: int,
) -> None:
    """WD11, TL6, LK6: epoch 1 exits without a terminal and a replacement is prepared —
    with the operator's abort during its route read before the reserve, after it, or none.
    The host crashes right after one write (the state directory as it was at that instant
    is what the next host starts on). Whatever the write: a replacement that launches was
    charged once, before its launch — a reserve found is reused, never charged again, and
    none is launched without one (the skip of a charge for an aborted task never lets a
    restart loop uncharged: a restart that does not find the abort durable charges as any
    replacement) — and a task that ends aborted keeps exactly the charges written while it
    was open (none when the abort came before the reserve)."""
    route_problem = _replacement.route_problem
    reads: list[int] = []

    async def aborted_during(lane: Any) -> str | None:
        problem = await route_problem(lane)
        reads.append(1)
        if len(reads) == abort_at:
            await first.runner.abort(TASK, "the operator gave up")
        return problem

    append = TaskLane.append
    passes: list[str] = []

    async def crash_after(lane: TaskLane, record: Record) -> int:
        seq = await append(lane, record)
        label = (
            f"action:{record.kind}:{record.state}"
            if isinstance(record, OutboxAction)
            else str(record.__struct_config__.tag)
        )
        passes.append(label)
        if label == point and passes.count(label) == nth:  # the host dies here
            shutil.copytree(tmp_path / "state", tmp_path / "crashed")
        return seq

    monkeypatch.setattr(_replacement, "route_problem", aborted_during)
    monkeypatch.setattr(TaskLane, "append", crash_after)
    behaviours = {1: Behaviours(at={"after_model:1": "exit:0"})}
    steps: list[Step] = [say("working"), done(), say()]
    async with open_rig(tmp_path, clocks, steps, behaviours=behaviours) as first:
        await first.runner.submit(first.spec())
        await first.ended(TASK)
    assert (tmp_path / "crashed").is_dir(), passes
    monkeypatch.setattr(_replacement, "route_problem", route_problem)
    monkeypatch.setattr(TaskLane, "append", append)
    async with open_rig(tmp_path, clocks, steps[1:], state="crashed") as rig:
        ended = await rig.ended(TASK)
        records = await rig.records()
        view = rig.runner.show(TASK)
    reserves = [a.action_id for a in actions(records, "reserve")]
    sent = [r.action_id for r in records if isinstance(r, ContinuationSent)]
    aborted = abort_at is not None and point != "action:reserve:done"
    assert ended.state == ("aborted" if aborted else "done")
    assert len(set(reserves)) == len(reserves)  # one charge per continuation
    assert view.budget["epochs_used"] == len(reserves)
    assert [s.replace("/prompt", "/reserve") for s in sent] == reserves[: len(sent)]
    if aborted:  # the charges written while the task was open, and nothing launched after
        assert len(reserves) == (abort_at or 0) - 1
        assert rig.workers.launched == []
    else:  # the replacement: launched once more after the crash, charged once in all
        assert reserves == ["task-1/g1/a1/c1/reserve"]
        assert sent == ["task-1/g1/a1/c1/prompt"]
        assert len(rig.workers.launched) == 1


# ------------------- WD11: a recovery an operator's resume started runs across a restart


async def test_wd11_a_recovery_started_by_a_resume_runs_across_a_host_restart(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WD11: a replacement held for a possibly-run effect (its reserve charged, its recovery
    ended and charged at the hold) is resumed by the operator: the continuation goes out on
    the reserve charged before, and a new recovery runs from the resume — no reserve marks
    its start. The relaunched worker is silent for 600 s and the host dies. The restart
    must go on counting from the resume, as it does from a reserve's ``at_ms``: a restart
    never resets the recovery clock, so the 600 s are charged (before, the resume's start
    was in memory only: the restart counted from its own reserve, and the 600 s the
    relaunched worker never progressed were never charged)."""
    calls: list[str] = []
    ledger_call = EffectLedger.__call__

    async def applied_then_hangs(ledger: EffectLedger, call: GateCall, intent_id: str) -> Any:
        calls.append(intent_id)
        result = await ledger_call(ledger, call, intent_id)
        if len(calls) == 1:
            await trio.sleep_forever()  # the effect is applied; its outcome never comes
        return result

    monkeypatch.setattr(EffectLedger, "__call__", applied_then_hangs)
    behaviours = {2: Behaviours(at={"agent_start:1": "hang"})}  # the relaunched one: silent
    async with open_rig(tmp_path, clocks, [effect("k"), say()], behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).hold_reason == "silent_in_tool_phase")
        rig.runner.resume(TASK)
        await rig.until(lambda: rig.runner.show(TASK).hold_reason == "effect_possibly_ran:effect")
        charged = [a.detail["seconds"] for a in actions(await rig.records(), "recovery_time")]
        assert len(charged) == 1  # the fence's recovery, ended at the hold
        rig.runner.resume(TASK)  # the operator continues: on the reserve charged before
        await rig.until(lambda: rig.workers.launched == [1, 2])
        resumed = clocks.wall.time_ms()
        await trio.sleep(600)  # the relaunched worker says nothing; then the host dies
        assert rig.runner.show(TASK).classification == "Resuming"
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        ended = await rig.ended(TASK)
        records = await rig.records()
        view = rig.runner.show(TASK)
    assert ended.state == "done"
    charges = actions(records, "recovery_time")
    assert len(charges) == 2
    assert charges[1].detail["from_ms"] <= resumed  # from the resume, not from the restart
    assert charges[1].detail["seconds"] >= 600
    assert view.budget["seconds_used"] >= charged[0] + 600
    assert len(actions(records, "reserve")) == 2  # the fence's, and the restart's (TL7)
