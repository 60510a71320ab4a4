"""What a task lane's watchdog sees of its worker: Pi events mapped to progress, phase and
leases (WD1, WD4, WD5), and the telemetry that is recorded but never changes policy.

Pure: no trio, no clock reads — the lane passes the suspend-aware readings in. The
classifications and clocks themselves are :mod:`runtime._tasks._watchdog`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ._watchdog import Lease, LeaseEnded, Phase, Progress, Watchdog

__all__ = ["Telemetry", "declared_lease", "is_model_output", "watch_event"]

_PROVIDER_EVENTS: Final = frozenset({"turn_start", "auto_retry_start", "compaction_start"})
_MESSAGE_EVENTS: Final = frozenset({"message_start", "message_update", "message_end"})
TELEMETRY_KEPT: Final = 10
"""How many of the latest samples of each series a lane keeps (its memory stays bounded)."""


def is_model_output(kind: str, record: Mapping[str, Any]) -> bool:
    """A message event of the model's own answer; the prompt or a tool result echoed is not
    (it is no progress of the model)."""
    if kind not in _MESSAGE_EVENTS:
        return False
    message = record.get("message") or {}
    return not isinstance(message, dict) or message.get("role") in (None, "assistant")


def watch_event(
    kind: str, record: Mapping[str, Any], now: float, awake: float
) -> Progress | Lease | LeaseEnded | None:
    """One worker event as the watchdog's event (WD1), or ``None`` when it is not progress.

    A request starting (a turn, a provider retry, a compaction) is progress in the provider
    phase; the model's tokens are progress in the generation phase; the end of a message is
    progress in an unknown phase (tools or the end come next: no guess, WD4); a tool starting
    is a lease when its arguments declare a deadline (WD5), else progress in the tool phase,
    and so is its live output while it runs."""
    if kind in _PROVIDER_EVENTS:
        return Progress(now, awake, Phase.PROVIDER, kind)
    if kind in _MESSAGE_EVENTS:
        if not is_model_output(kind, record):
            return None
        phase = Phase.UNKNOWN if kind == "message_end" else Phase.GENERATION
        return Progress(now, awake, phase, kind)
    if kind == "tool_execution_start":
        lease = declared_lease(record)
        if lease is not None:
            return Lease(now, awake, str(record.get("toolCallId", "")), now + lease)
        return Progress(now, awake, Phase.TOOL, kind)
    if kind == "tool_execution_update":  # a running tool's live output (a streaming bash)
        return Progress(now, awake, Phase.TOOL, kind)
    if kind == "tool_execution_end":
        return LeaseEnded(now, awake, str(record.get("toolCallId", "")))
    return None


def declared_lease(record: Mapping[str, Any]) -> float | None:
    """A gated tool's declared deadline (seconds), if its arguments name one (WD5)."""
    args = record.get("args")
    timeout = args.get("timeout") if isinstance(args, dict) else None
    if isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0:
        return float(timeout)
    return None


def keep(samples: list[float], sample: float) -> None:
    """Append ``sample``, keeping the latest :data:`TELEMETRY_KEPT` (a list: an empty one
    costs a tenth of an empty ``deque``, and parked lanes are many)."""
    samples.append(sample)
    del samples[:-TELEMETRY_KEPT]


@dataclass(slots=True)
class Telemetry:
    """Time to first token, inter-token gaps, probes and resume latency of one lane (issue #8
    item 10): recorded, shown by ``task show``, never read by a decision."""

    ttft: list[float] = field(default_factory=list)
    max_gap: float = 0.0
    resume_latency: list[float] = field(default_factory=list)
    probes: int = 0
    request_started: float | None = None
    last_token: float | None = None
    worktree_changes: int = 0
    """Worktree changes the progress scan saw (WD1)."""

    def see(self, kind: str, record: Mapping[str, Any], now: float) -> None:
        """Note one worker event at ``now`` (boottime seconds)."""
        if kind in _PROVIDER_EVENTS:
            self.request_started = now
        elif kind == "message_end" and is_model_output(kind, record):
            self.last_token = None
        elif is_model_output(kind, record):
            if self.last_token is None and self.request_started is not None:
                keep(self.ttft, now - self.request_started)
            elif self.last_token is not None:
                self.max_gap = max(self.max_gap, now - self.last_token)
            self.last_token = now

    def resumed(self, seconds: float) -> None:
        """A recovery ended after ``seconds`` (the resume latency)."""
        keep(self.resume_latency, seconds)

    def as_dict(self, watchdog: Watchdog) -> dict[str, Any]:
        return {
            "ttft_seconds": [round(t, 3) for t in self.ttft],
            "max_inter_token_gap_seconds": round(self.max_gap, 3),
            "false_suspects": watchdog.false_suspects,
            "suspicions": watchdog.suspicions,
            "probes": self.probes,
            "resume_latency_seconds": [round(t, 3) for t in self.resume_latency],
            "worktree_changes": self.worktree_changes,
        }
