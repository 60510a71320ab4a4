"""A task-runner host for the crash tests: ``python tests/tasks/task_host.py SPEC.json``.

It opens a task runner on ``<base>/state`` with real worker processes (subprocess Fake-Pi
behind the lane's gateway and gate, :class:`~runtime._tasks._workers.ProcessWorkers`) talking
to the scripted model at the spec's ``upstream``, on the unsafe test time scale
(``WatchdogPolicy().scaled(scale)``) and the real clock. It submits the spec's ``task`` unless
the state already holds it (a restart resumes it), then follows the task until it ends or is
held, and exits 0. Every fact is one JSON line on stdout, written and flushed as it happens,
so a test can SIGKILL the host right after a named point::

    {"event": {...}, "budget": {...}}   a change of the task (TaskEvent) and its budget then
    {"paused": POINT}                   the spec's ``pause`` barrier was passed; the host
                                        stops whole right after it, to be killed
    {"held": VIEW}                      the task is held (StalledOperatorRequired)
    {"granted": VIEW}                   the spec's ``on_hold`` grant was given
    {"ended": {...}, "view": VIEW}      the task's end record

Spec keys: ``base`` (the test's directory: ``state``, ``work``, ``worktree``,
``effects.jsonl`` below it), ``upstream`` (the model's ``…/v1``), ``scale``, ``task``
(``task_id``, ``prompt``, ``grants``), ``behaviours`` (per process epoch number, Fake-Pi's
``at`` barriers, e.g. ``{"1": {"before_model:1": "hang"}}``: that epoch wedges before its first
model request), ``pause`` (``{"point": P, "nth": N}``: stop right after the N-th pass of P),
``on_hold`` (``{"epochs": E, "seconds": S}``: when the task is first held, grant that once and
resume it, as an operator would), ``term_grace`` (seconds from TERM to KILL of a fenced tree;
a wedged Fake-Pi ignores TERM), ``probe_timeout`` (how long a probe waits for its answer: a
real process on a loaded machine, not a threshold of the clocks; a quick answer ends the wait),
``recovery_seconds`` (the recovery-time budget, in real seconds: 600 unless said, not the
scaled 6 s, since a host's restart or another host's takeover on a loaded machine is recovery
time too, WD11, and would run it out; its running out is tested in virtual time),
``backoff`` (a ``[backoff]`` table: an unavailable provider parks the turn, PB6),
``retention`` (a ``[retention]`` table) with ``retain_at_days`` (after the task ends, one
retention pass with the wall clock moved on by each of these days, then a resubmission of
the task, unless ``resubmit`` is false: ``{"retained": …}`` and ``{"resubmitted":
STATE_OR_CODE}`` facts, RT12) and ``forget_at_days`` (before those, an operator's ``task
forget`` of the task that many days on: a ``{"forgotten": REMOVED}`` fact),
``store`` (a PostgreSQL DSN: the host is one of a deployment on it, its lease owner ``owner``,
default ``a``, the same across its restarts, RT13).

Pause points (each wraps the runtime method named; the host stops *after* it unless said).
The host stops **whole** there (``tests/_host_process.py``'s :func:`stop_here`: it sends
itself ``SIGSTOP``), not just the task that passed the point: a pause in a lane's background
task (a probe, a guard check, a tool call) would otherwise let the lane's other tasks go on —
the watchdog's ticks to the fence probe, the reserve, a hold — for as long as the test's
SIGKILL takes, and a test that asserts what was durable at the point would depend on how
loaded the machine is. Stopped, the host is as it would be had the SIGKILL come at the point
itself, however late it comes.


* ``action:KIND[:STATE][:PURPOSE]`` — :meth:`TaskLane.record_action` recorded an outbox action of
  that kind (``probe``, ``eligibility``, ``reserve``, ``fence``, ``signal``, ``reap``,
  ``attest``, ``grant``), state (``reserved``/``done``) and probe purpose (``soft``/``fence``);
* ``record:TAG`` — the lane log appended a record of that type (``epoch_started``,
  ``continuation_sent``, ``lifecycle_receipt``, ``task_ended``), durable before anyone hears;
* ``continuation_launch`` — a replacement epoch is launched and recorded, before its
  continuation prompt is sent (the start of :meth:`EpochWatch.run` with a continuation);
* ``continuation_prompted`` — a continuation prompt is in the worker's session, before its
  record (the start of :meth:`TaskLane.record_marker`);
* ``effect`` — the runtime's ``effect`` tool wrote its ledger line, before its outcome;
* ``receipt_commit`` — ``write_document``'s receipt transaction committed, before its outcome;
* ``retention:METHOD`` — after the store's ``METHOD`` (``slim_log``, ``expire_tasks``,
  ``remove_tree``; on PostgreSQL ``slim_log``, ``expire_task``) in a retention pass (RT12,
  RT13);
* ``retention:inside_remove_tree`` — half-way through removing the spec's task's lane
  directory (the ``rmtree`` of it, wherever it is by then: RT15 renames it into ``trash/``
  first): its ``lane.log`` unlinked (on the file store), the rest still there (RT12, RT13);
* ``finalize`` — before :meth:`TaskLane._finalize` (terminal receipt durable, worker stopped,
  no end record yet);
* ``epoch_launched`` — the N-th worker epoch is launched and proven, its ``EpochStarted`` not
  yet appended (the launch window, workers.md W13).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec
import trio

from runtime._boundary._calls import GateCall, GateResult
from runtime._boundary._gateway import GatewayConfig
from runtime._boundary._receipts import receipt_store
from runtime._boundary._tools import EffectLedger
from runtime._clock import Clocks
from runtime._config import BackoffConfig, RetentionConfig
from runtime._errors import ReasonCode, TaskError
from runtime._journal._fence import Fence
from runtime._journal._interface import JournalStore
from runtime._journal._journal import Journal
from runtime._journal._postgres import PgStore, open_pg_store
from runtime._journal._store import Store, lane_key, open_store, runtime_dir
from runtime._pi._launch import ModelRoute, WorkerProgram
from runtime._records import Record
from runtime._tasks._epoch import EpochEnd, EpochWatch
from runtime._tasks._lane import TaskLane
from runtime._tasks._runner import (
    DuplicateElsewhere,
    SharedTasks,
    TaskRunner,
    open_task_runner,
)
from runtime._tasks._watchdog import WatchdogPolicy
from runtime._tasks._workers import EpochRequest, ProcessWorkers, TaskWorker
from runtime._wire import TaskSpec
from tests._host_process import (
    emit,
    pause_after_receipt_commit,
    pause_when_epoch_launched,
    stop_here,
)

ROUTE = ModelRoute(provider="fake", model="fake-model")
HELD = "StalledOperatorRequired"


def record_tag(record: Record) -> str:
    return str(record.__struct_config__.tag)


def install_pause(point: str, nth: int) -> None:
    """Stop the whole host right after the ``nth`` pass of ``point`` (:func:`stop_here`)."""
    passed = 0

    async def barrier() -> None:
        nonlocal passed
        passed += 1
        if passed == nth:
            stop_here(point)

    name, _, rest = point.partition(":")
    if point == "retention:inside_remove_tree":
        rmtree = shutil.rmtree

        state = os.path.join(SPEC["base"], "state") + os.sep
        key = lane_key(f"task:{SPEC['task']['task_id']}")

        def half_way(path: Any, *args: Any, **kwargs: Any) -> None:
            where, name = str(path), os.path.basename(str(path))
            if not where.startswith(state) or not name.startswith(key):
                return rmtree(path, *args, **kwargs)  # not the lane directory (a home, a tmp)
            log = os.path.join(path, "lane.log")
            if os.path.exists(log):  # (on PostgreSQL the log is rows: nothing to unlink)
                os.unlink(log)  # as rmtree may, the log first: the rest stays
            stop_here(point)  # from the removal's thread: the whole host stops here

        shutil.rmtree = half_way  # type: ignore[assignment]
        return
    if name == "action":
        wanted_kind, _, rest = rest.partition(":")
        wanted_state, _, wanted_purpose = rest.partition(":")
        action = TaskLane.record_action

        async def after_action(
            self: TaskLane,
            action_id: str,
            kind: str,
            state: str,
            detail: dict[str, Any] | None = None,
        ) -> None:
            await action(self, action_id, kind, state, detail)
            if (
                kind == wanted_kind
                and wanted_state in ("", state)
                and wanted_purpose in ("", (detail or {}).get("purpose", ""))
            ):
                await barrier()

        TaskLane.record_action = after_action  # type: ignore[method-assign]
    elif name == "retention":  # after a step of a retention pass (RT12, RT13): <store>.<rest>
        owner: type[Any] = PgStore if "store" in SPEC else Store
        method = getattr(owner, rest)

        async def after_step(self: Any, *args: Any, **kwargs: Any) -> Any:
            done = await method(self, *args, **kwargs)
            await barrier()
            return done

        setattr(owner, rest, after_step)
    elif name == "record":
        append = Journal.append

        async def after_append(self: Journal, record: Record, *, fence: Fence | None = None) -> int:
            seq = await append(self, record, fence=fence)
            if record_tag(record) == rest:
                await barrier()
            return seq

        Journal.append = after_append  # type: ignore[method-assign]
    elif name == "continuation_launch":
        run = EpochWatch.run

        async def before_run(
            self: EpochWatch, kind: str, text: str, action_id: str | None
        ) -> EpochEnd:
            if kind == "continuation":
                await barrier()
            return await run(self, kind, text, action_id)

        EpochWatch.run = before_run  # type: ignore[method-assign]
    elif name == "effect":
        apply = EffectLedger.__call__

        async def after_effect(self: EffectLedger, call: GateCall, intent_id: str) -> GateResult:
            result = await apply(self, call, intent_id)  # the ledger line is durable
            await barrier()  # before the gate records the outcome
            return result

        EffectLedger.__call__ = after_effect  # type: ignore[method-assign]
    elif name == "receipt_commit":
        pause_after_receipt_commit(barrier)
    elif name == "epoch_launched":
        pause_when_epoch_launched(nth)
    elif name == "continuation_prompted":
        record_marker = TaskLane.record_marker

        async def before_record_marker(self: TaskLane, action_id: str) -> None:
            await barrier()
            await record_marker(self, action_id)

        TaskLane.record_marker = before_record_marker  # type: ignore[method-assign]
    elif name == "finalize":
        finalize = TaskLane._finalize

        async def before_finalize(self: TaskLane) -> None:
            await barrier()
            await finalize(self)

        TaskLane._finalize = before_finalize  # type: ignore[method-assign]
    else:
        raise ValueError(f"unknown pause point {point!r}")


@dataclass
class EpochWorkers:
    """:class:`ProcessWorkers` whose Fake-Pi for epoch N reads ``configs[N]`` (its barriers)."""

    workers: ProcessWorkers
    configs: Mapping[int, Path]

    @property
    def in_host(self) -> bool:
        return self.workers.in_host

    def open(self, request: EpochRequest) -> contextlib.AbstractAsyncContextManager[TaskWorker]:
        path = self.configs.get(request.number)
        workers = self.workers
        if path is not None:
            program = workers.program
            command = (*program.command, "--fake-config", str(path))
            workers = replace(workers, program=replace(program, command=command))
        return workers.open(request)


def fake_configs(base: Path, behaviours: Mapping[str, Mapping[str, str]]) -> dict[int, Path]:
    configs = {}
    for epoch, at in behaviours.items():
        path = base / f"fake-epoch-{epoch}.json"
        path.write_text(json.dumps({"behaviours": {"at": dict(at)}}))
        configs[int(epoch)] = path
    return configs


def view_of(runner: TaskRunner, task_id: str) -> dict[str, Any]:
    view: dict[str, Any] = msgspec.to_builtins(runner.show(task_id))
    return view


class Changes:
    """Pulsed on every change event of the runner."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def pulse(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        with trio.move_on_after(0.1):  # and look again now and then, whatever happens
            await self._event.wait()


async def follow(runner: TaskRunner, spec: Mapping[str, Any], changes: Changes) -> None:
    """Until the task ends or is held (after the one ``on_hold`` grant, if any)."""
    task_id = spec["task"]["task_id"]
    grant = spec.get("on_hold")
    if runner._expired(task_id):  # let go by retention before this host started (RT12)
        emit({"expired": task_id})
        return
    if task_id in runner.ended:  # it had ended before this host started
        ended = runner.ended[task_id].ended
        emit({"ended": msgspec.to_builtins(ended), "view": view_of(runner, task_id)})
        return
    lane = runner.lane(task_id)
    granted = False
    while True:
        if lane.ended is not None:
            await lane.finished.wait()
            emit({"ended": msgspec.to_builtins(lane.ended), "view": view_of(runner, task_id)})
            return
        held = lane.view().classification == HELD and lane.worker is None
        if held and not granted:
            if grant is None:
                emit({"held": view_of(runner, task_id)})
                return
            await runner.grant(
                task_id,
                epochs=int(grant.get("epochs", 0)),
                seconds=float(grant.get("seconds", 0.0)),
                reason="crash test grant",
            )
            emit({"granted": view_of(runner, task_id)})
            runner.resume(task_id)  # the operator's next step: resume the held task
            grant, granted = None, True
        elif not held:
            granted = False  # the lane took the grant up
        await changes.wait()


@dataclass
class ShiftedWall:
    """The system's wall clock moved on by ``days`` (what retention ages by, RT12)."""

    days: float = 0.0

    def time_ms(self) -> int:
        return time.time_ns() // 1_000_000 + int(self.days * 86_400_000)


async def retain(runner: TaskRunner, spec: Mapping[str, Any], wall: ShiftedWall) -> None:
    """The spec's retention passes (``retain_at_days``), each at that many days on, then a
    resubmission of the task: each one fact."""
    retention = msgspec.convert(spec["retention"], RetentionConfig)
    if "forget_at_days" in spec:
        wall.days = float(spec["forget_at_days"])
        emit({"forgotten": await runner.forget(spec["task"]["task_id"], retention)})
    for days in spec.get("retain_at_days", []):
        wall.days = float(days)
        done = await runner.retain(retention)
        emit({"retained": {"days": days, "slimmed": done.slimmed, "expired": done.expired}})
    if not spec.get("resubmit", True):
        return
    task = spec["task"]
    try:
        view = await runner.submit(
            TaskSpec(
                task_id=task["task_id"],
                prompt=task["prompt"],
                worktree=str(Path(spec["base"]) / "worktree"),
                grants=frozenset(task["grants"]),
            )
        )
        emit({"resubmitted": view.state})
    except TaskError as error:
        emit({"resubmitted": str(error.code)})


SPEC: dict[str, Any] = {}
"""The spec this process runs (what a pause point needs to know of it)."""


@contextlib.asynccontextmanager
async def journal_store(
    spec: Mapping[str, Any], state: Path, clocks: Clocks
) -> AsyncIterator[tuple[JournalStore, SharedTasks | None]]:
    """The spec's store: the file store in ``state``, or with ``store`` (a DSN) the
    PostgreSQL store, this host one of a deployment (its owner ``owner``, the same across its
    restarts; its lanes' own files still under ``state``)."""
    if "store" not in spec:
        async with open_store(state, clocks=clocks) as store:
            yield store, None
        return
    owner = str(spec.get("owner", "a"))
    async with open_pg_store(spec["store"], root=state, clocks=clocks, owner=owner) as pg:
        yield pg, SharedTasks(store=pg, lease_seconds=60.0, poll_seconds=3600.0)


async def main(spec: dict[str, Any]) -> None:
    SPEC.update(spec)
    base = Path(spec["base"])
    if "pause" in spec:
        install_pause(spec["pause"]["point"], spec["pause"].get("nth", 1))
    state = base / "state"
    backoff = msgspec.convert(spec["backoff"], BackoffConfig) if "backoff" in spec else None
    upstream = GatewayConfig(upstream_url=spec["upstream"], park_unavailable=backoff is not None)
    policy = replace(  # the clocks on the test scale; the two bounds on the real machine
        WatchdogPolicy().scaled(float(spec.get("scale", 300))),
        term_grace_seconds=float(spec.get("term_grace", 5.0)),
        probe_timeout_seconds=float(spec.get("probe_timeout", 30.0)),
    )
    policy = replace(policy, recovery_seconds=float(spec.get("recovery_seconds", 600.0)))
    configs = fake_configs(base, spec.get("behaviours", {}))
    task = spec["task"]
    changes = Changes()

    def log(line: str) -> None:
        print(f"{time.monotonic():.3f} {line}", file=sys.stderr, flush=True)

    wall = ShiftedWall()
    clocks = replace(Clocks.system(), wall=wall)
    async with (
        journal_store(spec, state, clocks) as (store, shared),
        receipt_store(state) as receipts,
    ):
        workers = ProcessWorkers(
            program=WorkerProgram.fake_pi(),
            route=ROUTE,
            upstream=upstream,
            socket_dir=runtime_dir(state),
            state_dir=state,
        )
        async with (
            open_task_runner(
                store,
                workers=EpochWorkers(workers, configs),
                route=ROUTE,
                policy=policy,
                upstream=upstream,
                receipts=receipts,
                ledger=base / "effects.jsonl",
                work_root=base / "work",
                log=log,
                backoff=backoff,
                shared=shared,
            ) as runner,
            runner.events(buffer=10_000) as events,
            trio.open_nursery() as nursery,
        ):

            async def report() -> None:
                async for event in events:
                    budget = runner.show(event.task_id).budget
                    emit({"event": msgspec.to_builtins(event), "budget": budget})
                    changes.pulse()

            nursery.start_soon(report)
            elsewhere = None
            if not runner.known(task["task_id"]):
                try:
                    await runner.submit(
                        TaskSpec(
                            task_id=task["task_id"],
                            prompt=task["prompt"],
                            worktree=str(base / "worktree"),
                            grants=frozenset(task["grants"]),
                        )
                    )
                except DuplicateElsewhere as duplicate:  # on PostgreSQL: the task had ended
                    elsewhere = duplicate.view  # before this host started (S30)
                except TaskError as error:  # ... and retention let it go (RT13)
                    if error.code is not ReasonCode.TASK_EXPIRED:
                        raise
                    emit({"expired": task["task_id"]})
            if elsewhere is not None:
                emit({"ended": elsewhere.ended, "view": msgspec.to_builtins(elsewhere)})
            elif not runner._expired(task["task_id"]):
                await follow(runner, spec, changes)
            if "retention" in spec:
                await retain(runner, spec, wall)
            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main, json.loads(Path(sys.argv[1]).read_text()))
