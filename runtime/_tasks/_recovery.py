"""A task's replacement budget and the recovery that runs now (WD11 of
``docs/design/watchdog.md``), as plain state: what is charged, when, and when a recovery ends.

Pure: no trio, no clock reads, no I/O. The lane (``_lane.py``) passes the wall-clock
milliseconds in and makes each charge durable (a ``reserve`` or ``recovery_time`` outbox
action) from the detail these methods return; :func:`~runtime._tasks._state.read_lane` restores
the same state from those records after a restart.

A replacement epoch is charged before its launch, once, never refunded. A recovery runs from
the reserve that starts it (or, on a reserve charged before, from the operator's resume or the
prompt after a park) until the relaunched worker's first progress or a hold; its seconds are
charged when it ends. It runs across a host restart too, since its start is in the log: a
reserve's ``at_ms``, or a ``recovery_start`` action's when no reserve started it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from ._guards import Budget

__all__ = ["BUDGET_UNRECORDED", "RECOVERY_SPENT", "ChargeUnrecorded", "Recovery"]

RECOVERY_SPENT: Final = "budget_exhausted:recovery_seconds"
"""The hold of a recovery that outlasted the seconds left (WD11)."""
BUDGET_UNRECORDED: Final = "budget_unrecorded:"
"""The prefix of the hold of a reserve whose write failed (WD11): ``budget_unrecorded:<code>``."""


class ChargeUnrecorded(Exception):
    """A reserve's write failed (a disk that refused it): the charge is not made — the budget
    in memory is the log's again — and the task is held ``budget_unrecorded:<code>``, durably,
    before this is raised (WD11, WD12). Nothing is fenced or launched on it."""


@dataclass(slots=True)
class Recovery:
    """The budget of one attempt and the recovery running in it (WD11)."""

    budget: Budget
    continuations: int = 0
    """Replacement epochs reserved (charged) so far: the number of the last continuation."""
    recoveries: int = 0
    """Recoveries ended (their time charged)."""
    started_ms: int | None = None
    """When the running recovery started (wall ms), or ``None``: none runs."""
    awaiting_progress: bool = False
    """A relaunched worker has not shown progress yet: its first progress ends the recovery."""

    def saved(self) -> tuple[Budget, int, int | None]:
        """What :meth:`charge_epoch` changes, for :meth:`restore`."""
        return self.budget, self.continuations, self.started_ms

    def restore(self, saved: tuple[Budget, int, int | None]) -> None:
        """Undo a charge that was never recorded (its write failed): memory is the log again."""
        self.budget, self.continuations, self.started_ms = saved

    def charge_epoch(self, at_ms: int) -> dict[str, Any]:
        """Charge one replacement epoch (the reserve); a recovery starts now unless one runs.
        The reserve action's detail."""
        self.budget = self.budget.charge_epoch()
        self.continuations += 1
        self.started_ms = self.started_ms or at_ms
        return {"epochs": 1, "at_ms": at_ms}

    def start(self, at_ms: int) -> dict[str, Any] | None:
        """Start a recovery that no reserve starts (on a reserve charged before); the
        ``recovery_start`` action's detail, or ``None`` when one runs already."""
        if self.started_ms is not None:
            return None
        self.started_ms = at_ms
        return {"at_ms": at_ms}

    def relaunched(self, at_ms: int) -> None:
        """A replacement is queued: the recovery runs (from its reserve, or from now) until
        the relaunched worker's first progress."""
        self.started_ms = self.started_ms or at_ms
        self.awaiting_progress = True

    def first_progress(self) -> bool:
        """The relaunched worker showed progress: whether it is the first since the
        relaunch (then the recovery ends)."""
        first, self.awaiting_progress = self.awaiting_progress, False
        return first

    def end(self, now_ms: int) -> dict[str, Any] | None:
        """End the running recovery and charge its seconds, never refunded; the
        ``recovery_time`` action's detail, or ``None`` when none ran."""
        if self.started_ms is None:
            return None
        started = self.started_ms
        seconds = max(0.0, (now_ms - started) / 1000)
        self.started_ms = None
        self.budget = self.budget.charge_seconds(seconds)
        self.recoveries += 1
        return {"seconds": seconds, "from_ms": started, "to_ms": now_ms}

    def due_in(self, now_ms: int) -> float | None:
        """Seconds until the running recovery has used every second left (zero or less:
        overdue); ``None`` when none runs."""
        if self.started_ms is None:
            return None
        return self.budget.seconds_left - (now_ms - self.started_ms) / 1000

    def overdue(self, now_ms: int) -> bool:
        """The running recovery has used every second left (the task must hold)."""
        due = self.due_in(now_ms)
        return due is not None and due <= 0

    def exhausted_by(self) -> str:
        """What ran out, for the hold reason: ``epochs`` or ``recovery_seconds``."""
        return "epochs" if self.budget.epochs_left <= 0 else "recovery_seconds"
