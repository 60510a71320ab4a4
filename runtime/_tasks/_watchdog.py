"""The task-lane watchdog: classifications, clocks and the action table (docs/design/watchdog.md).

Pure core: no trio, no I/O, no clock reads. The shell (``runtime/_tasks/_lane.py``) feeds it what
the worker did (:class:`Progress`, :class:`Lease`, :class:`Settled`, …) and clock readings
(:class:`Tick`), and carries out the :class:`Action`\\ s it returns. The numbered invariants
(WD1…) are in ``docs/design/watchdog.md``; ``tests/tasks/test_watchdog.py`` cites them.

Two static clocks (WD2 to WD6):

* **soft** — ``soft_seconds`` (300) of *meaningful silence* on the boottime axis (a suspend
  counts as silence) → :attr:`Classification.SUSPECT`, evidence, exactly **one read-only
  probe**. The probe decides nothing: it cannot prompt, signal or fence;
* **hard** — a per-phase threshold (≥ 900 s for ``provider`` and ``generation``; none for
  ``unknown``, ``tool`` and ``settled``) measured in *awake* time (monotonic axis) since the
  later of the last progress and the first wake from a suspend after it; a separate grace
  (120 s) starts only once it is crossed. After both →
  :attr:`Classification.HARD_RESUME_ELIGIBLE`, one fresh probe; only when it brings no new
  evidence does the core ask the shell to check the fencing guards
  (``runtime/_tasks/_guards.py``). The core itself never fences.

Progress is a monotonic sequence advanced only by meaningful events (tokens, thinking, tool
calls, session appends, worktree changes); probes, polls, logs and heartbeats are not events
here at all, so they cannot reset anything (WD1).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final, assert_never

__all__ = [
    "ACTION_TABLE",
    "HARD_FLOOR_SECONDS",
    "Action",
    "CheckGuards",
    "Classification",
    "Event",
    "Exited",
    "FenceStarted",
    "GuardsFailed",
    "Hold",
    "Lease",
    "LeaseEnded",
    "Phase",
    "Probe",
    "ProbeAnswered",
    "Progress",
    "PromptCompletion",
    "Prompted",
    "ProviderParked",
    "Relaunched",
    "Settled",
    "TerminalAccepted",
    "Tick",
    "Watchdog",
    "WatchdogPolicy",
    "Woken",
]

HARD_FLOOR_SECONDS: Final = 900.0
"""No hard threshold may be shorter (docs/design/watchdog.md: free/low-QoS TTFT and inter-token ≥
900 s)."""
PROBE_TIMEOUT_FLOOR: Final = 2.0
"""The time scale shortens the probe's bound no further: it bounds a live worker's answer on
a loaded machine, it is not a threshold (too short, and a busy worker reads as wedged)."""
SUSPEND_EVIDENCE_SECONDS: Final = 1.0
"""A growth of ``boottime - monotonic`` beyond this between two ticks is a suspend."""
_SENT: Final = 1
"""A probe of the episode whose answer is due (:attr:`Watchdog.probes`)."""
_ANSWERED: Final = 2
"""A fence probe of the episode whose answer was taken: the guards, or a hold, follow once."""


class Classification(enum.StrEnum):
    """The watchdog's view of a task lane (docs/design/watchdog.md) — never a task status."""

    ACTIVE = "Active"
    WAITING_USER = "WaitingUser"
    LONG_TOOL = "LongTool"
    SUSPECT = "Suspect"
    HARD_RESUME_ELIGIBLE = "HardResumeEligible"
    NEEDS_FINALIZATION = "NeedsFinalization"
    FENCING = "Fencing"
    RESUMING = "Resuming"
    STALLED_OPERATOR_REQUIRED = "StalledOperatorRequired"
    PARKED = "Parked"
    """The model provider is unavailable: the turn waits out its backoff (PB6). Not
    silence: no clock runs, nothing is probed, charged or fenced."""


class Phase(enum.StrEnum):
    """What the worker is doing, as far as its events tell."""

    UNKNOWN = "unknown"
    """Alive, but no event says what it does (just launched, or ownership unclear)."""
    PROVIDER = "provider"
    """A model request is in flight and no output has arrived yet (time to first token)."""
    GENERATION = "generation"
    """The model is streaming (the gaps between tokens)."""
    TOOL = "tool"
    """A gated tool runs (a lease protects it while valid)."""
    SETTLED = "settled"
    """The worker is idle after ``agent_settled``."""


ACTION_TABLE: Final[Mapping[Classification, str]] = {
    Classification.ACTIVE: "none: progress is advancing; total runtime is irrelevant",
    Classification.WAITING_USER: "reply to the wait (pi-runtime task reply) or abort/fail",
    Classification.LONG_TOOL: "none: a valid tool lease protects the call",
    Classification.SUSPECT: "observe: one read-only probe was sent; no action before the hard "
    "threshold and its grace",
    Classification.HARD_RESUME_ELIGIBLE: "none: the guards are being checked",
    Classification.NEEDS_FINALIZATION: "none: one same-session completion prompt is due",
    Classification.FENCING: "none: the exact process tree is being stopped",
    Classification.RESUMING: "none: the same session is being resumed",
    Classification.STALLED_OPERATOR_REQUIRED: "inspect, then pi-runtime task resume | grant | "
    "abort | fail",
    Classification.PARKED: "none: the model provider is unavailable; the same session is "
    "prompted again after the backoff (pi-runtime task abort | fail to give up)",
}
"""The next safe operator action for each classification (docs/design/watchdog.md's action
table)."""


# ------------------------------------------------------------------------------- policy


MAX_REPLACEMENTS: Final = 10
"""The most replacement epochs a configuration may allow per attempt (WD9, WD11): the budget
bounds recovery exposure, so it is finite and small; more is an operator's audited grant."""


_DURATIONS: Final = (
    "soft_seconds",
    "grace_seconds",
    "tick_seconds",
    "probe_timeout_seconds",
    "recovery_seconds",
    "term_grace_seconds",
    "kill_bound_seconds",
)
"""The policy's durations: each a positive, finite number of seconds (WD9)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchdogPolicy:
    """The static thresholds and budgets of task lanes (seconds). Never adapted at run time."""

    soft_seconds: float = 300.0
    hard_seconds: Mapping[Phase, float] = field(
        default_factory=lambda: {Phase.PROVIDER: 900.0, Phase.GENERATION: 900.0}
    )
    """Hard threshold per phase; a phase not named here has none (WD4)."""
    grace_seconds: float = 120.0
    tick_seconds: float = 5.0
    probe_timeout_seconds: float = 30.0
    max_replacements: int = 3
    recovery_seconds: float = 1800.0
    term_grace_seconds: float = 5.0
    kill_bound_seconds: float = 5.0
    timescale: float = 1.0
    """>1 only under ``--unsafe-test-timescale``: every threshold was divided by it."""

    def problems(self) -> list[tuple[str, str]]:
        """Every rule this policy breaks, as ``(setting, why)`` (WD9). Empty: valid."""
        out: list[tuple[str, str]] = []
        unsafe = self.timescale != 1.0
        for name in _DURATIONS:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                out.append((name, f"must be a positive number of seconds, not {value!r}"))
        if not 1 <= self.max_replacements <= MAX_REPLACEMENTS:
            out.append(("max_replacements", f"must be at least 1 and at most {MAX_REPLACEMENTS}"))
        if not (math.isfinite(self.timescale) and self.timescale >= 1.0):
            out.append(("timescale", "must be a finite number, at least 1"))
        for phase, seconds in self.hard_seconds.items():
            setting = f"hard_seconds.{phase}"
            if phase not in (Phase.PROVIDER, Phase.GENERATION):
                out.append((setting, f"phase {phase} has no automatic hard threshold (WD4)"))
            elif not (math.isfinite(seconds) and seconds > 0):
                out.append((setting, f"must be a positive number of seconds, not {seconds!r}"))
            elif not unsafe and seconds < HARD_FLOOR_SECONDS:
                out.append((setting, f"must be at least {HARD_FLOOR_SECONDS:g} s, not {seconds:g}"))
            elif not seconds > self.soft_seconds:
                out.append((setting, "must be longer than soft_seconds"))
        if not unsafe and self.soft_seconds != 300.0:
            out.append(("soft_seconds", "is static: 300 s (docs/design/watchdog.md)"))
        return out

    def scaled(self, factor: float) -> WatchdogPolicy:
        """Every threshold divided by ``factor`` (the unsafe test time scale, WD9)."""
        if not factor >= 1.0:
            raise ValueError(f"a time scale must be at least 1, not {factor!r}")
        return replace(
            self,
            soft_seconds=self.soft_seconds / factor,
            hard_seconds={p: s / factor for p, s in self.hard_seconds.items()},
            grace_seconds=self.grace_seconds / factor,
            tick_seconds=self.tick_seconds / factor,
            probe_timeout_seconds=min(
                self.probe_timeout_seconds,
                max(PROBE_TIMEOUT_FLOOR, self.probe_timeout_seconds / factor),
            ),
            recovery_seconds=self.recovery_seconds / factor,
            timescale=self.timescale * factor,
        )

    def hard_for(self, phase: Phase) -> float | None:
        return self.hard_seconds.get(phase)

    def snapshot(self) -> dict[str, Any]:
        """Every setting as plain data: what a task's submission freezes (WD14)."""
        return {
            "soft_seconds": self.soft_seconds,
            "hard_seconds": {str(p): s for p, s in self.hard_seconds.items()},
            "grace_seconds": self.grace_seconds,
            "tick_seconds": self.tick_seconds,
            "probe_timeout_seconds": self.probe_timeout_seconds,
            "max_replacements": self.max_replacements,
            "recovery_seconds": self.recovery_seconds,
            "term_grace_seconds": self.term_grace_seconds,
            "kill_bound_seconds": self.kill_bound_seconds,
            "timescale": self.timescale,
        }

    @classmethod
    def from_snapshot(cls, data: Mapping[str, Any]) -> WatchdogPolicy:
        """The policy :meth:`snapshot` froze. Raises ``ValueError`` naming the first setting
        that is missing, of the wrong type, or breaks a rule of WD9 (a snapshot written by
        another version, or a damaged one, is never half-applied)."""
        numbers: dict[str, float] = {}
        for name in (*_DURATIONS, "timescale"):
            value = data.get(name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name}: a number, not {value!r}")
            numbers[name] = float(value)
        replacements = data.get("max_replacements")
        if isinstance(replacements, bool) or not isinstance(replacements, int):
            raise ValueError(f"max_replacements: a whole number, not {replacements!r}")
        hard = data.get("hard_seconds")
        if not isinstance(hard, Mapping):
            raise ValueError(f"hard_seconds: a table, not {hard!r}")
        phases: dict[Phase, float] = {}
        for phase, seconds in hard.items():
            try:
                known = Phase(phase)
            except ValueError:
                raise ValueError(f"hard_seconds.{phase}: no such phase") from None
            if isinstance(seconds, bool) or not isinstance(seconds, int | float):
                raise ValueError(f"hard_seconds.{phase}: a number, not {seconds!r}")
            phases[known] = float(seconds)
        policy = cls(hard_seconds=phases, max_replacements=replacements, **numbers)
        problems = policy.problems()
        if problems:
            setting, why = problems[0]
            raise ValueError(f"{setting}: {why}")
        return policy


# ------------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Progress:
    """A meaningful worker event at ``now`` (boottime) / ``awake`` (monotonic); ``phase`` is
    the phase it shows the worker in."""

    now: float
    awake: float
    phase: Phase
    kind: str = "event"


@dataclass(frozen=True, slots=True)
class Lease:
    """A gated tool with a declared deadline (boottime) started: it is also progress."""

    now: float
    awake: float
    key: str
    deadline: float


@dataclass(frozen=True, slots=True)
class LeaseEnded:
    now: float
    awake: float
    key: str


@dataclass(frozen=True, slots=True)
class Tick:
    """A reading of the suspend-aware clock (boottime, monotonic)."""

    now: float
    awake: float


@dataclass(frozen=True, slots=True)
class ProbeAnswered:
    """The probe sent for ``purpose`` came back; ``evidence``: it saw something new
    (the session grew, events arrived). ``None``: no answer within the bound (unknown)."""

    purpose: str
    evidence: bool | None


@dataclass(frozen=True, slots=True)
class Settled:
    """``agent_settled`` arrived and no terminal receipt was accepted."""


@dataclass(frozen=True, slots=True)
class Exited:
    """The worker process (or its channel) ended without a terminal receipt."""

    status: int | None = None


@dataclass(frozen=True, slots=True)
class TerminalAccepted:
    """The lifecycle kernel accepted ``done`` / ``fail`` / ``wait`` (or an operator's abort)."""

    kind: str


@dataclass(frozen=True, slots=True)
class Woken:
    """A wait's correlated reply arrived; the lane prompts again."""


@dataclass(frozen=True, slots=True)
class Prompted:
    """A prompt (first, reply, continuation or completion) was accepted by the worker."""

    now: float
    awake: float


@dataclass(frozen=True, slots=True)
class ProviderParked:
    """The worker's turn ended on an unavailable model provider and waits out its backoff
    (PB6): no clock runs until the next prompt (:class:`Prompted`)."""


@dataclass(frozen=True, slots=True)
class GuardsFailed:
    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class FenceStarted:
    pass


@dataclass(frozen=True, slots=True)
class Relaunched:
    """A replacement epoch runs on the same session."""

    now: float
    awake: float


@dataclass(frozen=True, slots=True)
class Hold:
    """Something the shell found makes automatic action unsafe (budget, effect, proof)."""

    reason: str


Event = (
    Progress | Lease | LeaseEnded | Tick | ProbeAnswered | Settled | Exited | TerminalAccepted
    | Woken | Prompted | GuardsFailed | FenceStarted | Relaunched | Hold | ProviderParked
)  # fmt: skip


# ------------------------------------------------------------------------------ actions


@dataclass(frozen=True, slots=True)
class Probe:
    """Send one read-only probe (``purpose``: ``soft`` or ``fence``); answer with
    :class:`ProbeAnswered`."""

    purpose: str


@dataclass(frozen=True, slots=True)
class CheckGuards:
    """Hard threshold, grace and a quiet fresh probe: check every fencing guard; fence only
    when all hold, else feed :class:`GuardsFailed`."""


@dataclass(frozen=True, slots=True)
class PromptCompletion:
    """Send the one same-session completion prompt (``reason``: settled / exited)."""

    reason: str


Action = Probe | CheckGuards | PromptCompletion


# -------------------------------------------------------------------------------- state


@dataclass
class Watchdog:
    """The classification and clocks of one task lane (one attempt). Mutable, pure.

    :meth:`feed` takes one event and returns the actions due. Disarmed (a terminal receipt,
    an accepted wait) it ignores silence entirely.
    """

    policy: WatchdogPolicy
    classification: Classification = Classification.ACTIVE
    phase: Phase = Phase.UNKNOWN
    progress_seq: int = 0
    last_progress: float = 0.0
    """Boottime of the last meaningful event (or of the prompt that started the phase)."""
    last_progress_awake: float = 0.0
    wake_awake: float = -math.inf
    """Monotonic time of the first wake from a suspend since the last progress: hard clocks
    count from here (WD6)."""
    suspended_total: float | None = None
    leases: dict[str, float] = field(default_factory=dict)
    armed: bool = False
    """Clocks run only while a prompt is being worked on (WD7)."""
    probes: dict[str, int] = field(default_factory=dict)
    """Probes sent in the current suspicion episode, by purpose (WD2: at most one each):
    :data:`_SENT` while its answer is due, :data:`_ANSWERED` once a fence probe's answer
    was taken (WD10: one answer, one decision)."""
    grace_started_awake: float | None = None
    suspicions: int = 0
    false_suspects: int = 0
    completion_prompts: int = 0
    """Completion prompts issued in the current process epoch (at most one, WD8)."""
    hold_reason: str | None = None
    terminal: str | None = None

    def feed(self, event: Event) -> list[Action]:
        """One event into the state machine; the actions it asks for (each handled by the
        shell, see :class:`~runtime._tasks._epoch.EpochWatch`)."""
        match event:
            case Progress():
                return self._on_progress(event)
            case Lease():
                return self._on_lease(event)
            case LeaseEnded():
                return self._on_lease_ended(event)
            case Tick():
                return self._on_tick(event)
            case ProbeAnswered():
                return self._on_probe(event)
            case Settled():
                return self._on_settled(event)
            case Exited():
                return self._on_exited(event)
            case TerminalAccepted():
                return self._on_terminal(event)
            case Woken():
                return self._on_woken(event)
            case Prompted():
                return self._on_prompted(event)
            case GuardsFailed():
                return self._on_guards_failed(event)
            case Hold():
                return self._on_hold(event)
            case FenceStarted():
                return self._on_fence(event)
            case Relaunched():
                return self._on_relaunched(event)
            case ProviderParked():
                return self._on_parked(event)
            case _:
                assert_never(event)

    # -- views --------------------------------------------------------------------------

    def silence(self, now: float) -> float:
        """Meaningful silence on the boottime axis (a suspend counts)."""
        return max(0.0, now - self.last_progress)

    def awake_silence(self, awake: float) -> float:
        """Silence in awake time since the later of the last progress and the first wake
        after it."""
        return max(0.0, awake - max(self.last_progress_awake, self.wake_awake))

    def lease_deadline(self) -> float | None:
        return max(self.leases.values()) if self.leases else None

    def hard_threshold(self) -> float | None:
        return self.policy.hard_for(self.phase)

    # -- handlers ------------------------------------------------------------------------

    def _progress(self, now: float, awake: float) -> None:
        self.progress_seq += 1
        self.last_progress = max(self.last_progress, now)
        self.last_progress_awake = max(self.last_progress_awake, awake)
        if self.classification in (
            Classification.SUSPECT,
            Classification.HARD_RESUME_ELIGIBLE,
            Classification.STALLED_OPERATOR_REQUIRED,
        ):
            self.false_suspects += 1  # it was not stalled after all (telemetry only)
        if self.classification in _CLEARED_BY_PROGRESS:
            self.classification = Classification.ACTIVE
            self.hold_reason = None
        self.probes.clear()
        self.grace_started_awake = None
        self._lease_view(now)

    def _lease_view(self, now: float) -> None:
        deadline = self.lease_deadline()
        if self.classification in (Classification.ACTIVE, Classification.LONG_TOOL):
            valid = deadline is not None and deadline > now
            self.classification = Classification.LONG_TOOL if valid else Classification.ACTIVE

    def _on_progress(self, event: Progress) -> list[Action]:
        self.phase = event.phase
        self._progress(event.now, event.awake)
        return []

    def _on_lease(self, event: Lease) -> list[Action]:
        self.phase = Phase.TOOL
        self.leases[event.key] = event.deadline
        self._progress(event.now, event.awake)
        return []

    def _on_lease_ended(self, event: LeaseEnded) -> list[Action]:
        self.leases.pop(event.key, None)
        self.phase = Phase.PROVIDER if not self.leases else Phase.TOOL
        self._progress(event.now, event.awake)
        return []

    def _on_prompted(self, event: Prompted) -> list[Action]:
        self.armed = True
        self.terminal = None
        self.phase = Phase.PROVIDER
        if self.classification is not Classification.RESUMING:  # until its first progress
            self.classification = Classification.ACTIVE
        self.hold_reason = None
        self.last_progress = max(self.last_progress, event.now)
        self.last_progress_awake = max(self.last_progress_awake, event.awake)
        self.probes.clear()
        self.grace_started_awake = None
        return []

    def _on_tick(self, event: Tick) -> list[Action]:
        self._note_suspend(event)
        if not self.armed or self.classification not in _WATCHED:
            return []
        deadline = self.lease_deadline()
        if deadline is not None and deadline > event.now:  # WD5: a valid lease holds
            self.classification = Classification.LONG_TOOL
            return []
        floor = max(self.last_progress, deadline if deadline is not None else -math.inf)
        if event.now - floor < self.policy.soft_seconds:
            if self.classification is Classification.LONG_TOOL:
                self.classification = Classification.ACTIVE
            return []
        actions: list[Action] = []
        if self.classification in (Classification.ACTIVE, Classification.LONG_TOOL):
            self.classification = Classification.SUSPECT  # WD2
            self.suspicions += 1
        if "soft" not in self.probes:
            self.probes["soft"] = _SENT
            actions.append(Probe("soft"))
        hard = self.hard_threshold() if not self.leases else None
        if hard is None:  # WD4: unknown, tool, settled: observe only
            return actions
        awake_floor = max(self.last_progress_awake, self.wake_awake)
        if deadline is not None:
            awake_floor = max(awake_floor, event.awake - (event.now - deadline))
        waited = event.awake - awake_floor
        if waited < hard:
            return actions
        if self.grace_started_awake is None:
            self.grace_started_awake = awake_floor + hard  # WD3: the grace starts now
        if event.awake - self.grace_started_awake < self.policy.grace_seconds:
            return actions
        if self.classification is Classification.SUSPECT:
            self.classification = Classification.HARD_RESUME_ELIGIBLE
        if "fence" not in self.probes:
            self.probes["fence"] = _SENT
            actions.append(Probe("fence"))
        return actions

    def _note_suspend(self, event: Tick) -> None:
        gap = event.now - event.awake
        last = self.suspended_total
        if last is not None and gap - last > SUSPEND_EVIDENCE_SECONDS:
            if self.wake_awake <= self.last_progress_awake:
                # WD6: hard clocks restart in awake time — at the first wake of a silence
                # only, so a host that sleeps more often than hard + grace still fences
                self.wake_awake = event.awake
            self.grace_started_awake = None
            self.probes.pop("fence", None)  # so does eligibility: a new fresh probe is due
            if self.classification is Classification.HARD_RESUME_ELIGIBLE:
                self.classification = Classification.SUSPECT
        self.suspended_total = gap

    def _on_probe(self, event: ProbeAnswered) -> list[Action]:
        if event.evidence:  # something new happened: not silent after all
            if self.classification in (Classification.SUSPECT, Classification.HARD_RESUME_ELIGIBLE):
                self.false_suspects += 1  # once per episode: progress may have counted it
            if self.classification in _CLEARED_BY_PROGRESS:
                self.classification = Classification.ACTIVE
            self.probes.clear()
            self.grace_started_awake = None
            return []
        if event.purpose == "fence" and self.classification is Classification.HARD_RESUME_ELIGIBLE:
            # WD10: one fence probe, one decision — the same answer twice (or a second one
            # for the same probe) never asks for the guards again: two checks at once would
            # each reserve, and one fence charge two epochs
            if self.probes.get("fence") != _SENT:
                return []
            self.probes["fence"] = _ANSWERED
            if event.evidence is None:
                return self._hold("probe_unanswered")
            return [CheckGuards()]
        no_hard = self.hard_threshold() is None or bool(self.leases)
        # WD4: observe, then hold — still suspect: progress fed after the probe's look (while
        # its answer was being recorded) made that answer stale, and an active worker is
        # never held on it
        suspect = self.classification is Classification.SUSPECT
        if event.purpose == "soft" and no_hard and suspect and self.phase is not Phase.SETTLED:
            return self._hold(f"silent_in_{self.phase}_phase")
        return []

    def _hold(self, reason: str) -> list[Action]:
        self.classification = Classification.STALLED_OPERATOR_REQUIRED
        self.hold_reason = reason
        return []

    def _on_guards_failed(self, event: GuardsFailed) -> list[Action]:
        return self._hold("guard:" + ",".join(event.reasons))

    def _on_hold(self, event: Hold) -> list[Action]:
        return self._hold(event.reason)

    def _on_settled(self, event: Settled) -> list[Action]:
        return self._needs_finalization("settled")

    def _on_exited(self, event: Exited) -> list[Action]:
        fenced = self.classification is Classification.FENCING
        if fenced or (self.classification is Classification.RESUMING and not self.armed):
            return []  # the fenced epoch's own exit, before the replacement was prompted
        return self._needs_finalization("exited")

    def _needs_finalization(self, reason: str) -> list[Action]:
        if self.terminal is not None:
            return []
        self.armed = False
        self.phase = Phase.SETTLED
        self.leases.clear()
        if self.completion_prompts >= 1:  # WD8: one completion prompt per epoch, then hold
            return self._hold(f"no_terminal_after_completion_prompt:{reason}")
        self.classification = Classification.NEEDS_FINALIZATION
        self.completion_prompts += 1
        return [PromptCompletion(reason)]

    def _on_terminal(self, event: TerminalAccepted) -> list[Action]:
        self.terminal = event.kind
        self.armed = False
        self.leases.clear()
        self.probes.clear()
        self.grace_started_awake = None
        self.hold_reason = None
        self.classification = (
            Classification.WAITING_USER if event.kind == "wait" else Classification.ACTIVE
        )
        return []

    def _on_woken(self, event: Woken) -> list[Action]:
        """The wait's reply: the task's input, never a proof and never the operator's
        resume — a hold (a tree not proven gone, TL12) stands over it (WD12), and the reply
        waits for the prompt that follows the operator's resume."""
        self.terminal = None
        self.completion_prompts = 0
        if self.classification is not Classification.STALLED_OPERATOR_REQUIRED:
            self.classification = Classification.ACTIVE
        return []

    def _on_fence(self, event: FenceStarted) -> list[Action]:
        self.classification = Classification.FENCING
        self.armed = False
        return []

    def _on_parked(self, event: ProviderParked) -> list[Action]:
        """PB6: an outage is not silence. Disarmed, nothing the clocks could count: no probe,
        no eligibility, no fence until the next prompt arms them again."""
        self.classification = Classification.PARKED
        self.armed = False
        self.phase = Phase.PROVIDER
        self.hold_reason = None
        self.leases.clear()
        self.probes.clear()
        self.grace_started_awake = None
        return []

    def _on_relaunched(self, event: Relaunched) -> list[Action]:
        self.classification = Classification.RESUMING
        self.hold_reason = None
        self.phase = Phase.UNKNOWN
        self.leases.clear()
        self.probes.clear()
        self.grace_started_awake = None
        self.completion_prompts = 0
        self.last_progress = max(self.last_progress, event.now)
        self.last_progress_awake = max(self.last_progress_awake, event.awake)
        return []


_WATCHED: Final = frozenset(
    {
        Classification.ACTIVE,
        Classification.LONG_TOOL,
        Classification.SUSPECT,
        Classification.HARD_RESUME_ELIGIBLE,
        Classification.RESUMING,
    }
)
"""Classifications whose silence the clocks measure (never a wait, a hold, a fence)."""
_CLEARED_BY_PROGRESS: Final = frozenset(
    {
        Classification.SUSPECT,
        Classification.HARD_RESUME_ELIGIBLE,
        Classification.RESUMING,
        Classification.STALLED_OPERATOR_REQUIRED,
        Classification.LONG_TOOL,
        Classification.ACTIVE,
    }
)
