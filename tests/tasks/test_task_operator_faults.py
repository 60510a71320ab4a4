"""Operator controls of a task lane under adversarial input and races (an adversarial review
of the operator surfaces): each test sends a control that must be refused with its stable
code, or puts one in the window of the lane's own transition, and checks that nothing is
acted on without the proof the control promises (``docs/design/watchdog.md`` WD11, TL8).
In-process Fake-Pi on virtual time (``io_autojump_clock``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import trio

from runtime._clock import Clocks
from runtime._errors import ReasonCode, TaskError
from runtime._records import OutboxAction, TaskEnded
from runtime._tasks._guards import MAX_GRANT_EPOCHS, MAX_GRANT_SECONDS, check_grant
from runtime._tasks._lane import TaskLane

from ..task_harness import TASK, open_rig, say, wait


@pytest.mark.trio
async def test_tl8_a_grant_that_waited_for_another_while_the_task_ended_is_task_ended(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TL8: a grant of an ended task is ``task_ended``, also one asked before the end that
    waited for another grant's write (grants are written one at a time, WD11) while an abort
    ended the task. Before, the waiting grant was written after the task's end record — its
    lane log, closed at the end, opened again for it and never closed — and answered as
    granted."""
    record_action = TaskLane.record_action
    first_written = trio.Event()
    release = trio.Event()

    async def slow_first_grant(
        lane: TaskLane, action_id: str, kind: str, state: str, detail: Any = None
    ) -> None:
        await record_action(lane, action_id, kind, state, detail)
        if kind == "grant" and not first_written.is_set():
            first_written.set()  # durable; its caller hears of it late (a slow fsync)
            await release.wait()

    outcome: dict[str, object] = {}

    async def second_grant(rig_runner: Any) -> None:
        try:
            await rig_runner.grant(TASK, seconds=60, reason="two")
        except TaskError as error:
            outcome["second"] = error.code
        else:
            outcome["second"] = "granted"

    async with open_rig(tmp_path, clocks, [wait(), say("asked")]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        monkeypatch.setattr(TaskLane, "record_action", slow_first_grant)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: rig.runner.grant(TASK, epochs=1, reason="one"))
            await first_written.wait()
            nursery.start_soon(second_grant, rig.runner)
            await trio.testing.wait_all_tasks_blocked()  # the second waits for the first
            await rig.runner.abort(TASK, "enough")
            ended = await rig.ended(TASK)
            release.set()
        records = await rig.records()
        open_after = rig.runner.log_rel(TASK) in rig.store._open
    assert ended.state == "aborted"
    assert outcome["second"] == ReasonCode.TASK_ENDED
    end = next(i for i, r in enumerate(records) if isinstance(r, TaskEnded))
    assert records[end + 1 :] == []  # nothing written after the end
    grants = [r for r in records if isinstance(r, OutboxAction) and r.kind == "grant"]
    assert [g.detail["reason"] for g in grants] == ["one"]
    assert not open_after  # the ended lane's log stays closed


@pytest.mark.parametrize(
    ("epochs", "seconds"),
    [
        (10**30, 0.0),  # accepted before: the budget showed 10**30 epochs left
        (MAX_GRANT_EPOCHS + 1, 0.0),
        (0, 1e308),  # accepted before; a second one made the budget inf (shown null)
        (0, MAX_GRANT_SECONDS + 1),
        (0, math.inf),
        (0, math.nan),
        (1, -1.0),
        (0, 0.0),
    ],
)
@pytest.mark.trio
async def test_wd11_a_grant_beyond_its_bound_is_task_invalid_and_nothing_is_written(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    epochs: int,
    seconds: float,
) -> None:
    """WD11: an operator grant adds a bounded amount — at most ``MAX_GRANT_EPOCHS`` epochs
    and ``MAX_GRANT_SECONDS`` seconds at once — and anything else is ``task_invalid`` before
    a record is written. Before, ``task grant --epochs 10**30`` (or two grants of ``1e308``
    seconds, whose sum is ``inf``) was recorded and switched the recovery budget off, the
    view showing a number, or ``null`` where the seconds left were."""
    async with open_rig(tmp_path, clocks, [wait(), say("asked")]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        before = rig.runner.show(TASK).budget
        with pytest.raises(TaskError) as refused:
            await rig.runner.grant(TASK, epochs=epochs, seconds=seconds, reason="too much")
        after = rig.runner.show(TASK).budget
        records = await rig.records()
        # the bound itself is a grant like any other
        await rig.runner.grant(
            TASK, epochs=MAX_GRANT_EPOCHS, seconds=MAX_GRANT_SECONDS, reason="the most"
        )
        granted = rig.runner.show(TASK).budget
        await rig.runner.abort(TASK, "enough")
        await rig.ended(TASK)
    assert refused.value.code == ReasonCode.TASK_INVALID
    assert after == before
    assert not [r for r in records if isinstance(r, OutboxAction) and r.kind == "grant"]
    assert (granted["granted_epochs"], granted["granted_seconds"]) == (
        MAX_GRANT_EPOCHS,
        MAX_GRANT_SECONDS,
    )


def test_wd11_check_grant_bounds_each_grant() -> None:
    check_grant(epochs=MAX_GRANT_EPOCHS, seconds=0.0)
    check_grant(epochs=0, seconds=MAX_GRANT_SECONDS)
    for epochs, seconds in [(MAX_GRANT_EPOCHS + 1, 0.0), (0, MAX_GRANT_SECONDS * 2), (0, 0.0)]:
        with pytest.raises(ValueError, match="grant again for more"):
            check_grant(epochs=epochs, seconds=seconds)


@pytest.mark.trio
@pytest.mark.parametrize("validation", [("true\x00",), ("sh", "-c", "exit 0\x00")])
async def test_tl1_a_validation_command_with_a_nul_byte_is_refused_at_submission(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    validation: tuple[str, ...],
) -> None:
    """TL1: a validation command no process can be started with — an argument holding a NUL
    byte (the admin socket's and the wire's JSON carry one, ``\\u0000``) — is ``task_invalid``
    at submission, and nothing is admitted. Before, it was admitted, the worker did the whole
    task, and at its Done the validation's start raised ``ValueError: embedded null byte``
    (not the ``OSError`` that gives a 127 receipt): the lane failed (``task_lane_failed``)
    instead of a coded refusal up front."""
    async with open_rig(tmp_path, clocks, [wait(), say("asked")]) as rig:
        with pytest.raises(TaskError) as refused:
            await rig.runner.submit(rig.spec(validation=validation))
        known = rig.runner.task_ids()
    assert refused.value.code == ReasonCode.TASK_INVALID
    assert "validation" in refused.value.message
    assert list(known) == []
