"""The lifecycle kernel of a task lane: first terminal wins (docs/design/watchdog.md,
docs/design/watchdog.md).

Pure core: no trio, no I/O. ``task_done`` / ``task_fail`` / ``task_wait`` reach it through
the tool gate as intents (the gate has made the intent durable first); the kernel decides
whether a report is *accepted*, a *duplicate* of one already consumed, or *late evidence*;
the shell records its verdict as a :class:`~runtime._records.LifecycleReceipt` before the
worker hears the answer. Operator controls (abort, fail) are reports too. The invariants
(LK1…) are in ``docs/design/watchdog.md``.

A terminal receipt is not Done. Done needs, besides an accepted ``done`` of the current
epoch: the exact process tree quiescent, a worktree manifest taken after quiescence, a
candidate checkpoint bound to that manifest and — when configured — a passing validation
receipt for the same manifest (:func:`done_missing`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from .._records import LifecycleKind, LifecycleReceipt

__all__ = [
    "DoneEvidence",
    "EpochKey",
    "LifecycleKernel",
    "Report",
    "TaskState",
    "Verdict",
    "done_missing",
]

OPERATOR_EPOCH: Final = -1
"""The epoch of an operator's report (abort/fail): it is never late by epoch."""


class TaskState(enum.StrEnum):
    """Where the task stands in its lifecycle (the kernel's, not the watchdog's view)."""

    OPEN = "open"
    WAITING = "waiting"
    """An accepted ``task_wait`` parks the task until its correlated reply."""
    SUCCESS_INTENT = "success_intent"
    """An accepted ``task_done``: not Done until the evidence is complete (LK4)."""
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in (TaskState.SUCCESS_INTENT, TaskState.DONE, TaskState.FAILED,
                        TaskState.ABORTED)  # fmt: skip


class Verdict(enum.StrEnum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    """The same intent again: consumed once, answered the same (LK3)."""
    LATE_EPOCH = "late_epoch"
    """From an epoch, fence, attempt or generation that is not current (LK2)."""
    LATE_TERMINAL = "late_terminal"
    """After a terminal was accepted (LK1)."""
    NOT_WAITING = "not_waiting"
    """A reply whose correlation is not the current wait's (LK5)."""
    REPLY_PENDING = "reply_pending"
    """The worker's report while the user's reply has not reached it yet (LK8)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochKey:
    """Whose report it is: only the current one may request a disposition."""

    task_id: str
    generation: int
    attempt: int
    fence: int
    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    key: EpochKey
    intent_id: str
    kind: LifecycleKind
    """``done`` / ``fail`` / ``wait``, or an operator's ``abort`` / ``operator_fail``."""
    detail: str = ""


_OUTCOME: Final = {
    LifecycleKind.DONE: TaskState.SUCCESS_INTENT,
    LifecycleKind.FAIL: TaskState.FAILED,
    LifecycleKind.WAIT: TaskState.WAITING,
    LifecycleKind.ABORT: TaskState.ABORTED,
    LifecycleKind.OPERATOR_FAIL: TaskState.FAILED,
}


_OPERATOR_ENDS: Final = (LifecycleKind.ABORT, LifecycleKind.OPERATOR_FAIL)


@dataclass
class LifecycleKernel:
    """The lifecycle of one task attempt. Mutable, pure; rebuilt from its receipts."""

    task_id: str
    generation: int = 1
    attempt: int = 1
    fence: int = 0
    epoch: int = 0
    state: TaskState = TaskState.OPEN
    wait_correlation: str | None = None
    reply_pending: bool = False
    """A reply woke the task and the worker has not been sent it yet (LK8)."""
    receipts: list[LifecycleReceipt] = field(default_factory=list)
    """Every verdict, accepted or late, in order."""
    _consumed: dict[str, Verdict] = field(default_factory=dict)

    @property
    def current(self) -> EpochKey:
        return EpochKey(
            task_id=self.task_id,
            generation=self.generation,
            attempt=self.attempt,
            fence=self.fence,
            epoch=self.epoch,
        )

    @property
    def terminal(self) -> LifecycleReceipt | None:
        """The accepted terminal receipt (done / fail / abort) in force, if any: the first, or
        an operator's that ended a success intent before it was finalized (LK9)."""
        for receipt in reversed(self.receipts):
            if receipt.accepted and _OUTCOME.get(receipt.kind, TaskState.OPEN).terminal:
                return receipt
        return None

    def may_begin(self) -> bool:
        """Whether a new process epoch may own the task (LK6): no terminal accepted, and no
        wait — a parked task is woken by its reply (LK5), not by a continuation."""
        return not self.state.terminal and self.state is not TaskState.WAITING

    def begin_epoch(self, epoch: int, *, fenced: bool) -> bool:
        """The epoch compare-and-set (LK6): a new process epoch may own the task only while
        no terminal (nor a wait: docs/design/watchdog.md, "park") was accepted. ``fenced``: the old
        epoch was
        fenced (the fence counter moves, so its late reports are old-fence evidence)."""
        if not self.may_begin():
            return False
        if epoch <= self.epoch:
            raise ValueError(f"epoch {epoch} is not after the current epoch {self.epoch}")
        self.epoch = epoch
        if fenced:
            self.fence += 1
        return True

    def report(self, report: Report) -> Verdict:
        """Judge one report (LK1 to LK3); the caller records the receipt this appends."""
        seen = self._consumed.get(report.intent_id)
        if seen is not None:
            return Verdict.DUPLICATE
        verdict = self._judge(report)
        self._consumed[report.intent_id] = verdict
        key = report.key
        self.receipts.append(
            LifecycleReceipt(
                task_id=key.task_id,
                generation=key.generation,
                attempt=key.attempt,
                fence=key.fence,
                epoch=key.epoch,
                intent_id=report.intent_id,
                kind=report.kind,
                detail=report.detail,
                accepted=verdict is Verdict.ACCEPTED,
                verdict=str(verdict),
            )
        )
        if verdict is Verdict.ACCEPTED:
            self.state = _OUTCOME[report.kind]
            self.wait_correlation = report.intent_id if report.kind == LifecycleKind.WAIT else None
        return verdict

    def _judge(self, report: Report) -> Verdict:
        operator = report.key.epoch == OPERATOR_EPOCH
        if operator:  # never late by epoch or fence, but only for this very attempt
            key, current = report.key, self.current
            if (key.task_id, key.generation, key.attempt) != (
                current.task_id, current.generation, current.attempt
            ):  # fmt: skip
                return Verdict.LATE_EPOCH
        elif report.key != self.current:
            return Verdict.LATE_EPOCH
        if self.state is TaskState.SUCCESS_INTENT and operator and report.kind in _OPERATOR_ENDS:
            return Verdict.ACCEPTED  # LK9: not finalized yet, an operator may still end it
        if self.state.terminal:
            return Verdict.LATE_TERMINAL
        if self.state is TaskState.WAITING and not operator:
            return Verdict.LATE_TERMINAL  # a parked task's worker says nothing more
        if self.reply_pending and not operator:
            return Verdict.REPLY_PENDING  # decided without the user's answer (LK8)
        return Verdict.ACCEPTED

    def reply(self, correlation: str | None) -> Verdict:
        """A reply to the current wait (LK5): only its correlation wakes the task."""
        if self.state is not TaskState.WAITING:
            return Verdict.NOT_WAITING
        if correlation is not None and correlation != self.wait_correlation:
            return Verdict.NOT_WAITING
        self.state = TaskState.OPEN
        self.wait_correlation = None
        self.reply_pending = True
        return Verdict.ACCEPTED

    def reply_heard(self) -> None:
        """The prompt carrying the reply reached the worker: its reports count again (LK8)."""
        self.reply_pending = False

    def operator_key(self) -> EpochKey:
        return EpochKey(
            task_id=self.task_id,
            generation=self.generation,
            attempt=self.attempt,
            fence=self.fence,
            epoch=OPERATOR_EPOCH,
        )

    def finalize(self) -> None:
        """Done: call only once :func:`done_missing` is empty."""
        if self.state is not TaskState.SUCCESS_INTENT:
            raise ValueError(f"only a success intent can become done, not {self.state}")
        self.state = TaskState.DONE

    @classmethod
    def restore(
        cls, task_id: str, receipts: Iterable[LifecycleReceipt], *, generation: int = 1,
        attempt: int = 1, fence: int = 0, epoch: int = 0, done: bool = False,
        replies: Iterable[str] = (),
    ) -> LifecycleKernel:  # fmt: skip
        """The kernel as its durable receipts and replies leave it (LK7)."""
        kernel = cls(task_id, generation=generation, attempt=attempt, fence=fence, epoch=epoch)
        answered = set(replies)
        for receipt in receipts:
            kernel.receipts.append(receipt)
            kernel._consumed[receipt.intent_id] = Verdict(receipt.verdict or "accepted")
            if receipt.accepted:
                kernel.state = _OUTCOME[receipt.kind]
                kernel.wait_correlation = None  # as report() leaves it
                if receipt.kind == LifecycleKind.WAIT:
                    kernel.wait_correlation = receipt.intent_id
                    if receipt.intent_id in answered:
                        kernel.state = TaskState.OPEN
                        kernel.wait_correlation = None
        if done and kernel.state is TaskState.SUCCESS_INTENT:
            kernel.state = TaskState.DONE
        return kernel


@dataclass(frozen=True, slots=True, kw_only=True)
class DoneEvidence:
    """What the shell gathered for a Done (docs/design/watchdog.md)."""

    terminal: LifecycleReceipt | None
    quiescent_epoch: int | None
    """The process epoch whose whole tree was proven gone (``None``: not proven)."""
    manifest_digest: str | None
    candidate_manifest_digest: str | None
    validation_required: bool = False
    validation_passed: bool | None = None
    validation_manifest_digest: str | None = None


def done_missing(kernel: LifecycleKernel, evidence: DoneEvidence) -> list[str]:
    """What still stands between the task and Done (LK4); empty: Done may be recorded."""
    missing: list[str] = []
    terminal = evidence.terminal
    if (
        terminal is None
        or terminal.kind != LifecycleKind.DONE
        or not terminal.accepted
        or terminal != kernel.terminal
    ):
        missing.append("terminal_receipt")
    if terminal is None or evidence.quiescent_epoch != terminal.epoch:
        missing.append("quiescence")
    if evidence.manifest_digest is None:
        missing.append("manifest")
    if (
        evidence.candidate_manifest_digest is None
        or evidence.candidate_manifest_digest != evidence.manifest_digest
    ):
        missing.append("candidate")
    if evidence.validation_required and not (
        evidence.validation_passed
        and evidence.validation_manifest_digest == evidence.manifest_digest
    ):
        missing.append("validation")
    return missing
