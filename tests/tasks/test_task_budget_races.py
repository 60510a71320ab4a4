"""The replacement budget under races and failing writes (WD11, WD12, TL8, TL9 of
``docs/design/watchdog.md``): each test puts one event into the window of one budget write —
a second reserve, an operator's resume, a reply, the worker's exit, a disk that fails — and
checks that the budget in memory is the one the log holds (what a restart counts) and that a
launch is charged for what it is. In-process Fake-Pi on virtual time (``io_autojump_clock``);
a write is held at the lane's append on an event the test sets; a failing disk is
``tests/faultfs.py`` under the store; a host restart is a second runner on the same state
directory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Final

import pytest
import trio
import trio.testing

from fake_pi.scenario import Hang, Step
from runtime._clock import Clocks
from runtime._journal._store import open_store
from runtime._linux._fs import OsFileSystem
from runtime._records import (
    ContinuationSent,
    EpochFenced,
    OutboxAction,
    Record,
    TaskReply,
)
from runtime._tasks._lane import TaskLane
from runtime._tasks._recovery import Recovery
from runtime._tasks._state import read_lane

from .. import task_harness
from ..faultfs import Fault, FaultyFileSystem
from ..task_harness import TASK, done, open_rig, say, wait
from .test_task_budget import (
    held_for_survivors_with_the_budget_spent,
)

pytestmark = pytest.mark.trio

HELD: Final = "StalledOperatorRequired"
WEDGED: Final[list[Step]] = [Hang(seconds=100_000), done(), say("finished")]
"""A worker wedged in its first model request (fenced past the hard threshold and its
grace), then a replacement that reports done."""


def actions(records: list[Record], kind: str) -> list[OutboxAction]:
    return [r for r in records if isinstance(r, OutboxAction) and r.kind == kind]


def durable_epochs(lane: TaskLane, records: list[Record]) -> int:
    """The replacement epochs a restart counts from ``records``."""
    return read_lane(lane.task, records, lane.policy).budget.used_epochs


class HeldWrite:
    """Hold the lane's append of the first record ``picks`` chooses until :meth:`release`:
    a slow disk under that one write. ``writing`` is set once the write is held."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, picks: Callable[[Record], bool]) -> None:
        self.writing = trio.Event()
        self._released = trio.Event()
        self._picks = picks
        append = TaskLane.append

        async def held(lane: TaskLane, record: Record) -> int:
            if not self.writing.is_set() and self._picks(record):
                self.writing.set()
                await self._released.wait()
            return await append(lane, record)

        monkeypatch.setattr(TaskLane, "append", held)

    def release(self) -> None:
        self._released.set()


def reserves(record: Record) -> bool:
    return isinstance(record, OutboxAction) and record.kind == "reserve"


def reserve_calls(monkeypatch: pytest.MonkeyPatch, second: trio.Event) -> None:
    """Set ``second`` once ``TaskLane.reserve`` is entered a second time."""
    reserve = TaskLane.reserve
    calls: list[float] = []

    async def counted(lane: TaskLane) -> bool:
        calls.append(trio.current_time())
        if len(calls) == 2:
            second.set()
        return await reserve(lane)

    monkeypatch.setattr(TaskLane, "reserve", counted)


# --------------------------------------------------- WD11: one reserve at a time per lane


async def test_wd11_two_reserves_at_once_charge_one_epoch(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WD11, TL6: two reserves of one lane at once, the first's write held at the store.
    The second must meet the first's reserve — charged and being recorded — and reuse it
    (the continuation is not sent yet): one epoch charged, in memory as in the log. Before,
    the "already reserved" look was not atomic with the write: the second looked while the
    first's write was held, found nothing recorded, and charged the next continuation —
    two epochs for one replacement."""
    async with open_rig(tmp_path, clocks, [wait("which one?")]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        lane = rig.runner.lanes[TASK]
        held = HeldWrite(monkeypatch, reserves)
        results: list[bool] = []

        async def reserve() -> None:
            results.append(await lane.reserve())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reserve)
            await held.writing.wait()
            nursery.start_soon(reserve)
            await trio.testing.wait_all_tasks_blocked()  # the second has looked (or waits)
            held.release()
        records = await rig.records()
    assert sorted(results) == [False, True]  # one charged (and started the recovery)
    assert len(actions(records, "reserve")) == 1
    assert (lane.budget.used_epochs, durable_epochs(lane, records)) == (1, 1)


async def test_wd11_tl8_a_resume_during_a_guard_checks_reserve_charges_one_epoch(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WD11, TL8, WD10: a wedged worker's guards hold and the guard check reserves; its
    write is held at the store (a slow disk). Meanwhile the task is held (the operator's
    look, standing in for any hold that comes then) and the operator resumes it: the
    resume's own reserve runs while the guard check's is still being written. The guard
    check is serialised with its own kind (``_checking``), not with the resume: before,
    the resume found nothing recorded and charged the next continuation — one replacement,
    two epochs charged (one would never launch). Now the resume waits for the write in
    flight, meets that reserve and reuses it: one epoch, one replacement."""
    held = HeldWrite(monkeypatch, reserves)
    resumed = trio.Event()
    reserve_calls(monkeypatch, resumed)
    async with open_rig(tmp_path, clocks, WEDGED) as rig:
        await rig.runner.submit(rig.spec())
        await held.writing.wait()  # the guard check's reserve is being written
        lane = rig.runner.lane(TASK)
        try:
            await lane.hold("the operator's look (the test)")
            rig.runner.resume(TASK)
            with trio.fail_after(60):
                await resumed.wait()  # the resume's reserve has begun
            await trio.testing.wait_all_tasks_blocked()
        finally:
            held.release()  # (a failed look above must not leave the write held for good)
        ended = await rig.ended(TASK)
        records = await rig.records()
        view = rig.runner.show(TASK)
    assert ended.state == "done"
    assert rig.workers.launched == [1, 2]
    assert len(actions(records, "reserve")) == 1
    assert view.budget["epochs_used"] == 1
    assert durable_epochs(lane, records) == 1


# ------------------------------- WD11, WD12, TL9: a reply to a held waiting task, then a resume


async def test_wd11_tl9_a_reply_before_the_resume_of_a_held_waiting_task_is_no_replacement(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WD11, WD12, TL9, LK8: the task's one replacement epoch is spent; epoch 2 asks
    (``task_wait``) and its stop leaves survivors, so the waiting task holds
    ``survivors:<pids>``. After a restart the user's reply comes first — recorded, lifting
    nothing (WD12) — and then the operator's resume, whose kill proves the tree gone. No
    worker is replaced: the worker asked and stopped, and the epoch that follows is the
    reply's, as it would be had the resume come first (TL9: not a replacement, not
    charged). Before, the order decided the charge: a reply first made the resume prepare
    a replacement — with the budget spent it held ``budget_exhausted:epochs``, a hold only
    a grant lifts, for a reply epoch that needs no budget (and with budget left it charged
    one and sent a continuation instead of the reply's prompt)."""
    steps, policy = await held_for_survivors_with_the_budget_spent(tmp_path, clocks, monkeypatch)
    async with open_rig(tmp_path, clocks, steps[2:], policy=policy) as rig:
        await rig.runner.reply(TASK, "the blue one")
        view = rig.runner.show(TASK)
        assert (view.classification, view.hold_reason) == (HELD, "survivors:4242")  # WD12
        rig.runner.resume(TASK)
        await rig.until(lambda: rig.runner.show(TASK).hold_reason != "survivors:4242", within=60)
        assert rig.runner.show(TASK).hold_reason is None
        ended = await rig.ended(TASK)
        records = await rig.records()
        view = rig.runner.show(TASK)
        prompts = [r.action_id for r in records if isinstance(r, ContinuationSent)]
    assert ended.state == "done"
    assert rig.workers.launched == [3]  # the reply's epoch, once
    assert len(actions(records, "reserve")) == 1  # epoch 2's, the one replacement
    assert view.budget["epochs_used"] == 1
    assert [r.text for r in records if isinstance(r, TaskReply)] == ["the blue one"]
    assert f"{TASK}/g1/a1/reply1" in prompts  # carried by the reply's own prompt
    assert not any("/c2/" in p for p in prompts)  # no continuation of a replacement


# ------------------------------------------ WD11, TL6: an epoch that exits during its fence


async def test_wd11_tl6_an_epoch_that_exits_during_its_fence_write_is_an_exit_charged_once(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WD11, TL6, TL2: every guard holds, the reserve is written, and the worker dies while
    the ``fence`` action is being written (the write lands whole, as a file store's does).
    The epoch ended by its own exit, not by the fence's stop: the log says so — the
    ``fence`` (the decision, made) is followed by ``epoch_fenced`` with reason ``exited``
    and no ``signal`` or ``reap`` (the fence never signalled a tree; the exit's stop did
    not need one). Nothing reads a ``fence`` action back: a restart counts the reserve, and
    the exit's replacement reuses it — one epoch charged, in memory as in the log, and the
    continuation tells the replacement what happened (an exit)."""
    exited: list[bool] = []
    append = TaskLane.append

    async def dies_during_the_fence(lane: TaskLane, record: Record) -> int:
        if isinstance(record, OutboxAction) and record.kind == "fence" and not exited:
            worker = lane.worker
            assert worker is not None
            with trio.CancelScope(shield=True):  # the write is under way: it lands whole
                worker.fake.kill()  # type: ignore[attr-defined]
                await trio.testing.wait_all_tasks_blocked()  # the exit is seen meanwhile
                exited.append(True)
                return await append(lane, record)
        return await append(lane, record)

    monkeypatch.setattr(TaskLane, "append", dies_during_the_fence)
    async with open_rig(tmp_path, clocks, WEDGED) as rig:
        await rig.runner.submit(rig.spec())
        lane = rig.runner.lane(TASK)
        ended = await rig.ended(TASK)
        records = await rig.records()
        lane_view = rig.runner.show(TASK)
    assert exited == [True]
    assert ended.state == "done"
    assert rig.workers.launched == [1, 2]
    ended_epochs = [(r.epoch, r.reason) for r in records if isinstance(r, EpochFenced)]
    assert ended_epochs[0] == (1, "exited")
    (fence,) = actions(records, "fence")
    assert fence.action_id.endswith("/e1/fence")
    assert [a for a in actions(records, "signal") + actions(records, "reap")] == []
    assert len(actions(records, "reserve")) == 1
    assert lane_view.budget["epochs_used"] == 1
    assert durable_epochs(lane, records) == 1
    markers = [r.action_id for r in records if isinstance(r, ContinuationSent)]
    assert markers == [f"{TASK}/g1/a1/c1/prompt"]


# ------------------------------------------------- WD11, WD12: a budget write that fails


def failing_disk(monkeypatch: pytest.MonkeyPatch) -> FaultyFileSystem:
    """The rig's store on a file system that fails the lane log's next write (EIO) from the
    moment a replacement epoch is charged: the reserve's own write."""
    faulty = FaultyFileSystem(OsFileSystem(), armed=False)
    monkeypatch.setattr(task_harness, "open_store", functools.partial(open_store, fs=faulty))
    charge = Recovery.charge_epoch

    def charged(recovery: Recovery, at_ms: int) -> dict[str, object]:
        if not faulty.fired:
            faulty.arm(Fault("write", 1, "before", path_contains="lane.log"))
        return charge(recovery, at_ms)

    monkeypatch.setattr(Recovery, "charge_epoch", charged)
    return faulty


async def test_wd11_tl11_a_reserve_whose_write_fails_charges_nothing_and_fences_nothing(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WD11, WD12, TL11: the fence's reserve is charged and its write fails (the disk
    refuses it, EIO). The charge is not made: the budget in memory is the log's (what a
    restart counts), and nothing is fenced or launched on it. The lane fails closed: it
    would hold ``budget_unrecorded:<code>``, but the file store's log, poisoned by the
    failed write (J15), takes no hold either, so the lane stops (TL11) with a stable code.
    Before, the view showed an epoch charged that the log never held, and the failure's code
    — in the view and in the runner's log line — was a nursery's ``ExceptionGroup``."""
    faulty = failing_disk(monkeypatch)
    async with open_rig(tmp_path, clocks, WEDGED) as rig:
        await rig.runner.submit(rig.spec())
        lane = rig.runner.lane(TASK)
        await rig.until(lambda: rig.runner.show(TASK).failure is not None)
        view = rig.runner.show(TASK)
        records = await rig.records()
    assert faulty.fired
    assert view.failure is not None
    assert view.failure["code"] == "journal_poisoned"
    failed = [line for line in rig.lines if "lane failed" in line]
    assert failed  # the runner's log line names the same code
    assert all("(journal_poisoned)" in line for line in failed), failed
    assert actions(records, "reserve") == []
    assert actions(records, "fence") == []
    assert (view.budget["epochs_used"], durable_epochs(lane, records)) == (0, 0)
    assert rig.workers.launched == [1]
