"""How a task lane ends: ``done`` only with the whole Done tuple (LK4 of
``docs/design/watchdog.md``), and the end record every ending writes.

:func:`conclude` runs when the lifecycle kernel holds an accepted ``task_done``: it takes the
worktree's manifest and a candidate (a commit or an archive), runs the task's validation
command when it has one, and asks the kernel what of the tuple is missing — the terminal
receipt, a quiescent epoch (nothing of the worker alive), the candidate and the validation
matching the manifest. Anything missing is an ending ``held`` with ``task_not_done`` and the
list, which the lane holds on rather than ends (LK10: the operator may retry); the whole
tuple finalizes the kernel and ends it ``done``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from .._errors import PiRuntimeError, ReasonCode
from .._records import LifecycleReceipt, Record, TaskEnded, TaskSubmitted
from ._candidate import acandidate
from ._lifecycle import DoneEvidence, LifecycleKernel, TaskState, done_missing
from ._state import inference_costs
from ._validation import run_validation
from ._worktree import amanifest

__all__ = ["Ending", "conclude", "end_record"]


@dataclass(frozen=True, slots=True)
class Ending:
    """How a lane ends, before its end record is written."""

    state: str
    """``done``, ``held``, or the terminal state (``failed``, ``aborted``)."""
    code: str | None = None
    detail: str = ""
    manifest: str | None = None
    candidate: dict[str, Any] | None = None
    validation: dict[str, Any] | None = None


async def conclude(
    kernel: LifecycleKernel,
    task: TaskSubmitted,
    *,
    archive_dir: Path,
    quiescent_epoch: int | None,
) -> Ending:
    """``done`` with the whole tuple (the kernel finalized), else ``held`` naming what is
    missing (LK4)."""
    worktree = Path(task.worktree)
    try:
        manifest = await amanifest(worktree)
        candidate = await acandidate(
            worktree,
            manifest,
            archive_dir=archive_dir,
            task_id=task.task_id,
            message=f"pi-runtime candidate for task {task.task_id}",
        )
    except PiRuntimeError as error:
        return Ending("held", code=str(error.code), detail=str(error))
    validation = None
    if task.validation:
        validation = await run_validation(
            worktree, task.validation, manifest, timeout=task.validation_timeout
        )
    evidence = DoneEvidence(
        terminal=kernel.terminal,
        quiescent_epoch=quiescent_epoch,
        manifest_digest=manifest.digest,
        candidate_manifest_digest=candidate.manifest_digest,
        validation_required=bool(task.validation),
        validation_passed=validation.passed if validation else None,
        validation_manifest_digest=validation.manifest_digest if validation else None,
    )
    if kernel.state is not TaskState.SUCCESS_INTENT:  # an operator ended it meanwhile (LK9)
        return Ending(str(kernel.state))
    taken = msgspec.to_builtins(candidate)
    checked = msgspec.to_builtins(validation) if validation else None
    missing = done_missing(kernel, evidence)
    if missing:
        detail = "missing: " + ", ".join(missing)
        return Ending(
            "held",
            code=ReasonCode.TASK_NOT_DONE,
            detail=detail,
            manifest=manifest.digest,
            candidate=taken,
            validation=checked,
        )
    kernel.finalize()
    return Ending("done", manifest=manifest.digest, candidate=taken, validation=checked)


def end_record(
    ending: Ending,
    terminal: LifecycleReceipt | None,
    records: Iterable[Record],
    *,
    ended_ms: int,
) -> TaskEnded:
    """The lane's last record: the ending, the terminal receipt's detail when the ending
    has none, and the task's inference costs from every record of its log (the gateway's
    too)."""
    detail = ending.detail or (terminal.detail if terminal is not None else "")
    return TaskEnded(
        costs=inference_costs(records),
        state=ending.state,
        code=ending.code,
        detail=detail,
        manifest_digest=ending.manifest,
        candidate=ending.candidate,
        validation=ending.validation,
        ended_ms=ended_ms,
    )
