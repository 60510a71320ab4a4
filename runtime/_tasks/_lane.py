"""Task lanes: one coding task run by a supervised worker until an explicit receipt
(docs/design/watchdog.md).

A :class:`TaskLane` owns one task: its log (``lanes/<hash>/lane.log``: the submission, model
steps, tool intents and outcomes, epochs, lifecycle receipts, outbox actions, continuations),
its Pi session, its worktree. Each process epoch runs inside ``async with workers.open(…)``
in the lane's task, so leaving that block — for a terminal, an exit or a fence — stops the
whole tree (TERM, bounded KILL, reap) before anything else happens.

The decisions are the pure cores': :class:`~runtime._tasks._watchdog.Watchdog` (classification and
clocks), :class:`~runtime._tasks._lifecycle.LifecycleKernel` (first terminal wins, the Done tuple),
:mod:`runtime._tasks._guards` (fencing guards, budget). This shell feeds them the worker's events
and the suspend-aware clock every tick, and carries out their actions: a read-only probe, a guard
check, a fence and a same-session resume, a completion prompt. The invariants (WD…, LK…,
TL…) are in ``docs/design/watchdog.md``.

Beside it: the ids of its outbox actions (``_action_ids.py``), its log parked or open
(``_lane_log.py``), the lifecycle tools its worker calls (``_lifecycle_tools.py``), how it
ends (``_done.py``: the Done tuple), its diagnostics view (``_view.py``), and one epoch's
watch (``_epoch.py``, through the ``EpochOwner`` protocol).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import trio

from .._backoff import DescriptorWait, RouteBreaker, patiently, sleeping
from .._boundary._boundaries import BoundaryConfig, make_journals
from .._boundary._calls import RuntimeTool
from .._boundary._gate import RecordingGateJournal
from .._boundary._gateway import GatewayConfig
from .._boundary._receipts import ReceiptStore
from .._boundary._steps import DeliveryStepJournal
from .._boundary._tools import DocumentTools, EffectLedger
from .._clock import Clocks
from .._errors import JournalError, PiRuntimeError, ReasonCode, TaskError, WorkerError
from .._journal._fence import Fence
from .._journal._interface import JournalStore, Log
from .._journal._leases import fenced_out
from .._journal._store import lane_key
from .._linux._proc import boot_id
from .._linux._proctree import new_nonce
from .._metrics import TASK_BUDGET_CHARGES, TASK_CONTINUATIONS
from .._pi._launch import ModelRoute
from .._pi._session import Attestation, attest
from .._pi._session_files import afsync_session, aread_session, create_session
from .._pi._worker import StopPolicy, kill_epoch_leftovers, kill_launch_leftovers
from .._records import (
    ContinuationSent,
    EpochFenced,
    EpochStarted,
    LifecycleKind,
    ModelResponse,
    OutboxAction,
    Parked,
    Record,
    ReplayClass,
    TaskEnded,
    TaskReply,
    TaskSubmitted,
    ToolIntent,
)
from .._wire import TaskView
from ._action_ids import ActionIds
from ._done import Ending, conclude, end_record
from ._epoch import EpochEnd, EpochWatch
from ._guards import Budget, check_grant
from ._lane_log import LaneLog
from ._lifecycle import LifecycleKernel, Report, TaskState, Verdict
from ._lifecycle_tools import lifecycle_tools
from ._recovery import BUDGET_UNRECORDED, RECOVERY_SPENT, ChargeUnrecorded, Recovery
from ._replacement import (
    RecoveryOverdue,
    TaskClosed,
    prepare_replacement,
    route_problem,
    settle_session,
)
from ._session import marker_in_session, prompt_in_session
from ._state import (
    CONTINUATION_VERSION,
    LIFECYCLE_TOOLS,
    continuation_marker,
    read_lane,
    reply_prompt,
    task_policy,
)
from ._view import task_view
from ._watch import Telemetry
from ._watchdog import (
    Classification,
    Exited,
    Hold,
    Prompted,
    TerminalAccepted,
    Watchdog,
    WatchdogPolicy,
    Woken,
)
from ._workers import EpochRequest, Stopped, TaskWorker, WorkerFactory

__all__ = ["TaskHost", "TaskLane"]

_T = TypeVar("_T")


@dataclass
class TaskHost:
    """What every task lane needs from its runner."""

    store: JournalStore
    clocks: Clocks
    policy: WatchdogPolicy
    workers: WorkerFactory
    route: ModelRoute
    upstream: GatewayConfig | None = None
    receipts: ReceiptStore | None = None
    ledger: Path | None = None
    work_root: Path | None = None
    on_change: Callable[[TaskLane], None] = lambda lane: None
    """Called whenever a lane's classification or state changes (events, diagnostics)."""
    leaseholder: Callable[[TaskSubmitted], str | None] = lambda task: None
    """The live task that holds the worktree lease a task needs, if another does (TL13)."""
    log: Callable[[str], None] = lambda line: None
    owner: str | None = None
    """On a shared store: this host's name in the lease rows (S10), recorded with each launch."""
    shared_worktrees: bool = False
    """On a shared store: task worktrees and lane directories are on storage every host sees
    at the same paths, so a task claimed from a lost host resumes here (S32)."""
    breaker: RouteBreaker | None = None
    """The host's model route's breaker (PB6): ``None`` when the backoff is off (a turn
    meeting an unavailable provider settles as any other, with the worker's own retries)."""


class TaskLane:
    """One task; the runner starts :meth:`run` in its own task."""

    __slots__ = (
        "_came_home",
        "_descriptors",
        "_fenced",
        "_finished",
        "_granting",
        "_holds_in_flight",
        "_log",
        "_lost",
        "_next",
        "_opened",
        "_operator",
        "_policy_problem",
        "_recorded_hold",
        "_replacing",
        "_reply_recording",
        "_reserving",
        "_restart_survivors",
        "_restarted",
        "_settle_first",
        "_task_undelivered",
        "_undelivered",
        "_unprompted",
        "_wake",
        "actions",
        "archive_dir",
        "attestation",
        "ended",
        "epochs",
        "failure",
        "home",
        "host",
        "ids",
        "kernel",
        "key",
        "launching",
        "markers",
        "moved_from",
        "parks",
        "pending_action",
        "policy",
        "probe_result",
        "quiescent_epoch",
        "record",
        "recovery",
        "replies",
        "session",
        "task",
        "task_id",
        "telemetry",
        "tmp",
        "watchdog",
        "worker",
        "worktree",
    )

    def __init__(
        self, host: TaskHost, submitted: TaskSubmitted, log: Log, *, fence: Fence | None = None
    ) -> None:
        self.host = host
        self.task = submitted
        self.task_id = submitted.task_id
        self.key = lane_key(f"task:{submitted.task_id}")
        self.ids = ActionIds(submitted.task_id, submitted.generation, submitted.attempt)
        self._log = LaneLog(
            host.store, f"task:{submitted.task_id}", log, self._make_journals, fence=fence
        )
        self.session = host.store.root / submitted.session_path
        self.worktree = Path(submitted.worktree)
        base = host.work_root or host.store.root / "work"
        self.home = base / "homes" / self.key
        self.tmp = base / "tmp" / self.key
        self.archive_dir = host.store.root / "candidates"
        self.kernel = LifecycleKernel(
            submitted.task_id, generation=submitted.generation, attempt=submitted.attempt
        )
        policy, self._policy_problem = task_policy(submitted, host.policy)
        self.policy = policy
        """The task's own thresholds, grace and budgets, frozen at submission (WD14)."""
        self.watchdog = Watchdog(policy=policy)
        self.recovery = Recovery(
            Budget(max_epochs=policy.max_replacements, max_seconds=policy.recovery_seconds)
        )
        """The replacement budget and the recovery that runs now (WD11)."""
        self.epochs = 0
        self.actions: dict[str, OutboxAction] = {}
        self.markers: dict[str, ContinuationSent] = {}
        self.replies: dict[str, TaskReply] = {}
        self.ended: TaskEnded | None = None
        self.failure: BaseException | None = None
        """Why the lane's task stopped without an end (a bug, a broken disk), if it did."""
        self.worker: TaskWorker | None = None
        self.record: EpochStarted | None = None
        self.launching: str | None = None
        """The nonce of the last epoch's launch while no ``EpochStarted`` names it (W13): from
        the launch action reserved before the spawn until the record is appended, or a
        restart's reading of a log a crash cut in between."""
        self.attestation: Attestation | None = None
        self.quiescent_epoch: int | None = None
        self.probe_result: str | None = None
        self.pending_action: str | None = None
        self.telemetry = Telemetry()
        self._wake = trio.Event()
        self._descriptors = DescriptorWait()
        """Tries refused in a row for want of a file descriptor (L21): the wait grows."""
        self._operator: str | None = None
        self._restarted = False
        self._restart_survivors: tuple[int, ...] | None = None
        """What a host restart could not kill of the previous epoch (None: nothing)."""
        self._undelivered: TaskReply | None = None
        """The user's reply the worker has not been sent yet (LK8)."""
        self._task_undelivered = True
        """No worker of this lane has answered the task's prompt yet: a replacement carries
        it (a restored lane with epochs cannot tell, and assumes the task was heard)."""
        self._unprompted: str | None = None
        """The code of the error with which this epoch's worker exited before it answered
        its first prompt (TL2, WD8), or None."""
        self._granting = trio.Lock()
        """Held by a grant while it is recorded: each its own action, counted once recorded."""
        self._reserving = trio.Lock()
        """Held by a reserve from its look for a reserve recorded to its write (WD11): one at
        a time per lane, whoever asks (a guard check, an operator's resume, a replacement)."""
        self._replacing = False
        """A replacement was asked for (a fence, an exit, a restart, a resume) and no epoch
        launched since: the next epoch replaces a worker, even one that carries a reply."""
        self._reply_recording = trio.Event()
        """Set while no accepted reply is being made durable (LK8, :meth:`reply_recorded`)."""
        self._reply_recording.set()
        self._recorded_hold: str | None = None
        """The hold the log says stands (WD12)."""
        self._holds_in_flight = 0
        """Hold records being appended now: their numbers are taken (:meth:`note_hold`)."""
        self._fenced = False
        self._next: tuple[str, str, str | None] = ("task", submitted.prompt, None)
        """(kind, text, continuation action id) of the next prompt."""
        self._finished = trio.Event()
        self._opened = False
        self._settle_first = False
        """A host that died left the last epoch's session: settle it before the next launch."""
        self.moved_from: str | None = None
        """The host whose lease on this lane ran out before this host claimed it (S32)."""
        self._came_home = False
        """S35: opened on the host a ``host_lost`` hold named: the hold is void here."""
        self._lost: str | None = None
        """``host_lost:<host>`` when the lane cannot resume here (S32)."""
        self.parks: list[Parked] = []
        """The parks since the provider last answered (PB6): the backoff's episode."""

    # -- the runner's view ---------------------------------------------------------------

    @property
    def finished(self) -> trio.Event:
        return self._finished

    @property
    def live(self) -> bool:
        return self.worker is not None

    @property
    def lease(self) -> Fence | None:
        """The lane's lease on a shared store (S31); ``None`` on a store with one owner."""
        return self._log.fence

    async def close_log(self) -> None:
        """Close the lane's log, for a lane claimed and then not run (its runner's look
        failed); its lease is the runner's to release."""
        await self._log.park()

    @property
    def budget(self) -> Budget:
        return self.recovery.budget

    @property
    def continuations(self) -> int:
        return self.recovery.continuations

    def view(self) -> TaskView:
        """A frozen snapshot of everything the diagnostics show."""
        return task_view(self)

    # -- operator controls (TL8) -----------------------------------------------------------

    async def reply(self, text: str, correlation: str | None = None) -> Verdict:
        verdict = self.kernel.reply(correlation)
        if verdict is Verdict.ACCEPTED:
            wait = self.kernel.receipts[-1] if self.kernel.receipts else None
            corr = correlation or (wait.intent_id if wait is not None else "")
            record = TaskReply(correlation=corr, text=text)
            recording = self._reply_recording = trio.Event()
            try:
                # the task is open from here: its reply is written whole, whoever cancels
                # the caller, else no prompt would ever carry it
                with trio.CancelScope(shield=True):
                    await self.append(record)
                self.replies[corr] = record
                self.watchdog.feed(Woken())
                self._reply_next(record)
                self._wake.set()
            finally:
                recording.set()
        return verdict

    async def reply_recorded(self) -> None:
        """Wait until no accepted reply is still being made durable (LK8). The task is open
        from the moment a reply is accepted, but the reply is sent to the worker only once
        its record is durable: what looks at the worker's settle or exit waits here first,
        else a settle in that window would look like one without a reply. No checkpoint
        after the last look: a reply begun there would otherwise go unseen by the caller's
        decision that follows."""
        while not self._reply_recording.is_set():
            await self._reply_recording.wait()

    async def abort(self, reason: str) -> Verdict:
        return await self._operator_report(LifecycleKind.ABORT, reason)

    async def fail(self, reason: str) -> Verdict:
        return await self._operator_report(LifecycleKind.OPERATOR_FAIL, reason)

    async def _operator_report(self, kind: LifecycleKind, reason: str) -> Verdict:
        intent = f"operator:{kind}:{len(self.kernel.receipts)}"
        verdict = self.kernel.report(
            Report(key=self.kernel.operator_key(), intent_id=intent, kind=kind, detail=reason)
        )
        with trio.CancelScope(shield=True):  # decided: its receipt is written whole (TL8)
            await self.append(self.kernel.receipts[-1])
        if verdict is Verdict.ACCEPTED:
            self.watchdog.feed(TerminalAccepted(str(kind)))
            self._operator = "terminal"
            self._wake.set()
            self.changed()
        return verdict

    async def grant(self, *, epochs: int, seconds: float, reason: str) -> Budget:
        """An audited manual grant (WD11): recorded before it counts. It adds to the budget
        as that is once recorded — a charge made meanwhile (the lane's own, while the record
        is written) is never refunded — and, recorded, it counts whoever cancels the caller.
        Grants are recorded one at a time, each under its own action id. A bounded amount
        (``ValueError`` otherwise, :func:`check_grant`), and only while the task's end is not
        decided (``task_ended``): looked at again after every await before its write — the
        wait for another grant's write, the reopening of a parked log — so it never lands
        after the end record (TL8). A log it reopened for a lane that no longer runs is
        closed again: a grant leaves no descriptor behind."""
        check_grant(epochs=epochs, seconds=seconds)
        self.recovery.budget.grant(epochs=epochs, seconds=seconds)  # refused before it is written
        self._check_grantable()
        async with self._granting:
            self._check_grantable()
            reopened = self._log.parked
            try:
                if reopened:  # the write reopens it: looked at again after that
                    await self._log.unpark()
                    self._check_grantable()
                action_id = self.ids.grant(len(self.actions))
                detail = {"epochs": epochs, "seconds": seconds, "reason": reason}
                with trio.CancelScope(shield=True):
                    await self.record_action(action_id, "grant", "done", detail)
                self.recovery.budget = self.recovery.budget.grant(epochs=epochs, seconds=seconds)
            finally:
                if reopened and self._finished.is_set() and not self._log.parked:
                    with trio.CancelScope(shield=True):
                        await self._log.park()  # a lane that runs no more holds no descriptor
        self._wake.set()
        return self.recovery.budget

    def _end_decided(self) -> bool:
        """The task has ended, or its end is decided (an accepted abort, fail or finalized
        done) and only its end record is still to be written."""
        return self.ended is not None or self.kernel.state in (
            TaskState.DONE, TaskState.FAILED, TaskState.ABORTED
        )  # fmt: skip

    def _check_grantable(self) -> None:
        if self._end_decided():
            raise TaskError(
                ReasonCode.TASK_ENDED,
                f"task {self.task_id!r} has ended (or its end is decided): nothing to grant",
            )

    def lost_to(self) -> str | None:
        """The host this lane is held ``host_lost`` for — the one its worktree and session are
        on (S32) — while it is held so; ``None`` otherwise."""
        reason = self.watchdog.hold_reason or ""
        if not self._held() or not reason.startswith(HOST_LOST):
            return None
        return reason.removeprefix(HOST_LOST)

    def session_missing(self) -> bool:
        """Held ``host_lost`` and the task's session is not on this host (S32)."""
        reason = self.watchdog.hold_reason or ""
        return reason.startswith(HOST_LOST) and not self.session.is_file()

    def resume(self) -> bool:
        """Operator resume of a held task: fence and resume in the same session once the
        process identity, no terminal, budget and attestation hold (the clocks, the probe and
        the progress compare-and-set are what the operator's look replaces; TL8). False when
        the task is not held."""
        if self.watchdog.classification is not Classification.STALLED_OPERATOR_REQUIRED:
            return False
        self._operator = "resume"
        self._wake.set()
        return True

    # -- the lane's task -------------------------------------------------------------------

    async def open(self) -> None:
        """Prepare the lane's directories and session and restore it from its log (LK7,
        WD11, TL6), once: the runner opens every unfinished lane before it serves anyone, so
        a control that comes right after a restart meets the restored task (a waiting task
        waits, a held one is held)."""
        if self._opened:
            return
        records = self._log.journal.contents.records
        self._came_home = self.host.owner is not None and recorded_hold(records) == (
            f"{HOST_LOST}{self.host.owner}"
        )
        if self._came_home:  # S35: held elsewhere because this host was lost; it is back
            self.moved_from = None
        else:
            self.moved_from = self.moved_from or self._last_launch_elsewhere()
        # before a session could be made here; each waits out a want of descriptors (L21)
        self._lost = await self._patiently("look for its session", self._host_lost)
        await self._patiently("prepare its session", self._prepare)
        await self._restore()
        if self._came_home:
            await self.note_hold()  # S35: the void host_lost hold lifted, durably, first
        self._opened = True

    async def run(self) -> None:
        try:
            await self.open()
            while self.ended is None:
                await self._step()
        finally:
            if not self._log.parked:
                with trio.CancelScope(shield=True):
                    await self._log.park()  # an ended (or stopped) lane holds no descriptor
            self._finished.set()
            self.changed()

    async def _step(self) -> None:
        state = self.kernel.state
        if state is TaskState.SUCCESS_INTENT and not self._held():
            await self._finalize()
            return
        if state in (TaskState.FAILED, TaskState.ABORTED, TaskState.DONE):
            await self._end(Ending(str(state)))
            return
        if state is TaskState.WAITING or self._held():
            await self.note_hold()  # every hold is durable before the lane parks (WD12)
            await self.end_recovery()  # a hold ends the running recovery; a resume starts one
            await self._log.park()
            self.changed()
            # a wake-up is taken once it is seen, never thrown away unseen: a resume asked
            # while the hold was being written (the task held, the lane not parked yet) is
            # answered, so it is found here; a stale one only costs a look (TL8)
            await self._wake.wait()
            self._wake = trio.Event()
            await self._log.unpark()
            if self._operator == "resume":
                self._operator = None
                if self.kernel.state is TaskState.SUCCESS_INTENT:
                    await self._retry_finalization()  # LK10: the worker is not needed
                else:
                    await self._relaunch_after_hold()
            return
        if self._restart_survivors is not None:  # TL12: never a second tree — whatever
            # launches next (the restart's replacement, or the epoch a reply wakes), the
            # previous epoch's tree the restart could not kill must be proven gone first
            await self.hold(_survivors(self._restart_survivors))
            return
        if self._restarted:  # TL7: a host restart replaced the worker
            self._restarted = False
            await self._replace("the runtime restarted and the previous worker is gone")
            if self._held():
                return
        holder = self.host.leaseholder(self.task)
        if holder is not None:  # TL13: never two live tasks in one worktree
            await self.hold(f"worktree_leased:{holder}")
            return
        await self._run_epoch()

    def _held(self) -> bool:
        return self.watchdog.classification is Classification.STALLED_OPERATOR_REQUIRED

    async def _prepare(self) -> None:
        def prepare() -> None:
            for path in (self.home, self.tmp, self.archive_dir, self.session.parent):
                path.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not self.session.exists() and self._lost is None:  # S32: never a new one
                create_session(
                    self.session,
                    cwd=str(self.worktree),
                    provider=str(self.task.route.get("provider", "")),
                    model_id=str(self.task.route.get("model", "")),
                    thinking_level=str(self.task.route.get("thinking_level", "off")),
                    clock=self.host.clocks.wall,
                )

        await trio.to_thread.run_sync(prepare)
        self._log.rebuild()

    def _make_journals(self, log: Log) -> tuple[DeliveryStepJournal, RecordingGateJournal]:
        """The lane's step and tool journals on ``log``, from every record it holds."""
        config = BoundaryConfig(
            upstream=self.host.upstream or GatewayConfig(upstream_url="http://127.0.0.1:9/v1"),
            granted=self._granted(),
            runtime_tools=self._runtime_tools(),
            socket_dir=self.host.store.root,
        )
        return make_journals(config, log, key=self.key, epoch=self.epochs)

    def gate_epoch(self) -> int:
        return self._log.journals()[1].epoch

    async def append(self, record: Record) -> int:
        """Append to the lane log (reopened first if the lane parked, TL9)."""
        return await self._log.append(record)

    async def _restore(self) -> None:
        """Rebuild the lane from its log (LK7, WD11, TL6): receipts, budget, markers, epochs."""
        state = read_lane(self.task, self._log.journal.contents.records, self.policy)
        self.actions, self.markers, self.replies = state.actions, state.markers, state.replies
        self.epochs, self.record, self.ended = state.epochs, state.record, state.ended
        unstarted = state.unstarted_launch()
        self.launching = None if unstarted is None else str(unstarted.detail["nonce"])
        self.kernel, self.attestation = state.kernel, state.attestation
        self.parks = _open_parks(self._log.journal.contents.records)
        self.recovery = Recovery(
            state.budget, state.continuations, state.recoveries, state.recovery_started_ms
        )
        if self.kernel.state is TaskState.WAITING:
            self.watchdog.feed(TerminalAccepted("wait"))
        # TL7: a worker that ran before the restart is replaced; when none ever ran (each
        # launch refused or cut before its start: L21's wait, a crash in the launch window)
        # there is nothing to replace, and the next epoch is a first one: the task itself
        ran = self.record is not None or any(
            a.kind == "launch" and a.state == "done" for a in self.actions.values()
        )
        if ran and self.ended is None and self.kernel.state is TaskState.OPEN:
            self._restarted = True
            self._fenced = True  # the dead host's epoch is superseded: its fence moves (LK2)
        self._settle_first = self.epochs > 0 and self.ended is None
        self._task_undelivered = not ran
        lost = self._lost
        last_boot = (
            unstarted.detail.get("boot_id")
            if unstarted is not None
            else (self.record.boot_id if self.record is not None else None)
        )
        foreign = self.moved_from is not None and last_boot not in (None, boot_id())
        if lost is not None or foreign:
            pass  # S32: nothing is killed here on a guess, nor counted quiescent (W5, LK4)
        elif self._last_epoch is not None and self.epochs > 0:
            stopped = await self._kill_last_epoch()
            if stopped.clean:
                self.quiescent_epoch = self._last_epoch  # nothing of it lives (LK4)
            else:
                self._restart_survivors = stopped.survivors
        elif self.epochs > 0 and state.launched_in_host(self.epochs) and self.moved_from is None:
            self.quiescent_epoch = self.epochs  # it lived in the host that died (LK4)
        if self._restarted and lost is None and not foreign:
            # TL5: a worker ran, but one that died before Pi wrote its first prompt in the
            # session never kept the task: its replacement's continuation carries it
            heard = await self._patiently(
                "read its session", lambda: prompt_in_session(self.session, wants=True)
            )
            self._task_undelivered = heard is False
        undelivered = await self._reply_undelivered(state.last_reply, state.reply_carrier)
        if undelivered is not False:
            assert state.last_reply is not None
            self.kernel.reply_pending = True
            self._reply_next(state.last_reply)
        self._recorded_hold = state.hold
        hold = state.hold or self._policy_problem  # WD14: never a task on a guessed policy
        if undelivered is None:  # LK8: nobody knows whether the worker kept the reply
            hold = hold or f"prompt_marker_unknown:{state.reply_carrier}"
        if self._came_home and state.hold == f"{HOST_LOST}{self.host.owner}":
            hold = self._policy_problem  # S35: home again, that hold is void (open lifts it)
        if lost is not None:
            hold = lost  # S32: first of all, the host it lived on is gone
        open_ = self.ended is None and not self.kernel.state.terminal
        unfinished = (  # LK10: an incomplete Done stays held across a restart too
            self.ended is None
            and self.kernel.state is TaskState.SUCCESS_INTENT
            and (state.hold or "").startswith(UNFINISHED)
        )
        if hold is not None and (open_ or unfinished):
            self.watchdog.feed(Hold(hold))  # WD12: a hold outlives the host

    async def _host_lost(self) -> str | None:
        """S32: the hold reason ``host_lost:<host>`` when this lane was claimed from another
        host whose lease ran out and its worktree or session is not here to resume from (no
        ``shared_worktrees``, or the session file is missing); ``None`` when it may resume.
        An epoch that lived on another host proves no quiescence here either way (LK4):
        its tree is stopped by that host's own deadline (S12), not by a kill from here."""
        moved = self.moved_from
        if moved is None:
            return None
        if self.host.shared_worktrees and await trio.to_thread.run_sync(self.session.is_file):
            return None
        return f"{HOST_LOST}{moved}"

    def _last_launch_elsewhere(self) -> str | None:
        """The host that launched the lane's last epoch, if not this one (as its launch
        says: a lane this host claimed over a lease that changed hands again meanwhile)."""
        mine = self.host.owner
        for record in reversed(self._log.journal.contents.records):
            if isinstance(record, OutboxAction) and record.kind == "launch":
                host = record.detail.get("host")
                return str(host) if mine is not None and host not in (None, mine) else None
        return None

    async def _reply_undelivered(self, reply: TaskReply | None, carrier: str | None) -> bool | None:
        """A reply is delivered once the prompt that carried it is in the session (LK8): a
        worker that was sent it and died before its turn began never kept it. ``None``: the
        session cannot say."""
        if reply is None or self.kernel.state is not TaskState.OPEN:
            return False
        if carrier is None:
            return True
        present = await self._patiently(  # (L21: a want of descriptors is waited out)
            "read its session", lambda: marker_in_session(self.session, carrier, wants=True)
        )
        return None if present is None else not present

    @property
    def _last_epoch(self) -> int | None:
        """The epoch a clean :meth:`_kill_last_epoch` proves quiescent: a launch with no
        start recorded, else the last epoch started; ``None`` when no record names a tree."""
        if self.launching is not None:
            return self.epochs
        return self.record.epoch if self.record is not None else None

    async def _kill_last_epoch(self) -> Stopped:
        """Whatever the last epochs left is killed before anything else runs (LK4, TL12): the
        one started, from its record (W7), and a launch a crash cut before its start, by the
        nonce its launch action journaled before the spawn (W13). Clean only when both are."""
        stopped = Stopped(True)
        if self.record is not None:
            stopped = await self._kill_leftovers(self.record)
        if self.launching is not None:
            try:
                report = await kill_launch_leftovers(self.launching)
            except PiRuntimeError:
                return Stopped(False, stopped.survivors)
            stopped = Stopped(
                stopped.clean and report.clean,
                stopped.survivors + report.survivors + report.undecided,
            )
        return stopped

    async def _kill_leftovers(self, record: EpochStarted) -> Stopped:
        """Whatever a recorded epoch left is killed from its record (the record's identity must
        match, W5) before the session is touched; clean when nothing of that epoch's tree is
        alive (its quiescence, LK4). A record that cannot be acted on proves nothing."""
        try:
            report = await kill_epoch_leftovers(record)
        except PiRuntimeError:
            return Stopped(False, (record.pid,))
        return Stopped(report.clean, report.survivors + report.undecided)

    # -- one epoch ---------------------------------------------------------------------------

    async def _run_epoch(self) -> None:
        number = self.epochs + 1
        if self._settle_first and self.kernel.may_begin():
            try:  # the dead host's worker may have left a call unanswered
                await self.patiently("settle its session", lambda: settle_session(self))
            except TaskClosed:  # (L21) its end decided, or it was held (WD11), while it
                return  # waited: nothing launches, and no epoch was begun
            self._settle_first = False
        if not self.kernel.begin_epoch(number, fenced=self._fenced):  # LK6, after the await
            return
        self._fenced = False
        self._replacing = False
        self.epochs = number
        launch = self.epoch_action_id("launch")  # TL6: no epoch number is ever used twice
        identity: dict[str, Any] = {  # LK2 keys, restored; in_host: whether it dies with it
            "epoch": number,
            "fence": self.kernel.fence,
            "in_host": self.host.workers.in_host,
        }
        if self.host.owner is not None:
            identity["host"] = self.host.owner  # S32: where it ran, for the next holder
        if not self.host.workers.in_host:  # W13: what names the tree until it has started
            identity["nonce"], identity["boot_id"] = new_nonce(), boot_id()
        await self.record_action(launch, "launch", "reserved", identity)
        self.launching = identity.get("nonce")
        try:
            await self._attest()
        except TaskClosed as closed:
            await self._not_launched(number, launch, identity, closed)
            return
        kind, text, action_id = self._next
        steps, tools = self._log.journals()
        request = EpochRequest(
            number=number,
            session=self.session,
            worktree=self.worktree,
            home=self.home,
            tmp=self.tmp,
            granted=self._granted(),
            runtime_tools=self._runtime_tools(),
            journals=(steps, tools),
            log=self._log.journal,
            started_ms=self.host.clocks.wall.time_ms,
            policy=StopPolicy(
                term_grace=self.policy.term_grace_seconds,
                kill_bound=self.policy.kill_bound_seconds,
            ),
            nonce=identity.get("nonce"),
        )
        end = EpochEnd.EXITED
        self._unprompted = None
        opened = False
        try:
            async with contextlib.AsyncExitStack() as stack:
                if self.kernel.state is not TaskState.OPEN:  # its end decided meanwhile
                    raise TaskClosed(ReasonCode.TASK_ENDED)
                worker = await self.patiently(  # L21: no descriptor: the same launch again
                    "launch its worker",
                    lambda: stack.enter_async_context(self.host.workers.open(request)),
                )
                opened = True
                self.worker = worker
                self.record = worker.record
                if worker.record is not None:
                    await self.append(worker.record)
                    self.launching = None  # the record names the tree from here (W7)
                await self.record_action(launch, "launch", "done", identity)
                try:
                    end = await EpochWatch(self, worker).run(kind, text, action_id)
                finally:
                    with trio.CancelScope(shield=True):
                        if end is EpochEnd.FENCE or end is EpochEnd.RESUME:
                            await self.record_action(
                                self.epoch_action_id("signal"), "signal", "reserved", {}
                            )
                        stopped = await worker.stop()
                        self.worker = None
        except TaskClosed as closed:  # never launched: ended or held as it waited (L21)
            if opened:
                raise
            await self._not_launched(number, launch, identity, closed)
            return
        except WorkerError as error:
            # The worker exited during its launch (W1): an exit before its prompt like any
            # other (TL2, WD8), not the lane's failure. Its tree was stopped on the way out
            # of ``open`` (W10), and a launch whose stop left a survivor raises
            # ``worker_tree_survived`` instead (W6), which stays the lane's failure (TL11).
            # (A launch refused for want of a file descriptor is tried again: L21.)
            if opened or error.code is not ReasonCode.WORKER_LAUNCH_FAILED:
                raise
            stopped = Stopped(True)
            failed = {**identity, "code": str(error.code)}
            await self.record_action(launch, "launch", "failed", failed)
            await self.exited_unprompted(error)
        clean = stopped.clean
        self.quiescent_epoch = number if clean else None
        reason = "fence" if end in (EpochEnd.FENCE, EpochEnd.RESUME) else str(end)
        await self.append(
            EpochFenced(epoch=number, reason=reason, fenced_ms=self.host.clocks.wall.time_ms())
        )
        await self.reply_recorded()  # LK8: a reply accepted as the epoch ended is seen below
        if end in (EpochEnd.FENCE, EpochEnd.RESUME):
            self._replacing = True  # a fenced worker is replaced, whatever holds first
            await self.record_action(
                self.epoch_action_id("signal"), "signal", "done", {"clean": clean}
            )
            await self.record_action(self.epoch_action_id("reap"), "reap", "done", {"clean": clean})
            self._fenced = True
            if not clean:
                await self.hold(_survivors(stopped.survivors))
                return
            await self._replace(
                "the worker was silent past the hard threshold and its grace"
                if end is EpochEnd.FENCE
                else "an operator resumed the task after a hold"
            )
        elif not clean and not self.kernel.state.terminal:  # TL12: never a second tree
            self._fenced = True
            await self.hold(_survivors(stopped.survivors))
        elif (
            self.kernel.state is TaskState.OPEN
            and self.pending_reply() is not None
            and self._unprompted is None  # (a worker that died before the reply: replaced)
        ):
            # LK8: the worker asked, the user answered before it stopped; the reply starts
            # the next epoch as a reply always does (not a replacement: not charged).
            self._fenced = True
            with contextlib.suppress(TaskClosed):  # (ended or held as it waited: L21)
                await self.patiently("settle its session", lambda: settle_session(self))
        elif end is EpochEnd.EXITED and self.kernel.state is TaskState.OPEN:
            self._fenced = True
            if self._held():  # WD8: the core held (an exit after the completion prompt)
                await self.note_hold()
                return
            await self._replace(
                "the worker exited without a terminal receipt"
                if self._unprompted is None
                else f"the worker exited before it answered its prompt ({self._unprompted})"
            )

    async def _attest(self) -> None:
        """TL4: the session the attempt owns, by path prefix — once, from the first epoch on;
        what it names durable before it is recorded (S15: Pi does not sync)."""
        if self.attestation is not None:
            return
        read = await self.patiently("read its session", lambda: aread_session(self.session))
        if read.session.leaf is None:
            return
        await self.patiently("sync its session", lambda: afsync_session(self.session))
        self.attestation = attest(read.session)
        await self.record_action(
            self.epoch_action_id("attest"), "attest", "done", msgspec.to_builtins(self.attestation)
        )

    async def _not_launched(
        self, number: int, launch: str, identity: dict[str, Any], closed: TaskClosed
    ) -> None:
        """Epoch ``number``'s launch, reserved, never made: the task's end was decided while
        it waited (L21, TL8), or its recovery's seconds ran out and it is held (WD11).
        Recorded failed with why, and ended; nothing ran, so nothing more is charged and the
        epoch is quiescent."""
        await self.record_action(launch, "launch", "failed", {**identity, "code": closed.code})
        self.quiescent_epoch = number
        await self.append(
            EpochFenced(epoch=number, reason=closed.code, fenced_ms=self.host.clocks.wall.time_ms())
        )

    async def patiently(self, what: str, work: Callable[[], Awaitable[_T]]) -> _T:
        """``work()`` — a step before the epoch's worker runs, which can be taken again as it
        is — tried again while the process (or the system) has no file descriptor left
        (L21): said with the stable code, after a wait that doubles (the lane's
        :class:`DescriptorWait`), charged nothing. The wait ends early for an operator's
        control; once the task is not open any more (an end decided) it raises
        :class:`TaskClosed` instead of trying again. A running recovery bounds it (WD11):
        the wait ends as the recovery's seconds run out, and then the task is held
        ``budget_exhausted:recovery_seconds`` and :class:`RecoveryOverdue` is raised."""

        async def pause(refused: BaseException, delay: float) -> None:
            due = self.recovery.due_in(self.wall_ms())
            delay = delay if due is None else max(0.0, min(delay, due))
            self._waiting(refused, what, delay)
            with trio.move_on_after(delay):
                await self._wake.wait()
            if self._wake.is_set():  # taken: the next want waits again (the request, if
                self._wake = trio.Event()  # any, is the task's state, looked at below)
            if self.kernel.state is not TaskState.OPEN:
                raise TaskClosed(ReasonCode.TOO_MANY_OPEN_FILES) from refused
            if self.recovery.overdue(self.wall_ms()):  # read after the wait (WD11)
                await self.hold(RECOVERY_SPENT)
                raise RecoveryOverdue from refused

        return await patiently(work, self._descriptors, pause)

    async def _patiently(self, what: str, work: Callable[[], Awaitable[_T]]) -> _T:
        """:meth:`patiently` for the lane's opening, before its task is restored: waited out
        whatever comes (its end is looked at once it is open)."""
        pause = sleeping(lambda error, delay: self._waiting(error, what, delay))
        return await patiently(work, self._descriptors, pause)

    def _waiting(self, error: BaseException, what: str, delay: float) -> None:
        """Say a want of descriptors, with its stable code (L21)."""
        code = ReasonCode.TOO_MANY_OPEN_FILES
        detail = str(getattr(error, "strerror", None) or error).removeprefix(f"{code}: ")
        self.host.log(
            f"task {self.task_id}: could not {what} for want of a file descriptor, it tries "
            f"again in {delay:.2f}s ({code}): {detail}"
        )

    # -- what an epoch's watch uses (runtime/_tasks/_epoch.py) -------------------------------------

    def prompted(self) -> None:
        """The epoch's prompt is sent: the next one is decided anew, and silence counts from
        now (WD1)."""
        self._next = ("none", "", None)
        self._undelivered = None  # every prompt carries a pending reply (LK8)
        self._task_undelivered = False  # and the task, if no worker answered it yet
        self.kernel.reply_pending = False
        self.watchdog.feed(Prompted(*self.readings()))
        self.telemetry.request_started = self.now()
        self.changed()

    async def operator_request(self) -> str | None:
        """Wait for the next wake-up (a reply, a grant, a control); the operator's request it
        carries (``"terminal"``, ``"resume"``), taken, or ``None``."""
        await self._wake.wait()
        self._wake = trio.Event()
        request, self._operator = self._operator, None
        return request

    async def exited_unprompted(self, error: PiRuntimeError) -> None:
        """The epoch's worker exited before it answered its first prompt — during its launch
        (``worker_launch_failed``) or at its start — which is an exit like any other (WD8,
        TL2): the watchdog is told, the error's own code is logged, and the lane replaces
        the worker within the budget (WD11) with a continuation that carries what that
        prompt carried. Never the lane's failure (TL11)."""
        self._unprompted = str(error.code)
        self.host.log(  # (the error's text begins with its code)
            f"task {self.task_id}: the worker of epoch {self.epochs} exited before it answered "
            f"its prompt, so it is replaced: {error}"
        )
        self.watchdog.feed(Exited())
        await self.note_hold()  # durable before anyone sees it (WD12)
        self.changed()

    async def resumed_progress(self) -> None:
        """Any progress of the worker: the first after a relaunch ends the recovery (WD11),
        whatever the watchdog has called the worker since (a probe's answer or a hold can
        move it out of ``Resuming`` first)."""
        if not self.recovery.first_progress():
            return
        seconds = await self.end_recovery()
        if seconds is not None:
            self.telemetry.resumed(seconds)

    async def end_recovery(self) -> float | None:
        """Charge the running recovery's time, durably, never refunded (WD11)."""
        detail = self.recovery.end(self.host.clocks.wall.time_ms())
        if detail is None:
            return None
        number = self.recovery.recoveries
        with trio.CancelScope(shield=True):  # charged in memory: written whole (WD11)
            await self.record_action(self.ids.recovery(number), "recovery_time", "done", detail)
        return float(detail["seconds"])

    async def recovery_resumes(self) -> None:
        """A relaunched worker that waited out an unavailable provider before its first
        prompt (PB6) is prompted now: the recovery that wait ended (its time is the
        outage's, never charged) runs again from here until the worker's first progress
        (WD11), its start durable. Nothing when the worker progressed already, or no
        recovery was waiting."""
        if self.recovery.awaiting_progress:
            await self.start_recovery()

    async def start_recovery(self) -> None:
        """Start a recovery that no reserve starts — an operator's resume on a reserve
        charged before, the prompt after a park — durably (WD11): a ``recovery_start``
        action, so a host restart counts on from it as from a reserve's ``at_ms`` and never
        resets the clock. Nothing when a recovery runs already."""
        detail = self.recovery.start(self.wall_ms())
        if detail is None:
            return
        number = self.recovery.recoveries + 1
        with trio.CancelScope(shield=True):  # started in memory: written whole (WD11)
            await self.record_action(
                self.ids.recovery_start(number), "recovery_start", "done", detail
            )

    def check_recovery_budget(self) -> None:
        """A recovery that outlasts the seconds left holds the task (WD11)."""
        if self.watchdog.classification is not Classification.RESUMING:
            return
        if self.recovery.overdue(self.host.clocks.wall.time_ms()):
            self.watchdog.feed(Hold(RECOVERY_SPENT))

    async def reserve(self) -> bool:
        """Charge one replacement epoch before its launch, once (WD11, TL6); whether this
        started the recovery (none ran, and this reserve is new). One reserve at a time per
        lane, from its look for a reserve recorded to its write: a second one — a guard
        check's and an operator's resume at once — waits for the first's write, meets its
        reserve and reuses it (before, it looked while the first's write was under way,
        found nothing recorded and charged the next continuation: two epochs for one).
        A write that fails (not a cancel: a disk that refuses it) makes no charge: memory is
        the log again, the task holds ``budget_unrecorded:<code>`` and
        :class:`ChargeUnrecorded` is raised — nothing may be fenced or launched on a charge
        the log, which a restart counts, does not hold. A log that takes no hold either (a
        file store's, poisoned by that failed write) fails the lane (TL11) instead."""
        async with self._reserving:
            action_id = self.ids.next_continuation(
                self.recovery.continuations, "reserve", self.actions, self.markers
            )
            if action_id in self.actions:
                return False
            starts = self.recovery.started_ms is None
            saved = self.recovery.saved()
            detail = self.recovery.charge_epoch(self.host.clocks.wall.time_ms())
            # charged in memory now (one reserve at a time: the next sees it), so written
            # whole whoever cancels the caller (WD11): cut at the write's first checkpoint (a
            # log's lock), the charge stood in memory alone — the next reserve charged again
            # under the next continuation's id, and a restart counted one
            try:
                with trio.CancelScope(shield=True):
                    await self.record_action(action_id, "reserve", "done", detail)
            except (OSError, JournalError) as error:
                self.recovery.restore(saved)  # never recorded: not charged, memory is the log
                if fenced_out(error):  # S31: the lane is another host's now, nothing to hold
                    raise
                code = str(error.code) if isinstance(error, JournalError) else _errno_code(error)
                self.host.log(
                    f"task {self.task_id}: the reserve {action_id} could not be written, so "
                    f"nothing is charged and the task is held ({code}): {error}"
                )
                # held durably, or — a log that accepts no more records (poisoned by the
                # failed write, J15) — the hold's own write raises and the lane fails (TL11):
                # closed either way, and the budget shown is the one a restart counts
                await self.hold(f"{BUDGET_UNRECORDED}{code}")
                raise ChargeUnrecorded(str(error)) from error
        TASK_BUDGET_CHARGES.inc()
        return starts

    def unsettled_effects(self) -> list[ToolIntent]:
        """Tools let run whose outcome is not recorded and whose running again is not proven
        harmless: a side effect that may have happened (WD10, WD13). Proven harmless are a
        ``safe`` tool (read-only or idempotent), a lifecycle tool (the kernel consumes its
        intent once, LK3) and a runtime tool backed by a receipt (the gate replays its
        receipt). Anything else — a ``never`` tool of the worker or of the runtime — is not."""
        runtime_tools = self._runtime_tools()

        def proven(intent: ToolIntent) -> bool:
            if intent.replay_class is ReplayClass.SAFE or intent.name in LIFECYCLE_TOOLS:
                return True
            return intent.replay_class is ReplayClass.RECEIPT and intent.name in runtime_tools

        return [i for i in self._log.journals()[1].unsettled() if not proven(i)]

    async def _replace(self, observed: str, *, forced: bool = False) -> None:
        """Prove and queue the next worker's continuation, or hold (``_replacement.py``)."""
        self._replacing = True  # until an epoch launches (a resume of its hold replaces too)
        reply = self._undelivered.text if self._undelivered is not None else None
        task = self.task.prompt if self._task_undelivered else None
        queued = await prepare_replacement(self, observed, forced=forced, reply=reply, task=task)
        if queued is not None:
            prompt, action_id = queued
            self._next = ("continuation", prompt, action_id)

    async def route_problem(self) -> str | None:
        """Why the next worker would not continue the task's own session on its own route
        (TL4, TL13), as a hold reason; None when every part is attested."""
        try:
            return await route_problem(self)
        except OSError:  # a want of descriptors (L21): the session is not read, so unproven
            return "session_unreadable"

    def journals(self) -> tuple[DeliveryStepJournal, RecordingGateJournal]:
        return self._log.journals()

    def _reply_next(self, reply: TaskReply) -> None:
        """The next prompt is the user's reply (LK8)."""
        self._undelivered = reply
        action_id = self.ids.reply(len(self.replies))
        self._next = ("reply", reply_prompt(action_id, reply.text), action_id)

    def pending_reply(self) -> tuple[str, str] | None:
        """(action id, prompt) of the user's reply not yet sent to the worker (LK8)."""
        kind, text, action_id = self._next
        if kind != "reply" or action_id is None or not self.kernel.reply_pending:
            return None
        return action_id, text

    async def _relaunch_after_hold(self) -> None:
        """An operator's resume of a held task whose worker is gone (TL8). A tree that was
        not proven gone must be proven gone now (TL12): the kill is tried again from the
        epoch's record, and without that proof the task stays held."""
        reason = self.watchdog.hold_reason or ""
        if reason.startswith(HOST_LOST) and not await trio.to_thread.run_sync(self.session.is_file):
            self.host.log(  # S32: never a new session in place of the task's own
                f"task {self.task_id} stays held ({reason}): its session {self.session} is "
                "not on this host; bring it (and the worktree) here, or end the task"
            )
            self.watchdog.feed(Hold(reason))
            return
        if not await self._survivors_gone():
            return
        if self.kernel.state is TaskState.WAITING:
            # LK5, WD11: a waiting task is woken by its reply, never by a continuation — the
            # hold is lifted and the task waits again; no worker is launched, so nothing is
            # charged (the reply's epoch is no replacement, TL9)
            self.watchdog.feed(TerminalAccepted("wait"))
            await self.note_hold()
            self.changed()
            return
        if (
            reason.startswith("survivors:")  # (a reply whose carrier is unknown is not: TL5)
            and self.pending_reply() is not None
            and not self._replacing
            and not self._restarted
            and self._unprompted is None
        ):
            # TL9, WD11: the worker asked and stopped, and the user's reply came while the
            # task was held (WD12: it lifted nothing). Nothing is replaced: the hold is
            # lifted, the task is woken by its reply as if the resume had come first, and
            # the next epoch is the reply's — its own prompt, uncharged
            self.watchdog.feed(TerminalAccepted("wait"))
            self.watchdog.feed(Woken())
            await self.note_hold()
            with contextlib.suppress(TaskClosed):  # (ended or held as it waited: L21)
                await self.patiently("settle its session", lambda: settle_session(self))
            self.changed()
            return
        self._restarted = False  # the resume is the replacement a restart would have made
        self.watchdog.classification = Classification.RESUMING
        await self.note_hold()  # the operator lifted the hold (WD12)
        await self._replace("an operator resumed the task after a hold", forced=True)

    @property
    def breaker(self) -> RouteBreaker | None:
        return self.host.breaker

    async def park(self, record: Parked) -> None:
        """A turn waits out an unavailable provider (PB6), durably: a restart finds the
        schedule in the lane log and waits for the rest of it."""
        await self.append(record)
        self.parks.append(record)
        self.changed()

    def answered(self) -> None:
        """The provider answered: the backoff's episode is over (PB6)."""
        self.parks.clear()

    async def record_marker(self, action_id: str) -> None:
        """The continuation ``action_id`` is in the session (TL5)."""
        record = ContinuationSent(
            epoch=self.epochs,
            action_id=action_id,
            marker=continuation_marker(action_id),
            prompt_version=CONTINUATION_VERSION,
        )
        await self.append(record)
        self.markers[action_id] = record
        TASK_CONTINUATIONS.inc()

    # -- the end: Done needs the whole tuple (LK4) ----------------------------------------------

    async def _finalize(self) -> None:
        """Done with the whole tuple (LK4); an incomplete one holds, with what it found
        recorded, for the operator to retry or end (LK10) — never an end of its own."""
        ending = await conclude(
            self.kernel,
            self.task,
            archive_dir=self.archive_dir,
            quiescent_epoch=self.quiescent_epoch,
        )
        if ending.state != "held":
            await self._end(ending)
            return
        number = 1 + sum(a.kind == "finalize" for a in self.actions.values())
        found = {
            "code": ending.code,
            "detail": ending.detail,
            "manifest": ending.manifest,
            "candidate": ending.candidate,
            "validation": ending.validation,
        }
        await self.record_action(self.ids.finalize(number), "finalize", "done", found)
        missing = ending.detail.removeprefix("missing: ").replace(" ", "")
        shown = missing if ending.code == ReasonCode.TASK_NOT_DONE else str(ending.code)
        await self.hold(f"{UNFINISHED}{shown}")
        self.host.log(f"task {self.task_id} not done ({ending.code}): {ending.detail}")

    async def _survivors_gone(self) -> bool:
        """TL12: a tree a restart could not kill is killed again from the epoch's record
        first, whatever the hold the operator resumes (one the log recorded before the host
        died stands over it). Without the proof the task holds ``survivors:<pids>`` again
        (``False``); with it that epoch is quiescent (LK4)."""
        reason = self.watchdog.hold_reason or ""
        if not reason.startswith("survivors:") and self._restart_survivors is None:
            return True
        stopped = (
            await self._kill_last_epoch() if self._last_epoch is not None else Stopped(False, ())
        )
        if not stopped.clean:
            known = self._restart_survivors or _pids(reason)
            await self.hold(_survivors(stopped.survivors or known))
            return False
        self.quiescent_epoch = self._last_epoch
        self._restart_survivors = None
        return True

    async def _retry_finalization(self) -> None:
        """The operator's resume of an incomplete Done: take the tuple again (LK10) — after
        proving gone a tree the restart could not kill (TL12), which is its quiescence."""
        if not await self._survivors_gone():
            return
        self.watchdog.feed(TerminalAccepted("done"))  # the success intent, unheld
        await self.note_hold()
        self.changed()

    async def _end(self, ending: Ending) -> None:
        log = await self.host.store.read(self._log.journal.rel)  # ours and the gateway's
        now = self.host.clocks.wall.time_ms()
        self.ended = end_record(ending, self.kernel.terminal, log.records, ended_ms=now)
        await self.append(self.ended)
        self.host.log(f"task {self.task_id} ended {ending.state}")

    # -- runtime tools (lifecycle through the gate, LK7) ----------------------------------------

    def _granted(self) -> frozenset[str]:
        return frozenset(self.task.grants) | frozenset(LIFECYCLE_TOOLS)

    def _runtime_tools(self) -> dict[str, RuntimeTool]:
        tools = lifecycle_tools(self)
        if self.host.receipts is not None:
            tools.update(DocumentTools(self.host.receipts).handlers())
        if self.host.ledger is not None:
            tools["effect"] = EffectLedger(self.host.ledger)
        return {n: t for n, t in tools.items() if n in self._granted()}

    # -- small helpers ---------------------------------------------------------------------------

    async def hold(self, reason: str) -> None:
        """Hold the task for an operator, durably (WD12)."""
        self.watchdog.feed(Hold(reason))
        await self.note_hold()
        self.changed()

    async def note_hold(self) -> None:
        """Make the watchdog's hold — or that no hold stands any more — durable (WD12): a
        restarted host keeps a hold until an operator's action (or progress) lifts it."""
        reason = self.watchdog.hold_reason if self._held() else None
        if reason == self._recorded_hold:
            return
        recorded = sum(a.kind in ("hold", "unhold") for a in self.actions.values())
        number = 1 + recorded + self._holds_in_flight  # one in flight has its number already
        kind, shown = ("hold", reason) if reason is not None else ("unhold", self._recorded_hold)
        self._recorded_hold = reason
        self._holds_in_flight += 1
        try:
            await self.record_action(self.ids.hold(number), kind, "done", {"reason": shown})
        finally:
            self._holds_in_flight -= 1
        if reason is not None:
            # WD11: a hold ends the running recovery — also one that holds a live worker
            # (its recovery seconds spent, say), not only when the lane parks: its seconds
            # are charged now, so the budget guard sees them, and an operator's resume starts
            # a recovery of its own instead of handing the overdue one to the next worker
            await self.end_recovery()

    async def record_action(
        self, action_id: str, kind: str, state: str, detail: dict[str, Any] | None = None
    ) -> None:
        """One outbox action, durable (TL6); the same id and state twice is written once."""
        existing = self.actions.get(action_id)
        if existing is not None and existing.state == state:
            return
        record = OutboxAction(action_id=action_id, kind=kind, state=state, detail=detail or {})
        self.pending_action = action_id if state == "reserved" else None
        await self.append(record)
        self.actions[action_id] = record

    def epoch_action_id(self, kind: str) -> str:
        """The id of this epoch's action ``kind`` (TL6)."""
        return self.ids.epoch(self.epochs, kind)

    def now(self) -> float:
        return self.host.clocks.silence.read().boottime

    def wall_ms(self) -> int:
        return self.host.clocks.wall.time_ms()

    def readings(self) -> tuple[float, float]:
        reading = self.host.clocks.silence.read()
        return reading.boottime, reading.monotonic

    def changed(self) -> None:
        self.host.on_change(self)


UNFINISHED = "finalization_incomplete:"
HOST_LOST = "host_lost:"


def recorded_hold(records: Sequence[Record]) -> str | None:
    """The hold a lane log says stands: the reason of its last ``hold`` action, unless an
    ``unhold`` came after it (WD12)."""
    for record in reversed(records):
        if isinstance(record, OutboxAction) and record.kind in ("hold", "unhold"):
            return str(record.detail.get("reason")) if record.kind == "hold" else None
    return None


"""The hold of a task claimed from a host whose lease ran out, that cannot resume here (S32)."""
"""The prefix of the hold an incomplete Done takes (LK10)."""


def _open_parks(records: Sequence[Record]) -> list[Parked]:
    """The parks after the last model response a lane log holds (PB6): the episode a restart
    resumes (an answer since ended the one before)."""
    parks: list[Parked] = []
    for record in records:
        if isinstance(record, ModelResponse):
            parks.clear()
        elif isinstance(record, Parked):
            parks.append(record)
    return parks


def _errno_code(error: OSError) -> str:
    """A stable word for a write's ``OSError``: ``disk_failed``, or the errno's name."""
    if error.errno == errno.EIO or error.errno is None:
        return str(ReasonCode.DISK_FAILED)
    return errno.errorcode.get(error.errno, str(ReasonCode.DISK_FAILED)).lower()


def _survivors(pids: tuple[int, ...]) -> str:
    """The hold reason of a tree that could not be proven gone (TL12)."""
    return "survivors:" + (",".join(map(str, pids)) or "unknown")


def _pids(reason: str) -> tuple[int, ...]:
    """The pids a ``survivors:`` hold names."""
    return tuple(int(p) for p in reason.removeprefix("survivors:").split(",") if p.isdigit())
