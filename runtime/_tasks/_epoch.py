"""One process epoch of a task lane under watch (docs/design/watchdog.md-6.3; TL2, WD1-WD3,
WD6-WD8, WD10).

A :class:`EpochWatch` lives exactly as long as one worker process: the lane opens the worker
(``async with workers.open(…)``), hands it to :meth:`EpochWatch.run`, and stops the tree when
``run`` returns. Inside, one nursery runs three tasks — the worker's events, the tick on the
suspend-aware clock, the operator's requests — and whichever decides the epoch must end
records why (:class:`EpochEnd`) and cancels the nursery. So cancellation follows the fence:
nothing of the watch outlives its process.

The decisions are the pure cores' (:class:`~runtime._tasks._watchdog.Watchdog`,
:func:`~runtime._tasks._guards.failed_guards`); the durable state (receipts, outbox actions, budget)
is the lane's (:class:`~runtime._tasks._lane.TaskLane`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, TypeVar, assert_never

import trio

from .._backoff import RouteBreaker, failure_park, give_up_ms, past_bounds, route_park
from .._errors import PiRuntimeError, ReasonCode, RpcError, WorkerExitedError
from .._metrics import TASK_FENCES, TASK_PROBES, labelled
from .._pi._rpc_protocol import Event
from .._records import Parked, ToolIntent
from ._guards import GuardEvidence, failed_guards
from ._lifecycle import TaskState
from ._recovery import ChargeUnrecorded
from ._replacement import RecoveryOverdue, TaskClosed
from ._session import marker_in_session, session_size
from ._state import continuation_prompt
from ._view import LaneFacts
from ._watch import watch_event
from ._watchdog import (
    Action,
    CheckGuards,
    Classification,
    Exited,
    FenceStarted,
    GuardsFailed,
    Phase,
    Probe,
    ProbeAnswered,
    Progress,
    PromptCompletion,
    Prompted,
    ProviderParked,
    Settled,
    Tick,
    WatchdogPolicy,
)
from ._workers import TaskWorker
from ._worktree import WorktreeStamp, worktree_stamp

__all__ = ["EpochEnd", "EpochOwner", "EpochWatch"]

WORKTREE_SCAN_TICKS = 6
"""The worktree progress scan runs every this many ticks (30 s at the production 5 s tick;
scaled with the tick under the unsafe time scale): far inside the 300 s soft threshold."""

PROVIDER_UNAVAILABLE = "provider_unavailable:"
"""The hold of a task whose provider stayed unavailable past the backoff's bounds (PB6)."""
PROMPT_ALREADY_SENT = "prompt_already_sent:"
"""The hold of a continuation the core asked for that its marker says was sent (WD8, TL5)."""
MANUAL_RESUME_GUARDS = ("process_identity", "no_terminal", "budget_left", "attested")
"""What an operator's resume must still prove (TL8): the look stands in for the rest."""


_T = TypeVar("_T")


class EpochEnd(enum.StrEnum):
    """Why an epoch ended."""

    TERMINAL = "terminal"
    """A terminal receipt (or the operator's abort or fail) is recorded."""
    EXITED = "exited"
    """The worker exited or closed its stream."""
    FENCE = "fence"
    """Every guard held past the hard threshold and its grace: fence and resume."""
    RESUME = "operator_resume"
    """An operator resumed a held task."""


class EpochOwner(LaneFacts, Protocol):
    """Everything :class:`EpochWatch` uses of its task lane, and nothing more: the coupling
    between one epoch's watch and the lane that owns it, on one page
    (:class:`~runtime._tasks._lane.TaskLane` is the one implementation): what every reader
    sees (:class:`~runtime._tasks._view.LaneFacts`), and these."""

    @property
    def policy(self) -> WatchdogPolicy:
        """The task's frozen policy (WD14)."""

    @property
    def session(self) -> Path: ...
    @property
    def worktree(self) -> Path: ...

    probe_result: str | None
    """What the last read-only probe found (the epoch writes it; ``task show`` reads it)."""

    def changed(self) -> None: ...
    def readings(self) -> tuple[float, float]: ...
    def wall_ms(self) -> int: ...
    def epoch_action_id(self, kind: str) -> str: ...
    def unsettled_effects(self) -> list[ToolIntent]: ...
    def prompted(self) -> None: ...
    def check_recovery_budget(self) -> None: ...
    async def record_action(
        self, action_id: str, kind: str, state: str, detail: dict[str, Any] | None = None
    ) -> None: ...
    async def reserve(self) -> bool: ...
    async def end_recovery(self) -> float | None: ...
    async def recovery_resumes(self) -> None:
        """A relaunched worker that waited out a park is prompted now (PB6, WD11)."""

    @property
    def breaker(self) -> RouteBreaker | None:
        """The host's model route's breaker (PB6), or ``None``: no backoff."""

    parks: list[Parked]
    """The parks since the provider last answered (PB6)."""

    async def park(self, record: Parked) -> None: ...
    def answered(self) -> None: ...
    async def route_problem(self) -> str | None:
        """Why the session and route are not the attested ones (TL4), or None."""

    async def hold(self, reason: str) -> None: ...

    async def record_marker(self, action_id: str) -> None: ...
    async def patiently(self, what: str, work: Callable[[], Awaitable[_T]]) -> _T:
        """``work()``, a want of file descriptors waited out (L21); ``TaskClosed`` once the
        task is not open any more, :class:`RecoveryOverdue` (held) once its recovery's
        seconds ran out (WD11)."""

    async def exited_unprompted(self, error: PiRuntimeError) -> None:
        """The epoch's worker exited before it answered its first prompt (TL2, WD8)."""

    async def resumed_progress(self) -> None: ...
    async def note_hold(self) -> None: ...
    def pending_reply(self) -> tuple[str, str] | None: ...
    async def reply_recorded(self) -> None: ...
    async def operator_request(self) -> str | None: ...


class EpochWatch:
    """The watch over one worker process of ``lane``."""

    def __init__(self, lane: EpochOwner, worker: TaskWorker) -> None:
        self.lane = lane
        self.worker = worker
        self.end: EpochEnd | None = None
        self._nursery: trio.Nursery | None = None
        self._probes = 0
        self._decided_at: float | None = None
        """When this epoch's worker was first seen past a lifecycle decision (LK9)."""
        self._stamp: WorktreeStamp | None = None
        """The worktree as the last progress scan saw it (WD1)."""
        self._ticks = 0
        self._eligible: tuple[int, int, int] | None = None
        """(progress sequence, session size, probe number) when the fence probe found
        nothing new."""
        self._fence_probe = 0
        """The number of the last fence probe sent: only its answer is fresh (WD6, WD10)."""
        self._checking = trio.Lock()
        """Held by a guard check: one at a time, so two never reserve at once (WD11)."""
        self._journaled = 0
        """The gateway's journaled answers when the last turn ended (PB6)."""
        self._probe_token: object | None = None
        """This turn is the half-open breaker's one probe: its token (PB6)."""
        self._completions = 0
        """Completion prompts asked for in this epoch so far (WD8): each its own id."""
        self._unparks = 0
        """Prompts after a park sent in this epoch so far (PB6): each its own id."""

    async def run(self, kind: str, text: str, action_id: str | None) -> EpochEnd:
        """Prompt the epoch (``kind``: a task, a reply or a continuation ``action_id``) and
        watch it until it must end (TL2)."""
        lane = self.lane
        gateway, breaker = self.worker.gateway, lane.breaker
        if gateway is not None and breaker is not None:
            # PB4: told as it is seen, not when the turn settles — the route's first answer
            # closes its breaker, an outage that ends the turn opens it (counted once: the
            # settle tells the same failure again, and a worker dead before it told nothing)
            gateway.on_answered = breaker.succeeded
            gateway.on_unavailable = lambda failure: breaker.failed(failure, self._probe_token)
        try:
            return await self._prompt_and_watch(kind, text, action_id)
        finally:
            if lane.breaker is not None and self._probe_token is not None:
                lane.breaker.abandoned(self._probe_token)  # no word on the route: another probes

    async def _prompt_and_watch(self, kind: str, text: str, action_id: str | None) -> EpochEnd:
        lane = self.lane
        held = False
        try:
            present = False if action_id is None else await self._marker_present(action_id)
        except RecoveryOverdue:  # (WD11) its seconds ran out as the look waited (L21): the
            present, held = False, True  # live worker is held, watched, never prompted
        except TaskClosed:  # its end decided while the look waited for a descriptor (L21)
            return EpochEnd.TERMINAL
        prompted = False
        if held:
            pass
        elif present is None:  # the session cannot say whether it was sent: hold, never guess
            await lane.hold(f"prompt_marker_unknown:{action_id}")
        elif present:
            prompted = True  # TL5: this continuation is already in the session; never twice
        elif not await self._route_open():  # PB6: a restart while parked waits the rest first
            if self.end is not None:  # the operator ended the task while it waited
                return self.end
            # else: held past the backoff's bounds, not prompted
        elif lane.kernel.state.terminal:  # LK6: ended (an operator's abort) while this epoch
            return EpochEnd.TERMINAL  # launched: nothing more to ask — never a paid request
        else:
            try:
                await self.worker.rpc.prompt(text)
            except WorkerExitedError as error:  # it died before it answered (TL2, WD8)
                return await self._exited_unprompted(kind, action_id, error)
            lane.kernel.reply_heard()  # the worker has every reply before it reports (LK8)
            if action_id is not None:
                await lane.record_marker(action_id)
            prompted = True
        if prompted:
            lane.prompted()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._read_events)
            nursery.start_soon(self._tick)
            nursery.start_soon(self._operator_watch)
        return self.end or EpochEnd.EXITED

    async def _exited_unprompted(
        self, kind: str, action_id: str | None, error: WorkerExitedError
    ) -> EpochEnd:
        """The worker exited before it answered the epoch's first prompt (a broken start, a
        crash): an exit like any other, never the lane's failure (WD8, TL2, TL11). The epoch
        ends ``EXITED`` and the lane replaces the worker within the budget (WD11), the
        replacement's continuation carrying what this prompt carried (the task, or the
        user's reply: LK8). A continuation this prompt was is spent — its marker recorded,
        in the log and not in the session (TL6) — so the next replacement is one of its own,
        charged: a worker that dies at every start runs the budget out and holds, never
        loops uncharged."""
        lane = self.lane
        if kind == "continuation" and action_id is not None:
            await lane.record_marker(action_id)
        await lane.reply_recorded()
        if lane.kernel.state is not TaskState.OPEN:  # ended (an abort) as it was prompted
            return EpochEnd.TERMINAL
        await lane.exited_unprompted(error)
        return EpochEnd.EXITED

    def _finish(self, end: EpochEnd) -> None:
        """The epoch ends for ``end`` (the first reason wins): cancel the watch."""
        if self.end is None:
            self.end = end
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()

    def _execute(self, actions: Iterable[Action]) -> None:
        """Carry out what the core asked for; an action this place cannot carry out is a bug,
        raised, never dropped."""
        assert self._nursery is not None
        for action in actions:
            match action:
                case Probe(purpose=purpose):
                    self._nursery.start_soon(self._probe, purpose)
                case CheckGuards():
                    self._nursery.start_soon(self._check_guards)
                case PromptCompletion():
                    # Only the worker's exit asks for it here (a settle's is sent by _see):
                    # the epoch is over, and the lane's replacement carries the prompt.
                    if self.end is not EpochEnd.EXITED:
                        raise AssertionError(f"{action} outside an exit of epoch {self.end}")
                case _:
                    assert_never(action)

    # -- the three tasks -----------------------------------------------------------------------

    async def _read_events(self) -> None:
        lane = self.lane
        try:
            async for event in self.worker.rpc:
                end = await self._see(event)
                if end is not None:
                    self._finish(end)
                    return
        except RpcError:
            pass
        await lane.reply_recorded()  # LK8: a reply accepted as the worker exited
        if lane.kernel.state is not TaskState.OPEN or lane.pending_reply() is not None:
            self._finish(EpochEnd.TERMINAL)  # LK8: a pending reply starts the next epoch
            return
        actions = lane.watchdog.feed(Exited())
        await lane.note_hold()  # durable before anyone sees it (WD12)
        self._finish(EpochEnd.EXITED)
        self._execute(actions)
        lane.changed()

    async def _see(self, event: Event) -> EpochEnd | None:
        """One worker event into the watchdog (WD1); the end of the epoch, if it is one."""
        lane = self.lane
        kind = event.type
        record = event.record
        now, awake = lane.readings()
        wd = lane.watchdog
        before = wd.classification
        if kind == "agent_settled":
            await lane.reply_recorded()  # LK8: a reply accepted as the turn settled
            if lane.kernel.state is not TaskState.OPEN:
                return EpochEnd.TERMINAL
            # PB6 first: a turn that ended on an outage is parked before anything is asked
            # again — a pending reply too waits out the schedule (it goes at the next settle)
            if await self._provider_unavailable():
                return None  # parked, then prompted again (or held past the bounds)
            pending = lane.pending_reply()
            if pending is not None:  # LK8: the reply that came mid-turn, now the turn is over
                if await self._send_prompt(*pending, reply=True) is not None:  # it has it now
                    lane.prompted()  # (not when held unknown: it stays the next prompt's)
                lane.changed()
                return None
            actions = wd.feed(Settled())
            await lane.note_hold()  # a second settle without a terminal holds (WD8, WD12)
            lane.changed()
            for action in actions:
                if isinstance(action, PromptCompletion):
                    await self._send_continuation(
                        self._completion_id(),
                        "the agent settled without calling a lifecycle tool",
                    )
            lane.changed()
            return None
        lane.telemetry.see(kind, record, now)
        seen = watch_event(kind, record, now, awake)
        if seen is None:
            return None
        wd.feed(seen)
        await lane.resumed_progress()  # WD11: the first progress after a relaunch
        if wd.classification is not before:
            await lane.note_hold()  # progress may have lifted a hold (WD12)
            lane.changed()
        return None

    # -- an unavailable provider (docs/design/retention.md PB6) --------------------------------

    async def _provider_unavailable(self) -> bool:
        """At a settle: whether the turn ended on an unavailable provider (the gateway's
        :attr:`~runtime._boundary._gateway.Gateway.upstream_failure`) and was parked — the
        schedule recorded in the lane log, the watchdog's classification ``Parked`` (no clock
        runs, nothing is probed, charged or fenced), the same worker prompted again in the same
        session once the route's breaker lets it — or held past the backoff's bounds
        (``provider_unavailable:<code>``). An answer, or a definite refusal, closes the
        breaker; a turn that asked nothing says nothing of the route."""
        lane, gateway, breaker = self.lane, self.worker.gateway, self.lane.breaker
        if breaker is None or gateway is None:
            return False
        journaled = gateway.statistics().journaled
        answered, self._journaled = journaled > self._journaled, journaled
        failure, probe, self._probe_token = gateway.upstream_failure, self._probe_token, None
        if failure is None or not failure.unavailable:
            if answered or failure is not None:
                breaker.succeeded()
                lane.answered()
            elif probe is not None:
                breaker.abandoned(probe)
            return False
        if answered:  # PB7: the provider answered this turn before it failed: a new episode,
            lane.answered()  # as a restart reads it (the parks after the last answer)
        next_attempt = breaker.failed(failure, probe)
        now = lane.wall_ms()
        record = failure_park(
            breaker.config,
            lane.parks,
            failure,
            next_attempt_ms=next_attempt,
            now_ms=now,
            code=str(ReasonCode.MODEL_FAILED),
            route_failures=breaker.failures,
        )
        if past_bounds(breaker.config, [*lane.parks, record], now):
            await lane.hold(f"{PROVIDER_UNAVAILABLE}{record.code}")
            return True
        lane.watchdog.feed(ProviderParked())
        await lane.park(record)
        if not await self._wait_for_route():
            return True
        gateway.upstream_failure = None
        # numbered over the epoch, not by the park's try: an answer ends the episode and its
        # tries count from 1 again, and a second outage's prompt under the first one's id
        # would be taken for it by its marker and never sent (TL5)
        self._unparks += 1
        await self._send_continuation(
            lane.epoch_action_id(f"unpark{self._unparks}"),
            # what was received (PB6): an error inside a 200 stream is not told as a status
            f"the model provider was unavailable ({failure.describe()}); the runtime waited it out",
        )
        lane.changed()
        return True

    async def _route_open(self) -> bool:
        """Before the epoch's first prompt: a lane whose log ends parked (a restart while it
        waited, PB6) waits out the recorded schedule first, and one that is not parked waits
        while the route's breaker is open (another task's outage, PB4: a new task, or a new
        epoch, asks the provider nothing a parked one may not). False: held past the bounds."""
        lane, breaker = self.lane, self.lane.breaker
        if breaker is None:
            return True
        if lane.parks:
            breaker.resume(lane.parks[-1])
        else:
            admit = breaker.admit()
            if admit.until_ms is None:  # closed, or this turn is the half-open one's probe
                self._probe_token = admit.probe
                return True
        lane.watchdog.feed(ProviderParked())
        lane.changed()
        go = False
        async with trio.open_nursery() as nursery:  # an operator may end the task meanwhile
            self._nursery = nursery
            nursery.start_soon(self._operator_watch)
            go = await self._wait_for_route()
            nursery.cancel_scope.cancel()
        if go and self.end is None:
            await lane.recovery_resumes()  # WD11: from its prompt, if it waited (the outage's)
        return go and self.end is None

    async def _wait_for_route(self) -> bool:
        """Wait while the route's breaker is open (PB4, PB6), each new wait recorded (a park
        by the route: no try of its own); the next turn may be the half-open breaker's probe.
        False when the bounds ran out meanwhile: the task is held."""
        lane, breaker = self.lane, self.lane.breaker
        assert breaker is not None
        never = trio.Event()  # the epoch's own cancellation ends the wait (abort, fail)
        while True:
            # PB3: weighed before every try — after each wait, at a restart — whatever the
            # breaker says (half-open, or closed meanwhile): past its bounds it asks nothing
            if past_bounds(breaker.config, lane.parks, lane.wall_ms()):
                await lane.hold(f"{PROVIDER_UNAVAILABLE}{lane.parks[-1].code}")
                return False
            admit = breaker.admit()
            if admit.until_ms is None:
                self._probe_token = admit.probe
                return True
            if not lane.parks or lane.parks[-1].next_attempt_ms != admit.until_ms:
                record = route_park(
                    breaker.config,
                    lane.parks,
                    until_ms=admit.until_ms,
                    now_ms=lane.wall_ms(),
                    route_failures=breaker.failures,
                )
                await lane.park(record)
            # PB6, WD11: the wait is the outage's, never recovery time — a recovery running
            # (a worker relaunched, by a restart say, that has not progressed yet) ends here
            await lane.end_recovery()
            ends = give_up_ms(breaker.config, lane.parks)  # PB3: no wait outlasts the deadline
            await breaker.wait(admit.until_ms if ends is None else min(admit.until_ms, ends), never)

    async def _tick(self) -> None:
        """Re-read the suspend-aware clock every tick (WD6) and act on what the core says."""
        lane = self.lane
        while True:
            now, awake = lane.readings()
            if await self._quiesced(now):
                return
            if self._ticks % WORKTREE_SCAN_TICKS == 0:
                await self._worktree_progress()
            self._ticks += 1
            now, awake = lane.readings()
            before = lane.watchdog.classification
            actions = lane.watchdog.feed(Tick(now, awake))
            lane.check_recovery_budget()
            if lane.watchdog.classification is not before:
                await lane.note_hold()  # WD12
                lane.changed()
            self._execute(actions)
            await trio.sleep(lane.policy.tick_seconds)

    async def _worktree_progress(self) -> None:
        """A change in the worktree since the last look is progress of the worker (WD1): a
        bounded stat scan (:func:`~runtime._tasks._worktree.worktree_stamp`) off the loop,
        every :data:`WORKTREE_SCAN_TICKS` ticks. The first look of an epoch is its baseline;
        a settled worker's phase is not changed by it (what it left running is no turn)."""
        lane = self.lane
        stamp = await trio.to_thread.run_sync(worktree_stamp, lane.worktree)
        previous, self._stamp = self._stamp, stamp
        wd = lane.watchdog
        if previous is None or stamp is None or stamp.digest == previous.digest:
            return
        if not wd.armed or wd.phase is Phase.SETTLED:
            return
        now, awake = lane.readings()
        before = wd.classification
        wd.feed(Progress(now, awake, wd.phase, "worktree"))
        lane.telemetry.worktree_changes += 1
        await lane.resumed_progress()  # WD11: the first progress after a relaunch
        if wd.classification is not before:
            await lane.note_hold()  # progress may lift a hold (WD12)
            lane.changed()

    async def _quiesced(self, now: float) -> bool:
        """LK9: a worker still running ``grace_seconds`` after its terminal or wait was
        accepted (or after the user's reply it has not settled to receive) is stopped — the
        receipt makes that safe — so the task's evidence and its next step never wait on it."""
        lane = self.lane
        kernel = lane.kernel
        if kernel.state is TaskState.OPEN and not kernel.reply_pending:
            self._decided_at = None
            return False
        if self._decided_at is None:
            self._decided_at = now
        waited = now - self._decided_at
        if waited < lane.policy.grace_seconds:
            return False
        await lane.record_action(
            lane.epoch_action_id("quiesce"), "quiesce", "done", {"after_seconds": waited}
        )
        if kernel.state is TaskState.OPEN and not kernel.reply_pending:  # read again after
            self._decided_at = None  # the write: the reply reached the worker meanwhile, and
            return False  # it works on it (LK8) — not stopped
        self._finish(EpochEnd.TERMINAL)
        return True

    async def _operator_watch(self) -> None:
        lane = self.lane
        while True:
            request = await lane.operator_request()
            if request == "terminal":
                self._finish(EpochEnd.TERMINAL)
                return
            if request == "resume":
                failed = await self._manual_resume_guards()
                if not self._still_held():  # it progressed, or ended, meanwhile: moot
                    continue
                if failed:  # still held, now for what the operator's resume could not prove
                    lane.watchdog.feed(GuardsFailed(failed))
                    await lane.note_hold()
                    lane.changed()
                    continue
                try:
                    started = await lane.reserve()
                except ChargeUnrecorded:  # (WD11) not charged, held again: no fence on it
                    lane.changed()
                    continue
                if not self._still_held():  # re-read after the reserve's await
                    if started:
                        await lane.end_recovery()  # (WD11: as a called-off fence's)
                    continue
                # the hold is resolved from here: the task is fenced, no longer held, so a
                # resume asked again while the tree is stopped is refused, never left to be
                # taken for a look at the hold the replacement may decide next (TL8, WD13)
                lane.watchdog.feed(FenceStarted())
                lane.changed()
                self._finish(EpochEnd.RESUME)
                return

    def _still_held(self) -> bool:
        """What an operator's resume of a live worker stands on, read after its last await:
        the task is still held and open. Progress lifts a hold (WD1): the worker is working,
        and a resume would kill it and charge an epoch for nothing (TL8)."""
        lane = self.lane
        held = lane.watchdog.classification is Classification.STALLED_OPERATOR_REQUIRED
        return held and lane.kernel.state is TaskState.OPEN

    # -- probe, guards, fence (WD2, WD3, WD10) -------------------------------------------------

    async def _probe(self, purpose: str) -> None:
        """One read-only probe: ``get_state``, a look at the worktree and the session's size.
        Evidence is anything new since it was sent; the answer itself is not progress (WD1).
        A fence probe's answer counts only while no later one was sent (WD6: a wake asks
        for a fresh one, and that one decides)."""
        lane = self.lane
        wd = lane.watchdog
        self._probes += 1
        number = self._probes
        if purpose == "fence":
            self._fence_probe = number
        action_id = lane.epoch_action_id(f"probe{number}")
        lane.telemetry.probes += 1
        labelled(TASK_PROBES, purpose).inc()
        seq_before = wd.progress_seq
        size_before = await session_size(lane.session)
        answered = False
        with trio.move_on_after(lane.policy.probe_timeout_seconds):
            with contextlib.suppress(RpcError):
                await self.worker.rpc.request({"type": "get_state"})
                answered = True
        # WD1: a worktree change the periodic scan has not seen yet (it looks every 30 s) is
        # evidence too — silence counts from the last change, and a fence stands on now
        await self._worktree_progress()
        size_after = await session_size(lane.session)
        if size_after != size_before:  # the session grew: a session append is progress (WD1)
            now, awake = lane.readings()
            wd.feed(Progress(now, awake, wd.phase, "session_append"))
            await lane.resumed_progress()  # WD11: a resumed worker's first progress too
        evidence: bool | None = wd.progress_seq != seq_before
        if not answered and not evidence:
            evidence = None
        lane.probe_result = (
            f"{purpose}: "
            + {True: "new evidence", False: "no new evidence", None: "no answer"}[evidence]
        )
        await lane.record_action(
            action_id, "probe", "done", {"purpose": purpose, "evidence": evidence}
        )
        if purpose == "fence" and number != self._fence_probe and not evidence:
            # WD6, WD10: a later wake asked for a fresh fence probe while this one was out;
            # a quiet (or no) answer of the old one is no proof — the fresh one decides
            lane.changed()
            return
        if purpose == "fence" and evidence is False:
            self._eligible = (wd.progress_seq, size_after, number)
            await lane.record_action(lane.epoch_action_id("eligibility"), "eligibility", "done")
        self._execute(wd.feed(ProbeAnswered(purpose, evidence)))
        await lane.note_hold()  # an unanswered probe holds (WD12)
        lane.changed()

    async def _check_guards(self) -> None:
        """Every guard, then the reserve, then every guard again: the compare-and-set holds
        only if nothing moved during the reserve's await (WD10). Progress meanwhile means the
        worker was not stalled: no fence, and the reserve waits for the next replacement.
        One check at a time: a second one meets the first one's reserve recorded (WD11)."""
        async with self._checking:  # (WD11: another check's reserve is recorded first)
            await self._check_guards_once()

    async def _check_guards_once(self) -> None:
        lane = self.lane
        if await self._guards_hold():
            try:
                started = await lane.reserve()
            except ChargeUnrecorded:  # (WD11) not charged, and held: no fence on it
                return
            if await self._guards_hold(reserved=True):  # re-read after the reserve's await
                lane.watchdog.feed(FenceStarted())
                TASK_FENCES.inc()
                await lane.record_action(lane.epoch_action_id("fence"), "fence", "done")
                lane.changed()
                self._finish(EpochEnd.FENCE)
            elif started:  # called off: the worker was working, so the recovery this reserve
                await lane.end_recovery()  # started ends with it, its seconds charged (WD11)

    async def _guards_hold(self, *, reserved: bool = False) -> bool:
        """Whether every guard holds now; a guard that fails holds the task, unless progress
        already cleared the eligibility (then there is nothing to fence). ``reserved``: this
        replacement's epoch is charged already, so the budget guard is met by that reserve."""
        lane = self.lane
        evidence = await self._guard_evidence()
        if reserved:
            evidence = dataclasses.replace(evidence, budget_left=True)
        failed = failed_guards(evidence)
        wd = lane.watchdog
        grown = self._eligible is not None and evidence.session_unchanged is False
        if grown and wd.classification is Classification.HARD_RESUME_ELIGIBLE:
            # the session changed since the quiet probe: an append is progress (WD1), as the
            # probe counts it — the worker is not stalled, so no fence and no hold either
            now, awake = lane.readings()
            wd.feed(Progress(now, awake, wd.phase, "session_append"))
            await lane.resumed_progress()  # WD11: a resumed worker's first progress too
            await lane.note_hold()
            lane.changed()
            return False
        if lane.watchdog.classification is not Classification.HARD_RESUME_ELIGIBLE:
            return False  # progress (or a hold) came first: the worker is not to be fenced
        if self._eligible is None or self._eligible[2] != self._fence_probe:
            return False  # WD6: a wake meanwhile asked for a fresh probe: its answer decides
        if lane.kernel.state is not TaskState.OPEN:  # a terminal (or a wait) decided during
            return False  # the reads — its receipt still being written: nothing to fence
        if failed:
            lane.watchdog.feed(GuardsFailed(failed))
            await lane.note_hold()
            lane.changed()
            return False
        return True

    async def _manual_resume_guards(self) -> tuple[str, ...]:
        """An operator's resume stands in for the clocks, the probe and the progress
        compare-and-set (the operator looked); the exact process identity, no terminal,
        budget and the same-session attestation must still hold (TL8)."""
        evidence = await self._guard_evidence()
        return tuple(name for name in MANUAL_RESUME_GUARDS if getattr(evidence, name) is not True)

    async def _guard_evidence(self) -> GuardEvidence:
        """Every guard of docs/design/watchdog.md, read now (the probe that asked for them was
        quiet): the two that read files first, then every other after those awaits, so none
        is older than the last await (WD10) — a terminal decided during the route's read is
        seen."""
        lane = self.lane
        attested = await self._attested()
        size = await session_size(lane.session)
        eligible = self._eligible
        return GuardEvidence(
            progress_unchanged=eligible is not None and eligible[0] == lane.watchdog.progress_seq,
            session_unchanged=eligible is not None and eligible[1] == size,
            process_identity=self.worker.identity_holds(),
            fresh_probe_quiet=eligible is not None and eligible[2] == self._probes,
            effects_safe=not lane.unsettled_effects(),
            no_terminal=lane.kernel.state is TaskState.OPEN,
            budget_left=not lane.budget.exhausted,
            attested=attested,
        )

    async def _attested(self) -> bool | None:
        """Same session (path prefix, model and level), route and worktree as recorded
        (WD10, TL4); unknown when nothing was attested yet or the session cannot be read."""
        problem = await self.lane.route_problem()
        if problem is not None and problem != "session_unreadable":
            return False
        if problem is not None or self.lane.attestation is None:
            return None
        return True

    def _completion_id(self) -> str:
        """The id of the next completion prompt of this epoch (WD8, TL5): ``e<n>/completion``,
        then ``completion2``, ``completion3``…. The core asks for one per epoch *and per
        reply* (a reply wakes its count), so one epoch may send several; under one id the
        second was taken for the first by its marker and never sent."""
        self._completions += 1
        number = self._completions
        return self.lane.epoch_action_id("completion" if number == 1 else f"completion{number}")

    async def _send_continuation(self, action_id: str, observed: str) -> None:
        """A continuation the core asked for on the live, settled worker — the completion
        prompt (WD8) or the prompt after a park (PB6) — idempotent by its marker (TL5). Not
        sent because its marker says the worker has it already, the worker (disarmed, idle)
        would wait forever for a prompt that never comes: the task holds
        ``prompt_already_sent:<action id>`` for the operator instead (WD12)."""
        lane = self.lane
        sent = await self._send_prompt(action_id, continuation_prompt(action_id, observed))
        if sent:
            lane.watchdog.feed(Prompted(*lane.readings()))
        elif sent is False and (
            lane.watchdog.classification is not Classification.STALLED_OPERATOR_REQUIRED
        ):
            await lane.hold(f"{PROMPT_ALREADY_SENT}{action_id}")

    async def _marker_present(self, action_id: str) -> bool | None:
        """:func:`marker_in_session`, a want of file descriptors waited out (L21): never an
        "unknown" (a hold for an operator) for a want that passes."""
        session = self.lane.session
        return await self.lane.patiently(
            "read its session", lambda: marker_in_session(session, action_id, wants=True)
        )

    async def _send_prompt(self, action_id: str, text: str, *, reply: bool = False) -> bool | None:
        """Prompt the live worker with ``text`` once (its marker in the log or the session
        means it was sent: TL5). True: sent now; False: the worker has it already; None:
        not sent and the worker does not have it — whether it does is unknown (the task
        holds ``prompt_marker_unknown``, TL5), or the task ended during the marker's look,
        the last await, and its worker is asked nothing more (LK6). A prompt not sent stays
        the next one's to carry (a reply: LK8). ``reply``: this prompt carries the pending
        reply, which the worker has heard once it is sent — a continuation does not carry
        it (LK8: a reply that came during a park's wait goes after the continuation)."""
        lane = self.lane
        if action_id in lane.markers:
            return False
        try:
            present = await self._marker_present(action_id)
        except TaskClosed:  # (L21: its end decided, or it was held, while the look waited)
            return None
        if lane.kernel.state is not TaskState.OPEN:
            return None
        if present is None:  # unknown whether the worker has it: hold (TL5)
            await lane.hold(f"prompt_marker_unknown:{action_id}")
            return None
        if present:
            return False
        await self.worker.rpc.prompt(text)
        if reply:
            lane.kernel.reply_heard()  # LK8: before any await, so no report comes between
        await lane.record_marker(action_id)
        return True
