"""Task lanes in-process (issue #8): Fake-Pi as a task of this Trio run, virtual time.

Every test runs on ``autojump_clock``: a 20-minute stall takes milliseconds, and nothing
sleeps on the real clock. The numbered invariants (WD…, LK…, TL…) are in
``docs/design/watchdog.md``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from fake_pi._behaviours import Behaviours
from fake_pi.scenario import Hang, Step, Text
from runtime._clock import Clocks
from runtime._errors import ReasonCode
from runtime._records import ContinuationSent, EpochStarted, LifecycleReceipt, OutboxAction
from runtime._tasks import TaskError

from .task_harness import TASK, done, effect, fail, open_rig, say, wait

pytestmark = pytest.mark.trio


async def test_tl1_done_needs_the_whole_tuple_and_hands_back_a_candidate(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, clocks, [effect("write-file"), done(), say("finished")]) as rig:
        await rig.runner.submit(rig.spec())
        ended = await rig.runner.wait(TASK)
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
        ended = await rig.runner.wait(TASK)
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
        ended = await rig.runner.wait(TASK)
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
        ended = await rig.runner.wait(TASK)
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
        ended = await rig.runner.wait(TASK)
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
        ended = await rig.runner.wait(TASK)
        assert ended.state == "aborted"


async def test_wd2_a_slow_first_token_is_suspect_then_recovers_without_a_fence(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    steps: list[Step] = [Text(text="slow but fine", first_token_delay=600), done(), say()]
    async with open_rig(tmp_path, clocks, steps) as rig:
        await rig.runner.submit(rig.spec())
        ended = await rig.runner.wait(TASK)
        assert ended.state == "done"
        assert "Suspect" in rig.classifications()
        assert rig.workers.launched == [1]
        assert rig.runner.show(TASK).telemetry["false_suspects"] >= 1
        records = await rig.records()
        assert not any(isinstance(r, OutboxAction) and r.kind == "fence" for r in records)
        assert sum(isinstance(r, EpochStarted) for r in records) == 0  # in-process: no pid
