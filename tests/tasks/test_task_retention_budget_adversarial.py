"""Adversarial checks of the task lanes' retention and budget (docs/design/retention.md RT4,
RT12, RT13, RT19; watchdog.md WD11): each tries to break one rule in an order of events.

* A task id used again after its first task was let go, then held back once more by that
  earlier task's entry (the wall clock set back, or ``forget_days`` raised): every path that
  forgets a task record — ``task forget`` on a server, with no server, and a shared store's
  pass and expiry — must take the entry for the earlier task's, never the new task's.
* A replacement epoch's reserve cancelled at its write's first checkpoint: charged once, in
  memory as in the log.

Real file stores and a real PostgreSQL (``pgserver``, as ``tests/journal`` runs it), the
in-process runner; the wall clock retention ages by is a mock clock moved by days."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

import pytest
import trio
import trio.testing

from fake_pi.scenario import Step
from runtime._clock import Clocks, MockWallClock
from runtime._config import RetentionConfig
from runtime._errors import ReasonCode, TaskError
from runtime._journal._interface import LeaseStore
from runtime._journal._store import lane_key
from runtime._records import OutboxAction, Record
from runtime._retention import RetentionSettings, follow_forget_days
from runtime._tasks._lane import TaskLane
from runtime._tasks._retention import TaskRetention, forget_offline, work_dirs
from runtime._tasks._state import read_lane, session_rel
from runtime._wire import TaskSpec

from ..journal.pg_fixtures import pg_dsn, pg_server
from ..task_harness import TASK, done, open_rig, say, wait
from .test_task_hosts import LIMIT, TaskHost, lane_records, spec, task_host
from .test_task_retention import RETENTION, _Refused

__all__ = ["pg_dsn", "pg_server"]  # the fixtures this module uses

pytestmark = pytest.mark.trio

DAY: Final = 86_400.0
DAY_MS: Final = 86_400_000
LIVE: Final = "task-live"
TWO_LIVES: Final[list[Step]] = [done(), say("finished"), done(), say("finished again")]
"""The task's first life, then its second under the same id."""


def _days(forget_days: int) -> RetentionConfig:
    return RetentionConfig(journal_days=7, idempotency_days=30, forget_days=forget_days)


# -- RT12, RT19 on the file store: ``task forget`` of a task id used again ---------------------


async def test_rt12_rt19_a_refused_task_forget_keeps_a_task_id_used_again(
    tmp_path: Path,
    clocks: Clocks,
    wall_clock: MockWallClock,
    io_autojump_clock: trio.testing.MockClock,
) -> None:
    """RT12, RT17, RT19: TASK ends at day 0, is expired at day 31 (``forget_days`` 365) and
    let go at day 365; submitted again at day 366, that task ends. The wall clock is set back
    three days: the earlier task's entry holds the id back again. A live task works in a
    clone in the new task's home, so an operator's ``task forget`` of the new task is refused
    ``worktree_leased`` and removes nothing — and the new task stays known: ``task show``
    says its end and a duplicate is answered with it. Before, the refusal's "expired
    already" check took the earlier task's entry for this task's: the runner let the task go
    (``task_expired`` for its show and its duplicate) while its record lay on disk, for the
    next pass to remove as a leftover."""
    async with open_rig(tmp_path, clocks, [*TWO_LIVES, wait("which one?")]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.ended(TASK)
        wall_clock.advance(31 * DAY)
        assert (await rig.runner.retain(RETENTION)).expired == (TASK,)
        wall_clock.advance(335 * DAY)  # day 366: let go at day 365, the entry still there
        await rig.runner.submit(rig.spec())
        await rig.ended(TASK)
        wall_clock.advance(-3 * DAY)
        assert rig.store.expired_tasks.holds(lane_key(f"task:{TASK}"), now_ms=clocks.wall.time_ms())
        home, _tmp = work_dirs(tmp_path / "work", TASK)
        tree = home / "clone"
        tree.mkdir(parents=True, exist_ok=True)
        base = rig.spec()
        live = TaskSpec(task_id=LIVE, prompt=base.prompt, worktree=str(tree), grants=base.grants)
        await rig.runner.submit(live)
        await rig.until(lambda: rig.runner.show(LIVE).state == "waiting")
        with _Refused(ReasonCode.WORKTREE_LEASED):
            await rig.runner.forget(TASK, RETENTION)
        shown = rig.runner.show(TASK).state
        duplicate = (await rig.runner.submit(rig.spec())).state
        passed = await rig.runner.retain(RETENTION)
        after_pass = rig.runner.show(TASK).state
    assert (shown, duplicate, after_pass) == ("done", "done", "done")
    assert passed.expired == ()
    assert (tmp_path / "state" / "lanes" / lane_key(f"task:{TASK}") / "lane.log").is_file()


async def test_rt12_rt19_task_forget_with_no_server_forgets_a_task_id_used_again(
    tmp_path: Path,
    clocks: Clocks,
    wall_clock: MockWallClock,
    io_autojump_clock: trio.testing.MockClock,
) -> None:
    """RT12, RT19: the same task id used again (its first task let go at day 365, the second
    ended at day 366), the wall clock set back three days. ``task forget`` with no server
    forgets the second task — its lane directory goes, its candidate too — and only then is
    the id ``task_expired``. Before, the earlier task's entry answered ``task_expired``
    ("let go already") for a task whose record and candidate lay there: the operator could
    not remove them."""
    async with open_rig(tmp_path, clocks, TWO_LIVES) as rig:
        await rig.runner.submit(rig.spec())
        await rig.ended(TASK)
        wall_clock.advance(31 * DAY)
        assert (await rig.runner.retain(RETENTION)).expired == (TASK,)
        wall_clock.advance(335 * DAY)
        await rig.runner.submit(rig.spec())
        await rig.ended(TASK)
        archive = rig.store.root / str((rig.runner.show(TASK).ended or {})["candidate"]["ref"])
    wall_clock.advance(-3 * DAY)
    state = tmp_path / "state"
    settings = RetentionSettings(retention=RETENTION, task_work_root=str(tmp_path / "work"))
    assert archive.exists()
    removed = await forget_offline(state, TASK, settings=settings, clocks=clocks)
    assert str(archive) in removed
    assert not archive.exists()
    assert not (state / "lanes" / lane_key(f"task:{TASK}")).exists()
    with _Refused(ReasonCode.TASK_EXPIRED):  # its own entry now
        await forget_offline(state, TASK, settings=settings, clocks=clocks)


# -- RT13, RT19 on PostgreSQL: a shared store's pass and expiry ------------------------------


def _shared(host: TaskHost) -> LeaseStore:
    assert host.runner.shared is not None
    return host.runner.shared.store


async def _let_go_then_used_again(host: TaskHost, wall: MockWallClock, root: Path) -> None:
    """TASK ends at day 0 under ``forget_days`` 40, is expired at day 31 and let go at day
    40; at day 41 it is submitted again; then a host's start raises ``forget_days`` to 400,
    and the earlier task's row holds the id back once more."""
    store = host.runner.host.store
    await follow_forget_days(store, _days(40))
    await host.runner.submit(spec(root))
    await host.runner.wait(TASK)
    wall.advance(31 * DAY)
    assert await host.runner.retain(_days(40)) == TaskRetention(expired=(TASK,))
    wall.advance(10 * DAY)  # day 41: not held any more, the row not forgotten yet
    await host.runner.submit(spec(root))


async def test_rt13_rt19_a_pass_keeps_a_live_task_under_an_id_used_again(
    tmp_path: Path, pg_dsn: str
) -> None:
    """RT13, RT19: the id used again (above), the new task live, waiting for its user, when
    ``forget_days`` is raised to 400. A pass on its host finds the earlier task's row held
    back and its id's lane directory here: it keeps the live task's session and work
    directories, and the task still waits. Before, the pass removed every lane directory
    here whose key the database held as expired — the live task's session file, home and
    temporary directory went under its feet."""
    wall = MockWallClock()
    clocks = Clocks(wall=wall)
    steps: list[Step] = [done(), say("finished"), wait("which one?")]
    with trio.fail_after(LIMIT):
        async with task_host(tmp_path, "a", pg_dsn, steps, clocks=clocks) as a:
            await _let_go_then_used_again(a, wall, tmp_path)
            await a.until(lambda: a.runner.show(TASK).state == "waiting")
            store = a.runner.host.store
            home, tmp = work_dirs(tmp_path / "a" / "work", TASK)
            paths = [store.root / session_rel(TASK), home, tmp]
            there = [p for p in paths if p.exists()]
            await follow_forget_days(store, _days(400))
            key = lane_key(f"task:{TASK}")
            held = await _shared(a).expired_task_keys([key])
            wall.advance(DAY)
            passed = await a.runner.retain(_days(400))
            kept = [p for p in there if p.exists()]
            state = a.runner.show(TASK).state
    assert key in held  # the earlier task's row, held back again
    assert store.root / session_rel(TASK) in there
    assert kept == there
    assert passed.left == ()
    assert state == "waiting"


async def test_rt4_rt19_a_task_id_used_again_is_held_back_from_its_own_end(
    tmp_path: Path, pg_dsn: str
) -> None:
    """RT4, RT13, RT19: the id used again (above); the new task ends at day 41, then
    ``forget_days`` is raised to 400, holding the earlier task's row back once more. The pass
    at day 72 expires the new task: its row counts from its own end (held until day 441), and
    a submission at day 402 is ``task_expired``. Before, the expiry found the earlier task's
    row (``ON CONFLICT DO NOTHING``) and kept its time: the id was let go at day 400, 359
    days after the new task's end instead of 400, and the submission ran as new."""
    wall = MockWallClock()
    clocks = Clocks(wall=wall)
    with trio.fail_after(LIMIT):
        async with task_host(tmp_path, "a", pg_dsn, [*TWO_LIVES, *TWO_LIVES], clocks=clocks) as a:
            await _let_go_then_used_again(a, wall, tmp_path)
            ended_ms = (await a.runner.wait(TASK)).ended_ms
            store = a.runner.host.store
            await follow_forget_days(store, _days(400))
            wall.advance(31 * DAY)  # day 72
            passed = await a.runner.retain(_days(400))
            key = lane_key(f"task:{TASK}")
            until = (await _shared(a).expired_task_keys([key]))[key]
            wall.advance(330 * DAY)  # day 402
            try:
                await a.runner.submit(spec(tmp_path))
            except TaskError as error:
                answer = str(error.code)
            else:
                answer = "new"
    assert passed.expired == (TASK,)
    assert until == ended_ms + 400 * DAY_MS
    assert answer == "task_expired"
    assert a.model.request_count == 4  # its two lives, each once


# -- WD11: a reserve cancelled at its write ---------------------------------------------------


def _reserves(records: list[Record]) -> int:
    return sum(isinstance(r, OutboxAction) and r.kind == "reserve" for r in records)


def _durable_epochs(lane: TaskLane, logged: list[Record]) -> int:
    return read_lane(lane.task, logged, lane.policy).budget.used_epochs


async def _cancel_a_reserve(lane: TaskLane, records: Callable[[], Awaitable[list[Record]]]) -> None:
    """A reserve whose caller is cancelled at the write's first checkpoint (the log's lock),
    then a reserve that runs: the epochs the budget has charged in memory are the reserves
    the log holds (what a restart counts), after each — one in all (the second finds the
    first's continuation reserved and unsent, TL6). (Only epochs: the lane's recovery may
    charge its seconds meanwhile, in memory just before its write.)"""
    before = lane.budget.used_epochs
    with trio.CancelScope() as scope:
        scope.cancel()  # the reserve's first checkpoint is inside its write
        await lane.reserve()
    logged = await records()
    charged = (lane.budget.used_epochs, _durable_epochs(lane, logged))
    assert charged == (_reserves(logged) + before, _reserves(logged) + before), charged
    await lane.reserve()
    logged = await records()
    charged = (lane.budget.used_epochs, _durable_epochs(lane, logged))
    assert charged == (before + 1, before + 1), charged
    assert _reserves(logged) == 1


async def test_wd11_a_reserve_cancelled_at_its_write_charges_once_on_the_file_store(
    tmp_path: Path, clocks: Clocks, io_autojump_clock: trio.testing.MockClock
) -> None:
    """WD11: a replacement epoch is charged once, in memory as in the log. A reserve
    cancelled at its write's first checkpoint, then another: each charge the budget shows
    is a reserve the log holds (a restart counts the same). Held before — the file store's
    write takes no cancellation before it lands — a check that it stays so (the
    PostgreSQL store's did: below)."""
    async with open_rig(tmp_path, clocks, [wait("which one?")]) as rig:
        await rig.runner.submit(rig.spec())
        await rig.until(lambda: rig.runner.show(TASK).state == "waiting")
        await _cancel_a_reserve(rig.runner.lanes[TASK], rig.records)


async def test_wd11_a_reserve_cancelled_at_its_write_charges_once_on_postgresql(
    tmp_path: Path, pg_dsn: str
) -> None:
    """WD11 on a shared store: the same, the cancellation landing at the PostgreSQL log's
    lock before its transaction. Before, the cancelled reserve charged the epoch in memory
    only (nothing in the database); the next one charged again under the next
    continuation's id — two epochs gone, one recorded, and a restart counted one."""
    with trio.fail_after(LIMIT):
        async with task_host(tmp_path, "a", pg_dsn, [wait("which one?")]) as a:
            await a.runner.submit(spec(tmp_path))
            await a.until(lambda: a.runner.show(TASK).state == "waiting")
            await _cancel_a_reserve(a.runner.lanes[TASK], lambda: lane_records(a))
