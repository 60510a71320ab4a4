"""Retention of ended tasks on a shared store (docs/design/retention.md RT13): two hosts of
one deployment on a real PostgreSQL, in one process, the in-process Fake-Pi on the scripted
model; the wall clock (what retention ages by) is one mock clock both hosts read, moved by
days, while leases run on the database's clock.

An ended task's lane log rows are slimmed ``journal_days`` after its end and expired
``idempotency_days`` after it by whichever host's pass first claims the task's lane (the claim
moves the lane's epoch on: a late writer of an earlier epoch is refused); every host removes
its own session and work directories, and its lane directory once the database says the task
expired. A submission to any host is then ``task_expired``; a task that has not ended is never
touched; a lane someone holds is left for a later pass."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest
import trio

from fake_pi.scenario import Step
from runtime._clock import Clocks, MockWallClock
from runtime._config import RetentionConfig
from runtime._errors import JournalError, ReasonCode
from runtime._journal._leases import fenced_out
from runtime._journal._postgres import open_pg_store
from runtime._journal._store import lane_key
from runtime._records import Compacted, Header, Record, TaskEnded, TaskSubmitted
from runtime._tasks._retention import TaskRetention, work_dirs
from runtime._wire import TaskSpec

from ..journal.pg_fixtures import execute, pg_dsn, pg_server
from ..task_harness import TASK, done, say, wait
from .test_task_hosts import LIMIT, TaskHost, spec, task_host
from .test_task_retention import _Refused

__all__ = ["pg_dsn", "pg_server"]  # the fixtures this module uses

pytestmark = pytest.mark.trio

DAY: Final = 86_400.0
RETENTION: Final = RetentionConfig(journal_days=7, idempotency_days=30, forget_days=40)
LIVE: Final = "task-live"
SUBJECT: Final = f"task:{TASK}"
A_STEPS: Final[list[Step]] = [done(), say("finished"), wait()]
"""A's model: the ended task's answer and reply, then the live task's wait."""


async def records_of(host: TaskHost, task_id: str = TASK) -> list[Record]:
    store = host.runner.host.store
    return list((await store.read(store.lane_rel(f"task:{task_id}"))).records)


async def ended_and_live(tmp_path: Path, a: TaskHost) -> None:
    """TASK ends done on A; LIVE, on another worktree, waits for its user there."""
    await a.runner.submit(spec(tmp_path))
    await a.runner.wait(TASK)
    live_tree = tmp_path / "live"
    live_tree.mkdir(exist_ok=True)
    await a.runner.submit(
        TaskSpec(task_id=LIVE, prompt="another task", worktree=str(live_tree),
                 grants=frozenset({"read"}))
    )  # fmt: skip
    await a.until(lambda: a.runner.show(LIVE).state == "waiting")


async def test_rt13_an_ended_task_is_slimmed_then_expired_for_the_whole_deployment(
    tmp_path: Path, pg_dsn: str
) -> None:
    """RT13: A runs the task to its end; B learns of it from the database. Day 6: nothing.
    Day 8: B's pass slims the rows to the submission and end (a new header, a ``Compacted``
    mark) — once —, A's session and work directories stay until A's own pass removes them;
    a duplicate sent to B gets the ended view, a changed one ``task_conflict``. Day 31: B's
    pass expires it — its rows gone, its id recorded —, A's pass removes A's lane directory
    and forgets the task: a submission to A, to B and to a host started after is
    ``task_expired``, ``task show`` on A too. The task waiting for its user, as old, is never
    touched. Past ``forget_days`` the id is let go: a submission runs it as new."""
    wall = MockWallClock()
    clocks = Clocks(wall=wall)
    with trio.fail_after(LIMIT):
        async with (
            task_host(tmp_path, "a", pg_dsn, A_STEPS, clocks=clocks) as a,
            task_host(tmp_path, "b", pg_dsn, [done(), say("again")], clocks=clocks) as b,
        ):  # fmt: skip
            await ended_and_live(tmp_path, a)
            await b.runner.claim_orphans()  # B learns TASK ended, LIVE is A's
            assert b.runner.elsewhere == {LIVE: "a"}
            before = await records_of(a)
            live_before = await records_of(a, LIVE)
            session = tmp_path / "a" / "state" / a.runner.show(TASK).session_path
            home, tmp = work_dirs(tmp_path / "a" / "work", TASK)
            assert session.is_file()
            assert home.is_dir()

            wall.advance(6 * DAY)
            assert await b.runner.retain(RETENTION) == TaskRetention()
            assert await a.runner.retain(RETENTION) == TaskRetention()
            assert await records_of(b) == before

            wall.advance(2 * DAY)
            assert await b.runner.retain(RETENTION) == TaskRetention(slimmed=(TASK,))
            slim = await records_of(b)
            assert [type(r) for r in slim] == [Header, Compacted, TaskSubmitted, TaskEnded]
            assert slim[2:] == [r for r in before if isinstance(r, TaskSubmitted | TaskEnded)]
            assert session.is_file()  # A's own copies: A's pass removes them
            assert await a.runner.retain(RETENTION) == TaskRetention()  # slim already
            assert not session.exists()
            assert not home.exists()
            assert not tmp.exists()
            assert await records_of(a) == slim
            assert (await b.runner.submit(spec(tmp_path))).state == "done"  # a duplicate
            assert b.runner.show(TASK).state == "done"  # B shows what A ended
            with _Refused(ReasonCode.TASK_CONFLICT):
                await b.runner.submit(spec(tmp_path, prompt="another task"))
            assert (await a.runner.submit(spec(tmp_path))).state == "done"

            wall.advance(23 * DAY)
            assert await b.runner.retain(RETENTION) == TaskRetention(expired=(TASK,))
            with pytest.raises(FileNotFoundError):
                await records_of(b)
            rows = await execute(pg_dsn, "SELECT task_id FROM pi_runtime.expired_tasks")
            assert rows == [(TASK,)]
            lane_dir = tmp_path / "a" / "state" / "lanes" / lane_key(SUBJECT)
            assert lane_dir.is_dir()
            assert await a.runner.retain(RETENTION) == TaskRetention()
            assert not lane_dir.exists()
            for host in (a, b):
                with _Refused(ReasonCode.TASK_EXPIRED):
                    await host.runner.submit(spec(tmp_path))
            with _Refused(ReasonCode.TASK_EXPIRED):
                a.runner.show(TASK)
            live_after = await records_of(a, LIVE)  # RT1: never touched — its own lane may
            assert live_after[: len(live_before)] == live_before  # have appended meanwhile
            assert not [r for r in live_after if isinstance(r, Compacted)]  # (its epoch's end)
            assert a.runner.show(LIVE).state == "waiting"
            async with task_host(tmp_path, "c", pg_dsn, [], clocks=clocks) as c:
                with _Refused(ReasonCode.TASK_EXPIRED):
                    await c.runner.submit(spec(tmp_path))

            wall.advance(10 * DAY)  # day 41: past forget_days (40) after its end
            assert await b.runner.retain(RETENTION) == TaskRetention()
            assert await execute(pg_dsn, "SELECT task_id FROM pi_runtime.expired_tasks") == []
            view = await b.runner.submit(spec(tmp_path))  # a new task under the old id
            assert view.ended is None  # not the old one's view
            assert (await b.runner.wait(TASK)).state == "done"
    assert b.model.request_count == 2


async def test_rt13_a_held_lane_is_left_and_a_late_writer_is_fenced_out(
    tmp_path: Path, pg_dsn: str
) -> None:
    """RT13: a host Z holds the ended task's lane (a zombie: it claimed the lane and was
    paused). While Z's lease runs, a pass slims nothing; once it ran out, the pass claims the
    lane — its epoch moves on — and slims it; Z, resumed, tries to append under its old
    epoch: refused by the fence, and the slim log stays as the pass wrote it."""
    wall = MockWallClock()
    clocks = Clocks(wall=wall)
    with trio.fail_after(LIMIT):
        async with (
            task_host(tmp_path, "a", pg_dsn, A_STEPS, clocks=clocks) as a,
            open_pg_store(pg_dsn, root=tmp_path / "z" / "state", owner="z", clocks=clocks) as z,
        ):  # fmt: skip
            await ended_and_live(tmp_path, a)
            zombie = await z.claim(SUBJECT, 600.0)
            assert zombie is not None
            late = await z.open_lane_log(SUBJECT, fence=zombie)
            wall.advance(8 * DAY)
            assert await a.runner.retain(RETENTION) == TaskRetention()  # held: left
            assert len(await records_of(a)) > 4
            await execute(
                pg_dsn, "UPDATE pi_runtime.lanes SET lease_until = now() WHERE owner = 'z'"
            )
            assert await a.runner.retain(RETENTION) == TaskRetention(slimmed=(TASK,))
            slim = await records_of(a)
            with pytest.raises(JournalError) as refusal:
                await late.append(Compacted(compacted_ms=0, removed=0))
            assert fenced_out(refusal.value)
            assert await records_of(a) == slim
            assert [type(r) for r in slim] == [Header, Compacted, TaskSubmitted, TaskEnded]


@pytest.mark.parametrize("point", ["retention:slim_log", "retention:expire_task"])
async def test_rt13_a_host_killed_in_a_retention_pass_loses_nothing_and_runs_nothing_again(
    point: str, tmp_path: Path, pg_dsn: str
) -> None:
    """A task-runner host on PostgreSQL (``tests/tasks/task_host.py``, real Fake-Pi workers,
    the real clock moved on by days) is SIGKILLed right after a transaction of its retention
    pass committed — the rows slimmed (its lease on the lane not released, its session not
    yet removed), or the task expired (its lane directory not yet removed) — and the host
    started again on the same state directory runs the passes again: the task ends up let go
    exactly as without the crash (its rows gone, its id recorded once, its lane directory and
    session gone, a resubmission ``task_expired``), and the model is asked nothing more."""
    from .test_task_crash import crash_rig, kill_when_paused, recover, task_spec

    async with crash_rig(tmp_path, [done(), say("finished")]) as (model, url, _workers):
        spec = {
            **task_spec(url),
            "store": pg_dsn,
            "retention": {"journal_days": 7, "idempotency_days": 30, "forget_days": 365},
            "retain_at_days": [8, 31],
        }
        facts = await kill_when_paused(tmp_path, spec, point)
        assert [f["ended"]["state"] for f in facts if "ended" in f] == ["done"]
        asked = model.request_count
        facts = await recover(tmp_path, spec)
    assert model.request_count == asked
    retained = [f["retained"] for f in facts if "retained" in f]
    assert [r["days"] for r in retained] == [8, 31]
    assert [f["resubmitted"] for f in facts if "resubmitted" in f] == ["task_expired"]
    rel = f"lanes/{lane_key(SUBJECT)}/lane.log"
    assert (
        await execute(pg_dsn, "SELECT seq FROM pi_runtime.log_records WHERE log = %s", [rel]) == []
    )
    assert await execute(pg_dsn, "SELECT task_id FROM pi_runtime.expired_tasks") == [(TASK,)]
    assert not (tmp_path / "state" / "lanes" / lane_key(SUBJECT)).exists()
    assert not work_dirs(tmp_path / "work", TASK)[0].exists()


async def test_rt13_rt15_a_lane_directory_half_removed_by_a_crash_goes_after_the_id_is_forgotten(
    tmp_path: Path, pg_dsn: str
) -> None:
    """RT13 (d), RT15: a host on PostgreSQL (``tests/tasks/task_host.py``, a real process) is
    SIGKILLed half-way through removing the expired task's lane directory. The next host's
    first pass comes only after ``forget_days``: the database lets the id go in it, so its
    word — the only thing that led a pass to a lane directory here — no longer names the
    directory. What the crash left goes all the same (from the trash), and so do the task's
    work directories (removed before its lane directory, never after)."""
    from .test_task_crash import crash_rig, kill_when_paused, recover, task_spec

    state = tmp_path / "state"
    async with crash_rig(tmp_path, [done(), say("finished")]) as (model, url, _workers):
        spec = {
            **task_spec(url),
            "store": pg_dsn,
            "retention": {"journal_days": 7, "idempotency_days": 30, "forget_days": 365},
            "retain_at_days": [31],
        }
        await kill_when_paused(tmp_path, spec, "retention:inside_remove_tree")
        asked = model.request_count
        facts = await recover(tmp_path, {**spec, "retain_at_days": [400], "resubmit": False})
    assert model.request_count == asked
    assert [f["retained"]["days"] for f in facts if "retained" in f] == [400]
    assert await execute(pg_dsn, "SELECT task_id FROM pi_runtime.expired_tasks") == []
    assert not (state / "lanes" / lane_key(SUBJECT)).exists()
    assert not [p for p in (state / "trash").glob("*")]
    home, tmp = work_dirs(tmp_path / "work", TASK)
    assert not home.exists()
    assert not tmp.exists()
