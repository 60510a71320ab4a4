"""A task lane whose host has no file descriptor left (docs/design/lanes.md L21; TL2, WD11).

Real processes (Fake-Pi behind the lane's gateway and gate, :class:`ProcessWorkers`), the
real clock, and the kernel's own ``EMFILE``: the process's descriptor table is made small and
filled but for a few places (``tests/_descriptors.py``). Nothing waits on time: the table is
given back as soon as the host *says* it met the want (a want it met and did not say would
leave the test waiting, and failing), or the task ended.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Final

import pytest
import trio

from runtime import _backoff as backoff_module
from runtime._errors import ReasonCode, TaskError
from runtime._records import EpochFenced, OutboxAction, Record
from runtime._wire import TaskSpec

from .._descriptors import descriptors_left, then_cancel
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


def _said(rig: FenceRig) -> trio.Event:
    """Set at the runner's first log line that names the want of a descriptor — or a lane's
    failure, which the test then reports."""
    event = trio.Event()
    log = rig.runner.host.log

    def noticing(line: str) -> None:
        log(line)
        if str(WANT) in line or "lane failed" in line:
            event.set()

    rig.runner.host.log = noticing
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
                said = _said(rig)
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
            said = _said(rig)
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
