"""Adversarial checks of retention (docs/design/retention.md RT4, RT12, RT19): each tries to
break one rule — a damaged expired-id filter read as empty, and a task id used again let go
by its earlier task's entry — on a real file store (the task runner in process, virtual
time; the wall clock retention ages by moved by days)."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest
import trio
import trio.testing

from fake_pi.scenario import Step
from runtime._clock import Clocks, MockWallClock
from runtime._config import RetentionConfig
from runtime._errors import JournalError, ReasonCode
from runtime._journal._expired import EXPIRED, read_expired
from runtime._journal._store import TASKS_EXPIRED, delivery_key, lane_key, open_store
from runtime._linux._fs import OsFileSystem
from runtime._retention import follow_forget_days
from runtime._tasks._retention import TaskRetention

from .task_harness import TASK, done, open_rig, say

pytestmark = pytest.mark.trio

DAY: Final = 86_400.0
DAY_MS: Final = 86_400_000
STEPS: Final[list[Step]] = [done(), say("finished"), done(), say("finished again")]
"""The task's first life, then its second under the same id."""


@pytest.mark.parametrize("name", [EXPIRED, TASKS_EXPIRED])
async def test_rt4_rt19_an_expired_id_filter_found_empty_fails_closed(
    tmp_path: Path, clocks: Clocks, name: str
) -> None:
    """RT4, RT19: a filter every write leaves with its header, found empty (a disk that lost
    what it held), is ``journal_corrupt`` at the start — never read as an empty filter, which
    would admit every expired delivery (or task) again as new. Before, an empty file was
    read as no filter at all: the host started and a duplicate of an expired id ran again."""
    state = tmp_path / "state"
    with trio.fail_after(30):
        async with open_store(state, clocks=clocks) as store:
            now = clocks.wall.time_ms()
            await store.expire({"d1": now}, forget_ms=365 * DAY_MS)
            await store.expire_tasks({"t1": now}, forget_ms=365 * DAY_MS)
            assert store.expired.holds(delivery_key("d1"), now_ms=now)
        (state / name).write_bytes(b"")
        with pytest.raises(JournalError) as refused:
            async with open_store(state, clocks=clocks):
                pass
    assert refused.value.code == ReasonCode.JOURNAL_CORRUPT
    with pytest.raises(JournalError):  # ``journal verify`` reads it the same way
        read_expired(OsFileSystem(), str(state / name), rel=name)


async def test_rt4_every_single_bit_flipped_in_the_filter_fails_closed(
    tmp_path: Path, clocks: Clocks
) -> None:
    """RT4: every one bit of a written filter flipped — its magic, count, checksum, days, a
    key, a time — is ``journal_corrupt`` at the start, never another filter (a flipped bit
    must not turn an expired delivery into a new one). Sound before: a check that it stays."""
    state = tmp_path / "state"
    with trio.fail_after(60):
        async with open_store(state, clocks=clocks) as store:
            now = clocks.wall.time_ms()
            await store.expire({"d1": now, "d2": now - DAY_MS}, forget_ms=365 * DAY_MS)
        data = (state / EXPIRED).read_bytes()
        for bit in range(len(data) * 8):
            damaged = bytearray(data)
            damaged[bit // 8] ^= 1 << (bit % 8)
            (state / EXPIRED).write_bytes(bytes(damaged))
            with pytest.raises(JournalError) as refused:
                read_expired(OsFileSystem(), str(state / EXPIRED))
            assert refused.value.code == ReasonCode.JOURNAL_CORRUPT, bit
        (state / EXPIRED).write_bytes(data)
        async with open_store(state, clocks=clocks) as store:
            assert store.expired.holds(delivery_key("d2"), now_ms=now)


@pytest.mark.parametrize("how", ["clock-set-back", "forget-days-raised"])
async def test_rt12_rt19_a_task_id_used_again_is_not_let_go_by_its_earlier_tasks_entry(
    tmp_path: Path,
    clocks: Clocks,
    wall_clock: MockWallClock,
    io_autojump_clock: trio.testing.MockClock,
    how: str,
) -> None:
    """RT12, RT19: a task expired at day 31 (``forget_days`` 40) is let go at day 40; its id
    is submitted again at day 41 and that task ends. Its earlier task's entry, which still
    lies in the filter, then holds the id back again — the wall clock set back three days, or
    the host restarted with ``forget_days`` 400 — and a pass finds the new task ended with
    its id "expired already". That entry is not this task's (it counts from before this
    task's end): the pass ages the new task from its own end, keeps its lane and its
    record, and ``task show`` says its end. Before, the pass took it for a task whose forget
    or expiry had been cut short and removed its lane directory the day after it ended —
    its idempotency record gone some 29 days early."""
    days40 = RetentionConfig(journal_days=7, idempotency_days=30, forget_days=40)
    days400 = RetentionConfig(journal_days=7, idempotency_days=30, forget_days=400)
    lane = tmp_path / "state" / "lanes" / lane_key(f"task:{TASK}")
    async with open_rig(tmp_path, clocks, STEPS) as rig:
        await rig.runner.submit(rig.spec())
        await rig.ended(TASK)
        wall_clock.advance(31 * DAY)
        assert (await rig.runner.retain(days40)).expired == (TASK,)
        wall_clock.advance(10 * DAY)  # day 41: let go at day 40, the entry still there
        await rig.runner.submit(rig.spec())
        await rig.ended(TASK)
        wall_clock.advance(DAY)
        retention = days40
        if how == "clock-set-back":
            wall_clock.advance(-3 * DAY)
            assert rig.store.expired_tasks.holds(
                lane_key(f"task:{TASK}"), now_ms=clocks.wall.time_ms()
            )
            passed = await rig.runner.retain(retention)
            state = rig.runner.show(TASK).state
    if how == "forget-days-raised":
        retention = days400
        async with open_store(tmp_path / "state", clocks=clocks) as store:
            await follow_forget_days(store, days400)  # what a host's start does (RT4)
        async with open_rig(tmp_path, clocks, []) as rig:
            assert rig.store.expired_tasks.holds(
                lane_key(f"task:{TASK}"), now_ms=clocks.wall.time_ms()
            )
            passed = await rig.runner.retain(retention)
            state = rig.runner.show(TASK).state
    assert passed == TaskRetention()
    assert state == "done"
    assert (lane / "lane.log").is_file()
