"""Task lanes act only on proof (issue #17): each test tries to break one rule of
``docs/design/watchdog.md`` — a hold holds, a proof is re-checked, nothing relaunches on a
guess, nothing a person said is lost. In-process Fake-Pi on virtual time
(``io_autojump_clock``); a host restart is a second runner on the same state directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from fake_pi._behaviours import Behaviours
from fake_pi.model_server import ScriptedModel
from fake_pi.scenario import Hang, Step
from runtime._clock import Clocks
from runtime._errors import ReasonCode, TaskError, WorkerError
from runtime._journal._journal import read_log
from runtime._journal._store import lane_key
from runtime._linux._fs import OsFileSystem
from runtime._pi._session import parse_session
from runtime._pi._session_files import create_session
from runtime._records import (
    ContinuationSent,
    EpochFenced,
    EpochStarted,
    LifecycleReceipt,
    OutboxAction,
    Record,
    TaskEnded,
    TaskReply,
)
from runtime._tasks._epoch import EpochEnd, EpochWatch
from runtime._tasks._lane import TaskLane
from runtime._tasks._service import TaskService
from runtime._tasks._session import marker_in_session
from runtime._tasks._state import continuation_marker
from runtime._tasks._watchdog import Phase, Progress, WatchdogPolicy
from runtime._tasks._workers import EpochRequest, Stopped
from runtime.testing._in_process import InProcessWorkers

from .._cancelling import cancelled_once
from ..task_harness import ROUTE, TASK, Rig, done, effect, open_rig, say, wait

pytestmark = pytest.mark.trio

HELD = "StalledOperatorRequired"


def actions(records: list[Record], kind: str) -> list[OutboxAction]:
    return [r for r in records if isinstance(r, OutboxAction) and r.kind == kind]


# ---------------------------------------------------------------- TL12: never a second tree


async def test_tl12_an_exit_whose_tree_survived_holds_naming_the_pids_and_launches_nothing(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    behaviours = {1: Behaviours(at={"after_model:1": "exit:0"})}
    async with open_rig(
        tmp_path, clocks, [say("working"), done(), say()], behaviours=behaviours,
        survivors={1: (4242, 4243)},
    ) as rig:  # fmt: skip
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        await trio.sleep(3600)  # an hour later: still one epoch, still held
        view = rig.runner.show(TASK)
        assert (view.classification, view.hold_reason) == (HELD, "survivors:4242,4243")
        assert rig.workers.launched == [1]
        assert view.budget["epochs_used"] == 0  # nothing was reserved for a replacement
        rig.runner.resume(TASK)  # in-process epochs have no record to kill from: no proof
        await trio.sleep(60)
        assert rig.runner.show(TASK).hold_reason == "survivors:4242,4243"
        assert rig.workers.launched == [1]


async def test_tl12_a_restart_that_cannot_kill_the_last_epoch_holds_instead_of_relaunching(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    steps: list[Step] = [say("working"), say("more"), done(), say()]
    behaviours = {1: Behaviours(at={"after_model:1": "hang"})}
    async with open_rig(tmp_path, clocks, steps, behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.workers.launched == [1])
        log = rig.runner.log_rel(TASK)
    # The host died with epoch 1 running; its record names a process the restart cannot act
    # on (a record whose nonce is not one the runtime makes): nothing proves the tree gone.
    await _append_lane_record(
        tmp_path, clocks, log,
        EpochStarted(epoch=1, pid=1, start_time=1, boot_id="b", nonce="not-a-nonce",
                     started_ms=0),
    )  # fmt: skip
    async with open_rig(tmp_path, clocks, steps) as rig:
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        view = rig.runner.show(TASK)
        assert view.hold_reason == "survivors:1"
        assert rig.workers.launched == []  # no replacement on a guess


UNKILLABLE = EpochStarted(
    epoch=1, pid=1, start_time=1, boot_id="b", nonce="not-a-nonce", started_ms=0
)
"""A record of epoch 1 no kill can act on (its nonce is not one the runtime makes): a restart
that finds it cannot prove that epoch's tree gone."""


async def test_tl12_a_reply_after_a_restart_that_could_not_kill_the_waiting_worker_launches_nothing(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """TL12: the host dies while the task waits and its worker still runs (inside the LK9
    grace), and the restart cannot kill that worker's tree. The task still waits for its
    reply, but the epoch the reply wakes is not launched over a tree that may live: the task
    holds ``survivors:<pids>``, and an operator's resume kills again from the record and,
    without proof, holds again."""
    steps: list[Step] = [wait(), say("I asked"), done(), say()]
    behaviours = {1: Behaviours(at={"after_tool:1": "hang"})}  # the turn runs on after the wait
    async with open_rig(tmp_path, clocks, steps, behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        assert rig.runner.lane(TASK).live
        log = rig.runner.log_rel(TASK)
    await _append_lane_record(tmp_path, clocks, log, UNKILLABLE)
    async with open_rig(tmp_path, clocks, steps[1:]) as rig:
        assert rig.runner.show(TASK).state == "waiting"
        await rig.runner.reply(TASK, "the blue one")
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD, within=3600)
        await trio.sleep(3600)
        view = rig.runner.show(TASK)
        assert (view.state, view.hold_reason) == ("open", "survivors:1")
        assert rig.workers.launched == []
        rig.runner.resume(TASK)  # the kill from the record is tried again: still no proof
        await trio.sleep(60)
        assert rig.runner.show(TASK).hold_reason == "survivors:1"
        assert rig.workers.launched == []


async def test_tl12_a_resume_of_a_hold_restored_over_an_unkilled_tree_kills_before_it_launches(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """TL12, WD12: the host dies while the task is held with its worker alive, and the
    restart cannot kill that worker's tree. The restored hold stands; the operator's resume
    of it does not launch a second tree: it kills again from the record first and, without
    proof, holds ``survivors:<pids>``."""
    behaviours = {1: Behaviours(at={"before_tool:1": "hang"})}
    steps: list[Step] = [effect("k"), done(), say()]
    async with open_rig(tmp_path, clocks, steps, behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        held = rig.runner.show(TASK).hold_reason
        assert rig.runner.lane(TASK).live
        log = rig.runner.log_rel(TASK)
    await _append_lane_record(tmp_path, clocks, log, UNKILLABLE)
    async with open_rig(tmp_path, clocks, steps[1:]) as rig:
        assert rig.runner.show(TASK).hold_reason == held  # WD12: the recorded hold stands
        rig.runner.resume(TASK)
        await rig.until(lambda: rig.runner.show(TASK).hold_reason != held, within=3600)
        await trio.sleep(60)
        view = rig.runner.show(TASK)
        assert (view.classification, view.hold_reason) == (HELD, "survivors:1")
        assert rig.workers.launched == []
        records = await rig.records()
        assert actions(records, "reserve") == []  # nothing charged for a launch not made


async def _append_lane_record(tmp_path: Path, clocks: Clocks, rel: str, record: Record) -> None:
    from runtime._journal._store import open_store

    async with open_store(tmp_path / "state", clocks=clocks) as store:
        subject = (await store.read(rel)).header.subject
        log = await store.open_lane_log(subject)
        await log.append(record)
        await store.close_log(log)


# ------------------------------------------------ WD8: the shell never overrides the core


async def test_wd8_an_exit_after_the_completion_prompt_holds_as_the_core_decided(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    # Settles without a terminal, gets the completion prompt, then exits without one.
    behaviours = {1: Behaviours(at={"after_model:2": "exit:0"})}
    async with open_rig(
        tmp_path, clocks, [say("I think I am done"), say("still"), done(), say()],
        behaviours=behaviours,
    ) as rig:  # fmt: skip
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        await trio.sleep(3600)
        view = rig.runner.show(TASK)
        assert view.hold_reason == "no_terminal_after_completion_prompt:exited"
        assert rig.workers.launched == [1]
        records = await rig.records()
        assert len([r for r in records if isinstance(r, ContinuationSent)]) == 1


async def test_wd8_each_completion_prompt_of_an_epoch_is_its_own_so_a_reply_cannot_strand_it(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """WD8, TL5: the worker settles without a terminal and gets its completion prompt; it
    answers with ``task_wait``, the user replies in the same epoch (the reply wakes the count
    of completion prompts), and the worker settles on the reply without a terminal again.
    The second completion prompt is a prompt of its own (``e1/completion2``), sent — not
    taken for the first by its marker and dropped, which left a live idle worker disarmed in
    ``NeedsFinalization`` with nothing to end it — and the task ends done in the one epoch."""
    behaviours = {1: Behaviours(at={"after_tool:1": "delay:30"})}  # the reply comes mid-turn
    steps: list[Step] = [
        say("I think I am done"), wait(), say("I asked"), say("worked on it, no tool"),
        done(), say(),
    ]  # fmt: skip
    async with open_rig(tmp_path, clocks, steps, behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        await rig.runner.reply(TASK, "the blue one")
        ended = await rig.ended(TASK, within=3600)
        records = await rig.records()
    assert ended.state == "done"
    assert rig.workers.launched == [1]
    sent = [r.action_id for r in records if isinstance(r, ContinuationSent)]
    prefix = f"{TASK}/g1/a1"
    assert sent == [f"{prefix}/e1/completion", f"{prefix}/reply1", f"{prefix}/e1/completion2"]
    assert actions(records, "hold") == []


async def test_wd8_a_completion_prompt_its_marker_says_was_sent_holds_never_waits_forever(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """WD8, WD12, TL5: a completion prompt the core asked for whose marker the session
    already shows (here the task's own prompt begins with it, as that prompt would: only a
    prompt that begins with its marker counts, TL5) is not sent a second time — and the
    idle, disarmed worker is not left waiting for a prompt that never comes: the task holds,
    naming the prompt, for the operator, whose resume continues it."""
    marker = continuation_marker(f"{TASK}/g1/a1/e1/completion")
    async with open_rig(tmp_path, clocks, [say("I think I am done"), done(), say()]) as rig:
        await rig.runner.submit(rig.spec(f"{marker}\ndo the task"))
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD, within=3600)
        view = rig.runner.show(TASK)
        assert view.hold_reason == f"prompt_already_sent:{TASK}/g1/a1/e1/completion"
        assert rig.workers.launched == [1]
        rig.runner.resume(TASK)
        ended = await rig.ended(TASK, within=3600)
    assert ended.state == "done"
    assert rig.workers.launched == [1, 2]


# --------------------------------- TL2, WD8: a worker that dies before its prompt is an exit


@pytest.mark.parametrize("action", ["exit:1", "kill"])
async def test_wd8_a_worker_that_exits_before_it_answers_its_prompt_is_replaced_not_failed(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock, action: str
) -> None:
    """WD8, TL2, TL11: the first worker dies before it answers the task's prompt. That is an
    exit like any other — not the lane's failure (``task_lane_failed``) — so the task gets a
    replacement within the budget, whose continuation carries the task (no worker heard
    it: it is not in the session), and ends done; the worker's error is logged by code."""
    behaviours = {1: Behaviours(at={"prompt:1": action})}
    async with open_rig(tmp_path, clocks, [done(), say()], behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec("paint the shed blue"))
        ended = await rig.ended(TASK, within=3600)
        records = await rig.records()
    assert ended.state == "done"
    assert rig.workers.launched == [1, 2]
    assert len(actions(records, "reserve")) == 1  # a replacement, charged
    (sent,) = [r for r in records if isinstance(r, ContinuationSent)]
    assert sent.epoch == 2
    assert "paint the shed blue" in _user_texts(rig)[0]  # the continuation carries the task
    assert [line for line in rig.lines if "exited before it answered its prompt" in line]
    assert [line for line in rig.lines if "worker_launch_failed" in line]


async def test_wd11_replacements_that_die_before_their_prompt_are_each_charged_until_it_holds(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """WD11, TL6: every worker dies before it answers its prompt. Each replacement is
    charged (the continuation a dead worker never answered is spent, its marker recorded:
    the next is its own), so the budget runs out and the task holds — it never loops on
    one reserve for free, and never fails its lane."""
    behaviours = {n: Behaviours(at={"prompt:1": "exit:1"}) for n in range(1, 6)}
    async with open_rig(tmp_path, clocks, [done(), say()], behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD, within=3600)
        view = rig.runner.show(TASK)
        records = await rig.records()
        assert view.hold_reason == "budget_exhausted:epochs"
        assert rig.workers.launched == [1, 2, 3, 4]
        assert len(actions(records, "reserve")) == 3
        sent = [r.action_id for r in records if isinstance(r, ContinuationSent)]
        assert sent == [f"{TASK}/g1/a1/c{n}/prompt" for n in (1, 2, 3)]
        await rig.runner.abort(TASK)


async def test_tl2_a_launch_that_fails_in_the_workers_open_is_an_exit_not_a_lane_failure(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TL2, TL11, WD8: the first epoch's launch fails inside ``workers.open`` (the worker
    exited during its launch, ``worker_launch_failed``): the epoch ends as an exit — its
    launch recorded failed, with the code — and a replacement finishes the task."""
    opened = InProcessWorkers.open

    @contextlib.asynccontextmanager
    async def failing_launch(self: InProcessWorkers, request: EpochRequest) -> Any:
        if request.number == 1:
            await trio.lowlevel.checkpoint()
            raise WorkerError(ReasonCode.WORKER_LAUNCH_FAILED, "the worker exited during launch")
        async with opened(self, request) as worker:
            yield worker

    monkeypatch.setattr(InProcessWorkers, "open", failing_launch)
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK, within=3600)
        records = await rig.records()
    assert ended.state == "done"
    assert [r.epoch for r in records if isinstance(r, EpochFenced)] == [1, 2]
    launches = {a.action_id: a for a in actions(records, "launch")}  # each as it ended
    found = [(a.detail["epoch"], a.state, a.detail.get("code")) for a in launches.values()]
    assert found == [(1, "failed", "worker_launch_failed"), (2, "done", None)]
    assert [line for line in rig.lines if "prompt, so it is replaced: worker_launch_fa" in line]


async def test_lk8_a_reply_whose_worker_exits_before_it_answers_reaches_the_replacement_once(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """LK8, WD8, WD11: the user's reply starts epoch 2, whose worker dies before it answers
    the reply's prompt. The reply is not lost and not resent for free in a loop: a charged
    replacement's continuation carries it, once, and the task ends done."""
    behaviours = {2: Behaviours(at={"prompt:1": "exit:1"})}
    steps: list[Step] = [wait(), say("I asked"), done(), say()]
    async with open_rig(tmp_path, clocks, steps, behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        await rig.until(lambda: not rig.runner.lane(TASK).live)  # the worker is stopped (TL9)
        await rig.runner.reply(TASK, "the blue one")
        ended = await rig.ended(TASK, within=3600)
        records = await rig.records()
    assert ended.state == "done"
    assert rig.workers.launched == [1, 2, 3]
    assert _replies_sent(rig, "the blue one") == 1
    assert len(actions(records, "reserve")) == 1


# ----------------------------------------------------------- WD12: a hold outlives the host


async def test_wd12_a_hold_survives_a_restart_and_only_the_operator_lifts_it(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    steps: list[Step] = [say("I think I am done"), say("still"), done(), say()]
    behaviours = {1: Behaviours(at={"after_model:2": "exit:0"})}
    async with open_rig(tmp_path, clocks, steps, behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
    # The host restarts (its scripted model starts afresh: what the resumed worker will say).
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        await trio.sleep(3600)
        view = rig.runner.show(TASK)
        assert view.hold_reason == "no_terminal_after_completion_prompt:exited"
        assert rig.workers.launched == []  # not resumed on its own
        assert view.budget["epochs_used"] == 0
        rig.runner.resume(TASK)
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        assert rig.workers.launched == [2]
        records = await rig.records()
        holds = [(a.kind, a.detail["reason"]) for a in records if isinstance(a, OutboxAction)
                 and a.kind in ("hold", "unhold")]  # fmt: skip
        assert holds == [
            ("hold", "no_terminal_after_completion_prompt:exited"),
            ("unhold", "no_terminal_after_completion_prompt:exited"),
        ]
        assert len(actions(records, "reserve")) == 1  # the resume is charged once


# ------------------------------------------------- LK8: a reply is delivered exactly once


def _user_texts(rig: Rig) -> list[str]:
    """Every user message of every model request, in order (repeats across requests kept
    apart by request)."""
    texts: list[str] = []
    for request in rig.model.requests:
        for message in request.body.get("messages", []):
            if message.get("role") == "user":
                content = message.get("content")
                texts.append(content if isinstance(content, str) else str(content))
    return texts


def _replies_sent(rig: Rig, text: str) -> int:
    """How many distinct user messages carried ``text`` (a message repeats in every later
    request of the session; count it once)."""
    return len({t for t in _user_texts(rig) if text in t})


async def test_lk8_a_reply_before_the_settle_reaches_the_worker_once_and_no_completion_prompt(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    behaviours = {1: Behaviours(at={"after_tool:1": "delay:30"})}
    steps: list[Step] = [wait(), say("I asked"), done(), say()]
    async with open_rig(tmp_path, clocks, steps, behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        await rig.runner.reply(TASK, "the blue one")
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        assert _replies_sent(rig, "the blue one") == 1
        assert rig.workers.launched == [1]  # delivered to the live worker after its turn
        markers = [r.action_id for r in await rig.records() if isinstance(r, ContinuationSent)]
        assert markers == [f"{TASK}/g1/a1/reply1"]  # no completion prompt


async def test_lk8_a_reply_still_being_recorded_when_the_turn_settles_reaches_the_live_worker(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LK8: the reply is accepted while the worker's turn runs, and the turn settles while
    the reply's record is still being written. The settle must not be taken for one without
    a reply: the reply reaches the live worker once it is durable — not after the LK9 grace
    (120 s) stops the worker, in an epoch of its own."""
    behaviours = {1: Behaviours(at={"after_tool:1": "delay:30"})}
    steps: list[Step] = [wait(), say("I asked"), done(), say()]
    async with open_rig(tmp_path, clocks, steps, behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        lane = rig.runner.lane(TASK)
        worker = lane.worker
        assert worker is not None  # the turn runs on (delay:30 after the tool)
        append = TaskLane.append

        async def slow_reply_record(self: TaskLane, record: Record) -> int:
            if isinstance(record, TaskReply):  # the turn settles while this is written
                await worker.rpc.wait_settled(0)
                await trio.testing.wait_all_tasks_blocked()  # the epoch has seen the settle
            return await append(self, record)

        monkeypatch.setattr(TaskLane, "append", slow_reply_record)
        await rig.runner.reply(TASK, "the blue one")
        ended = await rig.ended(TASK)
        records = await rig.records()
    assert ended.state == "done"
    assert _replies_sent(rig, "the blue one") == 1
    assert rig.workers.launched == [1]  # delivered to the live worker after its turn
    assert actions(records, "quiesce") == []


async def cancelled_while_written(
    monkeypatch: pytest.MonkeyPatch,
    held: Callable[[Record], bool],
    control: Callable[[], Awaitable[object]],
) -> None:
    """Run ``control()`` as a caller that is cancelled (a client gone) while the lane writes
    the record ``held`` picks: that write is held 5 s of the virtual clock, the cancel lands
    meanwhile, and the control's outcome — an error or ``Cancelled`` — is dropped."""
    writing = trio.Event()
    append = TaskLane.append

    async def held_append(self: TaskLane, record: Record) -> int:
        if held(record):
            writing.set()
            await trio.sleep(5)  # the caller is cancelled meanwhile
        return await append(self, record)

    monkeypatch.setattr(TaskLane, "append", held_append)
    await cancelled_once(writing, control)


async def test_lk8_a_reply_whose_caller_is_cancelled_during_its_write_is_still_delivered(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LK8: the task is open once a reply is accepted, so the reply's write is not given up
    half-way when its caller is cancelled (a client gone): the reply is recorded and reaches
    the worker. Given up, the task would stay open with a reply pending that no prompt
    carries, and every report of the worker would be refused ``reply_pending``."""
    behaviours = {1: Behaviours(at={"after_tool:1": "delay:30"})}
    steps: list[Step] = [wait(), say("I asked"), done(), say()]
    async with open_rig(tmp_path, clocks, steps, behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        await cancelled_while_written(
            monkeypatch,
            lambda record: isinstance(record, TaskReply),
            lambda: rig.runner.reply(TASK, "the blue one"),
        )
        ended = await rig.ended(TASK)
        records = await rig.records()
    assert ended.state == "done"
    assert [r.text for r in records if isinstance(r, TaskReply)] == ["the blue one"]
    assert _replies_sent(rig, "the blue one") == 1


async def test_tl8_an_abort_whose_caller_is_cancelled_during_its_write_still_ends_the_task(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TL8: an operator's abort is decided (the task terminal) before its receipt is written;
    a caller cancelled during that write (a client gone) must not leave the decision without
    its receipt: the receipt is written whole and the running epoch is ended at once — not
    by the LK9 grace, two minutes on, with no receipt of who ended it."""
    behaviours = {1: Behaviours(at={"after_tool:1": "delay:600"})}  # the turn runs on
    async with open_rig(tmp_path, clocks, [effect("k"), say()], behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.lane(TASK).worker is not None)
        started = trio.current_time()
        await cancelled_while_written(
            monkeypatch,
            lambda record: isinstance(record, LifecycleReceipt) and record.kind == "abort",
            lambda: rig.runner.abort(TASK, "stop it"),
        )
        ended = await rig.ended(TASK)
        took = trio.current_time() - started
        records = await rig.records()
    assert ended.state == "aborted"
    receipts = [(r.kind, r.detail) for r in records if isinstance(r, LifecycleReceipt)]
    assert receipts == [("abort", "stop it")]
    assert actions(records, "quiesce") == []
    assert took < 60  # not the LK9 grace (120 s)


async def test_lk8_a_done_decided_before_the_worker_heard_the_reply_is_not_accepted(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    behaviours = {1: Behaviours(at={"after_tool:1": "delay:30"})}
    steps: list[Step] = [wait(), done("guessed"), say("ok"), done("with the answer"), say()]
    async with open_rig(tmp_path, clocks, steps, behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        await rig.runner.reply(TASK, "the blue one")
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        receipts = [r for r in await rig.records() if isinstance(r, LifecycleReceipt)]
        assert [(r.kind, r.verdict) for r in receipts] == [
            ("wait", "accepted"),
            ("done", "reply_pending"),
            ("done", "accepted"),
        ]
        assert receipts[-1].detail == "with the answer"
        assert _replies_sent(rig, "the blue one") == 1


async def test_lk8_a_reply_recorded_before_a_host_crash_reaches_the_next_worker_once(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    # The reply is recorded, and the host dies before the epoch it wakes is launched: the
    # test leaves the rig right after the reply returns, so the lane is cancelled at its next
    # checkpoint. The reply must reach the next host's worker, exactly once.
    async with open_rig(tmp_path, clocks, [wait(), say("asked")]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        # until epoch 1 is stopped and the lane parked
        await rig.until_logged(lambda log: any(isinstance(r, EpochFenced) for r in log))
        await rig.runner.reply(TASK, "the blue one")
        log_rel = rig.runner.log_rel(TASK)
    # TL6: no epoch number is used twice. Whether the dying host's reservation of epoch 2
    # became durable before the cancel reached it depends on the scheduling of its last
    # append: if it did, 2 is spent and the next host launches 3, else 2.
    before = read_log(OsFileSystem(), str(tmp_path / "state"), log_rel).records
    spent = max(int(a.detail["epoch"]) for a in actions(list(before), "launch"))
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:  # the host restarts
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        assert _replies_sent(rig, "the blue one") == 1  # inside the one continuation
        assert rig.workers.launched == [spent + 1]


# ----------------------------------------- LK9: quiescence after a decision is an action


async def test_lk9_a_worker_running_on_after_its_done_is_stopped_after_the_grace_then_done(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    behaviours = {1: Behaviours(at={"after_tool:1": "hang"})}  # never settles after done
    async with open_rig(tmp_path, clocks, [done(), say()], behaviours=behaviours) as rig:
        start = trio.current_time()
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        waited = trio.current_time() - start
        assert 120 <= waited < 130  # the grace, not forever
        (quiesce,) = actions(await rig.records(), "quiesce")
        assert quiesce.detail["after_seconds"] >= 120
        assert rig.workers.launched == [1]


async def test_lk9_an_operator_may_abort_a_success_intent_that_is_not_finalized(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    behaviours = {1: Behaviours(at={"after_tool:1": "hang"})}
    async with open_rig(tmp_path, clocks, [done(), say()], behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "success_intent")
        await rig.runner.abort(TASK, "the operator saw it go wrong")
        ended = await rig.ended(TASK)
        assert ended.state == "aborted"
        assert ended.detail == "the operator saw it go wrong"


# ------------------------------------- WD10: the compare-and-set is re-checked after awaits


async def test_wd10_progress_during_the_reserve_stops_the_fence(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker shows progress while the lane awaits its budget reservation, after every
    guard held: the fence must not go ahead on the proof read before that await."""
    reserve = TaskLane.reserve
    injected: list[float] = []

    async def reserve_while_the_worker_speaks(lane: TaskLane) -> bool:
        if not injected:  # the first fence attempt: a token arrives during the await
            now, awake = lane.readings()
            injected.append(now)
            lane.watchdog.feed(Progress(now, awake, Phase.GENERATION, "token"))
        return await reserve(lane)

    monkeypatch.setattr(TaskLane, "reserve", reserve_while_the_worker_speaks)
    steps: list[Step] = [Hang(seconds=100_000), done(), say("finished")]
    async with open_rig(tmp_path, clocks, steps) as rig:
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        records = await rig.records()
        fence_probes = [a for a in actions(records, "probe") if a.detail["purpose"] == "fence"]
        assert len(fence_probes) == 2  # the first eligibility did not fence: a new episode
        (fence,) = actions(records, "fence")
        assert len(actions(records, "reserve")) == 1  # charged once, kept for the real fence
        assert rig.workers.launched == [1, 2]
        assert fence.action_id.endswith("/e1/fence")
        assert injected
        assert trio.current_time() - injected[0] >= 900 + 120  # a whole new hard episode
        # WD11: the recovery the called-off fence's reserve started ended with it (the worker
        # had progressed); the working time of the new episode is not recovery time
        charged = [a.detail["seconds"] for a in actions(records, "recovery_time")]
        assert charged[0] < 1.0, charged
        assert sum(charged) < 900, charged


async def resumed_while_live(
    tmp_path: Path, clocks: Clocks, monkeypatch: pytest.MonkeyPatch, spoke: list[bool]
) -> tuple[TaskEnded, list[Record], list[int]]:
    """A task whose live worker waits on its model request is held by the operator's look
    and resumed; once the test's patch has made the worker speak (``spoke``), the task runs
    to its end: its end record, its lane log and the epochs launched."""
    asked = trio.Event()
    next_step = ScriptedModel.next_step

    def noted(model: ScriptedModel, body: dict[str, Any]) -> Step:
        asked.set()
        return next_step(model, body)

    monkeypatch.setattr(ScriptedModel, "next_step", noted)
    async with open_rig(tmp_path, clocks, [Hang(seconds=600), done(), say("finished")]) as rig:
        await rig.runner.submit(rig.spec())
        await asked.wait()  # the worker waits on its model request,
        await trio.testing.wait_all_tasks_blocked()  # its events so far taken in
        await rig.runner.lane(TASK).hold("the operator's look (the test)")
        rig.runner.resume(TASK)
        await rig.until(lambda: bool(spoke))
        return await rig.ended(TASK), await rig.records(), rig.workers.launched


async def test_tl8_progress_while_a_resume_is_checked_calls_the_resume_off(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TL8, WD1: the operator resumes a held task whose worker is alive; while the resume's
    guards are read (the session, the route: awaits), the worker shows progress, which lifts
    the hold. The resume's premise — a held worker — is gone: the working worker is not
    fenced and nothing is relaunched (it would be killed, and an epoch charged, for nothing)."""

    guards = EpochWatch._manual_resume_guards
    spoke: list[bool] = []

    async def progress_meanwhile(watch: EpochWatch) -> tuple[str, ...]:
        failed = await guards(watch)
        now, awake = watch.lane.readings()
        watch.lane.watchdog.feed(Progress(now, awake, Phase.GENERATION, "token"))
        spoke.append(True)
        return failed

    monkeypatch.setattr(EpochWatch, "_manual_resume_guards", progress_meanwhile)
    ended, records, launched = await resumed_while_live(tmp_path, clocks, monkeypatch, spoke)
    assert ended.state == "done"
    assert launched == [1]  # never fenced, never relaunched
    assert actions(records, "reserve") == []


async def test_tl8_progress_while_a_resumes_reserve_is_written_calls_the_resume_off(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TL8, WD11: the same, the progress coming while the resume's reserve is written (its
    last await): the hold is read again after it, the working worker is not fenced, and the
    recovery that reserve started ends at once — the worker's working time is not charged
    as recovery."""
    reserve = TaskLane.reserve
    spoke: list[bool] = []

    async def progress_meanwhile(lane: TaskLane) -> bool:
        started = await reserve(lane)
        now, awake = lane.readings()
        lane.watchdog.feed(Progress(now, awake, Phase.GENERATION, "token"))
        spoke.append(True)
        return started

    monkeypatch.setattr(TaskLane, "reserve", progress_meanwhile)
    ended, records, launched = await resumed_while_live(tmp_path, clocks, monkeypatch, spoke)
    assert ended.state == "done"
    assert launched == [1]  # never fenced, never relaunched
    assert len(actions(records, "reserve")) == 1  # charged (never refunded), kept for later
    (recovery,) = actions(records, "recovery_time")
    assert recovery.detail["seconds"] < 1.0  # ended with the called-off resume


async def test_lk6_an_abort_while_the_epoch_launches_prompts_nothing(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LK6, TL8: the operator aborts the task while its epoch is being launched (after the
    epoch's compare-and-set, before its prompt). The task is over: the worker must not be
    prompted — its first model request would be paid for a task nobody runs any more."""

    route_open = EpochWatch._route_open
    aborted: list[bool] = []

    async def aborted_meanwhile(watch: EpochWatch) -> bool:
        if not aborted:
            aborted.append(True)
            await rig.runner.abort(TASK, "changed my mind")
        return await route_open(watch)

    from runtime._pi._rpc import RpcChannel

    prompt = RpcChannel.prompt
    prompts: list[str] = []

    async def counted(channel: RpcChannel, message: str, **kwargs: Any) -> Any:
        prompts.append(message)
        return await prompt(channel, message, **kwargs)

    monkeypatch.setattr(EpochWatch, "_route_open", aborted_meanwhile)
    monkeypatch.setattr(RpcChannel, "prompt", counted)
    async with open_rig(tmp_path, clocks, [done(), say("finished")]) as rig:
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
    assert aborted == [True]
    assert ended.state == "aborted"
    assert prompts == []  # the worker was never asked anything


# ------------------------------------------------- LK2: the fence counter survives a restart


async def test_lk2_the_fence_a_restart_restores_is_the_one_the_receipts_carry(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """An exit moves the fence (epoch 2 runs under fence 1); a host restart then restores
    fence 1 — not a count of fence-reason ends, which is 0 — and its replacement moves it to
    2, so the done the replacement reports is current and accepted."""
    behaviours = {1: Behaviours(at={"after_model:1": "exit:0"}),
                  2: Behaviours(at={"before_model:1": "hang"})}  # fmt: skip
    steps: list[Step] = [say("working"), done(), say()]
    async with open_rig(tmp_path, clocks, steps, behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).fence == 1)
        await rig.until_logged(
            lambda log: any(
                isinstance(r, OutboxAction) and r.kind == "launch" and r.detail.get("epoch") == 2
                for r in log
            )
        )
    async with open_rig(tmp_path, clocks, steps) as rig:  # the host restarts
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        receipts = [r for r in await rig.records() if isinstance(r, LifecycleReceipt)]
        assert [(r.kind, r.fence, r.epoch, r.verdict) for r in receipts] == [
            ("done", 2, 3, "accepted")
        ]


# ------------------------------------------- WD14: the policy is frozen at submission


WEDGED = Behaviours(at={"before_model:1": "hang"})


def launched(log: list[Record], epoch: int) -> bool:
    """The launch of ``epoch`` is recorded done (its worker started)."""
    return any(a.detail.get("epoch") == epoch and a.state == "done" for a in actions(log, "launch"))


async def test_wd14_a_restart_with_a_larger_budget_refunds_nothing_to_a_running_task(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """A task submitted with one replacement uses it and holds (the next fence's budget
    guard fails); the host restarts configured for five: the task's budget is still the one
    it was submitted with, nothing relaunches, and a new task gets the new configuration."""
    behaviours = dict.fromkeys((1, 2), WEDGED)
    small = WatchdogPolicy(max_replacements=1)
    async with open_rig(tmp_path, clocks, [done()], policy=small, behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).hold_reason == "guard:budget_left")
        assert rig.workers.launched == [1, 2]
    large = WatchdogPolicy(max_replacements=5, hard_seconds={Phase.PROVIDER: 1800.0})
    async with open_rig(tmp_path, clocks, [done(), say()], policy=large) as rig:
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        await trio.sleep(3600)
        view = rig.runner.show(TASK)
        assert view.hold_reason == "guard:budget_left"
        assert (view.budget["epochs_used"], view.budget["epochs_left"]) == (1, 0)
        assert rig.runner.lanes[TASK].policy == small  # thresholds too, not only the budget
        assert rig.workers.launched == []
        elsewhere = tmp_path / "another-worktree"
        elsewhere.mkdir()
        spec = msgspec.structs.replace(rig.spec(task_id="new-task"), worktree=str(elsewhere))
        other = await rig.runner.submit(spec)
        assert other.budget["epochs_left"] == 5
        assert rig.runner.lanes["new-task"].policy == large


async def test_wd14_a_restart_with_other_thresholds_fences_on_the_frozen_ones(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """The host restarts with a hard threshold of 1800 s under a task submitted with 900 s:
    the replacement wedged in the provider phase is fenced after 900 s and the grace, as the
    task was promised, not after 1800 s."""
    async with open_rig(tmp_path, clocks, [done()], behaviours={1: WEDGED}) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until_logged(lambda log: launched(log, 1))
    slow = WatchdogPolicy(hard_seconds={Phase.PROVIDER: 1800.0, Phase.GENERATION: 1800.0})
    behaviours = {2: WEDGED}
    async with open_rig(tmp_path, clocks, [done(), say()], policy=slow,
                        behaviours=behaviours) as rig:  # fmt: skip
        await rig.until_logged(lambda log: launched(log, 2))
        start = trio.current_time()  # (seen up to a second late: until_logged looks once a
        await rig.until_logged(lambda log: bool(actions(log, "fence")))  # virtual second)
        fenced = trio.current_time() - start
        assert 900 + 120 - 1 <= fenced < 1800
        assert (await rig.ended(TASK)).state == "done"


async def test_wd14_a_frozen_policy_this_version_cannot_read_holds_the_task(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A submission whose frozen policy breaks a rule of this version (written by another
    version: 50 replacements) is never run on a guessed policy: the task holds
    ``policy_unreadable`` naming the setting and launches nothing, and so it stays after a
    restart."""
    async with open_rig(tmp_path, clocks, [done()]) as rig:
        snapshot = WatchdogPolicy.snapshot
        monkeypatch.setattr(
            WatchdogPolicy, "snapshot", lambda p: {**snapshot(p), "max_replacements": 50}
        )
        await rig.runner.submit(rig.spec())
        monkeypatch.undo()
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        assert rig.workers.launched == []
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        await trio.sleep(3600)
        reason = rig.runner.show(TASK).hold_reason or ""
        assert reason.startswith("policy_unreadable:max_replacements")
        assert rig.workers.launched == []
        assert [a.detail["reason"] for a in actions(await rig.records(), "hold")] == [reason]


# ------------------------------- TL4: the whole route is frozen and attested before a write


def _session_bytes(tmp_path: Path) -> bytes:
    (path,) = (tmp_path / "state" / "lanes").glob("*/session.jsonl")
    return path.read_bytes()


@pytest.mark.parametrize(
    ("changed", "reason"),
    [
        ({"base_url": "http://127.0.0.1:9/other"}, "route_changed:endpoint"),
        ({"api": "anthropic-messages"}, "route_changed:api"),
        ({"thinking_level": "high"}, "route_changed:thinking_level"),
        ({"model": "another-model"}, "route_changed:model"),
    ],
)
async def test_tl4_a_restart_on_another_route_holds_before_any_write_or_charge(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    changed: dict[str, Any],
    reason: str,
) -> None:
    """The host restarts configured with another endpoint, API kind, reasoning level or
    model: the task holds naming the part, before it writes to the session, charges a
    replacement or launches a worker."""
    async with open_rig(tmp_path, clocks, [done()], behaviours={1: WEDGED}) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until_logged(lambda log: launched(log, 1))
    before = _session_bytes(tmp_path)
    other = dataclasses.replace(ROUTE, **changed)
    async with open_rig(tmp_path, clocks, [done(), say()], route=other) as rig:
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        assert rig.runner.show(TASK).hold_reason == reason
        records = await rig.records()
        assert actions(records, "reserve") == []
        assert rig.workers.launched == []
    assert _session_bytes(tmp_path) == before


async def test_tl4_a_session_moved_to_another_model_holds_the_replacement(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """The session the next worker would resume names another model than the frozen route
    (the worker switched it): the replacement holds ``route_changed:session.model`` instead
    of resuming a session on a route the task was never given."""
    async with open_rig(tmp_path, clocks, [done()], behaviours={1: WEDGED}) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until_logged(lambda log: launched(log, 1))
    (path,) = (tmp_path / "state" / "lanes").glob("*/session.jsonl")
    session = parse_session(path.read_bytes()).require_clean()
    switch = {"type": "model_change", "provider": "fake", "modelId": "another-model"}
    entry = session.new_entry(switch, time_ms=1)
    path.write_bytes(session.with_entry(entry).to_bytes())
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        assert rig.runner.show(TASK).hold_reason == "route_changed:session.model"
        assert rig.workers.launched == []


async def test_tl4_a_route_changed_under_a_wedged_worker_fails_the_fences_guard(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """The fence's attestation guard is the same proof: the host's route no longer the
    frozen one → the guard fails and the wedged worker is held, not fenced."""
    async with open_rig(tmp_path, clocks, [done()], behaviours={1: WEDGED}) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until_logged(lambda log: launched(log, 1))
        rig.runner.host.route = dataclasses.replace(ROUTE, base_url="http://127.0.0.1:9/x")
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        assert rig.runner.show(TASK).hold_reason == "guard:attested"
        assert actions(await rig.records(), "fence") == []
        assert rig.workers.launched == [1]


# --------------------------------------------------- TL13: one live task per worktree


async def test_tl13_a_second_live_task_on_a_worktree_is_refused_until_the_first_ends(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """While a task lives (here: waiting on a reply) its worktree is leased: another task on
    it, on a directory inside it or on one around it is refused ``worktree_leased``, after a
    host restart too; once the first ends, the worktree is free."""
    async with open_rig(tmp_path, clocks, [wait()]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        inner = rig.worktree / "src"
        inner.mkdir()
        for path in (rig.worktree, inner, rig.worktree.parent):
            spec = msgspec.structs.replace(rig.spec(task_id="second"), worktree=str(path))
            with pytest.raises(TaskError) as refused:
                await rig.runner.submit(spec)
            assert refused.value.code == "worktree_leased"
            assert TASK in str(refused.value)
    async with open_rig(tmp_path, clocks, [done(), say(), done(), say()]) as rig:  # durable
        with pytest.raises(TaskError, match="is leased to live task"):
            await rig.runner.submit(rig.spec(task_id="second"))
        await rig.runner.reply(TASK, "go on")
        assert (await rig.ended(TASK)).state == "done"
        # the dead host's worker never wrote the wait's answer: settled before the launch
        tool_results = [m.get("content") for m in rig.model.requests[0].body["messages"]
                        if m.get("role") == "tool"]  # fmt: skip
        assert tool_results
        assert "Accepted: waiting" in str(tool_results[0])
        second = await rig.runner.submit(rig.spec(task_id="second"))
        assert second.task_id == "second"
        assert (await rig.ended("second")).state == "done"


async def test_tl13_two_live_logs_on_one_worktree_the_later_task_holds(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two live task logs on one worktree (written by a version without the lease), both
    waiting when the host restarts: the reply to the task admitted later does not launch
    it — it holds ``worktree_leased:<first>`` — until the first has ended and an operator
    resumes it; then it runs, with the reply."""
    async with open_rig(tmp_path, clocks, [wait(), say(), wait(), say()]) as rig:
        monkeypatch.setattr("runtime._tasks._runner.overlap", lambda a, b: False)
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        await trio.sleep(1)  # admitted a virtual second later
        await rig.runner.submit(rig.spec(task_id="second"))
        await rig.until(lambda: rig.runner.show("second").state == "waiting")
        monkeypatch.undo()
    async with open_rig(tmp_path, clocks, [done(), say(), done(), say()]) as rig:
        await rig.runner.reply("second", "the second answer")
        await rig.until(lambda: rig.runner.show("second").classification == HELD)
        assert rig.runner.show("second").hold_reason == f"worktree_leased:{TASK}"
        rig.runner.resume("second")  # too early: the first still holds the lease
        leased = f"worktree_leased:{TASK}"
        await rig.until_logged(
            lambda log: [a.detail["reason"] for a in actions(log, "hold")].count(leased) == 2,
            task_id="second",
        )
        assert rig.runner.show("second").hold_reason == leased
        assert rig.workers.launched == []
        await rig.runner.reply(TASK, "go on")
        assert (await rig.ended(TASK)).state == "done"
        rig.runner.resume("second")
        assert (await rig.ended("second")).state == "done"
        assert _replies_sent(rig, "the second answer") == 1


# ----------------------------------------- WD1: worktree changes are progress of the worker


async def test_wd1_worktree_changes_keep_a_silent_worker_active_and_silence_counts_from_the_last(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """The worker says nothing for 2,000 s (its model request hangs) while its worktree
    changes every 60 s for the first 1,200 s (a build writing files, no output): it stays
    Active through the soft threshold, and only once the changes stop does silence count —
    Suspect 300 s after the last change (within one 30 s scan), never before."""
    steps: list[Step] = [Hang(seconds=2_000), done(), say()]
    async with open_rig(tmp_path, clocks, steps) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until_logged(lambda log: launched(log, 1))
        start = trio.current_time()
        build = rig.worktree / "build.log"
        while trio.current_time() - start < 1_200:
            with build.open("a") as log:
                log.write("compiled one more file\n")
            last_change = trio.current_time()
            await trio.sleep(60)
        assert "Suspect" not in rig.classifications()
        await rig.until(lambda: rig.runner.show(TASK).classification == "Suspect")
        suspected = rig.first("Suspect")
        assert suspected is not None
        assert last_change + 300 <= suspected <= last_change + 300 + 30 + 5
        assert (await rig.ended(TASK)).state == "done"
        assert rig.workers.launched == [1]  # never fenced
        assert rig.runner.show(TASK).telemetry["worktree_changes"] >= 19


# ------------------------------------------ LK10: an incomplete Done is retryable, not an end


async def test_lk10_an_incomplete_done_holds_then_the_operators_resume_finalizes_it(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """The validation fails (a file it needs is missing): the task is not ended — it holds
    ``finalization_incomplete:validation`` with what the attempt found recorded, through a
    restart too. The operator makes the file and resumes: the tuple is taken again and the
    task ends done, the worker never launched again and charged nothing."""
    needed = tmp_path / "validation-may-pass"
    code = f"import os, sys; sys.exit(0 if os.path.exists({str(needed)!r}) else 4)"
    check = (sys.executable, "-c", code)
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        await rig.runner.submit(rig.spec(validation=check))
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        assert rig.runner.show(TASK).hold_reason == "finalization_incomplete:validation"
    async with open_rig(tmp_path, clocks, []) as rig:  # the host restarts: still held
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        await trio.sleep(3600)
        view = rig.runner.show(TASK)
        assert (view.state, view.hold_reason) == (
            "success_intent",
            "finalization_incomplete:validation",
        )
        needed.write_text("fixed by the operator")
        rig.runner.resume(TASK)
        ended = await rig.ended(TASK)
        assert ended.state == "done"
        assert ended.validation is not None
        assert ended.validation["exit_status"] == 0
        records = await rig.records()
        assert len(actions(records, "finalize")) == 1  # the one incomplete attempt
        assert actions(records, "reserve") == []
        assert rig.workers.launched == []


async def test_lk10_tl12_a_resume_of_an_incomplete_done_kills_what_the_restart_could_not(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LK10, TL12: the task holds ``finalization_incomplete`` and its host dies; the restart
    cannot kill the last epoch's tree, so nothing proves it quiescent. The operator's resume
    kills again from the record before it takes the tuple again: while that kill proves
    nothing the task holds ``survivors:<pids>`` (no finalization attempt on a guess); once it
    proves the tree gone, the next resume ends the task done."""
    needed = tmp_path / "validation-may-pass"
    code = f"import os, sys; sys.exit(0 if os.path.exists({str(needed)!r}) else 4)"
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        await rig.runner.submit(rig.spec(validation=(sys.executable, "-c", code)))
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        log = rig.runner.log_rel(TASK)
    await _append_lane_record(tmp_path, clocks, log, UNKILLABLE)
    kill_leftovers = TaskLane._kill_leftovers
    kills: list[bool] = []

    async def kill_that_works_the_third_time(lane: TaskLane, record: EpochStarted) -> Stopped:
        stopped = await kill_leftovers(lane, record)  # the real kill: the record has no proof
        assert not stopped.clean
        kills.append(len(kills) >= 2)
        return Stopped(True, ()) if kills[-1] else stopped

    monkeypatch.setattr(TaskLane, "_kill_leftovers", kill_that_works_the_third_time)
    async with open_rig(tmp_path, clocks, []) as rig:
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        assert kills == [False]  # the restart's
        needed.write_text("fixed by the operator")
        rig.runner.resume(TASK)
        await rig.until(lambda: rig.runner.show(TASK).hold_reason == "survivors:1", within=60)
        assert kills == [False, False]
        records = await rig.records()
        assert len(actions(records, "finalize")) == 1  # the first, incomplete one only
        rig.runner.resume(TASK)
        ended = await rig.ended(TASK)
        assert kills == [False, False, True]
        assert ended.state == "done"
        assert rig.workers.launched == []


async def test_tl8_a_resume_asked_while_the_hold_is_being_written_is_not_lost(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TL8, LK10: the task holds ``finalization_incomplete``; the operator resumes it while
    the hold's record is still being written — the task shows held, and the lane has not
    parked yet. The resume is answered, so it must not be lost: the lane, parking, finds it
    and finalizes (it would otherwise hold on, the resume's answer a lie)."""
    needed = tmp_path / "validation-may-pass"
    code = f"import os, sys; sys.exit(0 if os.path.exists({str(needed)!r}) else 4)"
    record_action = TaskLane.record_action
    resumed: list[bool] = []

    async def resumed_meanwhile(
        lane: TaskLane, action_id: str, kind: str, state: str, detail: Any = None
    ) -> None:
        if kind == "hold" and not resumed:
            needed.write_text("fixed by the operator")
            resumed.append(lane.resume())  # the operator's look: held
        await record_action(lane, action_id, kind, state, detail)

    monkeypatch.setattr(TaskLane, "record_action", resumed_meanwhile)
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        await rig.runner.submit(rig.spec(validation=(sys.executable, "-c", code)))
        ended = await rig.ended(TASK)
    assert resumed == [True]
    assert ended.state == "done"


async def test_lk10_an_operator_may_fail_an_incomplete_done(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    check = (sys.executable, "-c", "import sys; sys.exit(4)")
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        await rig.runner.submit(rig.spec(validation=check))
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        await rig.runner.fail(TASK, "the validation cannot pass on this branch")
        ended = await rig.ended(TASK)
        assert ended.state == "failed"
        assert "cannot pass" in ended.detail


# ------------------------------------- TL5: an uncertain prompt marker holds, never guesses


async def test_tl5_a_marker_counts_only_in_an_entry_pi_loads_and_an_unreadable_session_is_unknown(
    tmp_path: Path, clocks: Clocks
) -> None:
    session = tmp_path / "session.jsonl"
    created = create_session(session, cwd=str(tmp_path), provider="fake", model_id="m",
                             clock=clocks.wall)  # fmt: skip
    action = "task-1/g1/a1/c1/prompt"
    marker = continuation_marker(action)
    assert await marker_in_session(session, action) is False
    assert created.leaf is not None
    message = {"role": "user", "content": marker}
    entry = {"type": "message", "id": "0badf00d", "parentId": created.leaf.id, "message": message}
    line = json.dumps(entry)
    with session.open("ab") as f:
        f.write(line.encode()[:-10])  # a torn last line: Pi skips it, the worker never had it
    assert await marker_in_session(session, action) is False
    with session.open("ab") as f:
        f.write(line.encode()[-10:] + b"\n")  # now whole: Pi loads it
    assert await marker_in_session(session, action) is True
    session.write_bytes(b"not a session header\n" + session.read_bytes())
    assert await marker_in_session(session, action) is None  # nobody can say
    assert await marker_in_session(tmp_path / "none.jsonl", action) is False


@pytest.mark.parametrize("sync", ["works", "fails"])
async def test_s15_j23_a_marker_found_is_made_durable_before_it_is_acted_on(
    tmp_path: Path, clocks: Clocks, monkeypatch: pytest.MonkeyPatch, sync: str
) -> None:
    """S15, J23, TL5, LK8: Pi appends its prompt's line without a sync (the worker's own, or
    one a restart killed after the start's sync), so a marker read through the page cache
    may be gone after a power loss — after the lane recorded the continuation as sent, or
    decided at a restart that a reply was delivered and need not be sent again. Tries to
    break: a "present" answered from a line no sync made durable. Expected: the session is
    fsynced (the real ``fsync``, watched) before the answer is yes; an absent marker needs no
    sync (nothing is decided on what could vanish); a sync that fails answers "unknown"
    (``None``: the caller holds rather than guess)."""
    session = tmp_path / "session.jsonl"
    created = create_session(session, cwd=str(tmp_path), provider="fake", model_id="m",
                             clock=clocks.wall)  # fmt: skip
    action = "task-1/g1/a1/c1/prompt"
    synced: list[str] = []
    real_fsync = os.fsync

    def watched(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if sync == "fails" and path == str(session):
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        real_fsync(fd)
        synced.append(path)

    monkeypatch.setattr(os, "fsync", watched)  # (what _session_files calls)
    assert await marker_in_session(session, action) is False
    assert synced == []  # absent: nothing to make durable
    assert created.leaf is not None
    message = {"role": "user", "content": continuation_marker(action)}
    entry = {"type": "message", "id": "0badf00d", "parentId": created.leaf.id, "message": message}
    with session.open("ab") as f:  # as Pi appends: no sync
        f.write(json.dumps(entry).encode() + b"\n")
    found = await marker_in_session(session, action)
    if sync == "works":
        assert found is True
        assert synced == [str(session)]
    else:
        assert found is None


async def test_s15_tl4_the_session_an_attestation_names_is_durable_before_it_is_recorded(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """S15, TL4: the attestation names the session's path as the lane read it, and the lane
    log records it; Pi's lines are not synced. Tries to break: the attestation recorded
    while the path it names is in the page cache only. Expected: the session file itself is
    fsynced (the real ``fsync``, watched) after it is read and before the attestation's
    record."""
    events: list[str] = []
    real_fsync = os.fsync

    def watched(fd: int) -> None:
        real_fsync(fd)
        events.append(f"fsync {os.readlink(f'/proc/self/fd/{fd}')}")

    real_record = TaskLane.record_action

    async def recorded(lane: TaskLane, action_id: str, kind: str, *args: Any) -> None:
        await real_record(lane, action_id, kind, *args)
        events.append(f"record {kind}")

    monkeypatch.setattr(os, "fsync", watched)
    monkeypatch.setattr(TaskLane, "record_action", recorded)
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.ended(TASK)
        session = str(rig.store.root / rig.runner.show(TASK).session_path)
    attested = events.index("record attest")
    assert f"fsync {session}" in events[events.index("record launch") : attested], events


async def test_lk8_a_reply_whose_carrier_cannot_be_checked_holds_instead_of_resending(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """The reply was sent to a worker that hung before answering, and the host died; the
    session cannot be read back at the restart. Whether the worker kept the reply is
    unknown: the task holds ``prompt_marker_unknown:<the reply's action>`` rather than send
    the reply a second time or drop it."""
    behaviours = {2: Behaviours(at={"before_model:1": "hang"})}
    async with open_rig(tmp_path, clocks, [wait(), say("asked")], behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        await rig.until_logged(lambda log: any(isinstance(r, EpochFenced) for r in log))
        await rig.runner.reply(TASK, "the blue one")  # the next epoch carries it, and hangs
        await rig.until_logged(lambda log: any(isinstance(r, ContinuationSent) for r in log))
        log = await rig.records()
        # the premise: nothing held before the host died
        assert not actions(log, "hold"), [
            (type(r).__name__, getattr(r, "epoch", None), getattr(r, "detail", None)) for r in log
        ]
    (path,) = (tmp_path / "state" / "lanes").glob("*/session.jsonl")
    path.write_bytes(b"not a session header\n" + path.read_bytes())
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        assert rig.runner.show(TASK).hold_reason == f"prompt_marker_unknown:{TASK}/g1/a1/reply1"
        assert rig.workers.launched == []
        assert rig.model.requests == []


# ------------------------------------------- TL11: a failed lane is seen, not followed forever


async def test_tl1_the_same_task_submitted_twice_at_once_is_started_once(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """TL1, P11: a task is idempotent by its id; two submissions of the same task at once
    (a client's retry racing its first try) are one lane, answered once ``started`` and once
    ``duplicate`` — not both ``started``."""
    async with open_rig(tmp_path, clocks, [wait(), say("asked")]) as rig:
        service = TaskService(rig.runner, WatchdogPolicy(), WatchdogPolicy())
        spec = rig.spec()
        answers: list[bool] = []

        async def submit() -> None:
            _, new = await service.submit(spec)
            answers.append(new)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit)
            nursery.start_soon(submit)
        assert sorted(answers) == [False, True]
        assert rig.runner.task_ids() == [TASK]


async def test_tl11_a_lane_that_fails_is_shown_failed_and_a_follower_is_told(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """The lane cannot prepare (a file stands where its tmp directory must go: a broken
    disk's stand-in): it stops without an end. The view says so with the code and a next
    action, and a follower through the service's ``task_wait`` (what ``task run --wait``
    polls) is told the task is over for this server, instead of polling forever."""
    async with open_rig(tmp_path, clocks, [done()]) as rig:
        blocker = tmp_path / "work" / "tmp" / lane_key(f"task:{TASK}")
        blocker.parent.mkdir(parents=True)
        blocker.write_text("not a directory")
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).failure is not None)
        view = rig.runner.show(TASK)
        assert view.failure is not None
        assert view.failure["code"] == "FileExistsError"
        assert view.next_action.startswith("its lane failed")
        service = TaskService(rig.runner, WatchdogPolicy(), WatchdogPolicy())
        answer = await service.task_wait(TASK, 0, 5.0)
        assert answer["ended"] is True
        assert answer["task"]["failure"]["code"] == "FileExistsError"
        with pytest.raises(TaskError) as raised:
            await rig.ended(TASK)
        assert raised.value.code == "task_lane_failed"


@pytest.mark.parametrize("damaged", [False, True], ids=["empty", "damaged"])
async def test_tl11_a_lane_log_a_crash_cut_short_or_damaged_stops_no_start(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock, damaged: bool
) -> None:
    """TL11, J3: a task lane log a crash left empty (its create cut short) or that is
    damaged (a whole frame whose checksum fails) does not stop the runner's start — it used
    to raise there (``IndexError``, or the read's ``journal_corrupt``), so no task of the
    host resumed: the empty one is no task yet, the damaged one is reported and not
    resumed (the host's log says so), and the task beside it runs on."""
    async with open_rig(tmp_path, clocks, [wait(), done(), say()]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        log = tmp_path / "state" / rig.runner.log_rel(TASK)
    written = bytearray(log.read_bytes() if damaged else b"")
    if damaged:
        written[len(written) // 2] ^= 0x10
    odd = tmp_path / "state" / "lanes" / ("0" * 32)
    odd.mkdir(mode=0o700)
    (odd / "lane.log").write_bytes(bytes(written))
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        known = rig.runner.task_ids()
        await rig.runner.reply(TASK, "yes")
        ended = await rig.ended(TASK)
    assert known == [TASK]
    assert ended.state == "done"


async def test_tl5_tl7_a_restart_after_a_launch_before_its_prompt_keeps_the_task(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TL5, TL7: the first worker is launched (its launch recorded ``done``) and the host
    stops before the task's prompt reaches it. Tries to break: the restart taking the task
    as heard — a worker ran — so its replacement's continuation goes without the task, which
    no worker ever kept (the session holds no prompt): the task lost. Expected: the
    replacement's continuation carries the task (one replacement charged: a worker ran)."""
    prompt_and_watch = EpochWatch._prompt_and_watch

    async def host_stops_first(self: EpochWatch, *args: Any) -> EpochEnd:
        await trio.sleep_forever()
        raise AssertionError("unreachable")  # pragma: no cover

    monkeypatch.setattr(EpochWatch, "_prompt_and_watch", host_stops_first)
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        await rig.runner.submit(rig.spec("paint the shed blue"))
        await rig.until_logged(lambda log: launched(log, 1))
    monkeypatch.setattr(EpochWatch, "_prompt_and_watch", prompt_and_watch)
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        ended = await rig.ended(TASK)
        records = await rig.records()
        first = _user_texts(rig)[0]
    assert ended.state == "done"
    assert "paint the shed blue" in first, first
    assert len(actions(records, "reserve")) == 1
