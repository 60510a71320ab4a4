"""The lifecycle tools a task's worker calls through the gate — ``task_done``, ``task_fail``,
``task_wait`` — answered by the lane's lifecycle kernel (LK1-LK7 of
``docs/design/watchdog.md``).

Each call becomes a report to the kernel, keyed by the epoch the gate decided it in (a call
from an epoch that is no longer current is late, LK2). The receipt is durable in the lane log
before the worker gets its answer; an accepted terminal stops the watchdog's clocks, and a
call from the current epoch is that worker's progress (WD11).
"""

from __future__ import annotations

import dataclasses
from typing import Final, Protocol

import trio

from .._boundary._calls import GateCall, GateResult, RuntimeTool
from .._records import LifecycleKind, Record
from ._lifecycle import LifecycleKernel, Report, Verdict
from ._watchdog import TerminalAccepted, Watchdog

__all__ = ["LifecycleOwner", "lifecycle_tools"]

KIND_OF_TOOL: Final = {
    "task_done": LifecycleKind.DONE,
    "task_fail": LifecycleKind.FAIL,
    "task_wait": LifecycleKind.WAIT,
}
_ANSWERS: Final = {
    LifecycleKind.DONE: "Accepted: the task is marked done pending checks. Stop now.",
    LifecycleKind.FAIL: "Accepted: the task is marked failed. Stop now.",
    LifecycleKind.WAIT: "Accepted: waiting for the user's reply. Stop now; the reply will "
    "arrive as a new message.",
}


class LifecycleOwner(Protocol):
    """What the lifecycle tools use of their task lane."""

    @property
    def kernel(self) -> LifecycleKernel: ...
    @property
    def watchdog(self) -> Watchdog: ...
    def gate_epoch(self) -> int:
        """The epoch the gate decides calls in now."""
        ...

    async def append(self, record: Record) -> int: ...
    async def resumed_progress(self) -> None: ...
    def changed(self) -> None: ...


def lifecycle_tools(lane: LifecycleOwner) -> dict[str, RuntimeTool]:
    """``task_done``, ``task_fail`` and ``task_wait`` for ``lane``'s gate."""
    return {name: _tool(lane, kind) for name, kind in KIND_OF_TOOL.items()}


def _tool(lane: LifecycleOwner, kind: LifecycleKind) -> RuntimeTool:
    async def handle(call: GateCall, intent_id: str) -> GateResult:
        kernel, epoch = lane.kernel, lane.gate_epoch()
        key = kernel.current
        if epoch != key.epoch:  # a call decided in another epoch: late (LK2)
            key = dataclasses.replace(key, epoch=epoch)
        detail = " ".join(str(v) for v in call.args.values())[:2000]
        verdict = kernel.report(Report(key=key, intent_id=intent_id, kind=kind, detail=detail))
        if verdict is not Verdict.DUPLICATE:
            # durable before the answer; decided already, so written whole whoever cancels
            # the call (its epoch ending takes the gate's requests with it)
            with trio.CancelScope(shield=True):
                await lane.append(kernel.receipts[-1])
        if verdict is Verdict.ACCEPTED:
            lane.watchdog.feed(TerminalAccepted(str(kind)))
        if epoch == kernel.current.epoch:
            # The resumed worker called a tool: its first progress, even when the gate
            # answers before its stdout events are read (WD11).
            await lane.resumed_progress()
        if verdict is Verdict.ACCEPTED:
            lane.changed()
            return GateResult.text(_ANSWERS[kind])
        if verdict is Verdict.DUPLICATE:
            return GateResult.text("Already recorded.")
        if verdict is Verdict.REPLY_PENDING:
            return GateResult.text(
                "Not accepted: the user has answered your task_wait; the answer arrives as "
                "your next message. Stop now and read it.",
                is_error=True,
            )
        return GateResult.text(
            f"Not accepted ({verdict}): a lifecycle outcome was already recorded for this task.",
            is_error=True,
        )

    return handle
