"""The task-lane watchdog and its fence under orders of events nobody planned (an adversarial
review of ``docs/design/watchdog.md``): each test tries to break one rule — a silent worker
is fenced only on proof re-checked after the last await, a slow but working worker is never
killed, the budget is charged once, a hold stands until the operator or progress lifts it.
In-process Fake-Pi on virtual time (``io_autojump_clock``); suspends through the silence
clock's ``suspend``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import trio

from fake_pi._behaviours import Behaviours
from fake_pi.scenario import Hang, Step
from runtime._clock import Clocks, MockSilenceClock
from runtime._pi._rpc import RpcChannel
from runtime._pi._session import parse_session
from runtime._records import OutboxAction, Record
from runtime._tasks._epoch import EpochWatch
from runtime._tasks._lane import TaskLane
from runtime._tasks._watchdog import (
    CheckGuards,
    Classification,
    Phase,
    Probe,
    ProbeAnswered,
    Progress,
    Prompted,
    Tick,
    Watchdog,
    WatchdogPolicy,
)

from ..task_harness import TASK, done, open_rig, say, wait

HELD = "StalledOperatorRequired"


def actions(records: list[Record], kind: str) -> list[OutboxAction]:
    return [r for r in records if isinstance(r, OutboxAction) and r.kind == kind]


# ------------------------------------ TL12, WD12: a reply does not lift a hold for survivors


@pytest.mark.trio
async def test_tl12_a_reply_to_a_task_held_for_survivors_launches_no_second_tree(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """TL12, WD12: the worker asks (``task_wait``) and its stop at the end of the turn leaves
    part of its tree alive: the waiting task holds ``survivors:<pids>``. The user's reply
    then comes. It is the task's input, recorded — but it is no proof the tree is gone, and
    it is not the operator's resume: the hold stands and no epoch is launched over a tree
    that may live."""
    steps: list[Step] = [wait(), say("I asked"), done(), say()]
    async with open_rig(tmp_path, clocks, steps, survivors={1: (4242,)}) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).classification == HELD)
        assert rig.runner.show(TASK).hold_reason == "survivors:4242"
        await rig.runner.reply(TASK, "the blue one")
        await trio.sleep(3600)
        view = rig.runner.show(TASK)
        assert rig.workers.launched == [1]  # never a second tree
        assert (view.classification, view.hold_reason) == (HELD, "survivors:4242")
        rig.runner.resume(TASK)  # in-process epochs have no record to kill from: no proof
        await trio.sleep(60)
        assert rig.runner.show(TASK).hold_reason == "survivors:4242"
        assert rig.workers.launched == [1]


# ------------------------- WD6, WD10: a fence probe's answer that a later wake made stale


def append_to_session(session: Path) -> None:
    """What a working worker writes into its session: one whole entry."""
    parsed = parse_session(session.read_bytes()).require_clean()
    entry = parsed.new_entry({"type": "custom", "customType": "note"}, time_ms=1)
    with session.open("ab") as f:
        f.write(entry.raw_line + b"\n")


Answer = Callable[[int, list[float]], Awaitable[None]]


def probes_answered(monkeypatch: pytest.MonkeyPatch, answer: Answer) -> list[float]:
    """Every read-only probe's ``get_state`` goes through ``answer(number, times)`` (numbered
    from 1, ``times`` when each was asked, virtual) before the worker answers it."""
    request = RpcChannel.request
    times: list[float] = []

    async def probed(channel: RpcChannel, command: Mapping[str, Any]) -> Any:
        if command.get("type") == "get_state":
            times.append(trio.current_time())
            await answer(len(times), times)
        return await request(channel, command)

    monkeypatch.setattr(RpcChannel, "request", probed)
    return times


@pytest.mark.trio
async def test_wd6_wd10_a_fence_probe_answered_after_a_later_wake_is_not_the_fresh_one(
    tmp_path: Path,
    clocks: Clocks,
    silence_clock: MockSilenceClock,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WD6, WD10: a wedged worker's silence sees one wake (the hard clock counts from it);
    past the hard threshold and grace the fence probe is sent — and the host sleeps again as
    it asks, the worker's answer coming 10 s after the wake. The wake takes the eligibility
    back and asks for a fresh probe (the second wake of a silence re-arms it at once). That
    fresh probe is the one the fence must stand on (WD10: the quiet probe must be the last
    one sent); the old probe's quiet answer, read while the fresh one is still out, is no
    proof. Here the worker, awake again, works: it appends to its session before the fresh
    probe's answer, which so brings evidence — it is not fenced. Before, the stale answer
    was recorded under the fresh probe's number, passed every guard, and the working worker
    was fenced before the fresh probe could see it."""
    grown: list[float] = []
    session: list[Path] = []

    async def answer(number: int, times: list[float]) -> None:
        if number == 1:  # the soft probe: the host sleeps a first time
            silence_clock.suspend(60)
        elif number == 2:  # the fence probe: the host sleeps again as it asks
            silence_clock.suspend(60)
            await trio.sleep(10)  # a worker slow to answer after the wake (within the bound)
        elif number == 3:  # the fresh probe after that wake: the worker works meanwhile
            await trio.sleep(15)
            append_to_session(session[0])
            grown.append(trio.current_time())
            await trio.sleep(5)

    times = probes_answered(monkeypatch, answer)
    steps: list[Step] = [Hang(seconds=100_000), done(), say("finished")]
    async with open_rig(tmp_path, clocks, steps) as rig:
        await rig.runner.submit(rig.spec())
        session.append(rig.runner.lane(TASK).session)
        ended = await rig.ended(TASK)
        records = await rig.records()
        fenced_at = rig.first("Fencing")
    assert ended.state == "done"
    assert len(times) >= 3
    assert len(grown) == 1  # the fresh probe was answered: the worker was not fenced first
    assert fenced_at is not None
    assert fenced_at - grown[0] >= 900 + 120  # a new silence's
    assert len(actions(records, "fence")) == 1
    assert len(actions(records, "reserve")) == 1
    assert rig.workers.launched == [1, 2]


@pytest.mark.trio
async def test_wd10_wd11_two_quiet_fence_answers_at_once_charge_one_epoch(
    tmp_path: Path,
    clocks: Clocks,
    silence_clock: MockSilenceClock,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WD10, WD11: as above, but the old fence probe and the fresh one are answered at the
    same instant, both quiet — the same answer twice, as far as the guards can tell. One
    eligibility is one guard check and one fence: one epoch charged. Before, each quiet
    answer asked for the guards; both checks passed their first read, and both reserved —
    the second while the first's reserve was written, under the next continuation's id —
    so one fence charged two of the three replacement epochs."""

    async def answer(number: int, times: list[float]) -> None:
        if number == 1:
            silence_clock.suspend(60)
        elif number == 2:
            silence_clock.suspend(60)
            await trio.sleep(10)
        elif number == 3:  # the fresh probe: answered with the old one
            await trio.sleep_until(times[1] + 10)

    times = probes_answered(monkeypatch, answer)
    steps: list[Step] = [Hang(seconds=100_000), done(), say("finished")]
    async with open_rig(tmp_path, clocks, steps) as rig:
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        records = await rig.records()
        budget = rig.runner.show(TASK).budget
    assert ended.state == "done"
    assert len(times) >= 3
    assert len(actions(records, "fence")) == 1
    assert len(actions(records, "reserve")) == 1  # one fence, one epoch charged
    assert budget["epochs_used"] == 1
    assert rig.workers.launched == [1, 2]


@pytest.mark.trio
async def test_wd6_wd10_a_wake_during_the_fences_guard_check_waits_for_the_fresh_probe(
    tmp_path: Path,
    clocks: Clocks,
    silence_clock: MockSilenceClock,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WD6, WD10: a wedged worker (its silence saw one wake already) is eligible, its fence
    probe quiet, and the guards are read — and the host sleeps during that read (the
    session's, off the loop). The wake asks for a fresh fence probe, which the worker is
    slow to answer. The guard check that was under way is moot: the fresh probe's answer
    decides, and the wedged worker is fenced on it. Before, the check read "the quiet probe
    is not the last one sent" as a failed guard and held the task
    (``guard:fresh_probe_quiet``): an operator called for a worker the watchdog fences on
    its own once the fresh probe answers — however often the host sleeps (WD6)."""
    route_problem = TaskLane.route_problem
    reads: list[float] = []

    async def the_host_sleeps_during_the_first_read(lane: TaskLane) -> str | None:
        if not reads:
            reads.append(trio.current_time())
            silence_clock.suspend(60)
            await trio.sleep(6)  # a slow read: the next tick sees the wake meanwhile
        return await route_problem(lane)

    async def answer(number: int, times: list[float]) -> None:
        if number == 1:  # the soft probe: the silence's first wake
            silence_clock.suspend(60)
        elif number == 3:  # the fresh fence probe after the second wake: slow
            await trio.sleep(10)

    monkeypatch.setattr(TaskLane, "route_problem", the_host_sleeps_during_the_first_read)
    times = probes_answered(monkeypatch, answer)
    steps: list[Step] = [Hang(seconds=100_000), done(), say("finished")]
    async with open_rig(tmp_path, clocks, steps) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until_logged(lambda log: bool(actions(log, "fence") or actions(log, "hold")))
        assert actions(await rig.records(), "hold") == []  # never an operator's case
        ended = await rig.ended(TASK)
        records = await rig.records()
    assert ended.state == "done"
    assert len(reads) == 1
    assert len(times) == 3
    assert actions(records, "hold") == []
    purposes = [a.detail["purpose"] for a in actions(records, "probe")]
    assert purposes[:3] == ["soft", "fence", "fence"]
    assert len(actions(records, "fence")) == 1
    assert len(actions(records, "reserve")) == 1
    assert rig.workers.launched == [1, 2]


def test_wd10_the_same_quiet_fence_answer_twice_asks_for_the_guards_once() -> None:
    """WD10: one fence probe, one decision. Its quiet answer asks the shell to check the
    guards once; the same answer again (a second answer for the one probe sent) asks for
    nothing more — two checks at once would each reserve an epoch for one fence (WD11).
    Before, every quiet answer in ``HardResumeEligible`` asked for the guards again."""
    policy = WatchdogPolicy()
    wd = Watchdog(policy=policy)
    wd.feed(Prompted(0.0, 0.0))
    wd.feed(Progress(1.0, 1.0, Phase.PROVIDER))
    assert wd.feed(Tick(301.0, 301.0)) == [Probe("soft")]
    wd.feed(ProbeAnswered("soft", False))
    assert wd.feed(Tick(1021.0, 1021.0)) == [Probe("fence")]
    assert wd.feed(ProbeAnswered("fence", False)) == [CheckGuards()]
    assert wd.feed(ProbeAnswered("fence", False)) == []
    assert wd.feed(ProbeAnswered("fence", None)) == []  # nor a hold on a stale "no answer"
    assert wd.classification is Classification.HARD_RESUME_ELIGIBLE
    # the next eligibility (after progress: a new episode) has a probe, and a decision, anew
    wd.feed(Progress(1030.0, 1030.0, Phase.GENERATION))
    assert wd.feed(Tick(1330.0, 1330.0)) == [Probe("soft")]
    assert wd.feed(Tick(2050.0, 2050.0)) == [Probe("fence")]
    assert wd.feed(ProbeAnswered("fence", False)) == [CheckGuards()]


# ---------------- WD1, WD10: a worktree change just before the fence is progress, seen by it


@pytest.mark.trio
async def test_wd1_wd10_a_worktree_change_just_before_eligibility_is_seen_by_the_fence_probe(
    tmp_path: Path,
    clocks: Clocks,
    io_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WD1, WD10: a worker whose only sign of life is its worktree (a build writing files
    while the model request waits) changes a file 990 to 1020 s into a silence — just under
    the hard threshold and grace — right after a progress scan looked. Silence counts from
    its last change (WD1), so it is not stalled; but the next scan is up to 30 s away, and
    eligibility comes first. The fence probe must look at the worktree as it looks at the
    session: a change is evidence, and the working worker is not fenced. Before, the probe
    looked only at ``get_state`` and the session's size: every guard held and the worker
    was fenced seconds after it wrote."""
    scan = EpochWatch._worktree_progress
    written: list[float] = []

    async def a_change_right_after_a_late_scan(watch: EpochWatch) -> None:
        await scan(watch)
        wd = watch.lane.watchdog
        silent = wd.awake_silence(watch.lane.readings()[1])
        if not written and wd.armed and 990 <= silent < 1020:
            (watch.lane.worktree / "build.out").write_text("a build's output\n")
            written.append(trio.current_time())

    monkeypatch.setattr(EpochWatch, "_worktree_progress", a_change_right_after_a_late_scan)
    steps: list[Step] = [Hang(seconds=100_000), done(), say("finished")]
    # the worker starts 10 s after its prompt: its last event falls between two scans
    slow_start = {1: Behaviours(at={"agent_start:1": "delay:10"})}
    async with open_rig(tmp_path, clocks, steps, behaviours=slow_start) as rig:
        await rig.runner.submit(rig.spec())
        ended = await rig.ended(TASK)
        records = await rig.records()
        fenced_at = rig.first("Fencing")
    assert ended.state == "done"
    assert len(written) == 1
    assert fenced_at is not None
    assert fenced_at - written[0] >= 900 + 120  # its own silence
    assert len(actions(records, "fence")) == 1
    assert rig.workers.launched == [1, 2]
