"""Task lanes: one coding task run by a supervised worker until an explicit receipt (brief §6).

A :class:`TaskLane` owns one task: its log (``lanes/<hash>/lane.log``: the submission, model
steps, tool intents and outcomes, epochs, lifecycle receipts, outbox actions, continuations),
its Pi session, its worktree. Each process epoch runs inside ``async with workers.open(…)``
in the lane's task, so leaving that block — for a terminal, an exit or a fence — stops the
whole tree (TERM, bounded KILL, reap) before anything else happens.

The decisions are the pure cores': :class:`~runtime._watchdog.Watchdog` (classification and
clocks), :class:`~runtime._lifecycle.LifecycleKernel` (first terminal wins, the Done tuple),
:mod:`runtime._guards` (fencing guards, budget). This shell feeds them the worker's events and
the suspend-aware clock every tick, and carries out their actions: a read-only probe, a guard
check, a fence and a same-session resume, a completion prompt. The invariants (WD…, LK…,
TL…) are in ``docs/design/watchdog.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import trio

from ._boundary import BoundaryConfig, make_journals, settle_session
from ._clock import Clocks
from ._errors import PiRuntimeError, ReasonCode
from ._gate import GateCall, GateResult, RecordingGateJournal
from ._gateway import DeliveryStepJournal, GatewayConfig
from ._guards import Budget, GuardEvidence, failed_guards
from ._journal import Journal
from ._launch import ModelRoute
from ._lifecycle import DoneEvidence, LifecycleKernel, Report, TaskState, Verdict, done_missing
from ._receipts import ReceiptStore
from ._records import (
    ContinuationSent,
    EpochFenced,
    EpochStarted,
    LifecycleKind,
    LifecycleReceipt,
    OutboxAction,
    Record,
    ReplayClass,
    TaskEnded,
    TaskReply,
    TaskSubmitted,
    ToolIntent,
)
from ._rpc import Event, RpcError
from ._session import (
    Attestation,
    SessionWriter,
    aread_session,
    atruncate_torn_tail,
    attest,
    contains_path,
    create_session,
)
from ._store import Store, lane_key
from ._task_workers import EpochRequest, TaskWorker, WorkerFactory
from ._tools import DocumentTools, EffectLedger, RuntimeTool
from ._watchdog import (
    ACTION_TABLE,
    Action,
    CheckGuards,
    Classification,
    Exited,
    FenceStarted,
    GuardsFailed,
    Hold,
    Lease,
    LeaseEnded,
    Phase,
    Probe,
    ProbeAnswered,
    Progress,
    PromptCompletion,
    Prompted,
    Relaunched,
    Settled,
    TerminalAccepted,
    Tick,
    Watchdog,
    WatchdogPolicy,
    Woken,
)
from ._worker import StopPolicy

__all__ = [
    "CONTINUATION_VERSION",
    "TaskError",
    "TaskHost",
    "TaskLane",
    "TaskSpec",
    "TaskView",
    "continuation_prompt",
]

CONTINUATION_VERSION: Final = 1
"""The version of the one neutral continuation prompt (its marker carries it)."""
LIFECYCLE_TOOLS: Final = ("task_done", "task_fail", "task_wait")
DEFAULT_TASK_GRANTS: Final = frozenset({"read", "bash", "edit", "write"})
_TASK_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
_KIND_OF_TOOL: Final = {
    "task_done": LifecycleKind.DONE,
    "task_fail": LifecycleKind.FAIL,
    "task_wait": LifecycleKind.WAIT,
}


class TaskError(PiRuntimeError):
    """A task request refused, with a stable reason code."""


def continuation_prompt(action_id: str, observed: str) -> str:
    """The one versioned, neutral continuation prompt (TL5): a bounded observed fact, the
    absence of a terminal receipt, what to inspect, what not to repeat, what to call. Its
    first line is the marker that makes it idempotent; its wording is guidance, never proof."""
    return (
        f"[pi-runtime continuation v{CONTINUATION_VERSION} {action_id}]\n"
        f"Observed: {observed}. No terminal receipt (task_done, task_fail or task_wait) has "
        "been recorded for this task.\n"
        "Before acting, inspect this session, the worktree, the task above and every tool "
        "result. Do not repeat a side effect that may already have happened: a result saying "
        "a tool possibly ran means check first.\n"
        "Then finish the task and call exactly one of task_done, task_fail or task_wait."
    )


class TaskSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A task as submitted (API, command line, wire)."""

    task_id: str
    prompt: str
    worktree: str
    grants: frozenset[str] = DEFAULT_TASK_GRANTS
    validation: tuple[str, ...] = ()
    """A command (argv) whose passing receipt Done needs; empty: none."""


class TaskView(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``pi-runtime task show`` prints (seed 002's diagnostics list)."""

    task_id: str
    state: str
    generation: int
    attempt: int
    fence: int
    process_epoch: int
    continuation_epoch: int
    session_path: str
    session_id: str | None
    route: dict[str, Any]
    worktree: str
    process: dict[str, Any] | None
    """pid, start time, boot id, nonce of the live epoch."""
    classification: str
    phase: str
    progress_seq: int
    silence_seconds: float
    soft_seconds: float
    probe: str | None
    hard_seconds: float | None
    grace_seconds: float
    grace: str
    receipts: list[dict[str, Any]]
    prompt_marker: str | None
    budget: dict[str, Any]
    pending_action: str | None
    hold_reason: str | None
    next_action: str
    timescale: float
    telemetry: dict[str, Any]
    ended: dict[str, Any] | None = None


@dataclass
class TaskHost:
    """What every task lane needs from its runner."""

    store: Store
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
    log: Callable[[str], None] = lambda line: None


class _End(enum.StrEnum):
    TERMINAL = "terminal"
    EXITED = "exited"
    FENCE = "fence"
    RESUME = "operator_resume"


@dataclass
class _Telemetry:
    ttft: list[float] = field(default_factory=list)
    max_gap: float = 0.0
    resume_latency: list[float] = field(default_factory=list)
    probes: int = 0

    def as_dict(self, watchdog: Watchdog) -> dict[str, Any]:
        return {
            "ttft_seconds": [round(t, 3) for t in self.ttft[-10:]],
            "max_inter_token_gap_seconds": round(self.max_gap, 3),
            "false_suspects": watchdog.false_suspects,
            "suspicions": watchdog.suspicions,
            "probes": self.probes,
            "resume_latency_seconds": [round(t, 3) for t in self.resume_latency],
        }


class TaskLane:
    """One task; the runner starts :meth:`run` in its own task."""

    def __init__(self, host: TaskHost, submitted: TaskSubmitted, log: Journal) -> None:
        self.host = host
        self.task = submitted
        self.task_id = submitted.task_id
        self.key = lane_key(f"task:{submitted.task_id}")
        self.log = log
        self.session = host.store.root / submitted.session_path
        self.worktree = Path(submitted.worktree)
        base = host.work_root or host.store.root / "work"
        self.home = base / "homes" / self.key
        self.tmp = base / "tmp" / self.key
        self.archive_dir = host.store.root / "candidates"
        self.kernel = LifecycleKernel(
            submitted.task_id, generation=submitted.generation, attempt=submitted.attempt
        )
        self.watchdog = Watchdog(policy=host.policy)
        policy = host.policy
        self.budget = Budget(
            max_epochs=policy.max_replacements, max_seconds=policy.recovery_seconds
        )
        self.epochs = 0
        self.continuations = 0
        self.actions: dict[str, OutboxAction] = {}
        self.markers: dict[str, ContinuationSent] = {}
        self.replies: dict[str, TaskReply] = {}
        self.ended: TaskEnded | None = None
        self.failure: BaseException | None = None
        """Why the lane's task stopped without an end (a bug, a broken disk), if it did."""
        self.worker: TaskWorker | None = None
        self.record: EpochStarted | None = None
        self.attestation: Attestation | None = None
        self.quiescent_epoch: int | None = None
        self.probe_result: str | None = None
        self.pending_action: str | None = None
        self.telemetry = _Telemetry()
        self._wake = trio.Event()
        self._operator: str | None = None
        self._restarted = False
        self._fenced = False
        self._next: tuple[str, str, str | None] = ("task", submitted.prompt, None)
        """(kind, text, continuation action id) of the next prompt."""
        self._pending: list[Record] = []
        """Records to append at the next tick (noted where no await is possible)."""
        self._parked = False
        """The log is closed and the journals dropped (TL9); reopened on the next append."""
        self._steps: DeliveryStepJournal | None = None
        self._tools: RecordingGateJournal | None = None
        self._finished = trio.Event()
        self._recovery_started_ms: int | None = None
        self._probe_seq = 0
        self._eligible: tuple[int, int] | None = None
        self._last_token: float | None = None
        self._request_started: float | None = None

    # -- the runner's view ---------------------------------------------------------------

    @property
    def finished(self) -> trio.Event:
        return self._finished

    def view(self) -> TaskView:
        """A frozen snapshot of everything the diagnostics show."""
        wd = self.watchdog
        now = self._now()
        hard = wd.hard_threshold()
        grace = "not started" if wd.grace_started_awake is None else "running"
        if wd.classification is Classification.HARD_RESUME_ELIGIBLE:
            grace = "elapsed"
        record = self.record
        process = None
        if record is not None and self.worker is not None:
            process = {
                "pid": record.pid,
                "start_time": record.start_time,
                "boot_id": record.boot_id,
                "nonce": record.nonce,
            }
        last_marker = next(reversed(self.markers.values()), None)
        budget = self.budget
        return TaskView(
            task_id=self.task_id,
            state=str(self.kernel.state),
            generation=self.kernel.generation,
            attempt=self.kernel.attempt,
            fence=self.kernel.fence,
            process_epoch=self.epochs,
            continuation_epoch=self.continuations,
            session_path=self.task.session_path,
            session_id=self.attestation.session_id if self.attestation else None,
            route=dict(self.task.route),
            worktree=self.task.worktree,
            process=process,
            classification=str(wd.classification),
            phase=str(wd.phase),
            progress_seq=wd.progress_seq,
            silence_seconds=round(wd.silence(now), 3) if wd.armed else 0.0,
            soft_seconds=self.host.policy.soft_seconds,
            probe=self.probe_result,
            hard_seconds=hard,
            grace_seconds=self.host.policy.grace_seconds,
            grace=grace,
            receipts=[msgspec.to_builtins(r) for r in self.kernel.receipts],
            prompt_marker=last_marker.marker if last_marker else None,
            budget=budget.as_dict(),
            pending_action=self.pending_action,
            hold_reason=wd.hold_reason,
            next_action=self._next_action(),
            timescale=self.host.policy.timescale,
            telemetry=self.telemetry.as_dict(wd),
            ended=msgspec.to_builtins(self.ended) if self.ended else None,
        )

    def _next_action(self) -> str:
        if self.ended is not None:
            return "none: the task has ended"
        if self.kernel.state is TaskState.WAITING:
            return ACTION_TABLE[Classification.WAITING_USER]
        return ACTION_TABLE[self.watchdog.classification]

    # -- operator controls (TL8) -----------------------------------------------------------

    async def reply(self, text: str, correlation: str | None = None) -> Verdict:
        verdict = self.kernel.reply(correlation)
        if verdict is Verdict.ACCEPTED:
            assert True
            wait = self.kernel.receipts[-1] if self.kernel.receipts else None
            corr = correlation or (wait.intent_id if wait is not None else "")
            record = TaskReply(correlation=corr, text=text)
            await self._append(record)
            self.replies[corr] = record
            self.watchdog.feed(Woken())
            self._next = ("reply", text, None)
            self._wake.set()
        return verdict

    async def abort(self, reason: str) -> Verdict:
        return await self._operator_report(LifecycleKind.ABORT, reason)

    async def fail(self, reason: str) -> Verdict:
        return await self._operator_report(LifecycleKind.OPERATOR_FAIL, reason)

    async def _operator_report(self, kind: LifecycleKind, reason: str) -> Verdict:
        intent = f"operator:{kind}:{len(self.kernel.receipts)}"
        verdict = self.kernel.report(
            Report(key=self.kernel.operator_key(), intent_id=intent, kind=kind, detail=reason)
        )
        await self._append(self.kernel.receipts[-1])
        if verdict is Verdict.ACCEPTED:
            self.watchdog.feed(TerminalAccepted(str(kind)))
            self._operator = "terminal"
            self._wake.set()
            self._changed()
        return verdict

    async def grant(self, *, epochs: int, seconds: float, reason: str) -> Budget:
        """An audited manual grant (WD11): recorded before it counts."""
        granted = self.budget.grant(epochs=epochs, seconds=seconds)
        action_id = f"{self._prefix()}/grant{len(self.actions)}"
        await self._action(
            action_id, "grant", "done", {"epochs": epochs, "seconds": seconds, "reason": reason}
        )
        self.budget = granted
        self._wake.set()
        return granted

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

    async def run(self) -> None:
        try:
            await self._prepare()
            await self._restore()
            while self.ended is None:
                await self._step()
        finally:
            if not self._parked:
                with trio.CancelScope(shield=True):
                    await self._park()  # an ended (or stopped) lane holds no descriptor
            self._finished.set()
            self._changed()

    async def _step(self) -> None:
        state = self.kernel.state
        if state is TaskState.SUCCESS_INTENT:
            await self._finalize()
            return
        if state in (TaskState.FAILED, TaskState.ABORTED, TaskState.DONE):
            await self._end(str(state))
            return
        if state is TaskState.WAITING or self._held():
            self._wake = trio.Event()
            await self._park()
            self._changed()
            await self._wake.wait()
            await self._unpark()
            if self._operator == "resume":
                self._operator = None
                await self._relaunch_after_hold()
            return
        if self._restarted:  # TL7: a host restart replaced the worker
            self._restarted = False
            await self._replacement("the runtime restarted and the previous worker is gone")
            if self._held():
                return
        await self._run_epoch()

    def _held(self) -> bool:
        return self.watchdog.classification is Classification.STALLED_OPERATOR_REQUIRED

    async def _prepare(self) -> None:
        def prepare() -> None:
            for path in (self.home, self.tmp, self.archive_dir, self.session.parent):
                path.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not self.session.exists():
                create_session(
                    self.session,
                    cwd=str(self.worktree),
                    provider=str(self.task.route.get("provider", "")),
                    model_id=str(self.task.route.get("model", "")),
                    clock=self.host.clocks.wall,
                )

        await trio.to_thread.run_sync(prepare)
        self._make_journals()

    def _make_journals(self) -> None:
        """The lane's step and tool journals on its log, from every record it holds."""
        config = BoundaryConfig(
            upstream=self.host.upstream or GatewayConfig(upstream_url="http://127.0.0.1:9/v1"),
            granted=self._granted(),
            runtime_tools=self._runtime_tools(),
            socket_dir=self.host.store.root,
        )
        self._steps, self._tools = make_journals(config, self.log, key=self.key, epoch=self.epochs)

    async def _append(self, record: Record) -> int:
        """Append to the lane log, reopening it first if the lane parked (TL9)."""
        if self._parked:
            await self._unpark()
        return await self.log.append(record)

    async def _park(self) -> None:
        """A parked lane (waiting, or held with no worker) holds no file descriptor and no
        journal: the log is closed and everything is rebuilt from it on wake (TL9)."""
        if self._parked:
            return
        self._parked = True
        self._steps = self._tools = None
        await self.host.store.close_log(self.log)

    async def _unpark(self) -> None:
        if not self._parked:
            return
        self.log = await self.host.store.open_lane_log(f"task:{self.task_id}")
        self._parked = False
        self._make_journals()

    async def _restore(self) -> None:
        """Rebuild the lane from its log (LK7, WD11, TL6): receipts, budget, markers, epochs."""
        state = read_lane(self.task, self.log.contents.records, self.host.policy)
        self.actions, self.markers, self.replies = state.actions, state.markers, state.replies
        self.epochs, self.record, self.ended = state.epochs, state.record, state.ended
        self.kernel, self.budget = state.kernel, state.budget
        self.continuations, self.attestation = state.continuations, state.attestation
        if self.kernel.state is TaskState.WAITING:
            self.watchdog.feed(TerminalAccepted("wait"))
        if self.epochs > 0 and self.ended is None and self.kernel.state is TaskState.OPEN:
            self._restarted = True
        if self.record is not None and self.epochs > 0 and await self._kill_leftovers(self.record):
            self.quiescent_epoch = self.record.epoch  # nothing of it lives: quiescent (LK4)

    async def _kill_leftovers(self, record: EpochStarted) -> bool:
        """A host restart: whatever the previous epoch left is killed from its record (the
        record's identity must match, W5) before the session is touched. True when nothing
        of that epoch's tree is alive (its quiescence, LK4)."""
        from ._worker import kill_epoch_leftovers

        with contextlib.suppress(PiRuntimeError):
            return (await kill_epoch_leftovers(record)).clean
        return False

    # -- one epoch ---------------------------------------------------------------------------

    async def _run_epoch(self) -> None:
        number = self.epochs + 1
        if not self.kernel.begin_epoch(number, fenced=self._fenced):  # LK6
            return
        self._fenced = False
        self.epochs = number
        if self.attestation is None:  # TL4: the session the attempt owns, by path prefix
            read = await aread_session(self.session)
            if read.session.leaf is not None:
                self.attestation = attest(read.session)
                await self._action(
                    self._id("attest"), "attest", "done", msgspec.to_builtins(self.attestation)
                )
        kind, text, action_id = self._next
        steps, tools = self._journals()
        request = EpochRequest(
            number=number,
            session=self.session,
            worktree=self.worktree,
            home=self.home,
            tmp=self.tmp,
            granted=self._granted(),
            runtime_tools=self._runtime_tools(),
            journals=(steps, tools),
            log=self.log,
            started_ms=self.host.clocks.wall.time_ms,
            policy=StopPolicy(
                term_grace=self.host.policy.term_grace_seconds,
                kill_bound=self.host.policy.kill_bound_seconds,
            ),
        )
        end = _End.EXITED
        clean = False
        async with self.host.workers.open(request) as worker:
            self.worker = worker
            self.record = worker.record
            if worker.record is not None:
                await self._append(worker.record)
            try:
                end = await self._drive(worker, kind, text, action_id)
            finally:
                with trio.CancelScope(shield=True):
                    if end is _End.FENCE or end is _End.RESUME:
                        await self._action(self._id("signal"), "signal", "reserved", {})
                    clean = await worker.stop()
                    self.worker = None
        self.quiescent_epoch = number if clean else None
        reason = "fence" if end in (_End.FENCE, _End.RESUME) else str(end)
        await self._append(
            EpochFenced(epoch=number, reason=reason, fenced_ms=self.host.clocks.wall.time_ms())
        )
        if end in (_End.FENCE, _End.RESUME):
            await self._action(self._id("signal"), "signal", "done", {"clean": clean})
            await self._action(self._id("reap"), "reap", "done", {"clean": clean})
            self._fenced = True
            if not clean:
                self.watchdog.feed(Hold("fence_left_survivors"))
                return
            await self._replacement(
                "the worker was silent past the hard threshold and its grace"
                if end is _End.FENCE
                else "an operator resumed the task after a hold"
            )
        elif end is _End.EXITED and self.kernel.state is TaskState.OPEN:
            self._fenced = True
            await self._replacement("the worker exited without a terminal receipt")

    def _journals(self) -> tuple[DeliveryStepJournal, RecordingGateJournal]:
        assert self._steps is not None
        assert self._tools is not None
        return self._steps, self._tools

    async def _drive(self, worker: TaskWorker, kind: str, text: str, action_id: str | None) -> _End:
        """Prompt the epoch and watch it until it must end (TL2)."""
        if action_id is not None and await self._marker_in_session(action_id):
            pass  # TL5: this continuation is already in the session; never a second copy
        else:
            await worker.rpc.prompt(text)
            if action_id is not None:
                await self._record_marker(action_id)
        self._next = ("none", "", None)
        self.watchdog.feed(Prompted(*self._readings()))
        self._request_started = self._now()
        self._changed()
        outcome: list[_End] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read_events, worker, nursery, outcome)
            nursery.start_soon(self._tick, worker, nursery, outcome)
            nursery.start_soon(self._operator_watch, worker, nursery, outcome)
        return outcome[0] if outcome else _End.EXITED

    async def _read_events(
        self, worker: TaskWorker, nursery: trio.Nursery, outcome: list[_End]
    ) -> None:
        try:
            async for event in worker.rpc:
                end = await self._see(worker, event)
                if end is not None:
                    outcome.append(end)
                    nursery.cancel_scope.cancel()
                    return
        except RpcError:
            pass
        outcome.append(_End.TERMINAL if self.kernel.state is not TaskState.OPEN else _End.EXITED)
        if self.kernel.state is TaskState.OPEN:
            self._execute(self.watchdog.feed(Exited()), worker, nursery, outcome)
            self._changed()
        nursery.cancel_scope.cancel()

    async def _see(self, worker: TaskWorker, event: Event) -> _End | None:
        """One worker event into the watchdog (WD1); the end of the epoch, if it is one."""
        kind = event.type
        record = event.record
        now, awake = self._readings()
        wd = self.watchdog
        before = wd.classification
        if kind == "agent_settled":
            if self.kernel.state is not TaskState.OPEN:
                return _End.TERMINAL
            actions = wd.feed(Settled())
            self._changed()
            for action in actions:
                if isinstance(action, PromptCompletion):
                    action_id = self._id("completion")
                    await self._send_continuation(
                        worker, action_id, "the agent settled without calling a lifecycle tool"
                    )
            self._changed()
            return None
        if kind == "turn_start" or kind == "auto_retry_start" or kind == "compaction_start":
            self._request_started = now
            wd.feed(Progress(now, awake, Phase.PROVIDER, kind))
        elif kind in ("message_start", "message_update", "message_end"):
            message = record.get("message") or {}
            if isinstance(message, dict) and message.get("role") not in (None, "assistant"):
                return None  # the prompt or a tool result echoed: not the model's output
            if kind == "message_end":  # tools or the end come next: no guess (WD4)
                wd.feed(Progress(now, awake, Phase.UNKNOWN, kind))
                self._last_token = None
            else:
                self._note_token(now)
                wd.feed(Progress(now, awake, Phase.GENERATION, kind))
        elif kind == "tool_execution_start":
            call_id = str(record.get("toolCallId", ""))
            lease = _declared_lease(record)
            if lease is not None:
                wd.feed(Lease(now, awake, call_id, now + lease))
            else:
                wd.feed(Progress(now, awake, Phase.TOOL, kind))
        elif kind == "tool_execution_end":
            wd.feed(LeaseEnded(now, awake, str(record.get("toolCallId", ""))))
        if wd.classification is not before or before is Classification.RESUMING:
            self._resumed_progress(before)
            self._changed()
        return None

    def _note_token(self, now: float) -> None:
        if self._last_token is None and self._request_started is not None:
            self.telemetry.ttft.append(now - self._request_started)
        elif self._last_token is not None:
            self.telemetry.max_gap = max(self.telemetry.max_gap, now - self._last_token)
        self._last_token = now

    def _resumed_progress(self, before: Classification) -> None:
        if before is Classification.RESUMING and self._recovery_started_ms is not None:
            seconds = (self.host.clocks.wall.time_ms() - self._recovery_started_ms) / 1000
            self.telemetry.resume_latency.append(seconds)
            self._recovery_started_ms = None
            self.budget = self.budget.charge_seconds(seconds)
            action_id = self._id("recovery_time")
            self._pending.append(
                OutboxAction(
                    action_id=action_id,
                    kind="recovery_time",
                    state="done",
                    detail={"seconds": seconds},
                )
            )

    async def _flush(self) -> None:
        while self._pending:
            record = self._pending.pop(0)
            if isinstance(record, OutboxAction):
                self.actions[record.action_id] = record
            await self._append(record)

    async def _tick(self, worker: TaskWorker, nursery: trio.Nursery, outcome: list[_End]) -> None:
        """Re-read the suspend-aware clock every tick (WD6) and act on what the core says."""
        while True:
            await self._flush()
            now, awake = self._readings()
            before = self.watchdog.classification
            actions = self.watchdog.feed(Tick(now, awake))
            self._check_recovery_budget()
            if self.watchdog.classification is not before:
                self._changed()
            self._execute(actions, worker, nursery, outcome)
            await trio.sleep(self.host.policy.tick_seconds)

    def _check_recovery_budget(self) -> None:
        if self.watchdog.classification is not Classification.RESUMING:
            return
        if self._recovery_started_ms is None:
            return
        spent = (self.host.clocks.wall.time_ms() - self._recovery_started_ms) / 1000
        if spent >= self.budget.seconds_left:
            self.watchdog.feed(Hold("budget_exhausted:recovery_seconds"))

    def _execute(
        self,
        actions: Iterable[Action],
        worker: TaskWorker,
        nursery: trio.Nursery,
        outcome: list[_End],
    ) -> None:
        for action in actions:
            if isinstance(action, Probe):
                nursery.start_soon(self._probe, worker, action.purpose, nursery, outcome)
            elif isinstance(action, CheckGuards):
                nursery.start_soon(self._check_guards, worker, nursery, outcome)

    async def _operator_watch(
        self, worker: TaskWorker, nursery: trio.Nursery, outcome: list[_End]
    ) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            if self._operator == "terminal":
                self._operator = None
                outcome.append(_End.TERMINAL)
                nursery.cancel_scope.cancel()
                return
            if self._operator == "resume":
                self._operator = None
                failed = await self._manual_resume_guards(worker)
                if failed:  # still held, now for what the operator's resume could not prove
                    self.watchdog.feed(GuardsFailed(failed))
                    self._changed()
                    continue
                await self._reserve()
                outcome.append(_End.RESUME)
                nursery.cancel_scope.cancel()
                return

    async def _manual_resume_guards(self, worker: TaskWorker) -> tuple[str, ...]:
        """An operator's resume stands in for the clocks, the probe and the progress
        compare-and-set (the operator looked); the exact process identity, no terminal,
        budget and the same-session attestation must still hold (TL8)."""
        evidence = await self._guard_evidence(worker, fresh_probe_quiet=True)
        return tuple(
            name
            for name in ("process_identity", "no_terminal", "budget_left", "attested")
            if getattr(evidence, name) is not True
        )

    # -- probe, guards, fence (WD2, WD3, WD10) ------------------------------------------------

    async def _probe(
        self, worker: TaskWorker, purpose: str, nursery: trio.Nursery, outcome: list[_End]
    ) -> None:
        """One read-only probe: ``get_state`` plus the session's size. Evidence is anything
        new since it was sent; the answer itself is not progress (WD1)."""
        self._probe_seq += 1
        action_id = self._id(f"probe{self._probe_seq}")
        self.telemetry.probes += 1
        seq_before = self.watchdog.progress_seq
        size_before = await self._session_size()
        answered = False
        with trio.move_on_after(self.host.policy.probe_timeout_seconds):
            with contextlib.suppress(RpcError):
                await worker.rpc.request({"type": "get_state"})
                answered = True
        size_after = await self._session_size()
        if size_after != size_before:  # the session grew: a session append is progress (WD1)
            now, awake = self._readings()
            self.watchdog.feed(Progress(now, awake, self.watchdog.phase, "session_append"))
        evidence: bool | None = self.watchdog.progress_seq != seq_before
        if not answered and not evidence:
            evidence = None
        self.probe_result = (
            f"{purpose}: "
            + {True: "new evidence", False: "no new evidence", None: "no answer"}[evidence]
        )
        await self._action(action_id, "probe", "done", {"purpose": purpose, "evidence": evidence})
        if purpose == "fence" and evidence is False:
            self._eligible = (self.watchdog.progress_seq, size_after)
            await self._action(self._id("eligibility"), "eligibility", "done", {})
        self._execute(
            self.watchdog.feed(ProbeAnswered(purpose, evidence)), worker, nursery, outcome
        )
        self._changed()

    async def _check_guards(
        self, worker: TaskWorker, nursery: trio.Nursery, outcome: list[_End]
    ) -> None:
        evidence = await self._guard_evidence(worker, fresh_probe_quiet=True)
        failed = failed_guards(evidence)
        if failed:
            self.watchdog.feed(GuardsFailed(failed))
            self._changed()
            return
        await self._reserve()
        self.watchdog.feed(FenceStarted())
        await self._action(self._id("fence"), "fence", "done", {})
        self._changed()
        outcome.append(_End.FENCE)
        nursery.cancel_scope.cancel()

    async def _guard_evidence(
        self, worker: TaskWorker | None, *, fresh_probe_quiet: bool
    ) -> GuardEvidence:
        eligible = self._eligible
        size = await self._session_size()
        return GuardEvidence(
            progress_unchanged=eligible is not None and eligible[0] == self.watchdog.progress_seq,
            session_unchanged=eligible is not None and eligible[1] == size,
            process_identity=worker.identity_holds() if worker is not None else None,
            fresh_probe_quiet=fresh_probe_quiet,
            effects_safe=not self._unsettled_effects(),
            no_terminal=self.kernel.state is TaskState.OPEN,
            budget_left=not self.budget.exhausted,
            attested=await self._attested(),
        )

    async def _attested(self) -> bool | None:
        """Same session (path prefix), route and worktree as recorded (WD10)."""
        if self.task.route != _route_snapshot(self.host.route):
            return False
        if not self.worktree.is_dir():
            return False
        if self.attestation is None:
            return None
        try:
            read = await aread_session(self.session)
        except (OSError, PiRuntimeError):
            return None
        return contains_path(read.session, self.attestation)

    async def _reserve(self) -> None:
        """Charge one replacement epoch before its launch, once (WD11, TL6)."""
        action_id = self._next_continuation_id("reserve")
        if action_id in self.actions:
            return
        self.budget = self.budget.charge_epoch()
        self.continuations += 1
        self._recovery_started_ms = self.host.clocks.wall.time_ms()
        await self._action(
            action_id, "reserve", "done", {"epochs": 1, "at_ms": self._recovery_started_ms}
        )

    def _next_continuation_id(self, kind: str) -> str:
        """The id of the next continuation's action ``kind``: a reserve already recorded
        whose continuation was never sent is that continuation's (TL6)."""
        number = self.continuations
        reserve = f"{self._prefix()}/c{number}/reserve"
        if number and reserve in self.actions and not self._continuation_sent(number):
            return f"{self._prefix()}/c{number}/{kind}"
        return f"{self._prefix()}/c{number + 1}/{kind}"

    def _continuation_sent(self, number: int) -> bool:
        return f"{self._prefix()}/c{number}/prompt" in self.markers

    def _unsettled_effects(self) -> list[ToolIntent]:
        """Worker tools let run whose outcome is not recorded and that may not simply run
        again (not ``safe``): a side effect that may have happened (WD10). The runtime's own
        tools are not among them: the gate settles those itself (a receipt tool by its
        receipt)."""
        runtime_tools = self._runtime_tools()
        return [
            i for i in self._journals()[1].unsettled()
            if i.replay_class is not ReplayClass.SAFE and i.name not in runtime_tools
        ]  # fmt: skip

    async def _replacement(self, observed: str) -> None:
        """After a fence, an exit or a restart: settle the session, charge the budget, re-attest
        and queue the one continuation prompt (TL4, TL5, WD11). Holds when unsafe."""
        tools = self._journals()[1]
        never = self._unsettled_effects()
        if never and self._operator != "forced":
            self.watchdog.feed(Hold("effect_possibly_ran:" + ",".join(i.name for i in never)))
            self._changed()
            return
        reserve_id = self._next_continuation_id("reserve")
        if reserve_id not in self.actions:
            if self.budget.exhausted or self.budget.epochs_left <= 0:
                self.watchdog.feed(Hold("budget_exhausted:epochs"))
                self._changed()
                return
            await self._reserve()
        number = self.continuations
        await self._reanswer_orphaned(tools)
        await settle_session(self.session, tools, clock=self.host.clocks.wall)
        read = await aread_session(self.session)
        if self.attestation is not None and not contains_path(read.session, self.attestation):
            self.watchdog.feed(Hold("session_attestation_mismatch"))
            self._changed()
            return
        if self.task.route != _route_snapshot(self.host.route):
            self.watchdog.feed(Hold("route_changed"))
            self._changed()
            return
        self.attestation = attest(read.session) if read.session.leaf is not None else None
        await self._action(
            f"{self._prefix()}/c{number}/attest",
            "attest",
            "done",
            msgspec.to_builtins(self.attestation) if self.attestation else {},
        )
        self._recovery_started_ms = self._recovery_started_ms or self.host.clocks.wall.time_ms()
        self.watchdog.feed(Relaunched(*self._readings()))
        action_id = f"{self._prefix()}/c{number}/prompt"
        self._next = ("continuation", continuation_prompt(action_id, observed), action_id)
        self._changed()

    async def _reanswer_orphaned(self, tools: RecordingGateJournal) -> None:
        """Before the session is settled (TL4, TL7): a call the gate let run whose outcome it
        never recorded may be answered in the session by what the worker wrote on its own
        once its host was gone ("request to the gate failed", "Operation aborted") — not what
        happened. That round is answered again from the gate (the recorded outcome, "possibly
        ran" or the receipt's result), as a branch at its assistant message: the next epoch's
        context follows what the runtime knows."""
        step = self._journals()[0].current_step  # the round the gate settles (its step)
        unsettled = {i.tool_call_id for i in tools.unsettled() if i.step == step}
        if not unsettled:
            return
        await atruncate_torn_tail(self.session)
        path = (await aread_session(self.session)).session.path_to_root()
        messages = [e.raw.get("message") if e.type == "message" else None for e in path]
        for index in range(len(path) - 1, -1, -1):
            message = messages[index]
            content = message.get("content") if isinstance(message, dict) else None
            calls = [
                b for b in (content if isinstance(content, list) else ())
                if isinstance(b, dict) and b.get("type") == "toolCall"
                and isinstance(b.get("id"), str)
            ]  # fmt: skip
            if {b["id"] for b in calls} & unsettled:
                break
        else:
            return
        answered = {
            m.get("toolCallId")
            for m in messages[index + 1 :]
            if isinstance(m, dict) and m.get("role") == "toolResult"
        }
        if not answered & unsettled:
            return  # dangling, not answered: settle_session answers it
        results = []
        for block in calls:
            args = block.get("arguments")
            args = args if isinstance(args, dict) else {}
            call = GateCall(block["id"], str(block.get("name")), args)
            result = await tools.settle(call)
            results.append(
                {"role": "toolResult", "toolCallId": call.tool_call_id, "toolName": call.name,
                 "content": result.content, "isError": result.is_error}
            )  # fmt: skip

        def branch() -> None:
            with SessionWriter.open(self.session, clock=self.host.clocks.wall) as writer:
                parent = path[index].id
                for result in results:
                    parent = writer.append_message(result, parent_id=parent).id
                writer.fsync()

        await trio.to_thread.run_sync(branch)

    async def _relaunch_after_hold(self) -> None:
        """An operator's resume of a held task whose worker is gone (TL8)."""
        self._operator = "forced"
        try:
            self.watchdog.classification = Classification.RESUMING
            await self._replacement("an operator resumed the task after a hold")
        finally:
            self._operator = None

    async def _send_continuation(self, worker: TaskWorker, action_id: str, observed: str) -> None:
        """The completion prompt on the live worker (WD8), idempotent by its marker (TL5)."""
        if action_id in self.markers or await self._marker_in_session(action_id):
            return
        await worker.rpc.prompt(continuation_prompt(action_id, observed))
        await self._record_marker(action_id)
        self.watchdog.feed(Prompted(*self._readings()))

    async def _record_marker(self, action_id: str) -> None:
        record = ContinuationSent(
            epoch=self.epochs,
            action_id=action_id,
            marker=f"[pi-runtime continuation v{CONTINUATION_VERSION} {action_id}]",
            prompt_version=CONTINUATION_VERSION,
        )
        await self._append(record)
        self.markers[action_id] = record

    async def _marker_in_session(self, action_id: str) -> bool:
        marker = f"[pi-runtime continuation v{CONTINUATION_VERSION} {action_id}]"
        try:
            data = await trio.Path(self.session).read_bytes()
        except FileNotFoundError:
            return False
        return json.dumps(marker)[1:-1].encode() in data

    # -- the end: Done needs the whole tuple (LK4) ----------------------------------------------

    async def _finalize(self) -> None:
        from ._worktree import run_validation, take_candidate, take_manifest

        terminal = self.kernel.terminal
        try:
            manifest = await trio.to_thread.run_sync(take_manifest, self.worktree)
            candidate = await trio.to_thread.run_sync(
                lambda: take_candidate(
                    self.worktree,
                    manifest,
                    archive_dir=self.archive_dir,
                    task_id=self.task_id,
                    message=f"pi-runtime candidate for task {self.task_id}",
                )
            )
        except PiRuntimeError as error:
            await self._end("held", code=str(error.code), detail=str(error))
            return
        validation = None
        if self.task.validation:
            validation = await run_validation(
                self.worktree,
                self.task.validation,
                manifest,
                timeout=max(60.0, self.host.policy.recovery_seconds),
            )
        evidence = DoneEvidence(
            terminal=terminal,
            quiescent_epoch=self.quiescent_epoch,
            manifest_digest=manifest.digest,
            candidate_manifest_digest=candidate.manifest_digest,
            validation_required=bool(self.task.validation),
            validation_passed=validation.passed if validation else None,
            validation_manifest_digest=validation.manifest_digest if validation else None,
        )
        missing = done_missing(self.kernel, evidence)
        if missing:
            await self._end(
                "held",
                code=ReasonCode.TASK_NOT_DONE,
                detail="missing: " + ", ".join(missing),
                manifest=manifest.digest,
                candidate=msgspec.to_builtins(candidate),
                validation=msgspec.to_builtins(validation) if validation else None,
            )
            return
        self.kernel.finalize()
        await self._end(
            "done",
            manifest=manifest.digest,
            candidate=msgspec.to_builtins(candidate),
            validation=msgspec.to_builtins(validation) if validation else None,
        )

    async def _end(
        self,
        state: str,
        *,
        code: str | None = None,
        detail: str = "",
        manifest: str | None = None,
        candidate: dict[str, Any] | None = None,
        validation: dict[str, Any] | None = None,
    ) -> None:
        terminal = self.kernel.terminal
        if not detail and terminal is not None:
            detail = terminal.detail
        self.ended = TaskEnded(
            state=state,
            code=code,
            detail=detail,
            manifest_digest=manifest,
            candidate=candidate,
            validation=validation,
            ended_ms=self.host.clocks.wall.time_ms(),
        )
        await self._append(self.ended)
        self.host.log(f"task {self.task_id} ended {state}")

    # -- runtime tools (lifecycle through the gate, LK7) ----------------------------------------

    def _granted(self) -> frozenset[str]:
        return frozenset(self.task.grants) | frozenset(LIFECYCLE_TOOLS)

    def _runtime_tools(self) -> dict[str, RuntimeTool]:
        tools: dict[str, RuntimeTool] = {
            name: self._lifecycle_handler(kind) for name, kind in _KIND_OF_TOOL.items()
        }
        if self.host.receipts is not None:
            tools.update(DocumentTools(self.host.receipts).handlers())
        if self.host.ledger is not None:
            tools["effect"] = EffectLedger(self.host.ledger)
        return {n: t for n, t in tools.items() if n in self._granted()}

    def _lifecycle_handler(self, kind: LifecycleKind) -> RuntimeTool:
        async def handle(call: GateCall, intent_id: str) -> GateResult:
            tools = self._journals()[1]
            key = self.kernel.current
            if tools.epoch != key.epoch:  # a call decided in another epoch: late (LK2)
                key = dataclasses.replace(key, epoch=tools.epoch)
            detail = " ".join(str(v) for v in call.args.values())[:2000]
            verdict = self.kernel.report(
                Report(key=key, intent_id=intent_id, kind=kind, detail=detail)
            )
            if verdict is not Verdict.DUPLICATE:
                await self._append(self.kernel.receipts[-1])  # durable before the answer
            if verdict is Verdict.ACCEPTED:
                self.watchdog.feed(TerminalAccepted(str(kind)))
                self._changed()
                answers = {
                    LifecycleKind.DONE: "Accepted: the task is marked done pending checks. "
                    "Stop now.",
                    LifecycleKind.FAIL: "Accepted: the task is marked failed. Stop now.",
                    LifecycleKind.WAIT: "Accepted: waiting for the user's reply. Stop now; "
                    "the reply will arrive as a new message.",
                }
                return GateResult.text(answers[kind])
            if verdict is Verdict.DUPLICATE:
                return GateResult.text("Already recorded.")
            return GateResult.text(
                f"Not accepted ({verdict}): a lifecycle outcome was already recorded for this "
                "task.",
                is_error=True,
            )

        return handle

    # -- small helpers ---------------------------------------------------------------------------

    async def _action(self, action_id: str, kind: str, state: str, detail: dict[str, Any]) -> None:
        """One outbox action, durable (TL6); the same id and state twice is written once."""
        existing = self.actions.get(action_id)
        if existing is not None and existing.state == state:
            return
        record = OutboxAction(action_id=action_id, kind=kind, state=state, detail=detail)
        self.pending_action = action_id if state == "reserved" else None
        await self._append(record)
        self.actions[action_id] = record

    def _prefix(self) -> str:
        return f"{self.task_id}/g{self.task.generation}/a{self.task.attempt}"

    def _id(self, kind: str) -> str:
        return f"{self._prefix()}/e{self.epochs}/{kind}"

    async def _session_size(self) -> int:
        try:
            return (await trio.Path(self.session).stat()).st_size
        except FileNotFoundError:
            return -1

    def _now(self) -> float:
        return self.host.clocks.silence.read().boottime

    def _readings(self) -> tuple[float, float]:
        reading = self.host.clocks.silence.read()
        return reading.boottime, reading.monotonic

    def _changed(self) -> None:
        self.host.on_change(self)


@dataclass
class LaneState:
    """What a task lane's log says, read without running anything (:func:`read_lane`)."""

    kernel: LifecycleKernel
    budget: Budget
    actions: dict[str, OutboxAction] = field(default_factory=dict)
    markers: dict[str, ContinuationSent] = field(default_factory=dict)
    replies: dict[str, TaskReply] = field(default_factory=dict)
    epochs: int = 0
    record: EpochStarted | None = None
    """The last epoch started."""
    fenced: set[int] = field(default_factory=set)
    """Epochs whose end is recorded."""
    ended: TaskEnded | None = None
    continuations: int = 0
    attestation: Attestation | None = None

    @property
    def pending_action(self) -> str | None:
        """The last outbox action reserved and not done."""
        return next(
            (a.action_id for a in reversed(self.actions.values()) if a.state == "reserved"), None
        )


def read_lane(
    submitted: TaskSubmitted, records: Iterable[Record], policy: WatchdogPolicy
) -> LaneState:
    """The lane's durable state from its records (LK7, WD11, TL6, TL7): the kernel from its
    receipts and replies, the budget from its reserves, recovery time and grants, the
    continuation markers, the epochs and the latest attestation. Pure."""
    records = list(records)
    state = LaneState(
        kernel=LifecycleKernel(submitted.task_id),
        budget=Budget(max_epochs=policy.max_replacements, max_seconds=policy.recovery_seconds),
    )
    for record in records:
        if isinstance(record, OutboxAction):
            state.actions[record.action_id] = record
            _apply_action(state, record)
        elif isinstance(record, ContinuationSent):
            state.markers[record.action_id] = record
        elif isinstance(record, TaskReply):
            state.replies[record.correlation] = record
        elif isinstance(record, EpochStarted):
            state.epochs = max(state.epochs, record.epoch)
            state.record = record
        elif isinstance(record, EpochFenced):
            state.fenced.add(record.epoch)
        elif isinstance(record, TaskEnded):
            state.ended = record
    state.kernel = LifecycleKernel.restore(
        submitted.task_id,
        [r for r in records if isinstance(r, LifecycleReceipt)],
        generation=submitted.generation,
        attempt=submitted.attempt,
        fence=sum(isinstance(r, EpochFenced) and r.reason == "fence" for r in records),
        epoch=state.epochs,
        replies=state.replies,
        done=state.ended is not None and state.ended.state == "done",
    )
    return state


def _apply_action(state: LaneState, action: OutboxAction) -> None:
    if action.kind == "attest" and action.detail:
        state.attestation = msgspec.convert(action.detail, Attestation)
    elif action.kind == "reserve" and action.state == "done":
        if state.budget.epochs_left > 0:
            state.budget = state.budget.charge_epoch()
        state.continuations += 1
    elif action.kind == "recovery_time" and action.state == "done":
        state.budget = state.budget.charge_seconds(float(action.detail.get("seconds", 0.0)))
    elif action.kind == "grant":
        with contextlib.suppress(ValueError):
            state.budget = state.budget.grant(
                epochs=int(action.detail.get("epochs", 0)),
                seconds=float(action.detail.get("seconds", 0.0)),
            )


def _declared_lease(record: Mapping[str, Any]) -> float | None:
    """A gated tool's declared deadline (seconds), if its arguments name one (WD5)."""
    args = record.get("args")
    timeout = args.get("timeout") if isinstance(args, dict) else None
    if isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0:
        return float(timeout)
    return None


def _route_snapshot(route: ModelRoute) -> dict[str, Any]:
    """The frozen route of a task: what names the model, never a key."""
    return {"provider": route.provider, "model": route.model}


def check_spec(spec: TaskSpec) -> None:
    """Refuse a bad task with a stable code (TL1)."""
    if not _TASK_ID.fullmatch(spec.task_id):
        raise TaskError(ReasonCode.TASK_INVALID, "task_id: 1-128 letters, digits, _ . : -")
    if not spec.prompt.strip():
        raise TaskError(ReasonCode.TASK_INVALID, "prompt: must not be empty")
    path = Path(spec.worktree)
    if not path.is_absolute():
        raise TaskError(ReasonCode.TASK_INVALID, "worktree: must be an absolute path")
    if not path.is_dir():
        raise TaskError(ReasonCode.WORKTREE_MISSING, f"worktree: {path} is not a directory")
    unknown = sorted(spec.grants - {"read", "bash", "edit", "write", "effect", "write_document",
                                    "read_document"})  # fmt: skip
    if unknown:
        raise TaskError(ReasonCode.TASK_INVALID, f"grants: unknown tools {', '.join(unknown)}")


def submitted_record(spec: TaskSpec, *, route: ModelRoute, now_ms: int) -> TaskSubmitted:
    key = lane_key(f"task:{spec.task_id}")
    return TaskSubmitted(
        task_id=spec.task_id,
        prompt=spec.prompt,
        worktree=os.path.realpath(spec.worktree),
        grants=sorted(spec.grants),
        session_path=f"lanes/{key}/session.jsonl",
        route=_route_snapshot(route),
        validation=list(spec.validation),
        submitted_ms=now_ms,
    )
