"""The task runner: submits, controls and shows task lanes (docs/design/watchdog.md; issue #8).

:func:`open_task_runner` owns a set of :class:`~runtime._tasks._lane.TaskLane`\\ s on a state
directory's :class:`~runtime._journal._store.Store`: each in its own task of the runner's nursery.
At start it finds every task whose log has no end and resumes it (a host restart replaces
its worker: TL7). Submitting is idempotent by task id: the same task again returns its view;
a different task under the same id is ``task_conflict``.

Error handling: every refusal is a :class:`~runtime._tasks._state.TaskError` with a stable code.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import trio

from .._boundary._gateway import GatewayConfig
from .._boundary._receipts import ReceiptStore
from .._clock import Clocks
from .._errors import ReasonCode, TaskError
from .._journal._interface import JournalStore
from .._journal._store import lane_key
from .._pi._launch import ModelRoute
from .._records import TaskEnded, TaskSubmitted
from .._wire import TaskEvent, TaskSpec, TaskView
from ._lane import TaskHost, TaskLane
from ._lifecycle import Verdict
from ._state import check_spec, submitted_record
from ._watchdog import WatchdogPolicy
from ._workers import WorkerFactory

__all__ = ["EndedTask", "TaskEvent", "TaskRunner", "open_task_runner"]


@dataclass(frozen=True, slots=True)
class EndedTask:
    """What the runner keeps of a task that has ended: its submission, its last view and its
    end record (TL9). The lane itself, its kernel, watchdog and journals are let go, so a
    long-lived runner's memory follows its live tasks, not its history."""

    task: TaskSubmitted
    view: TaskView
    ended: TaskEnded


class TaskRunner:
    """Task lanes on one store; obtain it from :func:`open_task_runner`."""

    def __init__(self, host: TaskHost, nursery: trio.Nursery) -> None:
        self.host = host
        self._nursery = nursery
        self.lanes: dict[str, TaskLane] = {}
        """The live lanes (not ended) by task id."""
        self.ended: dict[str, EndedTask] = {}
        """The tasks that have ended, by task id."""
        self._listeners: list[trio.MemorySendChannel[TaskEvent]] = []
        self._lock = trio.Lock()

    async def submit(self, spec: TaskSpec | dict[str, Any]) -> TaskView:
        """Admit a task durably and start it (TL1); the same task again returns its view."""
        if not isinstance(spec, TaskSpec):
            try:
                spec = msgspec.convert(spec, TaskSpec)
            except msgspec.ValidationError as error:
                raise TaskError(ReasonCode.TASK_INVALID, str(error)) from error
        check_spec(spec)
        async with self._lock:
            existing = self.lanes.get(spec.task_id) or self.ended.get(spec.task_id)
            if existing is not None:
                record = submitted_record(
                    spec, route=self.host.route, policy=self.host.policy, now_ms=0
                )

                def key(task: TaskSubmitted) -> tuple[Any, ...]:
                    return (task.prompt, task.worktree, task.grants, task.validation,
                            task.validation_timeout)  # fmt: skip

                same = key(record) == key(existing.task)
                if not same:
                    raise TaskError(
                        ReasonCode.TASK_CONFLICT,
                        f"task {spec.task_id!r} exists with another prompt, worktree or grants",
                    )
                return self.show(spec.task_id)
            record = submitted_record(
                spec,
                route=self.host.route,
                policy=self.host.policy,
                now_ms=self.host.clocks.wall.time_ms(),
            )
            holder = next(
                (
                    t
                    for t, lane in self.lanes.items()
                    if overlap(lane.task.worktree, record.worktree)
                ),
                None,
            )
            if holder is not None:  # TL13: one live task per worktree
                raise TaskError(
                    ReasonCode.WORKTREE_LEASED,
                    f"worktree {record.worktree} is leased to live task {holder!r} "
                    "(it, or a directory inside it or around it): one live task per worktree",
                )
            log = await self.host.store.open_lane_log(f"task:{spec.task_id}")
            await log.append(record)  # durable before anything runs
            lane = TaskLane(self.host, record, log)
            self.lanes[spec.task_id] = lane
            self._nursery.start_soon(self._run_lane, lane)
            return lane.view()

    def leaseholder(self, task: TaskSubmitted) -> str | None:
        """The live task holding the worktree lease ``task`` needs (TL13): one not ended
        whose worktree is ``task``'s, inside it or around it, admitted before it (the lease
        is the durable submission until its end record). Only a log written before the
        lease existed can have two; the later one then holds."""
        mine = (task.submitted_ms, task.task_id)
        for lane in self.lanes.values():
            other = lane.task
            earlier = (other.submitted_ms, other.task_id) < mine
            if earlier and overlap(other.worktree, task.worktree):
                return other.task_id
        return None

    def lane(self, task_id: str) -> TaskLane:
        """The live lane of ``task_id``: ``task_ended`` once it has ended, else
        ``task_unknown``."""
        lane = self.lanes.get(task_id)
        if lane is None:
            if task_id in self.ended:
                raise TaskError(ReasonCode.TASK_ENDED, f"task {task_id!r} has ended")
            raise TaskError(ReasonCode.TASK_UNKNOWN, f"no task {task_id!r}")
        return lane

    def known(self, task_id: str) -> bool:
        return task_id in self.lanes or task_id in self.ended

    def task_ids(self) -> list[str]:
        """Every task of the store, live or ended, sorted."""
        return sorted({*self.lanes, *self.ended})

    def has_failed(self, task_id: str) -> bool:
        """The task's lane stopped without an end (TL11): nothing runs it until a restart."""
        lane = self.lanes.get(task_id)
        return lane is not None and lane.ended is None and lane.failure is not None

    def has_ended(self, task_id: str) -> bool:
        """The task's end is recorded and its lane has stopped."""
        if task_id in self.ended:
            return True
        lane = self.lane(task_id)
        return lane.ended is not None and lane.finished.is_set()

    def log_rel(self, task_id: str) -> str:
        """The task's lane log, relative to the state directory."""
        return self.host.store.lane_rel(f"task:{task_id}")

    def show(self, task_id: str) -> TaskView:
        ended = self.ended.get(task_id)
        return ended.view if ended is not None else self.lane(task_id).view()

    def tasks(self) -> list[TaskView]:
        return [self.show(task_id) for task_id in self.task_ids()]

    async def reply(self, task_id: str, text: str, correlation: str | None = None) -> None:
        lane = self._open_lane(task_id)
        if await lane.reply(text, correlation) is not Verdict.ACCEPTED:
            raise TaskError(
                ReasonCode.TASK_NOT_WAITING,
                f"task {task_id!r} is not waiting"
                + (f" on {correlation!r}" if correlation else ""),
            )

    async def abort(self, task_id: str, reason: str = "aborted by the operator") -> None:
        await self._terminal(self._open_lane(task_id).abort, reason)

    async def fail(self, task_id: str, reason: str = "failed by the operator") -> None:
        await self._terminal(self._open_lane(task_id).fail, reason)

    async def _terminal(self, report: Callable[[str], Any], reason: str) -> None:
        if await report(reason) is not Verdict.ACCEPTED:
            raise TaskError(ReasonCode.TASK_LATE, "a terminal outcome was already recorded")

    def resume(self, task_id: str) -> None:
        if not self._open_lane(task_id).resume():
            raise TaskError(ReasonCode.TASK_NOT_HELD, f"task {task_id!r} is not held")

    async def grant(self, task_id: str, *, epochs: int = 0, seconds: float = 0.0,
                    reason: str = "") -> None:  # fmt: skip
        lane = self._open_lane(task_id)
        try:
            await lane.grant(epochs=epochs, seconds=seconds, reason=reason or "operator grant")
        except ValueError as error:
            raise TaskError(ReasonCode.TASK_INVALID, str(error)) from error

    async def wait(self, task_id: str) -> TaskEnded:
        """Wait until the task ends; its end record."""
        ended = self.ended.get(task_id)
        if ended is not None:
            return ended.ended
        lane = self.lane(task_id)
        await lane.finished.wait()
        if lane.ended is None:
            raise TaskError(
                ReasonCode.TASK_LANE_FAILED,
                f"task {task_id!r} stopped without an end: {lane.failure!r}",
            )
        return lane.ended

    def _open_lane(self, task_id: str) -> TaskLane:
        lane = self.lane(task_id)  # task_ended once retired
        if lane.ended is not None:
            raise TaskError(ReasonCode.TASK_ENDED, f"task {task_id!r} has ended")
        return lane

    @contextlib.asynccontextmanager
    async def events(
        self, buffer: int = 256
    ) -> AsyncIterator[trio.MemoryReceiveChannel[TaskEvent]]:
        """A channel of every task's changes while the block runs (dropped when full)."""
        send, receive = trio.open_memory_channel[TaskEvent](buffer)
        self._listeners.append(send)
        try:
            yield receive
        finally:
            self._listeners.remove(send)
            send.close()

    def _changed(self, lane: TaskLane) -> None:
        wd = lane.watchdog
        event = TaskEvent(
            task_id=lane.task_id,
            state=str(lane.kernel.state),
            classification=str(wd.classification),
            phase=str(wd.phase),
            process_epoch=lane.epochs,
            hold_reason=wd.hold_reason,
            ended=lane.ended.state if lane.ended else None,
        )
        for listener in self._listeners:
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError):
                listener.send_nowait(event)
        self.host.log(
            f"task {lane.task_id}: {event.classification} state={event.state} "
            f"epoch={event.process_epoch}"
            + (f" hold={event.hold_reason}" if event.hold_reason else "")
            + (f" [UNSAFE TEST TIMESCALE x{self.host.policy.timescale:g}]"
               if self.host.policy.timescale != 1.0 else "")
        )  # fmt: skip

    async def _recover(self) -> None:
        """Resume every task whose log has no end (TL7), once all of them are known (their
        worktree leases, TL13)."""
        lanes = self.host.store.root / "lanes"
        found = await trio.to_thread.run_sync(lambda: sorted(lanes.glob("*/lane.log")))
        for path in found:
            rel = str(path.relative_to(self.host.store.root))
            contents = await self.host.store.read(rel)
            subject = contents.header.subject
            if not subject.startswith("task:") or path.parent.name != lane_key(subject):
                continue
            submitted = next((r for r in contents.records if isinstance(r, TaskSubmitted)), None)
            if submitted is None:
                continue
            log = await self.host.store.open_lane_log(subject)
            lane = TaskLane(self.host, submitted, log)
            if any(isinstance(r, TaskEnded) for r in contents.records):
                await lane._restore()  # its receipts, epochs and end, for the diagnostics
                await self.host.store.close_log(log)
                self._retire(lane)
                continue
            self.lanes[submitted.task_id] = lane

        async def open_(lane: TaskLane) -> None:
            try:
                await lane.open()  # restored before anyone is served (a reply, a resume)
            except Exception as error:  # this lane alone fails (TL11); run() reports it
                lane.failure = error

        async with trio.open_nursery() as opening:  # side by side: one lane's kill bound
            for lane in self.lanes.values():  # does not delay the others' start
                opening.start_soon(open_, lane)
        for lane in list(self.lanes.values()):  # every lease is known before any lane runs
            self._nursery.start_soon(self._run_lane, lane)

    def _retire(self, lane: TaskLane) -> None:
        """Keep only what an ended task is asked for (its view and end record)."""
        assert lane.ended is not None
        self.ended[lane.task_id] = EndedTask(lane.task, lane.view(), lane.ended)
        self.lanes.pop(lane.task_id, None)

    async def _run_lane(self, lane: TaskLane) -> None:
        """Run one lane; a lane that fails stops alone, never the runner (TL11)."""
        try:
            await lane.run()
            if lane.ended is not None:
                self._retire(lane)
        except Exception as error:  # a bug or a broken disk in this lane: the others go on
            lane.failure = error
            code = getattr(error, "code", type(error).__name__)
            self.host.log(f"task {lane.task_id}: lane failed ({code}): {error}")
            self._changed(lane)


@contextlib.asynccontextmanager
async def open_task_runner(
    store: JournalStore,
    *,
    workers: WorkerFactory,
    route: ModelRoute,
    policy: WatchdogPolicy | None = None,
    clocks: Clocks | None = None,
    upstream: GatewayConfig | None = None,
    receipts: ReceiptStore | None = None,
    ledger: Path | None = None,
    work_root: Path | None = None,
    log: Callable[[str], None] | None = None,
) -> AsyncIterator[TaskRunner]:
    """Run task lanes on ``store`` until the block ends; unfinished tasks are resumed first.

    ``policy`` is checked (WD9): a breach raises ``TaskError(watchdog_config_invalid)``
    naming the setting. On exit every lane is cancelled: its epoch's tree is stopped, and the
    task stays unfinished in its log for the next start.
    """
    policy = policy or WatchdogPolicy()
    check_policy(policy)
    runner: TaskRunner | None = None

    def changed(lane: TaskLane) -> None:
        if runner is not None:
            runner._changed(lane)

    host = TaskHost(
        store=store,
        clocks=clocks or store.clocks,
        policy=policy,
        workers=workers,
        route=route,
        upstream=upstream,
        receipts=receipts,
        ledger=ledger,
        work_root=work_root,
        on_change=changed,
        log=log or (lambda line: None),
    )
    async with trio.open_nursery() as nursery:
        runner = TaskRunner(host, nursery)
        host.leaseholder = runner.leaseholder
        await runner._recover()
        try:
            yield runner
        finally:
            nursery.cancel_scope.cancel()


def check_policy(policy: WatchdogPolicy) -> None:
    """Refuse a policy that breaks a rule of WD9, naming the setting."""
    problems = policy.problems()
    if problems:
        setting, why = problems[0]
        raise TaskError(ReasonCode.WATCHDOG_CONFIG_INVALID, f"watchdog.{setting}: {why}")


def overlap(a: str, b: str) -> bool:
    """Whether two absolute real paths are one directory or one lies inside the other."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")
