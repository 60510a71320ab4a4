"""What a host holds as proof while it takes a task lane over (docs/design/scale-out.md S12,
S31, S32): a task lane runs, and takes controls, only while this host holds its lease — one
lost while the lane was being claimed and restored is not run on a lease nobody renews. A real,
throw-away PostgreSQL; Fake-Pi in-process on the scripted model; leases on the database's
clock (real time).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Final

import pytest
import trio

from runtime._errors import DiskFailedError, ReasonCode, TaskError
from runtime._journal._fence import Fence
from runtime._journal._postgres import PgStore
from runtime._journal._store import lane_key
from runtime._tasks._lane import TaskLane
from runtime._tasks._runner import TaskRunner

from ..journal.pg_fixtures import execute, pg_dsn, pg_server
from ..task_harness import TASK, done, say, wait
from .test_task_hosts import (
    STOP_BOUND,
    expire_leases,
    lane_records,
    launch_hosts,
    spec,
    task_host,
    waiting_on_shared_storage,
)

__all__ = ["pg_dsn", "pg_server"]  # the fixtures this module uses
LIMIT: Final = 60.0
LANE: Final = f"task:{TASK}"


async def test_s31_s32_a_lane_whose_lease_is_lost_while_it_is_restored_is_not_run(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S12, S31, S32: A's task waits for its user; A's lease runs out and B (shared
    worktrees, a 3 s lease) claims the lane. While B restores it, B's renewals fail (the
    database out of its reach) past their deadline: B's lease keeper gives the lane up — the
    lease may run out, and another host may claim it. The lane was not B's runner's yet when
    that was said, so nothing stopped it: it must not be run now on a lease nobody renews,
    nor take a control (the user's reply sent to B is ``task_elsewhere``). B's next look
    claims it again, under a new epoch, and then runs it to its one end."""
    lost = trio.Event()
    told = TaskRunner._lost

    def lost_and_told(self: TaskRunner, name: str, fence: Fence, why: str) -> None:
        told(self, name, fence, why)
        if name == LANE:
            lost.set()

    with trio.fail_after(LIMIT):
        async with task_host(
            tmp_path, "a", pg_dsn, [wait(), say("asked")], state="shared", shared_worktrees=True
        ) as a:
            await a.runner.submit(spec(tmp_path))
            await a.until(lambda: a.runner.show(TASK).state == "waiting")
            await a.until(lambda: not a.runner.lane(TASK).live)
            monkeypatch.setattr(TaskRunner, "_lost", lost_and_told)  # (B's, made below)
            async with task_host(
                tmp_path, "b", pg_dsn, [done(), say()], lease=3.0, state="shared",
                shared_worktrees=True,
            ) as b:  # fmt: skip
                store = b.runner.host.store
                assert isinstance(store, PgStore)
                assert b.runner.leases is not None
                renew, restore = store.renew, TaskLane.open

                async def partitioned(fences: Sequence[Fence], ttl: float) -> set[Fence]:
                    if lost.is_set():  # the partition heals once the lane is lost
                        return await renew(fences, ttl)
                    raise DiskFailedError(ReasonCode.STORE_UNAVAILABLE, "partitioned (the test)")

                async def restored_past_the_deadline(lane: TaskLane) -> None:
                    await restore(lane)
                    if lane.host is b.runner.host:
                        await lost.wait()  # B's keeper: not renewed in time (S12)

                await expire_leases(pg_dsn, ago=STOP_BOUND)
                monkeypatch.setattr(store, "renew", partitioned)
                monkeypatch.setattr(TaskLane, "open", restored_past_the_deadline)
                await b.runner.claim_orphans()
                held_after_the_look = b.runner.leases.fence(LANE)
                with pytest.raises(TaskError) as refused:
                    await b.runner.reply(TASK, "the blue one")
                await b.until(lambda: TASK not in b.runner.lanes)
                launched_meanwhile = list(b.workers.launched)
                await b.runner.claim_orphans()  # its next look: claimed again, and run
                again = b.runner.leases.fence(LANE)
                await b.runner.reply(TASK, "the blue one")
                ended = await b.runner.wait(TASK)
                records = await lane_records(b)
    assert held_after_the_look is None
    assert refused.value.code is ReasonCode.TASK_ELSEWHERE
    assert launched_meanwhile == []
    assert again is not None
    assert ended.state == "done"
    assert launch_hosts(records) == ["a", "b"]
    replies = [r for r in records if type(r).__name__ == "TaskReply"]
    assert len(replies) == 1


async def test_s12_s32_on_shared_storage_a_task_is_claimed_only_once_its_holders_tree_is_stopped(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S12, S32: on shared storage (``shared_worktrees``) the host claiming a task whose
    holder's lease ran out resumes it in the same worktree and session — and kills nothing
    of the last epoch, which may be another machine's: that tree is stopped by its own host,
    from its own deadline (S12). That stop — TERM, ``term_grace_seconds`` for the worker to
    exit, then the whole tree KILLed within ``kill_bound_seconds`` — outlasts the lease's
    margin (a tenth of it), so a lease that ran out a moment ago is no proof the tree is gone:
    claimed then, two trees would work in one worktree and one session. B claims A's task
    only once the lease has been out for the task's stop bound (its policy, frozen at its
    submission), and then resumes it to its one end."""
    rel = f"lanes/{lane_key(LANE)}/lane.log"
    with trio.fail_after(LIMIT):
        async with waiting_on_shared_storage(tmp_path, pg_dsn) as (a, b):
            await execute(  # A's lease ran out just now (A paused, or cut off)
                pg_dsn, "UPDATE pi_runtime.lanes SET lease_until = now() WHERE lane = %s", [rel]
            )
            await b.runner.claim_orphans()
            assert (list(b.runner.lanes), b.runner.elsewhere) == ([], {TASK: "a"})  # too soon
            await execute(  # ... and now it has been out for the stop bound
                pg_dsn,
                "UPDATE pi_runtime.lanes SET lease_until = now() - make_interval(secs => %s) "
                "WHERE lane = %s",
                [STOP_BOUND, rel],
            )
            await b.runner.claim_orphans()
            claimed = b.runner.show(TASK)
            await a.until(lambda: TASK not in a.runner.lanes)
            await b.runner.reply(TASK, "the blue one")
            ended = await b.runner.wait(TASK)
            records = await lane_records(b)
    assert (claimed.state, claimed.hold_reason) == ("waiting", None)
    assert ended.state == "done"
    assert launch_hosts(records) == ["a", "b"]
