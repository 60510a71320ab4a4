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
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple, NoReturn

import msgspec
import trio

from .._backoff import RouteBreaker
from .._boundary._gateway import GatewayConfig
from .._boundary._receipts import ReceiptStore
from .._clock import Clocks
from .._config import BackoffConfig, RetentionConfig
from .._errors import JournalError, ReasonCode, TaskError, descriptors_exhausted
from .._journal._fence import Fence, Lease
from .._journal._interface import JournalStore, LeaseStore, Log
from .._journal._leases import LaneLeases, fenced_out
from .._journal._store import Store, lane_key
from .._pi._launch import ModelRoute
from .._records import Record, TaskEnded, TaskSubmitted
from .._wire import TaskEvent, TaskSpec, TaskView
from ._lane import HOST_LOST, TaskHost, TaskLane, recorded_hold
from ._lifecycle import Verdict
from ._retention import (
    SeenHere,
    TaskRetention,
    expired_already,
    forget_task,
    lane_name,
    retain_ended_tasks,
    retain_shared_tasks,
    shared_expired_tasks,
    task_logs,
)
from ._state import check_spec, submitted_record, task_policy
from ._view import lane_failure, records_view, task_row, view_row
from ._watchdog import WatchdogPolicy
from ._workers import WorkerFactory

SUBMISSION_WAIT: Final = 2.0
"""S34: how long a submission that lost its lane's claim to another host waits for that host's
submission record before answering ``task_elsewhere`` (seconds)."""
SUBMISSION_POLL: Final = 0.02
SUBMISSION_TRIES: Final = 3
"""S34: claims a submission makes of a new task's lane that other hosts took and let go."""

__all__ = ["EndedTask", "SharedTasks", "TaskEvent", "TaskRunner", "open_task_runner"]


class TaskCensus(NamedTuple):
    """One task as a metrics scrape counts it (:meth:`TaskRunner.census`)."""

    state: str
    classification: str
    live_worker: bool
    ended: bool


@dataclass(frozen=True, slots=True)
class EndedTask:
    """What the runner keeps of a task that has ended: its submission, its last view and its
    end record (TL9). The lane itself, its kernel, watchdog and journals are let go, so a
    long-lived runner's memory follows its live tasks, not its history."""

    task: TaskSubmitted
    view: TaskView
    ended: TaskEnded


@dataclass(frozen=True, slots=True)
class SharedTasks:
    """How a runner on a store several hosts share holds its task lanes (S30-S32 of
    docs/design/scale-out.md)."""

    store: LeaseStore
    lease_seconds: float
    """A lease's time to live (renewed every third of it, S12)."""
    poll_seconds: float
    """How often the runner looks for task lanes whose holder's lease ran out (S32)."""
    shared_worktrees: bool = False
    """Worktrees and lane directories are on storage every host sees (S32)."""
    takeover_seconds: float = 60.0
    """Without ``shared_worktrees``: how long another host's lease must have run out before
    its task is claimed here (and held ``host_lost``); a host back sooner (a restart, a
    deploy) takes its tasks back itself (S32)."""


def _host_lane(owner: str) -> str:
    """The lease a host holds on itself while it runs (S35); never a log."""
    return f"host:{owner}"


def _same_task(a: TaskSubmitted, b: TaskSubmitted) -> bool:
    """Whether two submissions are one task (what a duplicate must repeat)."""

    def key(task: TaskSubmitted) -> tuple[Any, ...]:
        return (task.prompt, task.worktree, task.grants, task.validation,
                task.validation_timeout)  # fmt: skip

    return key(a) == key(b)


def _conflict(task_id: str) -> TaskError:
    return TaskError(
        ReasonCode.TASK_CONFLICT,
        f"task {task_id!r} exists with another prompt, worktree or grants",
    )


def _worktree_leased(worktree: str, holder: str) -> TaskError:
    return TaskError(
        ReasonCode.WORKTREE_LEASED,
        f"worktree {worktree} is leased to live task {holder!r} "
        "(it, or a directory inside it or around it): one live task per worktree",
    )


def _submitted(records: list[Record]) -> TaskSubmitted | None:
    return next((r for r in records if isinstance(r, TaskSubmitted)), None)


class TaskRunner:
    """Task lanes on one store; obtain it from :func:`open_task_runner`."""

    def __init__(
        self, host: TaskHost, nursery: trio.Nursery, shared: SharedTasks | None = None
    ) -> None:
        self.host = host
        self._nursery = nursery
        self.lanes: dict[str, TaskLane] = {}
        """The live lanes (not ended) by task id."""
        self.ended: dict[str, EndedTask] = {}
        """The tasks that have ended, by task id (on a shared store: also those found ended
        in the database, whichever host ended them)."""
        self._listeners: list[trio.MemorySendChannel[TaskEvent]] = []
        self._lock = trio.Lock()
        self.shared = shared
        self.leases: LaneLeases | None = None
        """This host's leases on its task lanes, on a shared store (S31)."""
        if shared is not None:
            self.leases = LaneLeases(shared.store, ttl=shared.lease_seconds, lost=self._lost)
        self.elsewhere: dict[str, str] = {}
        """Live tasks another host's lease holds, by task id: their holder (S30)."""
        self._scopes: dict[str, trio.CancelScope] = {}
        self._claiming: set[str] = set()
        """Tasks whose lanes this host claimed and is restoring (S32)."""
        self._subjects: dict[str, str] = {}
        """Each lane log's subject, by name (it never changes)."""
        self._not_tasks: set[str] = set()
        """Lane logs found to be a room's or an ended task's (looked at no more, S32)."""
        self._handed_back: dict[str, str] = {}
        """Tasks held ``host_lost`` here whose host is back, being given back to it (S35)."""
        self.alive: Fence | None = None
        """This host's own lease, ``host:<owner>``, held while it runs (S35)."""
        self._seen = SeenHere()
        """What retention did here already (RT13)."""
        self._retaining = trio.Lock()
        """One retention pass or ``task forget`` at a time (RT12): each reads which tasks
        are ended and removes their directories, and two at once would act on one task."""
        self._expired_here: dict[str, int] = {}
        """On a shared store: the tasks this runner learned had expired (RT13), by id: until
        when a submission under the id is refused."""

    async def submit(self, spec: TaskSpec | dict[str, Any]) -> TaskView:
        """Admit a task durably and start it (TL1); the same task again returns its view."""
        view, _ = await self.admit(spec)
        return view

    async def admit(self, spec: TaskSpec | dict[str, Any]) -> tuple[TaskView, bool]:
        """:meth:`submit`, and whether this call admitted the task (``False``: it was known,
        here — two submissions of one task at once are one new and one duplicate)."""
        if not isinstance(spec, TaskSpec):
            try:
                spec = msgspec.convert(spec, TaskSpec)
            except msgspec.ValidationError as error:
                raise TaskError(ReasonCode.TASK_INVALID, str(error)) from error
        check_spec(spec)
        for _ in range(SUBMISSION_TRIES):
            try:
                return await self._submit(spec)
            except _SubmittedElsewhere as elsewhere:  # waited for outside the lock (S34)
                records, let_go = await self._submission_elsewhere(lane_name(spec.task_id))
                if records is not None:
                    self._answer_existing(elsewhere.record, records)
                if not let_go:
                    break
        raise self._elsewhere_error(spec.task_id)

    async def _submit(self, spec: TaskSpec) -> tuple[TaskView, bool]:
        async with self._lock:
            existing = self.lanes.get(spec.task_id) or self.ended.get(spec.task_id)
            if existing is not None:
                record = submitted_record(
                    spec, route=self.host.route, policy=self.host.policy, now_ms=0
                )
                if not _same_task(record, existing.task):
                    raise _conflict(spec.task_id)
                return self.show(spec.task_id), False
            if self._expired(spec.task_id) and await self._expired_now(spec.task_id):
                raise self._expired_error(spec.task_id)  # RT12: never run again as new
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
                raise _worktree_leased(record.worktree, holder)
            try:
                if self.leases is None:
                    log = await self.host.store.open_lane_log(lane_name(spec.task_id))
                    fence = None
                else:
                    log, fence = await self._claim_new(record)
            except Exception as error:
                if not descriptors_exhausted(error):
                    raise
                raise TaskError(  # L21: nothing was admitted; asked again, it may be
                    ReasonCode.TOO_MANY_OPEN_FILES,
                    f"task {spec.task_id!r} was not admitted: the host has no file descriptor "
                    f"left ({error}); submit it again",
                ) from error
            try:
                # durable before anything runs; and once the lane is claimed, written whole
                # whoever cancels the caller: a claimed lane with no submission and no task
                # would be answered ``task_elsewhere`` everywhere while this host lives
                with trio.CancelScope(shield=True):
                    await log.append(record)
            except JournalError as error:  # its worktree lease, if any, stays until a
                # submission proves it abandoned (S33: no record, its lane's lease run out)
                if fence is not None and fenced_out(error):  # S31: another host's now
                    self.leases_drop(spec.task_id, fence)
                    raise self._elsewhere_error(spec.task_id) from error
                raise
            lane = TaskLane(self.host, record, log, fence=fence)
            self.lanes[spec.task_id] = lane
            self._nursery.start_soon(self._run_lane, lane)
            return lane.view(), True

    async def _claim_new(self, record: TaskSubmitted) -> tuple[Log, Fence]:
        """S30: the lease of a new task's lane, and its log, empty; a task any host
        submitted already is its duplicate (``DuplicateElsewhere``) or ``task_conflict``."""
        store, leases = self._shared_parts()
        name = lane_name(record.task_id)
        records: list[Record] | None = None
        if await store.exists(store.lane_rel(name)):
            with contextlib.suppress(FileNotFoundError):  # expired meanwhile: asked below
                records = list((await store.read(store.lane_rel(name))).records)
        if records is None:  # RT13: an expiry removes the log and records the id at once,
            found = await store.expired_task_keys([lane_key(name)])  # so asked after the log
            if found:
                self._expired_here[record.task_id] = found[lane_key(name)]
                raise self._expired_error(record.task_id)
        elif _submitted(records) is not None:
            self._answer_existing(record, records)
        fence = await leases.claim(name)
        if fence is None:  # being submitted (or run) by another host right now
            raise _SubmittedElsewhere(record)

        async def let_go(log: Log | None) -> None:
            """Never a lease held on a lane nobody runs, whoever cancels the caller: it would
            be renewed while this host lives, and every host answer ``task_elsewhere``."""
            with trio.CancelScope(shield=True):
                if log is not None:
                    await store.close_log(log)
                await leases.release(fence)

        try:
            log = await store.open_lane_log(name, fence=fence)
        except BaseException:
            await let_go(None)
            raise
        if _submitted(list(log.contents.records)) is not None:  # submitted elsewhere meanwhile
            await let_go(log)
            self._answer_existing(record, list(log.contents.records))
        try:
            holder = await self._lease_worktree(store, record)  # S33: the deployment's TL13
        except BaseException:
            await let_go(log)
            raise
        if holder is not None:
            await let_go(log)
            raise _worktree_leased(record.worktree, holder)
        return log, fence  # a log a submitter died before writing to is this one's

    async def _submission_elsewhere(self, name: str) -> tuple[list[Record] | None, bool]:
        """S34: the lane log of a task another host holds the lane of, once it has the task's
        submission — looked for every :data:`SUBMISSION_POLL` s while that host's lease runs,
        for at most :data:`SUBMISSION_WAIT` s (the same task sent to two hosts at once: the
        one that lost the claim answers as for a duplicate once the winner's record is
        durable). ``(None, True)`` when that host let the lane go with no record (its
        submission refused, or it died): the task is nobody's, this host may claim it;
        ``(None, False)`` when the wait ran out."""
        store, _ = self._shared_parts()
        deadline = trio.current_time() + SUBMISSION_WAIT
        while True:
            with contextlib.suppress(FileNotFoundError):
                records = list((await store.read(store.lane_rel(name))).records)
                if _submitted(records) is not None:
                    return records, False
            lease = await store.lease(name)
            if lease is None or not lease.live:
                return None, True
            if trio.current_time() >= deadline:
                return None, False
            await trio.sleep(SUBMISSION_POLL)

    async def _lease_worktree(self, store: LeaseStore, record: TaskSubmitted) -> str | None:
        """S33: lease the new task's worktree in the database — the task holding it, one
        around it or one inside it on any host, if one still lives (its lane log has no end:
        ``None`` when the lease is now this task's). A holder whose task ended (its host died
        before it let the worktree go) or was let go is struck out, and the lease asked
        again."""
        holders: list[str] = []
        for _ in range(4):  # a holder struck out does not come back but by a resubmission
            holders = await store.lease_worktree(record.task_id, record.worktree)
            if not holders:
                return None
            for holder in holders:
                if await self._lives(store, holder):
                    return holder
            for holder in holders:  # each proven ended or gone
                await store.release_worktree(holder)
        return holders[0]  # never a lease taken on a guess

    @staticmethod
    async def _lives(store: LeaseStore, task_id: str) -> bool:
        """Whether the task ``task_id`` holding a worktree lease still may (S33): its lane
        log in the database has its submission and no end — or no submission yet while its
        submitter's lease on the lane runs (a submission under way). A log that cannot be
        read proves nothing: it lives."""
        try:
            records = (await store.read(store.lane_rel(lane_name(task_id)))).records
        except FileNotFoundError:
            records = ()  # let go by retention (RT13), or a submitter that died early
        except JournalError:
            return True
        if any(isinstance(r, TaskEnded) for r in records):
            return False
        if any(isinstance(r, TaskSubmitted) for r in records):
            return True
        lease = await store.lease(lane_name(task_id))
        return lease is not None and lease.live

    def _shared_parts(self) -> tuple[LeaseStore, LaneLeases]:
        if self.shared is None or self.leases is None:
            raise AssertionError("the runner is not on a shared store")
        return self.shared.store, self.leases

    def _answer_existing(self, record: TaskSubmitted, records: list[Record]) -> NoReturn:
        """A task already in the shared store: ``task_conflict`` for another one under its
        id, else the holder's answer: ``task_elsewhere`` naming it (S30)."""
        found = _submitted(records)
        if found is not None and not _same_task(record, found):
            raise _conflict(record.task_id)
        view = records_view(records, self.host.policy)
        raise DuplicateElsewhere(view, self._elsewhere_error(record.task_id))

    def _elsewhere_error(self, task_id: str) -> TaskError:
        holder = self.elsewhere.get(task_id)
        where = f"host {holder!r}" if holder else "another host"
        return TaskError(
            ReasonCode.TASK_ELSEWHERE,
            f"task {task_id!r} is held by {where} of this deployment: send its frames there "
            "(docs/design/scale-out.md S30)",
        )

    def leases_drop(self, task_id: str, fence: Fence) -> None:
        if self.leases is not None:
            self.leases.drop(lane_name(task_id), fence)

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
            raise self._not_live(task_id)
        return lane

    def _not_live(self, task_id: str) -> TaskError:
        """Why ``task_id`` has no live lane here: ``task_ended``, ``task_elsewhere``,
        ``task_expired`` or ``task_unknown``."""
        if task_id in self.ended:
            return TaskError(ReasonCode.TASK_ENDED, f"task {task_id!r} has ended")
        if task_id in self.elsewhere:
            return self._elsewhere_error(task_id)
        if self._expired(task_id):
            return self._expired_error(task_id)
        return TaskError(ReasonCode.TASK_UNKNOWN, f"no task {task_id!r}")

    def _expired(self, task_id: str) -> bool:
        """Whether retention expired the task (RT12): its id is in the expired-task filter
        (on a shared store: among those this runner learned had expired, RT13)."""
        store = self.host.store
        now = self.host.clocks.wall.time_ms()  # RT4: held back until its forget_days
        if self.shared is not None:
            return self._expired_here.get(task_id, 0) > now
        return isinstance(store, Store) and store.expired_tasks.holds(
            lane_key(lane_name(task_id)), now_ms=now
        )

    async def _expired_now(self, task_id: str) -> bool:
        """RT4, RT13: on a shared store, a task this runner learned had expired asked again
        of the database before a submission is refused (a host's start may have changed
        ``forget_days`` since); on a file store its filter answered already."""
        if self.shared is None:
            return True
        key = lane_key(lane_name(task_id))
        until = (await self.shared.store.expired_task_keys([key])).get(key)
        if until is None:
            self._expired_here.pop(task_id, None)
            return False
        self._expired_here[task_id] = until
        return True

    @staticmethod
    def _expired_error(task_id: str) -> TaskError:
        return TaskError(
            ReasonCode.TASK_EXPIRED,
            f"task {task_id!r} ended longer ago than [retention] idempotency_days and was "
            "let go (or forgotten by an operator); submit it under a new id",
        )

    # -- retention (docs/design/retention.md RT12) ---------------------------------------

    def _work_root(self) -> Path:
        return self.host.work_root or self.host.store.root / "work"

    async def retain(self, retention: RetentionConfig) -> TaskRetention:
        """One retention pass over the ended tasks (RT12): lane logs past ``journal_days``
        slimmed to their idempotency record, tasks past ``idempotency_days`` expired and let
        go here too. On a shared store: :meth:`_retain_shared` (RT13)."""
        store = self.host.store
        async with self._retaining:  # never beside a ``task forget`` (RT12)
            if self.shared is not None:
                return await self._retain_shared(retention)
            if not isinstance(store, Store):
                return TaskRetention()
            ended = {task_id: e.ended.ended_ms for task_id, e in self.ended.items()}
            done = await retain_ended_tasks(
                store,
                ended,
                now_ms=self.host.clocks.wall.time_ms(),
                retention=retention,
                work_root=self._work_root(),
                in_use=self._worktrees,
            )
            for task_id in done.expired:  # the filter is durable: a duplicate is task_expired
                self.ended.pop(task_id, None)
            return done

    async def _retain_shared(self, retention: RetentionConfig) -> TaskRetention:
        """RT13: one pass over the deployment's ended tasks this host knows (those it ended,
        and those :meth:`claim_orphans` found ended in the database, :meth:`_learn_ended`);
        then every one of them
        past ``idempotency_days`` that the database holds as expired — by this pass or
        another host's — is forgotten here, and a submission under its id is
        ``task_expired`` until ``forget_days`` after its end."""
        assert self.shared is not None
        store = self.shared.store
        ended = {task_id: e.ended.ended_ms for task_id, e in self.ended.items()}
        now = self.host.clocks.wall.time_ms()
        done = await retain_shared_tasks(
            store,
            ended,
            now_ms=now,
            retention=retention,
            work_root=self._work_root(),
            lease_seconds=self.shared.lease_seconds,
            seen=self._seen,
            in_use=self._worktrees,
        )
        gone = await shared_expired_tasks(store, ended, now_ms=now, retention=retention)
        for task_id, until in gone.items():  # by their own expiry only (RT19)
            self.ended.pop(task_id, None)
            self._seen.forget(task_id)
            if until is None:  # let go already (its id past forget_days, or a later task's)
                self._expired_here.pop(task_id, None)
            else:
                self._expired_here[task_id] = until
            rel = store.lane_rel(lane_name(task_id))
            self._subjects.pop(rel, None)
            self._not_tasks.discard(rel)
        # RT4: those held back asked again (a host's start may have changed forget_days)
        held = {lane_key(lane_name(t)): t for t in self._expired_here}
        found = await store.expired_task_keys(list(held))
        self._expired_here = {held[key]: u for key, u in found.items()}
        return done

    def _worktrees(self) -> dict[str, str]:
        """The worktree of every task this runner knows, live or ended, by id: retention
        keeps a task's work directories while they hold one (RT17)."""
        trees = {task_id: e.task.worktree for task_id, e in self.ended.items()}
        trees.update((task_id, lane.task.worktree) for task_id, lane in self.lanes.items())
        return trees

    async def forget(self, task_id: str, retention: RetentionConfig) -> list[str]:
        """``pi-runtime task forget``: remove what is left of an ended task now, its
        candidate too (RT12); refused ``task_not_ended`` for a live task. What was removed.
        One at a time with the retention pass (it waits for one under way), and once begun
        it runs to its end, whoever cancels the caller; cut short by a failure after its
        id was expired, the task is let go here all the same (the next pass removes what is
        left)."""
        store = self.host.store
        if not isinstance(store, Store) or self.shared is not None:
            raise TaskError(ReasonCode.TASK_INVALID, "task forget is for the file store only")
        async with self._retaining:
            ended = self.ended.get(task_id)
            if ended is None:
                if task_id in self.lanes:
                    raise TaskError(
                        ReasonCode.TASK_NOT_ENDED,
                        f"task {task_id!r} has not ended: abort or fail it first",
                    )
                raise self._not_live(task_id)
            try:
                with trio.CancelScope(shield=True):  # bounded: git's own timeout, the disk
                    removed = await forget_task(
                        store,
                        ended.ended,
                        ended.task,
                        now_ms=self.host.clocks.wall.time_ms(),
                        retention=retention,
                        work_root=self._work_root(),
                        in_use=lambda: {t: w for t, w in self._worktrees().items() if t != task_id},
                    )
            except BaseException:
                now = self.host.clocks.wall.time_ms()  # its id expired for *this* task (the
                if expired_already(store, task_id, ended.ended.ended_ms, now_ms=now):  # RT19)
                    self.ended.pop(task_id, None)  # never known as ended again; an earlier
                raise  # task's entry under the id, held back again, lets go nothing of it
            self.ended.pop(task_id, None)
        self.host.log(f"task {task_id}: forgotten by the operator ({len(removed)} removed)")
        return removed

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

    def rows(self, task_ids: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Each task's overview (``_view.task_row``: the fields ``tasks`` shows), by id,
        without building the views of the live ones; with ``task_ids``, those tasks' only, in
        that order (an id of no task is passed over)."""
        rows = []
        for task_id in self.task_ids() if task_ids is None else task_ids:
            if task_id not in self.ended and task_id not in self.lanes:
                continue
            ended = self.ended.get(task_id)
            rows.append(
                view_row(ended.view) if ended is not None else task_row(self.lanes[task_id])
            )
        return rows

    def ends(self) -> dict[str, bool]:
        """Each task's id, by id, and whether its end is recorded (its row's ``ended`` is
        set), read without building its row: what the operator page orders by before it
        builds the rows it shows (OP6)."""
        return {
            task_id: task_id in self.ended or self.lanes[task_id].ended is not None
            for task_id in self.task_ids()
        }

    def classifications(self) -> dict[str, tuple[str, str]]:
        """Each task's id, by id, with its classification and state as its row says them
        (``task_row``, ``view_row``), read without building its row: where the operator
        page's timelines start (OP6)."""
        found = {}
        for task_id in self.task_ids():
            ended = self.ended.get(task_id)
            if ended is not None:
                found[task_id] = (ended.view.classification, ended.view.state)
                continue
            lane = self.lanes[task_id]
            state = lane.ended.state if lane.ended is not None else str(lane.kernel.state)
            found[task_id] = (str(lane.watchdog.classification), state)
        return found

    def census(self) -> list[TaskCensus]:
        """Each task's state, classification and whether a worker lives, read without
        building its view (what a metrics scrape needs, for a thousand tasks at once)."""
        found = [
            TaskCensus(
                str(lane.kernel.state),
                str(lane.watchdog.classification),
                lane.worker is not None,
                ended=False,
            )
            for lane in self.lanes.values()
            if lane.ended is None
        ]
        found += [
            TaskCensus(e.ended.state, e.view.classification, False, ended=True)
            for e in self.ended.values()
        ]
        return found

    @contextlib.contextmanager
    def _fenced_control(self, lane: TaskLane) -> Iterator[None]:
        """S31: a control whose write the lane's fence refused gives the lane up (another
        host claimed it) and is answered ``task_elsewhere``."""
        try:
            yield
        except JournalError as error:
            if lane.lease is None or not fenced_out(error):
                raise
            self._lost(lane_name(lane.task_id), lane.lease, "a write was refused by its fence")
            raise self._elsewhere_error(lane.task_id) from error

    async def reply(self, task_id: str, text: str, correlation: str | None = None) -> None:
        lane = self._open_lane(task_id)
        with self._fenced_control(lane):
            verdict = await lane.reply(text, correlation)
        if verdict is not Verdict.ACCEPTED:
            raise TaskError(
                ReasonCode.TASK_NOT_WAITING,
                f"task {task_id!r} is not waiting"
                + (f" on {correlation!r}" if correlation else ""),
            )

    async def abort(self, task_id: str, reason: str = "aborted by the operator") -> None:
        lane = self._open_lane(task_id)
        await self._terminal(lane, lane.abort, reason)

    async def fail(self, task_id: str, reason: str = "failed by the operator") -> None:
        lane = self._open_lane(task_id)
        await self._terminal(lane, lane.fail, reason)

    async def _terminal(self, lane: TaskLane, report: Callable[[str], Any], reason: str) -> None:
        with self._fenced_control(lane):
            verdict = await report(reason)
        if verdict is not Verdict.ACCEPTED:
            raise TaskError(ReasonCode.TASK_LATE, "a terminal outcome was already recorded")

    def resume(self, task_id: str) -> None:
        lane = self._open_lane(task_id)
        if lane.session_missing():  # S32: never a new session in place of the task's own
            raise TaskError(
                ReasonCode.HOST_LOST,
                f"task {task_id!r} is held {lane.watchdog.hold_reason}: its session "
                f"{lane.session} is not on this host; bring it and the worktree here (the "
                "same paths) and resume, or abort or fail the task",
            )
        if not lane.resume():
            raise TaskError(ReasonCode.TASK_NOT_HELD, f"task {task_id!r} is not held")

    async def grant(self, task_id: str, *, epochs: int = 0, seconds: float = 0.0,
                    reason: str = "") -> None:  # fmt: skip
        lane = self._open_lane(task_id)
        try:
            with self._fenced_control(lane):
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
        """The live lane a control acts on: ``task_ended`` once it ended; ``task_elsewhere``
        naming its host once it is given back (S35: this host acts for it no more, its lane
        only stopping)."""
        lane = self.lane(task_id)  # task_ended once retired
        if lane.ended is not None:
            raise TaskError(ReasonCode.TASK_ENDED, f"task {task_id!r} has ended")
        if task_id in self._handed_back:
            raise self._elsewhere_error(task_id)
        if not self._holds(lane):  # S31: lost, and its lane not stopped yet
            self.elsewhere.setdefault(task_id, "")
            raise self._elsewhere_error(task_id)
        return lane

    def _holds(self, lane: TaskLane) -> bool:
        """S31: whether this host still holds ``lane``'s lease, as its lease keeper knows
        right now (a lease given up at its deadline or found taken is not): a lane runs, and
        a control acts on it, only then. A lane lost before its runner knew it — while it
        was claimed and restored — was not stopped by the loss, so this is asked again
        when it is about to run, and at every control."""
        if lane.lease is None or self.leases is None:
            return True  # a store with one owner
        return self.leases.fence(lane_name(lane.task_id)) == lane.lease

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
        worktree leases, TL13). On a shared store: every task lane nobody else holds (S32)."""
        if self.shared is not None:
            await self.claim_orphans()
            return

        def unreadable(rel: str, error: Exception) -> None:  # TL11: that task alone
            self.host.log(
                f"task lane log {rel} cannot be read ({error}): its task is not resumed; "
                "`pi-runtime journal verify` says what is wrong"
            )

        async for submitted, contents in task_logs(self.host.store, unreadable):
            subject = contents.header.subject
            log = await self.host.store.open_lane_log(subject)
            lane = TaskLane(self.host, submitted, log)
            if any(isinstance(r, TaskEnded) for r in contents.records):
                await lane._restore()  # its receipts, epochs and end, for the diagnostics
                await self.host.store.close_log(log)
                self._retire(lane)
                continue
            self.lanes[submitted.task_id] = lane

        await self._open_and_run(list(self.lanes.values()))

    async def _open_and_run(self, lanes: list[TaskLane]) -> None:
        """Restore ``lanes`` side by side, then make them the runner's and run them: a
        control that finds one meets it restored (a waiting task waits, a held one holds)."""

        async def open_(lane: TaskLane) -> None:
            try:
                await lane.open()  # restored before anyone is served (a reply, a resume)
            except Exception as error:  # this lane alone fails (TL11); run() reports it
                lane.failure = error

        async with trio.open_nursery() as opening:  # side by side: one lane's kill bound
            for lane in lanes:  # does not delay the others' start
                opening.start_soon(open_, lane)
        for lane in lanes:  # every lease is known before any lane runs
            self.lanes[lane.task_id] = lane
            self._claiming.discard(lane.task_id)
            self.elsewhere.pop(lane.task_id, None)
            self._nursery.start_soon(self._run_lane, lane)
            if lane.lease is not None and self.shared is not None:
                epoch = lane.lease.epoch
                self.host.log(f"task {lane.task_id}: lane claimed at epoch {epoch}")

    async def announce_alive(self) -> None:
        """S35: hold this host's own lease (``host:<owner>``, renewed with its lanes' leases)
        while it runs, so that a host holding one of its tasks ``host_lost`` sees it is
        back."""
        _, leases = self._shared_parts()
        self.alive = await leases.claim(_host_lane(self.host.owner or ""))

    async def _stay_alive(self) -> None:
        """S35: claim this host's own lease again if it was lost (its renewals failed past
        their deadline: the database out of reach a while, S12). A host that runs without
        it passes for dead: a task another host holds ``host_lost`` for it would never be
        given back."""
        _, leases = self._shared_parts()
        if leases.fence(_host_lane(self.host.owner or "")) is not None:
            return
        await self.announce_alive()
        if self.alive is not None:
            self.host.log(f"this host's own lease claimed again at epoch {self.alive.epoch}")

    async def _alive(self, host: str) -> bool:
        """S35: whether ``host`` runs now: its own lease is live (the database's clock)."""
        store, _ = self._shared_parts()
        lease = await store.lease(_host_lane(host))
        return lease is not None and lease.live and lease.fence.owner == host

    async def _hand_back(self) -> None:
        """S35: every lane held here ``host_lost:<X>`` whose host X is back is given back to
        it: its scope cancelled (it is parked: nothing runs), its lease given up — never its
        task ended — so that X, whose worktree and session it is, claims it at its next look
        and goes on with it as after its own restart."""
        for lane in list(self.lanes.values()):
            home = lane.lost_to()
            if home is None or home == self.host.owner or not self._stoppable(lane):
                continue  # (on its way already, or not running yet: the next look)
            if not await self._alive(home):
                continue
            if lane.lost_to() != home or not self._stoppable(lane):
                continue  # resumed, ended or stopped meanwhile
            self.host.log(f"task {lane.task_id}: host {home!r} is back; given back to it")
            self._handed_back[lane.task_id] = home  # (its lane's end lets the lease go)
            self.elsewhere[lane.task_id] = home
            self._scopes[lane.task_id].cancel()

    def _stoppable(self, lane: TaskLane) -> bool:
        """S35: the lane runs here and is not being given back already."""
        return lane.task_id in self._scopes and lane.task_id not in self._handed_back

    async def claim_orphans(self) -> None:
        """S32: claim every task lane with no end whose holder's lease ran out (or that
        nobody holds), restore it — held ``host_lost`` when it cannot resume here — and run
        it; note which live tasks other hosts hold. S35: first give back the tasks held
        ``host_lost`` here whose host is back; never claim one whose host is back — after
        claiming this host's own lease again, if it was lost."""
        await self._stay_alive()
        await self._hand_back()
        claimed: list[TaskLane] = []
        try:
            await self._look_for_orphans(claimed)
        except BaseException:
            await self._let_go_unrun(claimed)
            raise
        await self._open_and_run(claimed)

    async def _let_go_unrun(self, lanes: list[TaskLane]) -> None:
        """Lanes a look claimed and will not run after all (a later step of the look failed,
        or it was cancelled): closed, their leases released and their ids free for the next
        look, whoever cancels — a lease renewed on a lane nobody runs would keep every host
        from the task while this one lives (S32)."""
        _, leases = self._shared_parts()
        with trio.CancelScope(shield=True):
            for lane in lanes:
                self._claiming.discard(lane.task_id)
                with contextlib.suppress(JournalError, OSError):  # a failing store: closed
                    await lane.close_log()  # with the store
                if lane.lease is not None:
                    await leases.release(lane.lease)  # (best effort: it runs out anyway)

    async def _look_for_orphans(self, claimed: list[TaskLane]) -> None:
        """:meth:`claim_orphans`' look: each lane it claims is added to ``claimed``."""
        store, _ = self._shared_parts()
        for rel in await store.lane_logs():
            if rel in self._not_tasks:
                continue
            subject = self._subjects.get(rel) or await self._subject(rel)
            if subject is None:
                continue
            task_id = subject.removeprefix("task:")
            if not subject.startswith("task:") or task_id in self.ended:
                self._not_tasks.add(rel)
                continue
            if task_id in self.lanes or task_id in self._claiming:
                continue
            lease = await store.lease(subject)  # before the log: a held lane is not read
            if (
                lease is not None
                and lease.fence.owner != store.owner
                and not self._claimable(lease)
            ):
                if self.elsewhere.get(task_id) != lease.fence.owner:
                    self.host.log(f"task {task_id}: held by host {lease.fence.owner!r}")
                self.elsewhere[task_id] = lease.fence.owner
                continue
            try:
                records = list((await store.read(rel)).records)
            except (FileNotFoundError, JournalError) as error:
                self.host.log(f"lane log {rel} not read: {error}")
                continue
            end = next((r for r in records if isinstance(r, TaskEnded)), None)
            if end is not None:
                self._not_tasks.add(rel)
                self.elsewhere.pop(task_id, None)
                self._learn_ended(records, end)
                continue
            submitted = _submitted(records)
            if submitted is None:
                continue  # a submission not written (yet, or ever): nothing to run
            if (
                lease is not None
                and lease.fence.owner != store.owner
                and not self._tree_stopped(lease, submitted)
            ):
                if self.elsewhere.get(task_id) != lease.fence.owner:
                    self.host.log(
                        f"task {task_id}: host {lease.fence.owner!r}'s lease ran out; claimed "
                        "once that host's epoch must be stopped (S12)"
                    )
                self.elsewhere[task_id] = lease.fence.owner
                continue
            held_for = recorded_hold(records) or ""
            home = held_for.removeprefix(HOST_LOST) if held_for.startswith(HOST_LOST) else None
            if home is not None and home != store.owner and await self._alive(home):
                self.elsewhere[task_id] = home  # S35: its host is back: it is that host's
                continue
            async with self._lock:  # never beside a submission's claim of the same task
                if task_id in self.lanes or task_id in self._claiming:
                    continue
                try:
                    lane = await self._claim_orphan(subject, lease.fence.owner if lease else None)
                except JournalError as error:  # this lane's log (damage): the others go on
                    self.host.log(f"task {task_id}: lane not claimed ({error.code}): {error}")
                    continue
            if lane is not None:
                claimed.append(lane)

    def _learn_ended(self, records: list[Record], end: TaskEnded) -> None:
        """An ended task found in the database (S30): kept as one this runner ended is, so
        any host shows it, answers its duplicate and ages it for retention (RT13) — after a
        restart too."""
        submitted = _submitted(records)
        view = records_view(records, self.host.policy)
        if submitted is not None and view is not None:
            self.ended.setdefault(submitted.task_id, EndedTask(submitted, view, end))

    async def _subject(self, rel: str) -> str | None:
        """The lane log ``rel``'s subject (a room, ``task:<id>``), read once and kept."""
        assert self.shared is not None
        try:
            contents = await self.shared.store.read(rel)
        except (FileNotFoundError, JournalError) as error:
            self.host.log(f"lane log {rel} not read: {error}")
            return None
        self._subjects[rel] = contents.header.subject
        return contents.header.subject

    def _claimable(self, lease: Lease) -> bool:
        """S32: another host's task lane is claimed once its lease ran out — and, unless
        its worktree can be resumed here (``shared_worktrees``), only once it has been out
        ``takeover_seconds``: its host may be coming back for it."""
        assert self.shared is not None
        if lease.live:
            return False
        return self.shared.shared_worktrees or lease.expired_for >= self.shared.takeover_seconds

    def _tree_stopped(self, lease: Lease, submitted: TaskSubmitted) -> bool:
        """S12, S32: whether the epoch of a task whose holder's lease ran out must be stopped
        by now. Its host gave the lane up at its own deadline, before the lease's end, and
        then stopped the tree: TERM, ``term_grace_seconds`` for the worker to exit, the whole
        tree KILLed within ``kill_bound_seconds`` (the task's policy, frozen at submission,
        WD14) — longer than the lease's margin. Where the claiming host resumes the task
        (``shared_worktrees``: the same worktree and session) and cannot kill that tree
        (another machine's, W5), it claims only once the lease has been out that long. Else
        the task is claimed only to be held ``host_lost``: nothing of it runs here."""
        assert self.shared is not None
        if not self.shared.shared_worktrees:
            return True
        policy, _ = task_policy(submitted, self.host.policy)
        return lease.expired_for >= policy.term_grace_seconds + policy.kill_bound_seconds

    async def _claim_orphan(self, subject: str, last_owner: str | None) -> TaskLane | None:
        store, leases = self._shared_parts()
        fence = await leases.claim(subject)
        if fence is None:
            return None  # another host was first
        try:
            log = await store.open_lane_log(subject, fence=fence)  # read after the claim (S11)
        except (JournalError, OSError):
            await leases.release(fence)  # never a lease held on a lane nobody runs
            raise
        records = list(log.contents.records)
        submitted = _submitted(records)
        if submitted is None or any(isinstance(r, TaskEnded) for r in records):
            await store.close_log(log)
            await leases.release(fence)
            return None  # ended meanwhile, or not a task: the next look sees it so
        lane = TaskLane(self.host, submitted, log, fence=fence)
        if last_owner is not None and last_owner != store.owner:
            lane.moved_from = last_owner
        self._claiming.add(submitted.task_id)  # the runner's once restored
        return lane

    async def watch_orphans(self) -> None:
        """Look for orphaned task lanes every ``poll_seconds`` until cancelled (S32)."""
        assert self.shared is not None
        while True:
            await trio.sleep(self.shared.poll_seconds)
            try:
                await self.claim_orphans()
            except (JournalError, OSError) as error:  # the database: look again next time
                self.host.log(f"looking for orphaned task lanes failed: {error}")

    def _lost(self, name: str, fence: Fence, why: str) -> None:
        """S31: the lease of ``name`` is lost (taken over, or not renewed in time): its
        lane's scope is cancelled — its epoch's tree stopped — and it is forgotten here.
        S35: this host's own lease is claimed again at the next look (:meth:`_stay_alive`)."""
        if self.alive is not None and fence == self.alive:
            self.alive = None
            self.host.log(f"this host's own lease lost ({why}); claimed again at the next look")
            return
        task_id = name.removeprefix("task:")
        lane = self.lanes.get(task_id)
        if lane is None or lane.lease != fence:
            return
        self.host.log(f"task {task_id}: lane lost ({why})")
        self.elsewhere[task_id] = ""
        scope = self._scopes.get(task_id)
        if scope is not None:
            scope.cancel()

    def _retire(self, lane: TaskLane) -> None:
        """Keep only what an ended task is asked for (its view and end record)."""
        assert lane.ended is not None
        self.ended[lane.task_id] = EndedTask(lane.task, lane.view(), lane.ended)
        self.lanes.pop(lane.task_id, None)

    async def _run_lane(self, lane: TaskLane) -> None:
        """Run one lane; a lane that fails stops alone, never the runner (TL11). A lane
        whose write is refused by its fence, or whose lease is lost, stops and is another
        host's (S31): not failed, forgotten here."""
        scope = trio.CancelScope()
        self._scopes[lane.task_id] = scope
        try:
            with scope:
                if self._holds(lane):
                    await lane.run()
                else:  # S31: its lease was lost while it was claimed or restored
                    self.host.log(f"task {lane.task_id}: lane lost before it ran (S12)")
                    self.elsewhere[lane.task_id] = ""
                    with (
                        trio.CancelScope(shield=True),
                        contextlib.suppress(JournalError, OSError),
                    ):
                        await lane.close_log()  # nothing of it ran here: nothing to stop
                    lane.finished.set()
            if lane.ended is not None:
                self._retire(lane)
        except Exception as error:  # a bug or a broken disk in this lane: the others go on
            if lane.lease is not None and _fenced(error):
                self.host.log(f"task {lane.task_id}: a write was refused by its fence (S31)")
                self.elsewhere[lane.task_id] = ""
            else:
                lane.failure = error
                failure = lane_failure(error)  # as the view says it: a nursery's one error
                assert failure is not None
                self.host.log(
                    f"task {lane.task_id}: lane failed ({failure['code']}): {failure['message']}"
                )
                self._changed(lane)
        finally:
            self._scopes.pop(lane.task_id, None)
            fence = lane.lease
            handed_back = self._handed_back.pop(lane.task_id, None) is not None
            if handed_back and lane.ended is not None:  # it ended here first (an abort):
                self.elsewhere.pop(lane.task_id, None)  # an ended task, let go as any is
            if fence is not None and lane.task_id in self.elsewhere:  # lost (S31)
                self.lanes.pop(lane.task_id, None)
                self.leases_drop(lane.task_id, fence)
                if handed_back and self.leases is not None:
                    with trio.CancelScope(shield=True):  # S35: its host claims it at once
                        await self.leases.release(fence)
                self._changed(lane)  # its followers learn it is gone from here
            elif fence is not None and lane.ended is not None and self.leases is not None:
                with trio.CancelScope(shield=True):
                    await self._release_worktree(lane.task_id)
                    await self.leases.release(fence)  # an ended task needs no holder

    async def _release_worktree(self, task_id: str) -> None:
        """S33: an ended task lets its worktree go; a database that does not answer leaves
        it held — a later submission proves it ended (its lane log) and strikes it out."""
        if self.shared is None:
            return
        try:
            await self.shared.store.release_worktree(task_id)
        except (JournalError, OSError) as error:
            self.host.log(f"task {task_id}: its worktree lease not let go now: {error}")


class _SubmittedElsewhere(Exception):
    """Inside :meth:`TaskRunner._submit`: another host holds the lane of the new task
    ``record`` (a submission under way there, or its task running)."""

    def __init__(self, record: TaskSubmitted) -> None:
        super().__init__(record.task_id)
        self.record = record


class DuplicateElsewhere(TaskError):
    """A submission of a task another host (or an earlier life of the deployment) admitted:
    its view as the shared store says, and the error naming where it runs (S30)."""

    def __init__(self, view: TaskView | None, error: TaskError) -> None:
        super().__init__(error.code, str(error))
        self.view = view


def _fenced(error: BaseException) -> bool:
    """Whether ``error`` (or every error of a group) is a write refused by a fence (S11)."""
    if isinstance(error, BaseExceptionGroup):
        return all(_fenced(e) for e in error.exceptions)
    return fenced_out(error)


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
    shared: SharedTasks | None = None,
    backoff: BackoffConfig | None = None,
) -> AsyncIterator[TaskRunner]:
    """Run task lanes on ``store`` until the block ends; unfinished tasks are resumed first.

    ``backoff``: a turn meeting an unavailable provider is parked and prompted again after
    the route's backoff (PB6; its gateway must park, ``GatewayConfig.park_unavailable``).

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
        owner=shared.store.owner if shared is not None else None,
        shared_worktrees=shared.shared_worktrees if shared is not None else False,
    )
    if backoff is not None and backoff.enabled:
        host.breaker = RouteBreaker(backoff, host.clocks)
    async with trio.open_nursery() as nursery:
        runner = TaskRunner(host, nursery, shared)
        host.leaseholder = runner.leaseholder
        if runner.leases is not None:
            nursery.start_soon(runner.leases.run)
            await runner.announce_alive()
        await runner._recover()
        if shared is not None:
            nursery.start_soon(runner.watch_orphans)
        try:
            yield runner
        finally:
            nursery.cancel_scope.cancel()
    if runner.leases is not None and runner.alive is not None:
        with trio.CancelScope(shield=True):  # S35: gone, as far as other hosts can tell
            await runner.leases.release(runner.alive)
    if runner.leases is not None and shared is not None and shared.shared_worktrees:
        with trio.CancelScope(shield=True):  # stopped, every lane's tree too: hand them over
            for fence in runner.leases.held.values():  # (a local worktree waits for its
                await runner.leases.release(fence)  # host to come back, S32)


def check_policy(policy: WatchdogPolicy) -> None:
    """Refuse a policy that breaks a rule of WD9, naming the setting."""
    problems = policy.problems()
    if problems:
        setting, why = problems[0]
        raise TaskError(ReasonCode.WATCHDOG_CONFIG_INVALID, f"watchdog.{setting}: {why}")


def overlap(a: str, b: str) -> bool:
    """Whether two absolute real paths are one directory or one lies inside the other."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")
