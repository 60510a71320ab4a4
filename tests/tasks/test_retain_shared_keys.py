"""Task retention on a shared store (``docs/design/retention.md`` RT13, RT19): a pass deletes
a task's lane log, and records its id expired, only for the task it is retaining — never
for another task under the same id (an id let go and submitted again), whatever a host
still remembers. Real PostgreSQL (pgserver), two task hosts on one database, the wall clock a
mock moved on by days."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest
import trio
import trio.testing

from fake_pi.scenario import Step
from runtime._clock import Clocks, MockWallClock
from runtime._config import RetentionConfig
from runtime._errors import ReasonCode, TaskError
from runtime._journal._store import lane_key
from runtime._records import TaskEnded
from runtime._retention import follow_forget_days
from runtime._tasks._retention import TaskRetention

from ..journal.pg_fixtures import execute, pg_dsn, pg_server
from ..task_harness import TASK, done, open_rig, say
from .test_task_hosts import LIMIT, TaskHost, lane_records, spec, task_host
from .test_task_retention_budget_adversarial import DAY, DAY_MS, _shared

__all__ = ["pg_dsn", "pg_server"]  # the fixtures this module uses

ONE_LIFE: Final[list[Step]] = [done(), say("finished")]


def _days(idempotency: int, forget: int) -> RetentionConfig:
    return RetentionConfig(journal_days=7, idempotency_days=idempotency, forget_days=forget)


@pytest.mark.trio
@pytest.mark.parametrize("how", ["forget-days-equal", "forget-days-raised"])
async def test_rt13_rt19_a_pass_never_expires_a_later_task_under_an_id_a_host_remembers(
    tmp_path: Path, pg_dsn: str, how: str
) -> None:
    """RT13, RT19: host A runs TASK, which ends at day 0; A keeps it in memory as ended past
    its let-go — with ``forget_days`` equal to ``idempotency_days`` (a valid setting) its
    own pass at day 31 expires it with a row no longer held, so it never finds it "held
    expired"; or host B (which learned it) expires it at day 31 while A's passes do not run
    until day 42. The id is let go, and B runs TASK again as a new task, which ends. A's
    next pass must leave that later task alone: its log stays in the database (a duplicate
    is answered with its end, never run again, never ``task_expired`` a day after it
    ended), and A lets its own stale task go instead of answering a submission with it.
    Before, A's pass claimed the lane and deleted the later task's log as its earlier
    task's expiry (and, ``forget_days`` raised, the earlier row held the id back: the later
    task was ``task_expired`` the day after it ended)."""
    wall = MockWallClock()
    clocks = Clocks(wall=wall)
    subject = f"task:{TASK}"
    equal = how == "forget-days-equal"
    first = _days(30, 30 if equal else 40)
    with trio.fail_after(LIMIT):
        async with (
            task_host(tmp_path, "a", pg_dsn, ONE_LIFE, clocks=clocks) as a,
            task_host(tmp_path, "b", pg_dsn, ONE_LIFE, clocks=clocks) as b,
        ):
            store = _shared(a)
            await follow_forget_days(a.runner.host.store, first)
            await a.runner.submit(spec(tmp_path))
            earlier_end = (await a.runner.wait(TASK)).ended_ms
            ran_out = "UPDATE pi_runtime.lanes SET lease_until = now() WHERE lane = %s"
            await execute(pg_dsn, ran_out, [store.lane_rel(subject)])  # A's lease: released
            wall.advance(31 * DAY)
            if equal:
                assert await a.runner.retain(first) == TaskRetention(expired=(TASK,))
                wall.advance(1 * DAY)  # day 32
            else:
                await b.runner.claim_orphans()  # B learns the ended task
                assert b.runner.show(TASK).state == "done"
                assert await b.runner.retain(first) == TaskRetention(expired=(TASK,))
                wall.advance(10 * DAY)  # day 41: let go
            _view, admitted = await b.runner.admit(spec(tmp_path))  # the id, new again
            assert admitted
            later_end = (await b.runner.wait(TASK)).ended_ms
            await execute(pg_dsn, ran_out, [store.lane_rel(subject)])  # B's lease: released
            assert later_end > earlier_end
            retention = first
            if not equal:  # a host's start raises forget_days: the earlier row holds again
                retention = _days(30, 400)
                await follow_forget_days(a.runner.host.store, retention)
            wall.advance(1 * DAY)
            passed = await a.runner.retain(retention)  # A's pass: it remembers the earlier task
            log_kept = await store.exists(store.lane_rel(subject))
            kept = await lane_records(b) if log_kept else []
            ends = [r.ended_ms for r in kept if isinstance(r, TaskEnded)]
            held = await store.expired_task_keys([lane_key(subject)])
            try:
                shown_on_a: str | int = a.runner.show(TASK).state
            except TaskError as error:
                shown_on_a = str(error.code)
            await a.runner.claim_orphans()  # A learns what the database holds of the id
            try:  # a duplicate of the later task, sent to A
                again, admitted_again = await a.runner.admit(spec(tmp_path))
                answer = again.state
            except TaskError as error:
                answer, admitted_again = str(error.code), False
    assert passed.expired == ()  # nothing of A's to expire: its task was let go already
    assert log_kept  # the later task's record, a day after it ended
    assert ends == [later_end]
    key = lane_key(subject)  # the row, if any, is the earlier task's, held again (RT19)
    assert held == ({} if equal else {key: earlier_end + 400 * DAY_MS})
    assert shown_on_a != "done"  # A no longer answers with the earlier task it let go
    assert (answer, admitted_again) == ("done", False)  # answered, never run again
    assert shown_on_a != ReasonCode.TASK_EXPIRED.value  # nor as expired


@pytest.mark.trio
async def test_rt13_two_hosts_retaining_at_once_expire_the_task_once(
    tmp_path: Path, pg_dsn: str
) -> None:
    """RT13: A ran TASK to its end and B learned it; at day 31 both hosts' passes run at
    once. The lane's claim lets one of them expire it (the row at its own end, the log
    gone), the other finds nothing to do; both let the task go, and a submission to
    either is ``task_expired``."""
    wall = MockWallClock()
    clocks = Clocks(wall=wall)
    subject = f"task:{TASK}"
    retention = _days(30, 40)
    with trio.fail_after(LIMIT):
        async with (
            task_host(tmp_path, "a", pg_dsn, ONE_LIFE, clocks=clocks) as a,
            task_host(tmp_path, "b", pg_dsn, ONE_LIFE, clocks=clocks) as b,
        ):
            store = _shared(a)
            await follow_forget_days(a.runner.host.store, retention)
            await a.runner.submit(spec(tmp_path))
            end = (await a.runner.wait(TASK)).ended_ms
            ran_out = "UPDATE pi_runtime.lanes SET lease_until = now() WHERE lane = %s"
            await execute(pg_dsn, ran_out, [store.lane_rel(subject)])  # A's lease: released
            await b.runner.claim_orphans()
            wall.advance(31 * DAY)
            passes: list[TaskRetention] = []

            async def retain(host: TaskHost) -> None:
                passes.append(await host.runner.retain(retention))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(retain, a)
                nursery.start_soon(retain, b)
            for host in (a, b):  # a pass that could not claim the lane learns it at its next
                await host.runner.retain(retention)
            log_left = await store.exists(store.lane_rel(subject))
            held = await store.expired_task_keys([lane_key(subject)])
            answers = []
            for host in (a, b):
                with pytest.raises(TaskError) as caught:
                    await host.runner.submit(spec(tmp_path))
                answers.append(caught.value.code)
    assert sorted(p.expired for p in passes) == [(), (TASK,)]
    assert not log_left
    assert held == {lane_key(subject): end + 40 * DAY_MS}
    assert answers == [ReasonCode.TASK_EXPIRED, ReasonCode.TASK_EXPIRED]


@pytest.mark.trio
async def test_rt12_rt19_the_file_store_keeps_a_later_task_under_an_id_let_go_at_once(
    tmp_path: Path,
    clocks: Clocks,
    wall_clock: MockWallClock,
    io_autojump_clock: trio.testing.MockClock,
) -> None:
    """RT12, RT19, the file store's side of the same rule: with ``forget_days`` equal to
    ``idempotency_days`` the pass at day 31 expires TASK and lets it go at once; submitted
    again at day 32 it runs as new and ends. The next pass leaves that later task alone —
    its lane log stays, ``task show`` and a duplicate answer its end — and expires it only
    at its own ``idempotency_days``."""
    retention = _days(30, 30)
    async with open_rig(tmp_path, clocks, [*ONE_LIFE, *ONE_LIFE]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.ended(TASK)
        wall_clock.advance(31 * DAY)
        assert (await rig.runner.retain(retention)).expired == (TASK,)
        wall_clock.advance(1 * DAY)
        _view, admitted = await rig.runner.admit(rig.spec())
        assert admitted
        later_end = (await rig.ended(TASK)).ended_ms
        wall_clock.advance(1 * DAY)
        kept = await rig.runner.retain(retention)
        log = rig.store.root / rig.store.lane_rel(f"task:{TASK}")
        log_kept = log.exists()
        shown = rig.runner.show(TASK).state
        _again, admitted_again = await rig.runner.admit(rig.spec())
        wall_clock.advance(30 * DAY)  # the later task's own idempotency_days
        last = await rig.runner.retain(retention)
    assert kept == TaskRetention()
    assert log_kept
    assert shown == "done"
    assert not admitted_again
    assert later_end > 0
    assert last.expired == (TASK,)
    assert not log.exists()
