"""A task lane's diagnostics view (``task show``, ``tasks``, ``task_event``): what the lane
knows, frozen into a :class:`~runtime._wire.TaskView` (docs/design/watchdog.md, "What an
operator sees")."""

from __future__ import annotations

from typing import Protocol

import msgspec

from .._pi._session import Attestation
from .._records import ContinuationSent, EpochStarted, TaskEnded, TaskSubmitted
from .._wire import TaskView
from ._guards import Budget
from ._lifecycle import LifecycleKernel, TaskState
from ._watch import Telemetry
from ._watchdog import ACTION_TABLE, Classification, Watchdog, WatchdogPolicy

__all__ = ["Viewed", "next_action", "task_view"]


class Viewed(Protocol):
    """What the view reads of a task lane (:class:`~runtime._tasks._lane.TaskLane`)."""

    @property
    def task(self) -> TaskSubmitted: ...
    @property
    def policy(self) -> WatchdogPolicy: ...
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
    def now(self) -> float: ...


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
        state=str(kernel.state),
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
        silence_seconds=round(wd.silence(lane.now()), 3) if wd.armed else 0.0,
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
    )


def next_action(lane: Viewed) -> str:
    """The next safe operator action (``docs/design/watchdog.md``, the action table)."""
    if lane.ended is not None:
        return "none: the task has ended"
    if lane.kernel.state is TaskState.WAITING:
        return ACTION_TABLE[Classification.WAITING_USER]
    return ACTION_TABLE[lane.watchdog.classification]
