"""A task lane's diagnostics view (``task show``, ``tasks``, ``task_event``): what a live lane
knows, frozen into a :class:`~runtime._wire.TaskView` (docs/design/watchdog.md, "What an
operator sees") — or, with no server running, what its lane log says (:func:`offline_views`:
no lock, no write)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

import msgspec

from .._errors import ReasonCode, TaskError
from .._journal._fence import Lease
from .._journal._inspect import pg_reader
from .._journal._journal import LogContents, read_log
from .._journal._store import lane_key
from .._linux._fs import OsFileSystem
from .._pi._session import Attestation
from .._records import (
    ContinuationSent,
    EpochStarted,
    LogKind,
    OutboxAction,
    Record,
    TaskEnded,
    TaskSubmitted,
)
from .._wire import TaskView
from ._guards import Budget
from ._lifecycle import LifecycleKernel, TaskState
from ._state import inference_costs, read_lane
from ._watch import Telemetry
from ._watchdog import ACTION_TABLE, Classification, Watchdog, WatchdogPolicy

__all__ = [
    "LaneFacts",
    "Viewed",
    "database_views",
    "next_action",
    "offline_view",
    "offline_views",
    "records_view",
    "store_view",
    "store_views",
    "task_view",
]


class LaneFacts(Protocol):
    """What a task lane (:class:`~runtime._tasks._lane.TaskLane`) shows everyone who reads it:
    its task, watchdog and lifecycle kernel, budget, telemetry, markers and attestation. The
    view (:class:`Viewed`) and an epoch's watch (``_epoch.py``'s ``EpochOwner``) add what
    each needs more."""

    @property
    def task(self) -> TaskSubmitted: ...
    @property
    def watchdog(self) -> Watchdog: ...
    @property
    def kernel(self) -> LifecycleKernel: ...
    @property
    def budget(self) -> Budget: ...
    @property
    def telemetry(self) -> Telemetry: ...
    @property
    def markers(self) -> dict[str, ContinuationSent]: ...
    @property
    def attestation(self) -> Attestation | None: ...


class Viewed(LaneFacts, Protocol):
    """What the view reads of a task lane."""

    @property
    def policy(self) -> WatchdogPolicy: ...
    @property
    def record(self) -> EpochStarted | None: ...
    @property
    def live(self) -> bool:
        """A worker of the lane runs now."""
        ...

    @property
    def epochs(self) -> int: ...
    @property
    def continuations(self) -> int: ...
    @property
    def probe_result(self) -> str | None: ...
    @property
    def pending_action(self) -> str | None: ...
    @property
    def ended(self) -> TaskEnded | None: ...
    @property
    def actions(self) -> dict[str, OutboxAction]: ...
    @property
    def failure(self) -> BaseException | None:
        """Why the lane's task stopped without an end (TL11), if it did."""

    def now(self) -> float: ...


def last_finalization(actions: Mapping[str, OutboxAction]) -> dict[str, Any] | None:
    """What the last incomplete finalization attempt found (LK10), if there was one."""
    attempts = [a for a in actions.values() if a.kind == "finalize"]
    return dict(attempts[-1].detail) if attempts else None


def task_view(lane: Viewed) -> TaskView:
    """A frozen snapshot of everything the diagnostics show."""
    wd, policy, kernel, record = lane.watchdog, lane.policy, lane.kernel, lane.record
    hard = wd.hard_threshold()
    grace = "not started" if wd.grace_started_awake is None else "running"
    if wd.classification is Classification.HARD_RESUME_ELIGIBLE:
        grace = "elapsed"
    process = None
    if record is not None and lane.live:
        process = {
            "pid": record.pid,
            "start_time": record.start_time,
            "boot_id": record.boot_id,
            "nonce": record.nonce,
        }
    last_marker = next(reversed(lane.markers.values()), None)
    ended = lane.ended
    return TaskView(
        task_id=lane.task.task_id,
        state=ended.state if ended is not None else str(kernel.state),  # RT12: a slim log
        generation=kernel.generation,
        attempt=kernel.attempt,
        fence=kernel.fence,
        process_epoch=lane.epochs,
        continuation_epoch=lane.continuations,
        session_path=lane.task.session_path,
        session_id=lane.attestation.session_id if lane.attestation else None,
        route=dict(lane.task.route),
        worktree=lane.task.worktree,
        process=process,
        classification=str(wd.classification),
        phase=str(wd.phase),
        progress_seq=wd.progress_seq,
        silence_seconds=_silence(lane),
        silence_watched=_watched(lane),
        soft_seconds=policy.soft_seconds,
        probe=lane.probe_result,
        hard_seconds=hard,
        grace_seconds=policy.grace_seconds,
        grace=grace,
        receipts=[msgspec.to_builtins(r) for r in kernel.receipts],
        prompt_marker=last_marker.marker if last_marker else None,
        budget=lane.budget.as_dict(),
        pending_action=lane.pending_action,
        hold_reason=wd.hold_reason,
        next_action=next_action(lane),
        timescale=policy.timescale,
        telemetry=lane.telemetry.as_dict(wd),
        ended=msgspec.to_builtins(ended) if ended else None,
        costs=ended.costs if ended else None,
        finalization=last_finalization(lane.actions),
        failure=lane_failure(lane.failure) if lane.ended is None else None,
    )


ROW_FIELDS: Final = (
    "task_id",
    "state",
    "classification",
    "phase",
    "process_epoch",
    "silence_seconds",
    "silence_watched",
    "soft_seconds",
    "hard_seconds",
    "grace_seconds",
    "budget",
    "hold_reason",
    "pending_action",
    "next_action",
)
"""The fields of a :class:`TaskView` an overview shows, and ``ended`` (the end's state)."""


def task_row(lane: Viewed) -> dict[str, Any]:
    """:func:`view_row` of the lane's :func:`task_view`, computed the same way without building
    the whole view (the operator page shows a thousand lanes a second)."""
    wd, ended = lane.watchdog, lane.ended
    return {
        "task_id": lane.task.task_id,
        "state": ended.state if ended is not None else str(lane.kernel.state),
        "classification": str(wd.classification),
        "phase": str(wd.phase),
        "process_epoch": lane.epochs,
        "silence_seconds": _silence(lane),
        "silence_watched": _watched(lane),
        "soft_seconds": lane.policy.soft_seconds,
        "hard_seconds": wd.hard_threshold(),
        "grace_seconds": lane.policy.grace_seconds,
        "budget": lane.budget.as_dict(),
        "hold_reason": wd.hold_reason,
        "pending_action": lane.pending_action,
        "next_action": next_action(lane),
        "ended": ended.state if ended is not None else None,
    }


def view_row(view: TaskView) -> dict[str, Any]:
    """The fields of ``view`` an overview shows (:data:`ROW_FIELDS`, and ``ended``)."""
    row = {name: getattr(view, name) for name in ROW_FIELDS}
    row["ended"] = view.ended.get("state") if view.ended else None
    return row


def _silence(lane: Viewed) -> float:
    wd = lane.watchdog
    return round(wd.silence(lane.now()), 3) if wd.armed else 0.0


def _watched(lane: Viewed) -> bool:
    """Whether the lane's silence is measured now (OP11): it runs here — no end, no lane
    failure — and its watchdog is armed (a prompt is being worked on, WD7)."""
    return lane.ended is None and lane.failure is None and lane.watchdog.armed


def lane_failure(error: BaseException | None) -> dict[str, Any] | None:
    """What the view says of a lane that stopped without an end (TL11)."""
    if error is None:
        return None
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]  # a nursery's wrapping of the one error: its own code
    code = getattr(error, "code", None)
    return {"code": str(code or type(error).__name__), "message": str(error)}


def next_action(lane: Viewed) -> str:
    """The next safe operator action (``docs/design/watchdog.md``, the action table)."""
    if lane.ended is not None:
        return "none: the task has ended"
    if lane.failure is not None:  # TL11: nothing runs it until the next start
        return "its lane failed (see failure and the server log): fix the cause, then restart"
    if lane.kernel.state is TaskState.WAITING:
        return ACTION_TABLE[Classification.WAITING_USER]
    return ACTION_TABLE[lane.watchdog.classification]


def offline_views(state_dir: Path, policy: WatchdogPolicy | None = None) -> list[TaskView]:
    """Every task of ``state_dir`` as its lane log says, read without the lock and without
    writing (like ``status``, O9). The watchdog runs only in an owner, so ``classification``
    says no server runs; thresholds are ``policy``'s (default: the production ones)."""
    root = state_dir.absolute()
    lanes = root / "lanes"
    views: list[TaskView] = []
    if not lanes.is_dir():
        return views
    for directory in sorted(lanes.iterdir()):
        view = _offline_lane(root, directory.name, policy or WatchdogPolicy())
        if view is not None:
            views.append(view)
    return sorted(views, key=lambda v: v.task_id)


def offline_view(state_dir: Path, task_id: str, policy: WatchdogPolicy | None = None) -> TaskView:
    """One task as its lane log says (see :func:`offline_views`); ``task_unknown`` if none."""
    root = state_dir.absolute()
    view = _offline_lane(root, lane_key(f"task:{task_id}"), policy or WatchdogPolicy())
    if view is None:
        raise TaskError(ReasonCode.TASK_UNKNOWN, f"no task {task_id!r} in {root}")
    return view


class _DeploymentReader(Protocol):
    """What reading a deployment's task lanes needs of a PostgreSQL store: a host's own
    (:class:`~runtime._journal._postgres.PgStore`) or a read-only one (``pg_reader``)."""

    async def lane_logs(self) -> list[str]: ...
    def lane_rel(self, lane: str) -> str: ...
    async def read(self, rel: str, kind: LogKind | None = None) -> LogContents: ...
    async def lease(self, lane: str) -> Lease | None: ...


async def store_views(
    store: _DeploymentReader, policy: WatchdogPolicy
) -> list[tuple[TaskView, dict[str, Any] | None]]:
    """Every task of the deployment ``store`` reads, as its lane log says, with the host
    holding its lane's lease (``host``, ``epoch``, ``live``; ``None``: never claimed), by
    task id (S30)."""
    found = [await _lane_view(store, rel, policy) for rel in await store.lane_logs()]
    return sorted((one for one in found if one is not None), key=lambda pair: pair[0].task_id)


async def store_view(
    store: _DeploymentReader, task_id: str, policy: WatchdogPolicy
) -> tuple[TaskView, dict[str, Any] | None] | None:
    """One task of :func:`store_views` (``None``: the database holds no such task)."""
    try:
        return await _lane_view(store, store.lane_rel(f"task:{task_id}"), policy)
    except FileNotFoundError:
        return None


async def _lane_view(
    store: _DeploymentReader, rel: str, policy: WatchdogPolicy
) -> tuple[TaskView, dict[str, Any] | None] | None:
    contents = await store.read(rel, LogKind.LANE)
    subject = contents.header.subject
    if not subject.startswith("task:"):
        return None
    view = records_view(
        contents.records,
        policy,
        classification="unknown: read from the database (the watchdog runs in its host)",
        waiting_action=" (on the host that holds it)",
        resume_action="the host that holds it runs it; if none does, start one",
    )
    if view is None:
        return None
    lease = await store.lease(subject)
    holder = (
        None
        if lease is None
        else {"host": lease.fence.owner, "epoch": lease.fence.epoch, "live": lease.live}
    )
    return view, holder


async def database_views(
    dsn: str, policy: WatchdogPolicy | None = None
) -> list[tuple[TaskView, dict[str, Any] | None]]:
    """:func:`store_views` of the deployment whose PostgreSQL store ``dsn`` names, read only
    (like :func:`offline_views`)."""
    async with pg_reader(dsn) as store:
        return await store_views(store, policy or WatchdogPolicy())


def _offline_lane(root: Path, name: str, policy: WatchdogPolicy) -> TaskView | None:
    rel = f"lanes/{name}/lane.log"
    try:
        contents = read_log(OsFileSystem(), str(root), rel, kind=LogKind.LANE)
    except FileNotFoundError:
        return None
    if not contents.records or not contents.header.subject.startswith("task:"):
        return None
    return records_view(contents.records, policy)


def records_view(
    records: Sequence[Record],
    policy: WatchdogPolicy,
    *,
    classification: str = "unknown: no server runs (the watchdog runs only in the owner)",
    waiting_action: str = " (start the server first)",
    resume_action: str = "start pi-runtime serve (or task run again) to resume it",
) -> TaskView | None:
    """A task as its lane log's ``records`` say, read by someone who does not run it (no
    server, or another host holds its lane: S30); ``None`` without a submission."""
    submitted = next((r for r in records if isinstance(r, TaskSubmitted)), None)
    if submitted is None:
        return None
    state = read_lane(submitted, records, policy)
    policy = state.policy  # the task's own, frozen at submission (WD14)
    kernel, budget, ended, epochs = state.kernel, state.budget, state.ended, state.epochs
    receipts = kernel.receipts
    live = (
        state.record
        if state.record is not None and state.record.epoch not in state.fenced
        else None
    )
    continuations = state.continuations
    pending = state.pending_action
    markers = list(state.markers.values())
    if ended is not None:
        next_action = "none: the task has ended"
    elif str(kernel.state) == "waiting":
        next_action = ACTION_TABLE[Classification.WAITING_USER] + waiting_action
    else:
        next_action = resume_action
    return TaskView(
        task_id=submitted.task_id,
        state=ended.state if ended is not None else str(kernel.state),
        generation=kernel.generation,
        attempt=kernel.attempt,
        fence=kernel.fence,
        process_epoch=epochs,
        continuation_epoch=continuations,
        session_path=submitted.session_path,
        session_id=None,
        route=dict(submitted.route),
        worktree=submitted.worktree,
        process=(
            {
                "pid": live.pid,
                "start_time": live.start_time,
                "boot_id": live.boot_id,
                "nonce": live.nonce,
            }
            if live is not None and ended is None
            else None
        ),
        classification=classification,
        phase="unknown",
        progress_seq=0,
        silence_seconds=0.0,
        soft_seconds=policy.soft_seconds,
        probe=None,
        hard_seconds=min(policy.hard_seconds.values(), default=None),
        grace_seconds=policy.grace_seconds,
        grace="not started",
        receipts=[msgspec.to_builtins(r) for r in receipts],
        prompt_marker=markers[-1].marker if markers else None,
        budget=budget.as_dict(),
        pending_action=pending,
        hold_reason=state.hold,
        next_action=next_action,
        timescale=policy.timescale,
        telemetry={},
        ended=msgspec.to_builtins(ended) if ended is not None else None,
        costs=inference_costs(records),
        finalization=last_finalization(state.actions),
    )
