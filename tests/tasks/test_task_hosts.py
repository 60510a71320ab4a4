"""Task lanes of several hosts on one PostgreSQL database, in one process
(docs/design/scale-out.md S30-S32): a task is held under its lane's lease by the host it was
submitted to, every write of it is fenced, and a task whose holder's lease ran out is claimed by
another host — held ``host_lost`` when its worktree and session are that host's alone, resumed
when the deployment says they are on shared storage. Fake-Pi runs in-process on the scripted
model; leases run on the database's clock (real time), so nothing here waits on a threshold of
the watchdog.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio

from fake_pi.model_server import ScriptedModel
from fake_pi.scenario import Scenario, Step
from runtime._cli import EXIT_FAILED, EXIT_OK, main
from runtime._cli._tasks import _print_tasks
from runtime._clock import Clocks
from runtime._errors import DiskFailedError, JournalError, ReasonCode, TaskError
from runtime._journal._fence import Fence
from runtime._journal._postgres import PgLog, PgStore, open_pg_store
from runtime._journal._store import Store
from runtime._records import OutboxAction, Record, TaskEnded, TaskSubmitted
from runtime._tasks._runner import DuplicateElsewhere, SharedTasks, TaskRunner, open_task_runner
from runtime._tasks._service import TaskService
from runtime._tasks._watchdog import WatchdogPolicy
from runtime._wire import TaskEvent, TaskSpec
from runtime.testing._in_process import InProcessWorkers

from .._cancelling import cancelled_once
from ..journal.pg_fixtures import execute, pg_dsn, pg_server
from ..task_harness import ROUTE, TASK, done, make_worktree, say, wait

__all__ = ["pg_dsn", "pg_server"]  # the fixtures this module uses
LIMIT: Final = 60.0


@dataclass
class TaskHost:
    name: str
    runner: TaskRunner
    workers: InProcessWorkers
    model: ScriptedModel
    lines: list[str]
    events: trio.MemoryReceiveChannel[TaskEvent]

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Wait on the runner's task events (never on time) until ``predicate()`` holds."""
        while not predicate():
            await self.events.receive()


@contextlib.asynccontextmanager
async def task_host(
    root: Path,
    name: str,
    dsn: str,
    steps: Sequence[Step],
    *,
    lease: float = 60.0,
    shared_worktrees: bool = False,
    takeover: float = 0.0,
    state: str | None = None,
    clocks: Clocks | None = None,
) -> AsyncIterator[TaskHost]:
    """A host ``name`` of the deployment: its own state directory (``state`` names one the
    hosts share, standing for shared storage), the lease owner ``name``; ``clocks`` (its
    wall clock: what retention ages by) the system's by default."""
    model = ScriptedModel(
        scenario=Scenario(steps=list(steps)), call_id_prefix=f"call_{secrets.token_hex(4)}"
    )
    workers = InProcessWorkers(model=model)
    lines: list[str] = []
    async with open_pg_store(
        dsn, root=root / (state or name) / "state", owner=name, clocks=clocks
    ) as store:
        shared = SharedTasks(
            store=store,
            lease_seconds=lease,
            poll_seconds=3600.0,  # the tests look for orphans themselves (claim_orphans)
            shared_worktrees=shared_worktrees,
            takeover_seconds=takeover,
        )
        async with (
            open_task_runner(
                store,
                workers=workers,
                route=ROUTE,
                work_root=root / (state or name) / "work",
                shared=shared,
                log=lines.append,
            ) as runner,
            runner.events(buffer=10_000) as events,
        ):
            yield TaskHost(name, runner, workers, model, lines, events)


def spec(root: Path, prompt: str = "do the task") -> TaskSpec:
    worktree = make_worktree(root)  # one path for every host (the tests share a machine)
    return TaskSpec(task_id=TASK, prompt=prompt, worktree=str(worktree), grants=frozenset({"read"}))


async def lane_records(host: TaskHost) -> list[Record]:
    store = host.runner.host.store
    return list((await store.read(store.lane_rel(f"task:{TASK}"))).records)


async def durable_holds(host: TaskHost) -> list[Record]:
    """The lane log once it holds a hold record: a claimed lane's view says it is held as
    soon as it is restored, and the lane records the hold (WD12) before it parks and tells
    its followers — so each look that finds none waits for the runner's next event."""
    while True:
        records = await lane_records(host)
        if any(isinstance(r, OutboxAction) and r.kind == "hold" for r in records):
            return records
        await host.events.receive()


def launch_hosts(records: list[Record]) -> list[str]:
    return [
        str(r.detail.get("host"))
        for r in records
        if isinstance(r, OutboxAction) and r.kind == "launch" and r.state == "done"
    ]


async def expire_leases(dsn: str, ago: float = 0.0) -> None:
    """Every lease runs out now — or ran out ``ago`` seconds ago: on shared storage a task is
    claimed only once its holder's epoch must be stopped (S12, S32: :data:`STOP_BOUND`)."""
    await execute(
        dsn, "UPDATE pi_runtime.lanes SET lease_until = now() - make_interval(secs => %s)", [ago]
    )


STOP_BOUND: Final = WatchdogPolicy().term_grace_seconds + WatchdogPolicy().kill_bound_seconds
"""How long a task epoch's stop may take (TERM, its grace, the KILL of its tree): the tasks
here run under the default policy (S32)."""


@contextlib.asynccontextmanager
async def orphaned_by_a(tmp_path: Path, pg_dsn: str) -> AsyncIterator[tuple[TaskHost, TaskHost]]:
    """A's task waits for its user, its epoch over; A's lease (3 s, renewed each second) is
    made to run out. B — no shared worktrees, no takeover delay — has not looked yet."""
    async with (
        task_host(tmp_path, "a", pg_dsn, [wait(), say("asked")], lease=3.0) as a,
        task_host(tmp_path, "b", pg_dsn, []) as b,
    ):
        await a.runner.submit(spec(tmp_path))
        await a.until(lambda: a.runner.show(TASK).state == "waiting")
        await a.until(lambda: a.workers.launched == [1] and not a.runner.lane(TASK).live)
        await expire_leases(pg_dsn)
        yield a, b


@contextlib.asynccontextmanager
async def waiting_on_shared_storage(
    tmp_path: Path, pg_dsn: str
) -> AsyncIterator[tuple[TaskHost, TaskHost]]:
    """A and B on one state directory (``shared_worktrees``): A's task waits for its user,
    its epoch over; A's lease (3 s) still holds, B has not looked."""
    async with (
        task_host(
            tmp_path, "a", pg_dsn, [wait(), say("asked")], lease=3.0, state="shared",
            shared_worktrees=True,
        ) as a,
        task_host(
            tmp_path, "b", pg_dsn, [done(), say()], state="shared", shared_worktrees=True
        ) as b,
    ):  # fmt: skip
        await a.runner.submit(spec(tmp_path))
        await a.until(lambda: a.runner.show(TASK).state == "waiting")
        await a.until(lambda: not a.runner.lane(TASK).live)
        yield a, b


@contextlib.asynccontextmanager
async def claimed_from_a(tmp_path: Path, pg_dsn: str) -> AsyncIterator[tuple[TaskHost, TaskHost]]:
    """:func:`orphaned_by_a`, and B claims the lane."""
    async with orphaned_by_a(tmp_path, pg_dsn) as (a, b):
        await b.runner.claim_orphans()
        yield a, b


async def test_s30_a_task_is_held_by_the_host_it_was_submitted_to(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S30: the task runs on A, under A's lease; B, looking, knows A holds it: the same task
    sent to B is a duplicate (the view as the database says), another one under its id is
    ``task_conflict``, a reply to B is ``task_elsewhere`` naming A; A runs it to its end, and
    then B finds nothing to claim."""
    with trio.fail_after(LIMIT):
        async with (
            task_host(tmp_path, "a", pg_dsn, [wait(), say("asked"), done(), say()]) as a,
            task_host(tmp_path, "b", pg_dsn, []) as b,
        ):
            await a.runner.submit(spec(tmp_path))
            await a.until(lambda: a.runner.show(TASK).state == "waiting")
            # epoch 1 over, so the reply starts epoch 2 (LK8: a reply that comes before the
            # worker's turn ends is sent to that worker instead)
            await a.until(lambda: a.workers.launched == [1] and not a.runner.lane(TASK).live)
            await b.runner.claim_orphans()
            assert b.runner.elsewhere == {TASK: "a"}
            with pytest.raises(DuplicateElsewhere) as duplicate:
                await b.runner.submit(spec(tmp_path))
            assert duplicate.value.view is not None
            assert duplicate.value.view.state == "waiting"
            with pytest.raises(TaskError) as conflict:
                await b.runner.submit(spec(tmp_path, prompt="another task"))
            assert conflict.value.code is ReasonCode.TASK_CONFLICT
            with pytest.raises(TaskError) as elsewhere:
                await b.runner.reply(TASK, "the blue one")
            assert elsewhere.value.code is ReasonCode.TASK_ELSEWHERE
            assert "'a'" in str(elsewhere.value)
            await a.runner.reply(TASK, "the blue one")
            ended = await a.runner.wait(TASK)
            assert ended.state == "done"
            await b.runner.claim_orphans()
            assert b.runner.lanes == {}
            assert b.workers.launched == []
            records = await lane_records(a)
    assert launch_hosts(records) == ["a", "a"]
    assert sum(isinstance(r, TaskEnded) for r in records) == 1


async def test_s30_a_submission_whose_caller_is_cancelled_while_it_is_written_still_runs(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S30, TL1: A has claimed the new task's lane and writes its submission when the caller
    is cancelled (a client gone). A must not be left renewing a lease on a lane with no
    submission and no lane task — every other host answering ``task_elsewhere`` for the id
    while A lives: the submission is written whole and A runs the task; B, sent the same
    task, finds it A's."""
    writing, release = trio.Event(), trio.Event()
    append = PgLog.append

    async def held_append(self: PgLog, record: Record, *, fence: Fence | None = None) -> int:
        if isinstance(record, TaskSubmitted):
            writing.set()
            await release.wait()  # the caller is cancelled meanwhile
        return await append(self, record, fence=fence)

    with trio.fail_after(LIMIT):
        async with (
            task_host(tmp_path, "a", pg_dsn, [wait(), say("asked")]) as a,
            task_host(tmp_path, "b", pg_dsn, []) as b,
        ):
            monkeypatch.setattr(PgLog, "append", held_append)
            await cancelled_once(writing, lambda: a.runner.submit(spec(tmp_path)), then=release)
            await a.until(lambda: TASK in a.runner.lanes)
            await a.until(lambda: a.runner.show(TASK).state == "waiting")
            with pytest.raises(DuplicateElsewhere):
                await b.runner.submit(spec(tmp_path))
            records = await lane_records(a)
    assert sum(isinstance(r, TaskSubmitted) for r in records) == 1
    assert launch_hosts(records) == ["a"]


async def test_s30_a_refused_submission_whose_caller_is_cancelled_lets_its_lane_go(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S30, S33: A's task holds its worktree. B, sent a second task on it, claimed the new
    lane, found the worktree leased, and is letting the lane go when the caller is cancelled
    (a client gone). The lease must not stay held — renewed while B lives, with no
    submission and no lane task — or every other host answers ``task_elsewhere`` for the id:
    C, sent the same task, is refused for the worktree, as B was."""
    closing, release = trio.Event(), trio.Event()
    aclose = PgLog.aclose

    async def held_aclose(self: PgLog) -> None:
        if self.rel == Store.lane_rel("task:second"):
            closing.set()
            await release.wait()  # the caller is cancelled meanwhile
        await aclose(self)

    second = other_task("second", make_worktree(tmp_path))
    with trio.fail_after(LIMIT):
        async with (
            task_host(tmp_path, "a", pg_dsn, [wait(), say("asked")]) as a,
            task_host(tmp_path, "b", pg_dsn, []) as b,
            task_host(tmp_path, "c", pg_dsn, []) as c,
        ):
            await a.runner.submit(spec(tmp_path))
            await a.until(lambda: a.runner.show(TASK).state == "waiting")
            monkeypatch.setattr(PgLog, "aclose", held_aclose)
            refused: list[TaskError] = []

            async def submit_on_b() -> None:  # its answer is the refusal or the cancel
                try:
                    await b.runner.submit(second)
                except TaskError as error:
                    refused.append(error)

            await cancelled_once(closing, submit_on_b, then=release)
            with pytest.raises(TaskError) as on_c:
                await c.runner.submit(second)
    refused_leased(on_c, TASK)
    assert all(error.code is ReasonCode.WORKTREE_LEASED for error in refused)


async def test_s31_s32_a_task_claimed_from_a_host_whose_lease_ran_out_is_held_host_lost(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S31, S32: A's task waits for its user; A's lease runs out and B claims the lane. Its
    worktree and session are A's alone, so B holds it ``host_lost:a`` — launching nothing,
    killing nothing, making no session of its own — and A, whose renewal finds the lease
    taken, stops the lane and forgets it: a reply to A is ``task_elsewhere``."""
    with trio.fail_after(LIMIT):
        async with claimed_from_a(tmp_path, pg_dsn) as (a, b):
            view = b.runner.show(TASK)
            assert view.hold_reason == "host_lost:a"
            assert view.classification == "StalledOperatorRequired"
            await a.until(lambda: TASK not in a.runner.lanes)
            with pytest.raises(TaskError) as elsewhere:
                await a.runner.reply(TASK, "the blue one")
            assert elsewhere.value.code is ReasonCode.TASK_ELSEWHERE
            records = await durable_holds(b)  # the view holds at once; the record follows
            assert b.workers.launched == []
            assert not (tmp_path / "b" / "state" / view.session_path).exists()
    holds = [r for r in records if isinstance(r, OutboxAction) and r.kind == "hold"]
    assert [h.detail["reason"] for h in holds] == ["host_lost:a"]
    assert launch_hosts(records) == ["a"]
    assert any("lane lost" in line or "refused by its fence" in line for line in a.lines)


async def test_s32_a_look_that_fails_after_claiming_a_lane_lets_that_lane_go(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S32: B's look claims A's orphaned task, then fails on a lane after it (the database
    away for longer than the store's retries). The lane it claimed must not stay claimed —
    renewed while B lives, never run, never claimed again: B lets it go, and its next look
    claims it and holds it ``host_lost:a`` as S32 says."""
    ghost = "lanes/ghost/lane.log"
    async with orphaned_by_a(tmp_path, pg_dsn) as (_a, b):
        store = b.runner.host.store
        assert isinstance(store, PgStore)
        lane_logs, lease = store.lane_logs, store.lease

        async def and_a_ghost() -> list[str]:
            return [*await lane_logs(), ghost]  # looked at after the task's lane

        async def away_for_the_ghost(lane: str) -> Any:
            if lane == "task:ghost":
                raise DiskFailedError(ReasonCode.DISK_FAILED, "the database is away (the test)")
            return await lease(lane)

        b.runner._subjects[ghost] = "task:ghost"
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(store, "lane_logs", and_a_ghost)
            patch.setattr(store, "lease", away_for_the_ghost)
            with pytest.raises(DiskFailedError):
                await b.runner.claim_orphans()
        await b.runner.claim_orphans()
        view = b.runner.show(TASK)
    assert view.hold_reason == "host_lost:a"


async def test_s32_on_shared_storage_a_claimed_task_resumes_on_the_new_host(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S32: the same, on storage both hosts see at the same paths (``shared_worktrees``;
    here one state directory): B claims the waiting task, keeps it waiting in its session,
    and the user's reply sent to B runs it there to its end — one end record, the second
    epoch launched by B in the same session."""
    with trio.fail_after(LIMIT):
        async with waiting_on_shared_storage(tmp_path, pg_dsn) as (a, b):
            first = a.runner.show(TASK).session_path
            await expire_leases(pg_dsn, ago=STOP_BOUND)
            await b.runner.claim_orphans()
            assert b.runner.show(TASK).state == "waiting"
            assert b.runner.show(TASK).hold_reason is None
            await a.until(lambda: TASK not in a.runner.lanes)
            await b.runner.reply(TASK, "the blue one")
            ended = await b.runner.wait(TASK)
            records = await lane_records(b)
    assert ended.state == "done"
    assert b.runner.show(TASK).session_path == first
    assert launch_hosts(records) == ["a", "b"]
    assert sum(isinstance(r, TaskEnded) for r in records) == 1
    assert a.model.request_count == 2
    assert b.model.request_count == 2


async def test_s31_a_write_after_the_lease_was_taken_is_refused_and_nothing_is_written(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S31: A's lease is taken over before A noticed (its renewal is a minute away): the
    user's reply sent to A is refused by the fence (``lane_fenced``), nothing of it is in the
    log, and A gives the lane up."""
    with trio.fail_after(LIMIT):
        async with (
            task_host(tmp_path, "a", pg_dsn, [wait(), say("asked")]) as a,
            task_host(tmp_path, "b", pg_dsn, []) as b,
        ):
            await a.runner.submit(spec(tmp_path))
            await a.until(lambda: a.runner.show(TASK).state == "waiting")
            await a.until(lambda: not a.runner.lane(TASK).live)
            await expire_leases(pg_dsn)
            await b.runner.claim_orphans()
            with pytest.raises(TaskError) as refused:
                await a.runner.reply(TASK, "the blue one")
            assert refused.value.code in (ReasonCode.LANE_FENCED, ReasonCode.TASK_ELSEWHERE)
            await a.until(lambda: TASK not in a.runner.lanes)
            records = await lane_records(b)
    assert not [r for r in records if type(r).__name__ == "TaskReply"]


async def answered_on(host: TaskHost) -> tuple[TaskEnded, list[Record]]:
    """The task, waiting on ``host`` and held for nothing, answered there and run to its end:
    its end record and its lane log."""
    assert host.runner.show(TASK).state == "waiting"
    assert host.runner.show(TASK).hold_reason is None
    await host.runner.reply(TASK, "the blue one")
    ended = await host.runner.wait(TASK)
    return ended, await lane_records(host)


async def test_s32_a_host_back_within_the_takeover_time_takes_its_task_back(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S32: A stops while its task waits (its lease is left to run out, not handed over: the
    worktree is A's). B, whose takeover time has not passed, does not claim it; A started
    again under its name takes it back at once and runs it on: no hold, one end."""
    with trio.fail_after(LIMIT):
        async with task_host(tmp_path, "b", pg_dsn, [], takeover=3600.0) as b:
            async with task_host(tmp_path, "a", pg_dsn, [wait(), say("asked")]) as a:
                await a.runner.submit(spec(tmp_path))
                await a.until(lambda: a.runner.show(TASK).state == "waiting")
            await expire_leases(pg_dsn)
            await b.runner.claim_orphans()
            assert b.runner.lanes == {}
            assert b.runner.elsewhere == {TASK: "a"}
            async with task_host(tmp_path, "a", pg_dsn, [done(), say()]) as a:
                ended, records = await answered_on(a)
    assert ended.state == "done"
    assert not [r for r in records if isinstance(r, OutboxAction) and r.kind == "hold"]
    assert b.workers.launched == []


async def test_s35_a_host_lost_task_goes_back_to_its_host_when_it_is_back(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S35: A stopped while its task waited, and stayed away past the takeover time: B
    claimed the task and holds it ``host_lost:a``. A starts again: B, at its next look, sees
    A's own lease live and gives the task back (its lease given up, the task not ended); a
    third host C, looking too, leaves it to A; A claims it and goes on as after its own
    restart — the hold lifted durably, the user's reply answered on A, one end."""
    with trio.fail_after(LIMIT):
        async with (
            task_host(tmp_path, "b", pg_dsn, []) as b,
            task_host(tmp_path, "c", pg_dsn, []) as c,
        ):
            async with task_host(tmp_path, "a", pg_dsn, [wait(), say("asked")]) as a:
                await a.runner.submit(spec(tmp_path))
                await a.until(lambda: a.runner.show(TASK).state == "waiting")
            await expire_leases(pg_dsn)
            await b.runner.claim_orphans()
            assert b.runner.show(TASK).hold_reason == "host_lost:a"
            await durable_holds(b)
            await c.runner.claim_orphans()
            assert c.runner.lanes == {}
            async with task_host(tmp_path, "a", pg_dsn, [done(), say()]) as a:
                assert a.runner.lanes == {}  # B holds it: not A's to take at its start
                await b.runner.claim_orphans()
                await b.until(lambda: TASK not in b.runner.lanes)
                await c.runner.claim_orphans()
                assert c.runner.lanes == {}
                assert c.runner.elsewhere == {TASK: "a"}
                await a.runner.claim_orphans()
                ended, records = await answered_on(a)
    assert ended.state == "done"
    assert_given_back_to_a(records)
    assert b.workers.launched == []
    assert c.workers.launched == []


async def test_s35_a_task_is_not_given_back_to_a_host_that_is_not_running(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S35: a hand-back needs the proof that the host runs now — its own lease live. A
    stopped (giving its lease up) or died (its lease run out): B, holding its task
    ``host_lost:a``, keeps holding it."""
    with trio.fail_after(LIMIT):
        async with task_host(tmp_path, "b", pg_dsn, []) as b:
            async with task_host(tmp_path, "a", pg_dsn, [wait(), say("asked")]) as a:
                await a.runner.submit(spec(tmp_path))
                await a.until(lambda: a.runner.show(TASK).state == "waiting")
                assert a.runner.alive is not None
            await expire_leases(pg_dsn)
            await b.runner.claim_orphans()
            await durable_holds(b)
            await b.runner.claim_orphans()  # A stopped: its own lease was given up
            assert b.runner.show(TASK).hold_reason == "host_lost:a"
            async with open_pg_store(pg_dsn, root=tmp_path / "z", owner="a") as dead_a:
                assert await dead_a.claim("host:a", 60.0) is not None  # A back, then dead
            await expire_leases(pg_dsn)  # (every lease run out: A's own too)
            await b.runner.claim_orphans()
            assert b.runner.show(TASK).hold_reason == "host_lost:a"
            assert TASK in b.runner.lanes
    assert b.workers.launched == []


async def test_s35_a_host_that_lost_its_own_lease_claims_it_again_and_gets_its_task_back(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S35: A's renewals fail past their deadline (the database out of its reach a while):
    A loses its task lane's lease and its own, ``host:a``. The partition heals; B claims the
    task and holds it ``host_lost:a``. A, running, claims its own lease again at its next
    look (``runner.alive`` the new one); B's next look sees A live and gives the task back;
    A claims it and ends it — one end, every epoch launched on A."""
    with trio.fail_after(LIMIT):
        async with (
            task_host(tmp_path, "b", pg_dsn, []) as b,
            task_host(tmp_path, "a", pg_dsn, [wait(), say("asked"), done(), say()], lease=3.0) as a,
        ):
            await a.runner.submit(spec(tmp_path))
            await a.until(lambda: a.runner.show(TASK).state == "waiting")
            await a.until(lambda: a.workers.launched == [1] and not a.runner.lane(TASK).live)
            assert a.runner.shared is not None
            assert a.runner.leases is not None
            first = a.runner.alive

            async def partitioned(fences: Sequence[Fence], ttl: float) -> set[Fence]:
                raise DiskFailedError(ReasonCode.STORE_UNAVAILABLE, "partitioned")

            monkeypatch.setattr(a.runner.shared.store, "renew", partitioned)
            await a.until(lambda: TASK not in a.runner.lanes)  # its deadline passed (S12)
            monkeypatch.undo()  # the partition heals
            lost = a.runner.leases.fence("host:a")
            await expire_leases(pg_dsn)  # (the database's own leases run out: no waiting)
            await b.runner.claim_orphans()
            assert b.runner.show(TASK).hold_reason == "host_lost:a"
            await durable_holds(b)
            await a.runner.claim_orphans()  # S35: A claims its own lease again
            again = a.runner.alive
            own = await a.runner.shared.store.lease("host:a")
            assert own is not None
            assert own.live  # (else B would wait for ever)
            assert own.fence == again
            await b.runner.claim_orphans()
            await b.until(lambda: TASK not in b.runner.lanes)
            await a.runner.claim_orphans()
            ended, records = await answered_on(a)
    assert lost is None
    assert first is not None
    assert again is not None
    assert again.epoch > first.epoch
    assert ended.state == "done"
    assert_given_back_to_a(records)
    assert b.workers.launched == []


@contextlib.asynccontextmanager
async def held_for_a_who_is_back(
    tmp_path: Path, pg_dsn: str
) -> AsyncIterator[tuple[TaskHost, TaskHost]]:
    """A's task waits; A stops and stays away: B claims it and holds it ``host_lost:a``
    (durably). A starts again (its own lease live): the task is B's to give back."""
    async with task_host(tmp_path, "b", pg_dsn, []) as b:
        async with task_host(tmp_path, "a", pg_dsn, [wait(), say("asked")]) as a:
            await a.runner.submit(spec(tmp_path))
            await a.until(lambda: a.runner.show(TASK).state == "waiting")
        await expire_leases(pg_dsn)
        await b.runner.claim_orphans()
        await durable_holds(b)
        async with task_host(tmp_path, "a", pg_dsn, [done(), say()]) as a:
            yield a, b


async def lane_holder(host: TaskHost) -> str | None:
    """The host whose lease on the task's lane is live, if any (asked through ``host``'s
    store, by the database's clock)."""
    assert host.runner.shared is not None
    lease = await host.runner.shared.store.lease(f"task:{TASK}")
    return lease.fence.owner if lease is not None and lease.live else None


async def worktree_holder(pg_dsn: str) -> str | None:
    """The task holding the worktree lease of the task's id, if any (S33)."""
    rows = await execute(
        pg_dsn, "SELECT task_id FROM pi_runtime.task_worktrees WHERE task_id = %s", [TASK]
    )
    return str(rows[0][0]) if rows else None


async def test_s35_an_abort_while_the_hand_back_asks_the_database_ends_the_task_once(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S35, an adversary's order: B holds A's task ``host_lost:a`` and, A being back, asks the
    database whether A runs; the operator's abort reaches B during that await. The hand-back
    re-checks after it: the task has ended, so it is not given back; its end lets its
    worktree lease go; A launches nothing."""
    with trio.fail_after(LIMIT):
        async with held_for_a_who_is_back(tmp_path, pg_dsn) as (a, b):
            asked = b.runner._alive

            async def abort_meanwhile(host: str) -> bool:
                answer = await asked(host)
                await b.runner.abort(TASK, "no longer needed")
                return answer

            b.runner._alive = abort_meanwhile  # type: ignore[method-assign]
            await b.runner.claim_orphans()
            ended = await b.runner.wait(TASK)
            assert b.runner.elsewhere == {}
            await a.runner.claim_orphans()  # (B's lease given up or not yet: not A's to run)
            assert a.runner.lanes == {}
            records = await lane_records(a)
    assert await worktree_holder(pg_dsn) is None  # an ended task's (B's lane let it go)
    assert ended.state == "aborted"
    assert sum(isinstance(r, TaskEnded) for r in records) == 1
    assert a.workers.launched == []
    assert b.workers.launched == []


async def test_s35_an_abort_right_after_the_hand_back_is_answered_by_the_tasks_host(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S35, the other order: B has given the task back (its lane's scope cancelled, the lane
    not stopped yet) when the operator's abort reaches B. B no longer acts for the task: the
    abort is answered ``task_elsewhere`` naming A, writes nothing, and A — where the abort
    is then sent — ends the task once."""
    with trio.fail_after(LIMIT):
        async with held_for_a_who_is_back(tmp_path, pg_dsn) as (a, b):
            assert await lane_holder(a) == "b"
            await b.runner._hand_back()
            with pytest.raises(TaskError) as refused:
                await b.runner.abort(TASK, "no longer needed")
            assert refused.value.code is ReasonCode.TASK_ELSEWHERE
            assert "'a'" in str(refused.value)
            while await lane_holder(a) == "b":  # given up once its lane has stopped
                await b.events.receive()  # (its followers are told after)
            await a.runner.claim_orphans()
            await a.runner.abort(TASK, "no longer needed")
            ended = await a.runner.wait(TASK)
            records = await lane_records(a)
    assert ended.state == "aborted"
    assert sum(isinstance(r, TaskEnded) for r in records) == 1
    assert b.workers.launched == []


async def test_s32_a_host_lost_task_is_not_resumed_without_its_session(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S32: the operator's resume of a task held ``host_lost`` on a host without its session
    is refused (``host_lost``) — a fresh session would not be the task's — and the task stays
    held; ``abort`` ends it there."""
    with trio.fail_after(LIMIT):
        async with claimed_from_a(tmp_path, pg_dsn) as (_a, b):
            with pytest.raises(TaskError) as refused:
                b.runner.resume(TASK)
            assert refused.value.code is ReasonCode.HOST_LOST
            assert b.runner.show(TASK).hold_reason == "host_lost:a"
            await b.runner.abort(TASK, "its host is gone")
            ended = await b.runner.wait(TASK)
    assert ended.state == "aborted"
    assert b.workers.launched == []


async def test_s30_a_submitter_that_died_before_its_submission_leaves_no_task(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S30: a host claimed a new task's lane and died before the submission record was
    written (its log holds a header only). Nobody runs that lane, and the task submitted again
    to another host is a new task there, run to its end."""
    with trio.fail_after(LIMIT):
        async with open_pg_store(pg_dsn, root=tmp_path / "dead" / "state", owner="dead") as store:
            fence = await store.claim(f"task:{TASK}", 60.0)
            assert fence is not None
            await store.open_lane_log(f"task:{TASK}", fence=fence)  # the header, then death
        await expire_leases(pg_dsn)
        async with task_host(tmp_path, "a", pg_dsn, [done(), say()]) as a:
            assert a.runner.lanes == {}
            await a.runner.submit(spec(tmp_path))
            ended = await a.runner.wait(TASK)
            records = await lane_records(a)
    assert ended.state == "done"
    assert launch_hosts(records) == ["a"]


def test_s30_tasks_store_lists_the_deployments_tasks_and_their_hosts(
    tmp_path: Path, pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tasks --store DSN`` lists every task of the deployment as its lane log in the
    database says, with the host holding it; ``task show ID --store DSN`` prints one (and
    refuses an unknown one ``task_unknown``)."""

    async def run_until_waiting() -> None:
        with trio.fail_after(LIMIT):
            async with task_host(tmp_path, "a", pg_dsn, [wait(), say("asked")]) as a:
                await a.runner.submit(spec(tmp_path))
                await a.until(lambda: a.runner.show(TASK).state == "waiting")

    trio.run(run_until_waiting)  # A stopped; its lease runs on (its worktree is its own)
    assert main(["tasks", "--store", pg_dsn, "--json"]) == EXIT_OK
    listing = json.loads(capsys.readouterr().out)
    assert listing["source"] == "database"
    (task,) = listing["tasks"]
    assert (task["task_id"], task["state"], task["process_epoch"]) == (TASK, "waiting", 1)
    assert task["holder"]["host"] == "a"
    assert task["holder"]["live"] is True
    assert main(["tasks", "--store", pg_dsn]) == EXIT_OK
    table = capsys.readouterr().out
    assert f"{TASK}  waiting  a " in table
    assert main(["task", "show", TASK, "--store", pg_dsn]) == EXIT_OK
    assert "held by a (epoch 1, its lease runs)" in capsys.readouterr().out
    assert main(["task", "show", "nobody", "--store", pg_dsn]) == EXIT_FAILED
    assert "task_unknown" in capsys.readouterr().err


async def test_s30_a_hosts_task_list_is_the_deployments(
    tmp_path: Path, pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """S30: asked for its tasks (the admin socket's ``tasks``), a host on the
    shared store lists every task of the deployment — its own from its live lanes, the
    others' as the database says — each with the host holding it, and shows one it does not
    hold the same way; a database it cannot read now leaves it listing its own, saying so."""
    policy = WatchdogPolicy()
    with trio.fail_after(LIMIT):
        async with (
            task_host(tmp_path, "a", pg_dsn, [wait(), say("asked")]) as a,
            task_host(tmp_path, "b", pg_dsn, []) as b,
        ):
            await a.runner.submit(spec(tmp_path))
            await a.until(lambda: a.runner.show(TASK).state == "waiting")
            on_a = await TaskService(a.runner, policy, policy).task_list()
            on_b = await TaskService(b.runner, policy, policy).task_list()
            shown = await TaskService(b.runner, policy, policy).task_show(TASK)
            with pytest.raises(TaskError) as unknown:
                await TaskService(b.runner, policy, policy).task_show("nobody")

            async def unreadable() -> list[str]:
                raise JournalError(ReasonCode.STORE_UNAVAILABLE, "the database is away")

            a.runner.host.store.lane_logs = unreadable  # type: ignore[method-assign]
            degraded = await TaskService(a.runner, policy, policy).task_list()
    for listing in (on_a, on_b):
        assert listing["deployment"] is True
        (task,) = listing["tasks"]
        assert (task["task_id"], task["state"], task["holder"]["host"]) == (TASK, "waiting", "a")
    assert not str(on_a["tasks"][0]["classification"]).startswith("unknown")  # A's live lane
    assert str(on_b["tasks"][0]["classification"]).startswith("unknown: read from the database")
    assert (shown["task"]["state"], shown["task"]["holder"]["host"]) == ("waiting", "a")
    assert unknown.value.code is ReasonCode.TASK_UNKNOWN
    assert "deployment" not in degraded
    assert "the database is away" in degraded["deployment_error"]
    assert [t["task_id"] for t in degraded["tasks"]] == [TASK]
    _print_tasks({"source": "server"} | on_b, json=False)
    table = capsys.readouterr().out
    assert "every task of its deployment" in table
    assert f"{TASK}  waiting  a " in table


def other_task(task_id: str, worktree: Path) -> TaskSpec:
    worktree.mkdir(parents=True, exist_ok=True)
    return TaskSpec(task_id=task_id, prompt="another task", worktree=str(worktree),
                    grants=frozenset({"read"}))  # fmt: skip


def refused_leased(error: pytest.ExceptionInfo[TaskError], holder: str) -> None:
    assert error.value.code is ReasonCode.WORKTREE_LEASED, error.value
    assert repr(holder) in str(error.value)


async def test_s33_one_live_task_per_worktree_across_hosts(tmp_path: Path, pg_dsn: str) -> None:
    """S33 (TL13 for the deployment): A's task waits for its user on the worktree; B is
    refused ``worktree_leased`` naming it for a task on a directory inside it and on one
    around it — also after B looked at the deployment's lanes —, takes one on a directory
    beside it; once A's task ended, B takes a task on the worktree itself."""
    worktree = make_worktree(tmp_path)
    with trio.fail_after(LIMIT):
        async with (
            task_host(tmp_path, "a", pg_dsn, [wait(), say("asked"), done(), say()]) as a,
            task_host(tmp_path, "b", pg_dsn, [wait(), wait()]) as b,
        ):
            await a.runner.submit(spec(tmp_path))
            await a.until(lambda: a.runner.show(TASK).state == "waiting")
            with pytest.raises(TaskError) as inside:
                await b.runner.submit(other_task("inside", worktree / "sub"))
            refused_leased(inside, TASK)
            await b.runner.claim_orphans()
            with pytest.raises(TaskError) as around:
                await b.runner.submit(other_task("around", tmp_path))
            refused_leased(around, TASK)
            beside = await b.runner.submit(other_task("beside", tmp_path / "beside"))
            assert beside.task_id == "beside"
            await a.runner.reply(TASK, "the blue one")
            assert (await a.runner.wait(TASK)).state == "done"
            after = await b.runner.submit(other_task("after", worktree))
            assert after.task_id == "after"
    rows = await execute(pg_dsn, "SELECT task_id FROM pi_runtime.task_worktrees ORDER BY 1")
    assert rows == [("after",), ("beside",)]  # live (waiting) when the hosts stopped


async def test_s33_two_hosts_leasing_one_worktree_at_once_one_is_refused(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S33: two new tasks on one worktree sent to two hosts at the same moment: the database
    serialises the two leases, so one task runs and the other is refused ``worktree_leased``
    naming it."""
    worktree = make_worktree(tmp_path)
    outcomes: dict[str, str] = {}

    async def submit(host: TaskHost, task_id: str) -> None:
        try:
            await host.runner.submit(other_task(task_id, worktree))
            outcomes[task_id] = "accepted"
        except TaskError as error:
            outcomes[task_id] = str(error.code)

    with trio.fail_after(LIMIT):
        async with (
            task_host(tmp_path, "a", pg_dsn, [wait()]) as a,
            task_host(tmp_path, "b", pg_dsn, [wait()]) as b,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(submit, a, "from-a")
            nursery.start_soon(submit, b, "from-b")
    assert sorted(outcomes.values()) == ["accepted", "worktree_leased"], outcomes


@contextlib.asynccontextmanager
async def racing_submissions(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch, *, a_fails: bool = False
) -> AsyncIterator[tuple[TaskHost, TaskHost, dict[str, object]]]:
    """The same new task sent to A and B at once, the order forced: A stops between its
    claim of the lane and its record until B's claim has lost — then goes on, or (with
    ``a_fails``) is refused and lets the lane go. Yields once both answered, with what each
    answered (a view or a :class:`TaskError`)."""
    a_claimed, b_lost = trio.Event(), trio.Event()
    outcomes: dict[str, object] = {}

    async def submit(host: TaskHost) -> None:
        try:
            outcomes[host.name] = await host.runner.submit(spec(tmp_path))
        except TaskError as error:
            outcomes[host.name] = error

    async with (
        task_host(tmp_path, "a", pg_dsn, [wait()]) as a,
        task_host(tmp_path, "b", pg_dsn, [wait()]) as b,
    ):
        lease_worktree = a.runner._lease_worktree

        async def held_at_the_claim(*args: object) -> str | None:
            a_claimed.set()
            await b_lost.wait()
            if a_fails:
                raise TaskError(ReasonCode.WORKTREE_LEASED, "refused (the test)")
            return await lease_worktree(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(a.runner, "_lease_worktree", held_at_the_claim)
        assert b.runner.leases is not None
        claim = b.runner.leases.claim

        async def losing(*args: object, **kwargs: object) -> object:
            fence = await claim(*args, **kwargs)  # type: ignore[arg-type]
            if fence is None:
                b_lost.set()
            return fence

        monkeypatch.setattr(b.runner.leases, "claim", losing)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit, a)
            await a_claimed.wait()
            nursery.start_soon(submit, b)
        yield a, b, outcomes


async def test_s34_one_task_sent_to_two_hosts_at_once_is_a_duplicate_on_the_one_that_lost(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S34: A claims the lane; B, whose claim lost while A's submission record was not yet
    written, waits for that record and answers as for a duplicate — the task's view, held
    by A — not a bare ``task_elsewhere``."""
    with trio.fail_after(LIMIT):
        async with racing_submissions(tmp_path, pg_dsn, monkeypatch) as (a, b, outcomes):
            await a.until(lambda: a.runner.show(TASK).state == "waiting")
            assert TASK not in b.runner.lanes
    view_on_a, on_b = outcomes["a"], outcomes["b"]
    assert getattr(view_on_a, "task_id", None) == TASK, view_on_a
    assert isinstance(on_b, DuplicateElsewhere), on_b
    assert on_b.view is not None
    assert on_b.view.task_id == TASK


async def test_s34_a_lane_the_winner_let_go_without_its_record_is_claimed_by_the_other(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S34: A claimed the lane, then its submission was refused and it let the lane go with
    no record: the task is nobody's, so B — waiting for A's record — claims it itself and
    runs it (not ``task_elsewhere`` for a task no host has)."""
    with trio.fail_after(LIMIT):
        async with racing_submissions(tmp_path, pg_dsn, monkeypatch, a_fails=True) as (
            a,
            b,
            outcomes,
        ):
            await b.until(lambda: b.runner.show(TASK).state == "waiting")
            records = await lane_records(b)
    on_a, view_on_b = outcomes["a"], outcomes["b"]
    assert isinstance(on_a, TaskError), on_a
    assert on_a.code is ReasonCode.WORKTREE_LEASED
    assert getattr(view_on_b, "task_id", None) == TASK, view_on_b
    assert launch_hosts(records) == ["b"]
    assert a.workers.launched == []


async def test_s33_a_lease_left_by_an_ended_task_is_struck_out(tmp_path: Path, pg_dsn: str) -> None:
    """S33: a task ended on A, but its worktree lease is still in the database (A died
    between its end record and letting the worktree go): B, asked for a task there, reads the
    holder's lane log, finds it ended, strikes the lease out and takes the task."""
    worktree = make_worktree(tmp_path)
    with trio.fail_after(LIMIT):
        async with task_host(tmp_path, "a", pg_dsn, [done(), say()]) as a:
            await a.runner.submit(spec(tmp_path))
            assert (await a.runner.wait(TASK)).state == "done"
        # A stopped: its lane let the worktree go; the lease A would have left if it had died
        # between its end record and that, put back
        await execute(
            pg_dsn,
            "INSERT INTO pi_runtime.task_worktrees VALUES (%s, %s)",
            [TASK, str(worktree)],
        )
        async with task_host(tmp_path, "b", pg_dsn, [wait()]) as b:
            taken = await b.runner.submit(other_task("next", worktree / "sub"))
            assert taken.task_id == "next"
    rows = await execute(pg_dsn, "SELECT task_id FROM pi_runtime.task_worktrees ORDER BY 1")
    assert rows == [("next",)]


async def test_s33_a_submission_under_way_holds_the_worktree_an_abandoned_one_does_not(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S33: a worktree lease whose task has no submission record yet holds while that
    task's submitter holds its lane (a submission under way on Z): B is refused
    ``worktree_leased``; once Z's lease ran out (Z died before its record) the lease is
    proven abandoned, struck out, and B's task takes the worktree."""
    worktree = make_worktree(tmp_path)
    with trio.fail_after(LIMIT):
        async with (
            task_host(tmp_path, "b", pg_dsn, [wait()]) as b,
            open_pg_store(pg_dsn, root=tmp_path / "z" / "state", owner="z") as z,
        ):
            assert await z.claim("task:ghost", 600.0) is not None
            await execute(
                pg_dsn,
                "INSERT INTO pi_runtime.task_worktrees VALUES ('ghost', %s)",
                [str(worktree)],
            )
            with pytest.raises(TaskError) as under_way:
                await b.runner.submit(other_task("next", worktree))
            refused_leased(under_way, "ghost")
            await expire_leases(pg_dsn)
            taken = await b.runner.submit(other_task("next", worktree))
            assert taken.task_id == "next"
    rows = await execute(pg_dsn, "SELECT task_id FROM pi_runtime.task_worktrees ORDER BY 1")
    assert rows == [("next",)]


async def test_s30_an_ended_task_is_shown_by_any_host_after_a_restart(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S30: a task A ran to its end is shown by A started again and by a host that started
    after — its view as the database says — and sent again to either it is a duplicate with
    that view, never run again; before, a host knew only the tasks it had ended itself since
    it started (``task_unknown``)."""
    with trio.fail_after(LIMIT):
        async with task_host(tmp_path, "a", pg_dsn, [done(), say()]) as a:
            await a.runner.submit(spec(tmp_path))
            ended = await a.runner.wait(TASK)
        async with (
            task_host(tmp_path, "a", pg_dsn, []) as again,
            task_host(tmp_path, "b", pg_dsn, []) as b,
        ):
            for host in (again, b):
                view = host.runner.show(TASK)
                assert (view.state, view.ended) == ("done", msgspec.to_builtins(ended))
                assert (await host.runner.submit(spec(tmp_path))).state == "done"
                assert host.workers.launched == []


def assert_given_back_to_a(records: list[Record]) -> None:
    """S35: held ``host_lost:a`` by another host, then given back: both epochs launched on
    ``a``, and the task ended once."""
    holds = [(r.kind, r.detail["reason"]) for r in records if isinstance(r, OutboxAction)
             and r.kind in ("hold", "unhold")]  # fmt: skip
    assert holds == [("hold", "host_lost:a"), ("unhold", "host_lost:a")]
    assert launch_hosts(records) == ["a", "a"]
    assert sum(isinstance(r, TaskEnded) for r in records) == 1
