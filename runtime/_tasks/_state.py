"""What a task is and what its lane log says: the submission, the diagnostics view, the
continuation prompt, and the lane's durable state read back from its records
(docs/design/watchdog.md).

Pure apart from :func:`check_spec`'s look at the worktree: no trio, no clock. The task lane
(``runtime/_tasks/_lane.py``) restores itself with :func:`read_lane`; the offline ``task show``
reads a log no server runs on with the same function. The invariants (LK…, WD…, TL…) are in
``docs/design/watchdog.md``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec

from .._errors import ReasonCode, TaskError
from .._journal._store import lane_key
from .._pi._launch import ModelRoute
from .._pi._session import Attestation, Session
from .._records import (
    ContinuationSent,
    EpochFenced,
    EpochStarted,
    LifecycleReceipt,
    ModelRequestIntent,
    ModelResponse,
    OutboxAction,
    Record,
    TaskEnded,
    TaskReply,
    TaskSubmitted,
)
from .._wire import TaskSpec
from ._guards import Budget
from ._lifecycle import LifecycleKernel
from ._watchdog import WatchdogPolicy

__all__ = [
    "CONTINUATION_VERSION",
    "LIFECYCLE_TOOLS",
    "LaneState",
    "check_spec",
    "continuation_marker",
    "continuation_prompt",
    "inference_costs",
    "read_lane",
    "reply_prompt",
    "route_change",
    "route_snapshot",
    "session_rel",
    "session_route_change",
    "submitted_record",
    "task_policy",
]

CONTINUATION_VERSION: Final = 1
"""The version of the one neutral continuation prompt (its marker carries it)."""
LIFECYCLE_TOOLS: Final = ("task_done", "task_fail", "task_wait")
MAX_VALIDATION_TIMEOUT: Final = 86_400.0
_TASK_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


def continuation_marker(action_id: str) -> str:
    """The first line of prompt ``action_id`` (a continuation, or a reply: ``…/replyN``):
    what makes it idempotent in the session (TL5, LK8)."""
    kind = "reply" if action_id.rsplit("/", 1)[-1].startswith("reply") else "continuation"
    return f"[pi-runtime {kind} v{CONTINUATION_VERSION} {action_id}]"


def reply_prompt(action_id: str, text: str) -> str:
    """The user's reply as the worker's next prompt: its marker, then the reply (LK8)."""
    return f"{continuation_marker(action_id)}\n{text}"


def continuation_prompt(
    action_id: str, observed: str, reply: str | None = None, task: str | None = None
) -> str:
    """The one versioned, neutral continuation prompt (TL5): a bounded observed fact, the
    absence of a terminal receipt, what to inspect, what not to repeat, what to call. Its
    first line is the marker that makes it idempotent; its wording is guidance, never proof.
    ``reply``: the user's answer no prompt carried yet (LK8); ``task``: the task itself, when
    no worker answered its prompt (the one sent it died first), so it is not in the session."""
    return (
        f"{continuation_marker(action_id)}\n"
        f"Observed: {observed}. No terminal receipt (task_done, task_fail or task_wait) has "
        "been recorded for this task.\n"
        "Before acting, inspect this session, the worktree, the task above and every tool "
        "result. Do not repeat a side effect that may already have happened: a result saying "
        "a tool possibly ran means check first.\n"
        "Then finish the task and call exactly one of task_done, task_fail or task_wait."
        + (f"\nThe user answered your task_wait: {reply}" if reply is not None else "")
        + (
            f"\nThe task (the worker it was sent to exited first):\n{task}"
            if task is not None
            else ""
        )
    )


def task_policy(
    submitted: TaskSubmitted, fallback: WatchdogPolicy
) -> tuple[WatchdogPolicy, str | None]:
    """The watchdog policy frozen in ``submitted`` (WD14), so a restart with another
    configuration changes nothing of a running task's thresholds, grace or budgets; and the
    hold reason when it cannot be read back (``policy_unreadable:<why>``: a snapshot of
    another version, or damaged), with ``fallback`` (the host's) in its place until an
    operator decides. ``fallback`` also serves a log written before the policy was frozen."""
    if not submitted.policy:
        return fallback, None
    try:
        return WatchdogPolicy.from_snapshot(submitted.policy), None
    except ValueError as error:
        return fallback, f"policy_unreadable:{error}"


@dataclass
class LaneState:
    """What a task lane's log says, read without running anything (:func:`read_lane`)."""

    kernel: LifecycleKernel
    budget: Budget
    policy: WatchdogPolicy
    """The task's own policy, frozen at its submission (WD14)."""
    policy_problem: str | None = None
    """Why the frozen policy could not be read back (the task holds on it), if it could not."""
    actions: dict[str, OutboxAction] = field(default_factory=dict)
    markers: dict[str, ContinuationSent] = field(default_factory=dict)
    replies: dict[str, TaskReply] = field(default_factory=dict)
    epochs: int = 0
    record: EpochStarted | None = None
    """The last epoch started."""
    fenced: set[int] = field(default_factory=set)
    """Epochs whose end is recorded."""
    hold: str | None = None
    """The reason of a hold no operator action lifted yet (WD12)."""
    fence: int | None = None
    """The fence of the last epoch launched, as its launch action recorded it (LK2)."""
    last_reply: TaskReply | None = None
    reply_carrier: str | None = None
    """The action id of the first prompt sent after the last reply: the one that carried it
    (LK8). Whether the worker kept it is the session's to say."""
    ended: TaskEnded | None = None
    continuations: int = 0
    attestation: Attestation | None = None
    recoveries: int = 0
    """Recoveries whose time is charged."""
    recovery_started_ms: int | None = None
    """The start of a recovery still running (WD11): the ``at_ms`` of its first reserve, or
    of its ``recovery_start`` when no reserve started it."""

    def launched_in_host(self, epoch: int) -> bool:
        """Epoch ``epoch`` was launched, recorded as a worker inside its host (it died with
        it); False for a process worker or a log that does not say."""
        return any(
            a.kind == "launch" and a.detail.get("epoch") == epoch and a.detail.get("in_host")
            for a in self.actions.values()
        )

    def unstarted_launch(self) -> OutboxAction | None:
        """The launch of the last epoch when no ``EpochStarted`` or end names that epoch and
        the launch journaled a nonce: a host that died between the spawn and the start left
        a tree only that nonce names (W13). ``None`` for an in-host worker, a launch that
        started or ended, or a log from before W13."""
        if self.epochs == 0 or self.epochs in self.fenced:
            return None
        if self.record is not None and self.record.epoch == self.epochs:
            return None
        for action in reversed(self.actions.values()):
            if action.kind == "launch" and action.detail.get("epoch") == self.epochs:
                nonce = action.detail.get("nonce")
                return action if isinstance(nonce, str) else None
        return None

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
    continuation markers, the epochs and the latest attestation. The budget is the frozen
    policy's (WD14); ``policy`` serves a log from before it was frozen. Pure."""
    records = list(records)
    policy, problem = task_policy(submitted, policy)
    state = LaneState(
        kernel=LifecycleKernel(submitted.task_id),
        budget=Budget(max_epochs=policy.max_replacements, max_seconds=policy.recovery_seconds),
        policy=policy,
        policy_problem=problem,
    )
    for record in records:
        if isinstance(record, OutboxAction):
            state.actions[record.action_id] = record
            _apply_action(state, record)
        elif isinstance(record, ContinuationSent):
            state.markers[record.action_id] = record
            if state.last_reply is not None and state.reply_carrier is None:
                state.reply_carrier = record.action_id  # LK8
        elif isinstance(record, TaskReply):
            state.replies[record.correlation] = record
            state.last_reply, state.reply_carrier = record, None
        elif isinstance(record, EpochStarted):
            state.epochs = max(state.epochs, record.epoch)
            state.record = record
        elif isinstance(record, EpochFenced):  # an in-process epoch records only its end
            state.fenced.add(record.epoch)
            state.epochs = max(state.epochs, record.epoch)
        elif isinstance(record, TaskEnded):
            state.ended = record
    state.kernel = LifecycleKernel.restore(
        submitted.task_id,
        [r for r in records if isinstance(r, LifecycleReceipt)],
        generation=submitted.generation,
        attempt=submitted.attempt,
        fence=(
            state.fence
            if state.fence is not None  # a log from before launch actions: count the fences
            else sum(isinstance(r, EpochFenced) and r.reason == "fence" for r in records)
        ),
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
        at_ms = action.detail.get("at_ms")
        if state.recovery_started_ms is None and isinstance(at_ms, int):
            state.recovery_started_ms = at_ms
    elif action.kind == "launch":  # intent before effect: an epoch that began counts
        state.epochs = max(state.epochs, int(action.detail.get("epoch", 0)))
        state.fence = max(state.fence or 0, int(action.detail.get("fence", 0)))
    elif action.kind == "hold":
        state.hold = str(action.detail.get("reason"))
    elif action.kind == "unhold":
        state.hold = None
    elif action.kind == "recovery_start" and action.state == "done":  # no reserve started it
        at_ms = action.detail.get("at_ms")
        if state.recovery_started_ms is None and isinstance(at_ms, int):
            state.recovery_started_ms = at_ms
    elif action.kind == "recovery_time" and action.state == "done":
        state.budget = state.budget.charge_seconds(float(action.detail.get("seconds", 0.0)))
        state.recoveries += 1
        state.recovery_started_ms = None
    elif action.kind == "grant":
        with contextlib.suppress(ValueError):
            state.budget = state.budget.grant(
                epochs=int(action.detail.get("epochs", 0)),
                seconds=float(action.detail.get("seconds", 0.0)),
            )


def route_snapshot(route: ModelRoute) -> dict[str, Any]:
    """The frozen route of a task (TL4): provider, model, endpoint, API kind and reasoning
    level — everything that decides which model answers and how; never a key."""
    return {
        "provider": route.provider,
        "model": route.model,
        "endpoint": route.base_url,
        "api": route.api,
        "thinking_level": route.thinking_level,
    }


_ROUTE_REQUIRED: Final = ("provider", "model")


def route_change(frozen: Mapping[str, Any], route: ModelRoute) -> str | None:
    """The hold reason when ``route`` is not the frozen one (TL4): ``route_changed:<part>``
    naming the first part that differs, else None. A snapshot written before a part was
    frozen is compared on the parts it has, provider and model always."""
    current = route_snapshot(route)
    for part, value in current.items():
        if (part in frozen or part in _ROUTE_REQUIRED) and frozen.get(part) != value:
            return f"route_changed:{part}"
    return None


def session_route_change(frozen: Mapping[str, Any], session: Session) -> str | None:
    """The hold reason when the session would resume on another route than the frozen one
    (TL4): its last ``model_change`` and ``thinking_level_change`` on the current path are
    what Pi continues with. ``route_changed:session.<part>``, else None."""
    model: dict[str, Any] = {}
    level: str | None = None
    for entry in session.path_to_root():
        if entry.type == "model_change":
            model = entry.raw
        elif entry.type == "thinking_level_change":
            level = entry.raw.get("thinkingLevel")
    found = {"provider": model.get("provider"), "model": model.get("modelId")}
    if "thinking_level" in frozen:
        found["thinking_level"] = level
    for part, value in found.items():
        if frozen.get(part) != value:
            return f"route_changed:session.{part}"
    return None


def check_spec(spec: TaskSpec) -> None:
    """Refuse a bad task with a stable code (TL1)."""
    if not _TASK_ID.fullmatch(spec.task_id):
        raise TaskError(ReasonCode.TASK_INVALID, "task_id: 1-128 letters, digits, _ . : -")
    if not spec.prompt.strip():
        raise TaskError(ReasonCode.TASK_INVALID, "prompt: must not be empty")
    path = Path(spec.worktree)
    if not path.is_absolute():
        raise TaskError(ReasonCode.TASK_INVALID, "worktree: must be an absolute path")
    try:
        is_dir = path.is_dir()
    except OSError as exc:  # too long a name, a parent it may not search
        raise TaskError(
            ReasonCode.WORKTREE_MISSING, f"worktree: cannot be looked at ({exc.strerror})"
        ) from None
    if not is_dir:
        raise TaskError(ReasonCode.WORKTREE_MISSING, f"worktree: {path} is not a directory")
    if any("\x00" in word for word in spec.validation):  # no process starts with one
        raise TaskError(
            ReasonCode.TASK_INVALID, "validation: a command's words must not hold a NUL byte"
        )
    timeout = spec.validation_timeout
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_VALIDATION_TIMEOUT):
        raise TaskError(
            ReasonCode.TASK_INVALID,
            f"validation_timeout: seconds above 0, at most {MAX_VALIDATION_TIMEOUT:g}, "
            f"not {timeout!r}",
        )
    unknown = sorted(spec.grants - {"read", "bash", "edit", "write", "effect", "write_document",
                                    "read_document"})  # fmt: skip
    if unknown:
        raise TaskError(ReasonCode.TASK_INVALID, f"grants: unknown tools {', '.join(unknown)}")


def session_rel(task_id: str) -> str:
    """Where a task's session lives under the state directory (its lane directory)."""
    return f"lanes/{lane_key(f'task:{task_id}')}/session.jsonl"


def submitted_record(
    spec: TaskSpec, *, route: ModelRoute, policy: WatchdogPolicy, now_ms: int
) -> TaskSubmitted:
    return TaskSubmitted(
        task_id=spec.task_id,
        prompt=spec.prompt,
        worktree=os.path.realpath(spec.worktree),
        grants=sorted(spec.grants),
        session_path=session_rel(spec.task_id),
        route=route_snapshot(route),
        validation=list(spec.validation),
        validation_timeout=spec.validation_timeout,
        submitted_ms=now_ms,
        policy=policy.snapshot(),
    )


def inference_costs(records: Iterable[Record]) -> dict[str, Any]:
    """What the task's model answers cost, from its log (domain isolation, TL10): the
    original work (the task and the user's replies) and the continuations (every answer after
    a continuation or completion prompt until the next reply) apart. Each bucket counts the
    complete upstream answers (``model_response``: journal replays are not asked again, so
    never counted twice) and their reported tokens. ``requests_without_answer`` counts
    upstream requests recorded with no complete answer before the same step was asked again
    or the log ended (cut, failed, or lost in a crash): possibly paid, possibly twice. Pure;
    attribution follows the log's order."""
    buckets = {"task": _zero_cost(), "continuation": _zero_cost()}
    bucket = "task"
    asked: set[int] = set()
    without = 0
    for record in records:
        if isinstance(record, ContinuationSent):
            bucket = "continuation"
        elif isinstance(record, TaskReply):
            bucket = "task"
        elif isinstance(record, ModelRequestIntent):
            if record.step in asked:
                without += 1  # asked again: the earlier request got no complete answer
            asked.add(record.step)
        elif isinstance(record, ModelResponse):
            asked.discard(record.step)
            cost = buckets[bucket]
            cost["answers"] += 1
            prompt, completion = _reported_tokens(record.chunks)
            cost["prompt_tokens"] += prompt
            cost["completion_tokens"] += completion
    return {**buckets, "requests_without_answer": without + len(asked)}


def _zero_cost() -> dict[str, int]:
    return {"answers": 0, "prompt_tokens": 0, "completion_tokens": 0}


def _reported_tokens(chunks: Iterable[str]) -> tuple[int, int]:
    """The tokens an OpenAI-style stream reports (its last ``usage``); (0, 0) if none."""
    prompt = completion = 0
    for chunk in chunks:
        if '"usage"' not in chunk:
            continue
        try:
            usage = json.loads(chunk).get("usage")
        except (ValueError, AttributeError):
            continue
        if isinstance(usage, dict):
            prompt = _count(usage.get("prompt_tokens"))
            completion = _count(usage.get("completion_tokens"))
    return prompt, completion


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
