"""A task lane whose host has no file descriptor left (docs/design/lanes.md L21; TL2, WD11).

Real processes (Fake-Pi behind the lane's gateway and gate, :class:`ProcessWorkers`), the
real clock, and the kernel's own ``EMFILE``: the process's descriptor table is made small and
filled but for a few places (``tests/_descriptors.py``). Nothing waits on time: the table is
given back as soon as the host *says* it met the want (a want it met and did not say would
leave the test waiting, and failing), or the task ended.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final

import pytest
import trio

from fake_pi._behaviours import Behaviours
from runtime import _backoff as backoff_module
from runtime._clock import Clocks
from runtime._errors import ReasonCode, TaskError
from runtime._pi._session_files import aread_session
from runtime._records import ContinuationSent, EpochFenced, OutboxAction, Record
from runtime._tasks import _epoch as epoch_module
from runtime._tasks import _lane as lane_module
from runtime._tasks import _replacement
from runtime._tasks._replacement import settle_session
from runtime._tasks._runner import TaskRunner
from runtime._tasks._session import marker_in_session, reanswer_orphaned
from runtime._tasks._workers import EpochRequest
from runtime._wire import TaskSpec
from runtime.testing._in_process import InProcessWorkers

from .._descriptors import descriptors_left, then_cancel
from ..task_harness import TASK, done, open_rig, say
from .test_task_fence import LIMIT, DoneOnEveryPrompt, FenceRig, open_fence_rig

pytestmark = pytest.mark.slow

SWEEP: Final = range(14)
"""Free descriptors left when a task is submitted: from none to more than its submission,
its lane's start and its first epoch's launch need (its lane log, its session, the gateway's
and the gate's sockets, the worker's settings files, its cgroup, its pipes)."""
WANT: Final = ReasonCode.TOO_MANY_OPEN_FILES


def _spec(tmp_path: Path, task_id: str) -> TaskSpec:
    worktree = tmp_path / f"worktree-{task_id}"
    worktree.mkdir(exist_ok=True)
    (worktree / "README.md").write_text("a task's worktree\n")
    return TaskSpec(
        task_id=task_id, prompt="do it", worktree=str(worktree.resolve()), grants=frozenset()
    )


def _said(runner: TaskRunner) -> trio.Event:
    """Set at the runner's first log line that names the want of a descriptor — or a lane's
    failure, which the test then reports."""
    event = trio.Event()
    log = runner.host.log

    def noticing(line: str) -> None:
        log(line)
        if str(WANT) in line or "lane failed" in line:
            event.set()

    runner.host.log = noticing
    return event


async def _ended_or_failed(rig: FenceRig, task_id: str) -> None:
    def settled() -> bool:
        lane = rig.runner.lanes.get(task_id)
        return rig.runner.has_ended(task_id) or (lane is not None and lane.failure is not None)

    await rig.until(settled)


async def _first(*waits: Callable[[], Awaitable[object]]) -> None:
    """Return as soon as the first of ``waits`` (async callables) returns."""
    async with trio.open_nursery() as nursery:
        done = trio.Event()
        for wait in waits:

            async def run(wait: Callable[[], Awaitable[object]] = wait) -> None:
                await wait()
                done.set()

            nursery.start_soon(run)
        nursery.start_soon(then_cancel, done, nursery.cancel_scope)


def _actions(records: Sequence[Record], kind: str) -> list[OutboxAction]:
    return [r for r in records if isinstance(r, OutboxAction) and r.kind == kind]


async def test_l21_tl2_a_task_really_out_of_descriptors_at_every_step_of_its_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L21 for a task lane, with the kernel's own ``EMFILE``: for each number of free
    descriptors in :data:`SWEEP`, a task is submitted while the process has only that many
    left. Tries to break: a submission refused with a raw ``OSError`` (no reason code), a
    refused one that leaves its half-made lane behind so it can never be submitted again,
    the gateway's or gate's socket, the settings file, the cgroup or the spawn failing the
    lane (``task_lane_failed``), a launch refused for want of a descriptor charged as the
    worker's death (a replacement reserved, the budget spent), a want met and never said.
    Expected: a submission is either admitted or refused ``too_many_open_files`` (and then
    admitted when submitted again once descriptors are free); every admitted task ends done
    on one launch that worked — no reserve, no failed launch, no lane failure — and the
    sweep spans both ends: its first step meets the want, its last does not."""
    monkeypatch.setattr(backoff_module, "DESCRIPTORS_FIRST", 0.01)  # (how long: not tested)
    refused: list[int] = []
    wanted: dict[int, bool] = {}
    with trio.fail_after(LIMIT * 3):
        async with open_fence_rig(tmp_path, "fake", DoneOnEveryPrompt()) as rig:
            for k in SWEEP:
                task_id = f"t{k}"
                spec = _spec(tmp_path, task_id)
                said = _said(rig.runner)
                with descriptors_left(k) as release:
                    try:
                        await rig.runner.submit(spec)
                    except TaskError as error:
                        refusal: TaskError | None = error
                        said.set()
                    else:
                        refusal = None
                        await _first(said.wait, functools.partial(_ended_or_failed, rig, task_id))
                    release()
                if refusal is not None:
                    assert refusal.code is WANT, refusal
                    refused.append(k)
                wanted[k] = said.is_set()
                if k in refused:
                    await rig.runner.submit(spec)  # nothing of the refused one is in the way
                await _ended_or_failed(rig, task_id)
                lane = rig.runner.lanes.get(task_id)
                assert lane is None or lane.failure is None, (k, lane.failure)
                ended = await rig.runner.wait(task_id)
                assert ended.state == "done", (k, ended)
                records = list((await rig.store.read(rig.runner.log_rel(task_id))).records)
                assert _actions(records, "reserve") == [], k  # nothing charged (WD11)
                launches = [(a.state, a.detail.get("code")) for a in _actions(records, "launch")]
                assert launches == [("reserved", None), ("done", None)], (k, launches)
    assert refused, "no submission met the want"
    assert wanted[SWEEP[0]], "the sweep's first step met no want of a descriptor"
    assert not wanted[SWEEP[-1]], f"the sweep's last step ({SWEEP[-1]}) met a want too"
    assert any(wanted[k] for k in SWEEP if k not in refused), "no launch met the want"


async def test_l21_tl8_an_abort_while_the_launch_waits_for_descriptors_launches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L21, TL8: a task is admitted while its first launch cannot get a descriptor, and the
    operator aborts it while the lane waits to try again (the wait as long as it may be).
    Tries to break: the abort waiting out the lane's backoff, or a worker launched for a task
    whose end is decided. Expected: the task ends aborted at once, no worker was launched,
    its launch recorded failed ``too_many_open_files`` and nothing charged."""
    monkeypatch.setattr(backoff_module, "DESCRIPTORS_FIRST", 3600.0)
    with trio.fail_after(LIMIT):
        async with open_fence_rig(tmp_path, "fake", DoneOnEveryPrompt()) as rig:
            task_id = "t-abort"
            said = _said(rig.runner)
            with descriptors_left(4):  # its lane log and session, not its boundaries' sockets
                await rig.runner.submit(_spec(tmp_path, task_id))
                await said.wait()
                assert "launch its worker" in rig.lines[-1], rig.lines[-1]
                await rig.runner.abort(task_id)
                ended = await rig.runner.wait(task_id)
            records = list((await rig.store.read(rig.runner.log_rel(task_id))).records)
    assert ended.state == "aborted"
    assert rig.workers.launched == []
    launches = [(a.state, a.detail.get("code")) for a in _actions(records, "launch")]
    assert launches == [("reserved", None), ("failed", str(WANT))]
    assert _actions(records, "reserve") == []
    assert [r.epoch for r in records if isinstance(r, EpochFenced)] == [1]


# ------------------------------------------- the same in process, the want injected (L21)


def _wants_once(real: Callable[..., Awaitable[Any]], wants: list[int]) -> Callable[..., Any]:
    """``real``, refused ``EMFILE`` while ``wants`` holds an item (one taken per refusal)."""

    async def wanting(*args: Any, **kwargs: Any) -> Any:
        if wants:
            wants.pop()
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return await real(*args, **kwargs)

    return wanting


async def test_l21_tl7_a_restart_while_the_first_launch_waits_charges_nothing_and_keeps_the_task(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L21, TL7, TL5, WD11: a task's first launch finds no descriptor, and the host stops
    while the lane waits (the launch reserved, never made). Tries to break: the restart
    taken as one that replaced a worker — a replacement charged for a worker that never
    ran, and its continuation sent without the task, which no worker ever heard (the task
    lost). Expected: after the restart the first launch is made again, with the task as its
    prompt, and nothing is charged."""
    opened = InProcessWorkers.open

    @contextlib.asynccontextmanager
    async def refused(self: InProcessWorkers, request: EpochRequest) -> AsyncIterator[Any]:
        await trio.lowlevel.checkpoint()
        if request.number > 0:  # (every launch: the host has no descriptor left)
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        yield  # pragma: no cover

    monkeypatch.setattr(InProcessWorkers, "open", refused)
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        said = _said(rig.runner)
        await rig.runner.submit(rig.spec("paint the shed blue"))
        await said.wait()
        assert "launch its worker" in rig.lines[-1], rig.lines[-1]
    monkeypatch.setattr(InProcessWorkers, "open", opened)  # the host starts again
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        ended = await rig.ended(TASK)
        records = await rig.records()
        first = rig.model.requests[0].body["messages"]
    assert ended.state == "done"
    assert _actions(records, "reserve") == []  # nothing charged (WD11)
    assert "paint the shed blue" in json.dumps(first)  # the task reached a worker (TL5)


async def test_l21_a_replacements_settling_out_of_descriptors_waits_and_the_lane_goes_on(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L21, TL11: the first worker exits before it answers; its replacement's settling of
    the session finds no descriptor. Tries to break: the raw ``OSError`` failing the lane
    (``task_lane_failed``, no reason code, the task stuck). Expected: the want is said, the
    settling waits and is tried again, and the replacement finishes the task."""
    wants = [1]
    monkeypatch.setattr(_replacement, "reanswer_orphaned", _wants_once(reanswer_orphaned, wants))
    behaviours = {1: Behaviours(at={"prompt:1": "exit:1"})}
    async with open_rig(tmp_path, clocks, [done(), say()], behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
    assert wants == []  # the want was met
    assert any("settle its session" in line and str(WANT) in line for line in rig.lines)
    assert ended.state == "done"


async def test_l21_tl8_an_abort_while_a_step_before_the_launch_waits_launches_nothing(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L21, TL8: the first epoch's read of the session (its attestation, after the launch
    is reserved) finds no descriptor and waits as long as it may; the operator aborts the
    task, and descriptors come back at once. Tries to break: the abort waiting out the
    lane's backoff, and a worker launched for a task whose end is decided. Expected: the
    task ends aborted at once (virtual time), no worker was launched, and the reserved
    launch is recorded failed ``too_many_open_files``."""
    monkeypatch.setattr(backoff_module, "DESCRIPTORS_FIRST", 600.0)
    wants = [1]
    monkeypatch.setattr(lane_module, "aread_session", _wants_once(aread_session, wants))
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        said = _said(rig.runner)
        await rig.runner.submit(rig.spec())
        await said.wait()
        assert "read its session" in rig.lines[-1], rig.lines[-1]
        asked = trio.current_time()
        await rig.runner.abort(TASK)
        ended = await rig.ended(TASK)
        took = trio.current_time() - asked
        records = await rig.records()
    assert ended.state == "aborted"
    assert took < 1.0, took
    assert rig.workers.launched == []
    launches = [(a.state, a.detail.get("code")) for a in _actions(records, "launch")]
    assert launches == [("reserved", None), ("failed", str(WANT))]


@pytest.mark.parametrize("look", ["route_check", "marker_check"])
async def test_l21_tl4_tl5_a_replacements_look_at_the_session_out_of_descriptors_waits_not_holds(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    look: str,
) -> None:
    """L21, TL4, TL5: the first worker exits before it answers; its replacement looks at the
    session and finds no descriptor — its route check's read (TL4: the attested path, the
    frozen model), or, before it sends the continuation, the look for that continuation's
    marker (TL5: sent already?). Tries to break: the want taken for an unreadable session —
    held ``session_unreadable`` or ``prompt_marker_unknown``, an operator needed for a want
    that passes. Expected: the look waits and is tried again; the task ends done, never
    held."""
    wants = [1]
    if look == "route_check":
        monkeypatch.setattr(_replacement, "aread_session", _wants_once(aread_session, wants))
    else:
        wanting = _wants_once(marker_in_session, wants)
        monkeypatch.setattr(epoch_module, "marker_in_session", wanting)
    behaviours = {1: Behaviours(at={"prompt:1": "exit:1"})}
    async with open_rig(tmp_path, clocks, [done(), say()], behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(
            lambda: rig.runner.has_ended(TASK) or rig.runner.show(TASK).hold_reason is not None,
            within=3600,
        )
        held = rig.runner.show(TASK).hold_reason
        if held is not None:
            await rig.runner.abort(TASK)
        ended = await rig.runner.wait(TASK)
    assert held is None
    assert wants == []
    assert ended.state == "done"


def _refused_while(real: Callable[..., Awaitable[Any]], refusing: list[bool]) -> Callable[..., Any]:
    """``real``, refused ``EMFILE`` for as long as ``refusing`` holds ``True``."""

    async def wanting(*args: Any, **kwargs: Any) -> Any:
        if refusing[0]:
            await trio.lowlevel.checkpoint()
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return await real(*args, **kwargs)

    return wanting


@pytest.mark.parametrize("step", ["settle", "launch", "marker_check"])
async def test_l21_wd11_a_recovery_that_waits_for_descriptors_past_its_seconds_holds(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    step: str,
) -> None:
    """L21, WD11: the first worker exits before it answers, and its replacement — a running
    recovery, 1800 s of budget — meets a host that has no descriptor left for good at one
    step: its settling of the session, its worker's launch, or (the worker launched) its
    look for the continuation's marker. Tries to break: a recovery that waits past its
    seconds for ever, never held — a finite budget that does not bound — or one held only
    once a worker is launched after the want passes. Expected: the task holds
    ``budget_exhausted:recovery_seconds`` as the seconds run out (the wait ends then, not at
    its next doubling), the recovery charged 1800 s and no more; before the launch nothing
    is launched (a launch reserved is recorded failed ``too_many_open_files``), after it the
    live worker is held and never prompted. Once descriptors are back, a grant and a resume
    finish the task."""
    refusing = [True]
    launched = {"settle": [1], "launch": [1], "marker_check": [1, 2]}[step]
    if step == "settle":
        refused_settle = _refused_while(reanswer_orphaned, refusing)
        monkeypatch.setattr(_replacement, "reanswer_orphaned", refused_settle)
    elif step == "launch":
        opened = InProcessWorkers.open

        def launch(self: InProcessWorkers, request: EpochRequest) -> Any:
            if request.number > 1 and refusing[0]:  # the replacement's launch
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
            return opened(self, request)

        monkeypatch.setattr(InProcessWorkers, "open", launch)
    else:
        refused_look = _refused_while(marker_in_session, refusing)
        monkeypatch.setattr(epoch_module, "marker_in_session", refused_look)
    behaviours = {1: Behaviours(at={"prompt:1": "exit:1"})}
    spent = "budget_exhausted:recovery_seconds"
    async with open_rig(tmp_path, clocks, [done(), say()], behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).hold_reason == spent, within=7200)
        await trio.sleep(60)  # (virtual time) the lane's writes after the hold's are made
        assert rig.workers.launched == launched
        assert rig.runner.lane(TASK).live is (step == "marker_check")  # held, never killed
        records = await rig.records()
        (charged,) = _actions(records, "recovery_time")
        assert 1800 <= charged.detail["seconds"] < 1801, charged.detail
        launches = [(a.state, a.detail.get("code")) for a in _actions(records, "launch")]
        last = {"settle": "done", "launch": "failed", "marker_check": "done"}[step]
        assert launches[-1] == (last, str(WANT) if last == "failed" else None), launches
        assert not [r for r in records if isinstance(r, ContinuationSent)], "a prompt was sent"
        refusing[0] = False
        await rig.runner.grant(TASK, seconds=600, reason="descriptors are back")
        rig.runner.resume(TASK)
        ended = await rig.ended(TASK)
    assert ended.state == "done"


async def test_l21_wd11_lk6_a_restarts_settling_held_for_its_seconds_begins_no_epoch(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L21, WD11, LK6: the host stops while a worker runs; at the restart the lane's
    settling of the session before its next epoch (the dead host's worker may have left a
    call unanswered) finds no descriptor until the restart's recovery has spent its
    seconds. Tries to break: the epoch begun before the settling's wait (its number taken
    in the kernel), so that the operator's resume after the hold asks to begin the same
    number again and fails the lane. Expected: held ``budget_exhausted:recovery_seconds``,
    nothing launched; once descriptors are back, a grant and a resume launch epoch 2 and
    the task ends done."""
    refusing = [False]
    monkeypatch.setattr(lane_module, "settle_session", _refused_while(settle_session, refusing))
    behaviours = {1: Behaviours(at={"before_model:1": "hang"})}
    async with open_rig(tmp_path, clocks, [done(), say()], behaviours=behaviours) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.lane(TASK).live)
    refusing[0] = True  # the host starts again, with no descriptor to spare
    spent = "budget_exhausted:recovery_seconds"
    async with open_rig(tmp_path, clocks, [done(), say()]) as rig:
        await rig.until(lambda: rig.runner.show(TASK).hold_reason == spent, within=7200)
        await trio.sleep(60)  # (virtual time) the lane's writes after the hold's are made
        assert rig.workers.launched == []
        assert [a.detail["epoch"] for a in _actions(await rig.records(), "launch")] == [1, 1]
        refusing[0] = False
        await rig.runner.grant(TASK, seconds=600, reason="descriptors are back")
        rig.runner.resume(TASK)
        ended = await rig.ended(TASK)
    assert ended.state == "done"  # (a lane failed on the epoch's number never ends)
    assert rig.workers.launched == [2]
