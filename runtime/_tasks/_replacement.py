"""How a task lane proves and prepares a replacement worker (TL4, TL5, WD11, WD13, TL13 of
``docs/design/watchdog.md``): after a fence, an exit, a restart or an operator's resume, the
next worker may continue the task only in its own session, on its own route and worktree,
with no possibly-run effect left unproven and budget left; then the session is settled,
re-attested, and the one continuation prompt is queued.

Each step that acts reads its proof again after its last await: the route and session before
anything is charged, and again after the reserve, before the first write. A failed or unknown
proof holds the task (:meth:`ReplacementOwner.hold`); nothing falls back. The task must still be
open after every await too (LK6, WD11): an end decided meanwhile (an operator's abort or fail)
means no launch will be attempted, so nothing more is charged, held or written for it.

These functions see the lane only through :class:`ReplacementOwner` (``TaskLane`` is the one
implementation), so what a replacement reads and writes of it is on one page.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec

from .._boundary._boundaries import settle_session as settle_dangling
from .._boundary._gate import RecordingGateJournal
from .._boundary._steps import DeliveryStepJournal
from .._clock import Clocks
from .._errors import PiRuntimeError, ReasonCode, descriptors_exhausted
from .._pi._launch import ModelRoute
from .._pi._session import Attestation, attest, contains_path
from .._pi._session_files import aread_session
from .._records import OutboxAction, TaskSubmitted, ToolIntent
from ._action_ids import ActionIds
from ._lifecycle import TaskState
from ._recovery import RECOVERY_SPENT, ChargeUnrecorded, Recovery
from ._session import marker_in_session, reanswer_orphaned
from ._state import continuation_prompt, route_change, session_route_change
from ._view import LaneFacts
from ._watchdog import Relaunched

__all__ = [
    "RecoveryOverdue",
    "ReplacementOwner",
    "TaskClosed",
    "prepare_replacement",
    "reconcile_marker",
    "route_problem",
    "settle_session",
]


class ReplacementHost(Protocol):
    """What a replacement reads of the lane's host."""

    @property
    def route(self) -> ModelRoute: ...
    @property
    def clocks(self) -> Clocks: ...
    @property
    def leaseholder(self) -> Callable[[TaskSubmitted], str | None]: ...


_T = TypeVar("_T")


class TaskClosed(Exception):
    """A step before a worker's launch waited for file descriptors (docs/design/lanes.md
    L21), and the task is not open any more (its end was decided meanwhile) — or, as
    :class:`RecoveryOverdue`, it was held: nothing is launched for it. ``code``: why, as the
    launch's record says it."""

    def __init__(self, code: ReasonCode, why: str = "the task is not open any more") -> None:
        super().__init__(f"{why} ({code})")
        self.code = str(code)


class RecoveryOverdue(TaskClosed):
    """A step of a running recovery waited for file descriptors until the recovery's seconds
    were spent (L21, WD11): the task is held ``budget_exhausted:recovery_seconds`` — durably,
    before this is raised — and the step is not taken (nothing launched, no prompt sent)."""

    def __init__(self) -> None:
        super().__init__(
            ReasonCode.TOO_MANY_OPEN_FILES, "the recovery's seconds ran out as it waited"
        )


class ReplacementOwner(LaneFacts, Protocol):
    """Everything a replacement uses of its task lane, and nothing more."""

    attestation: Attestation | None
    """The attested session path (a replacement writes the new one)."""

    @property
    def host(self) -> ReplacementHost: ...
    @property
    def session(self) -> Path: ...
    @property
    def worktree(self) -> Path: ...
    @property
    def ids(self) -> ActionIds: ...
    @property
    def actions(self) -> dict[str, OutboxAction]: ...
    @property
    def recovery(self) -> Recovery: ...

    def journals(self) -> tuple[DeliveryStepJournal, RecordingGateJournal]: ...
    def unsettled_effects(self) -> list[ToolIntent]: ...
    def readings(self) -> tuple[float, float]: ...
    def changed(self) -> None: ...
    async def hold(self, reason: str) -> None: ...
    async def reserve(self) -> bool: ...
    async def start_recovery(self) -> None: ...
    async def record_marker(self, action_id: str) -> None: ...
    async def patiently(self, what: str, work: Callable[[], Awaitable[_T]]) -> _T: ...
    async def record_action(
        self, action_id: str, kind: str, state: str, detail: dict[str, Any] | None = None
    ) -> None: ...


async def prepare_replacement(
    lane: ReplacementOwner,
    observed: str,
    *,
    forced: bool,
    reply: str | None,
    task: str | None = None,
) -> tuple[str, str] | None:
    """Prove and prepare the next worker of ``lane`` (TL4, TL5, WD11, WD13): the
    continuation ``(prompt, action id)`` to send it, or ``None`` when the lane holds.
    ``forced``: an operator's resume, which continues past a possibly-run effect (settled
    "possibly ran"); ``reply``: the user's reply the worker has not had yet (LK8);
    ``task``: the task's prompt, when no worker answered it yet (one died before it, TL5).
    ``None`` too, with nothing written, once the task is not open (LK6): the kernel is read
    again after every await, so an abort decided before the reserve's write charges nothing,
    and one decided after it leaves that charge — made while the task was open, before its
    launch — as it is, never refunded (WD11)."""
    if _closed(lane):
        return None
    never = lane.unsettled_effects()
    if never and not forced:  # WD13: auto-continue only on proof
        await lane.hold("effect_possibly_ran:" + ",".join(i.name for i in never))
        return None
    try:  # (L21: a want of descriptors is waited out, not taken for an unreadable session)
        problem = await lane.patiently("read its session", lambda: route_problem(lane))
        if problem is not None:  # TL4: before anything is charged or written
            await lane.hold(problem)
            return None
        if not await reconcile_marker(lane) or _closed(lane):
            return None
    except TaskClosed:
        return None
    recovery = lane.recovery
    if recovery.overdue(lane.host.clocks.wall.time_ms()):  # WD11: its seconds ran out
        await lane.hold(RECOVERY_SPENT)  # before this worker (a host down longer, say):
        return None  # held before anything is charged or launched
    reserve_id = lane.ids.next_continuation(
        recovery.continuations, "reserve", lane.actions, lane.markers
    )
    if reserve_id in lane.actions:  # charged before (a fence's, or one a hold left unsent):
        await lane.start_recovery()  # a recovery no reserve starts, its start durable (WD11)
    elif recovery.budget.exhausted:  # the hold names what ran out (WD11)
        await lane.hold(f"budget_exhausted:{recovery.exhausted_by()}")
        return None
    else:
        try:
            await lane.reserve()
        except ChargeUnrecorded:  # (WD11) its write failed: not charged, and held
            return None
    number = recovery.continuations
    try:  # TL4: again after the awaits, before the write
        problem = await lane.patiently("read its session", lambda: route_problem(lane))
    except TaskClosed:
        return None
    if _closed(lane):
        return None
    if problem is not None:
        await lane.hold(problem)
        return None
    try:  # (L21: each waits out a want of descriptors; the charge above stays, WD11)
        await lane.patiently("settle its session", lambda: settle_session(lane))
        read = await lane.patiently("read its session", lambda: aread_session(lane.session))
    except TaskClosed:
        return None
    if _closed(lane):
        return None
    lane.attestation = attest(read.session) if read.session.leaf is not None else None
    await lane.record_action(
        lane.ids.continuation(number, "attest"),
        "attest",
        "done",
        msgspec.to_builtins(lane.attestation) if lane.attestation else {},
    )
    recovery.relaunched(lane.host.clocks.wall.time_ms())
    lane.watchdog.feed(Relaunched(*lane.readings()))
    action_id = lane.ids.continuation(number, "prompt")
    lane.changed()
    return continuation_prompt(action_id, observed, reply=reply, task=task), action_id


def _closed(lane: ReplacementOwner) -> bool:
    """The task is no longer open (an end or a wait decided): no replacement will launch
    (LK6), so nothing is charged or written for one (WD11)."""
    return lane.kernel.state is not TaskState.OPEN


async def route_problem(lane: ReplacementOwner) -> str | None:
    """Why the next worker would not continue the task's own session on its own route
    (TL4), as a hold reason; None when every part is attested: the host's route is the
    frozen one (provider, model, endpoint, API kind, reasoning level), the session's path
    begins with the attested one and names the frozen model and level, and the worktree is
    there and leased to this task alone (TL13). An unreadable session proves nothing and is
    a reason too; one not read for want of a file descriptor is raised (L21: the caller
    waits it out, or takes it for unreadable)."""
    change = route_change(lane.task.route, lane.host.route)
    if change is not None:
        return change
    if not lane.worktree.is_dir():
        return "worktree_missing"
    holder = lane.host.leaseholder(lane.task)
    if holder is not None:  # TL13: one live task per worktree
        return f"worktree_leased:{holder}"
    try:
        read = await aread_session(lane.session)
    except (OSError, PiRuntimeError) as error:
        if descriptors_exhausted(error):
            raise
        return "session_unreadable"
    if lane.attestation is not None and not contains_path(read.session, lane.attestation):
        return "session_attestation_mismatch"
    return session_route_change(lane.task.route, read.session)


async def reconcile_marker(lane: ReplacementOwner) -> bool:
    """A continuation delivered to a worker that died before its record was written is in
    the session but not in the log: record it now (TL5). It was sent; the worker that got it
    is gone, so the next replacement gets a continuation of its own rather than waiting on an
    answer that will never come. False when the lane holds: the session cannot say."""
    number = lane.recovery.continuations
    action_id = lane.ids.continuation(number, "prompt")
    if number == 0 or lane.ids.sent(number, lane.markers):
        return True
    present = await lane.patiently(  # (L21: a want of descriptors is waited out)
        "read its session", lambda: marker_in_session(lane.session, action_id, wants=True)
    )
    if present is None:  # it may be in the session or not: hold, never guess
        await lane.hold(f"prompt_marker_unknown:{action_id}")
        return False
    if present:
        await lane.record_marker(action_id)
    return True


async def settle_session(lane: ReplacementOwner) -> None:
    """Answer what the previous worker left dangling in the session (TL5, WD10): calls the
    gate never saw are re-answered from the journal, and every call without a result gets
    its recorded outcome or "possibly ran"."""
    steps, tools = lane.journals()
    wall = lane.host.clocks.wall
    await reanswer_orphaned(lane.session, tools, step=steps.current_step, clock=wall)
    await settle_dangling(lane.session, tools, clock=wall)
