"""Fake-Pi as a task of the test's own Trio run: task-lane workers for virtual-time tests.

:class:`InProcessWorkers` is a :class:`~runtime._tasks._workers.WorkerFactory` whose epochs
are Fake-Pi instances in this process, answering their tool gate from the lane's gate journal
without a socket; with ``autojump_clock`` (or :func:`runtime.testing.io_aware_autojump_clock`)
a 20-minute silence takes no real time. Here, not in ``runtime._tasks``: the runtime never
imports its test double (docs/design/index.md, Layout).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import trio

from fake_pi._app import FakePi, open_fake_pi
from fake_pi._behaviours import Behaviours
from fake_pi._gate import GateDecision, Refused, Run, SavedResult, ToolCall, ToolResult
from fake_pi.model_server import ScriptedModel

from .._boundary._calls import GateCall, GateResult, Refuse, RunTool, Saved
from .._boundary._gate import RecordingGateJournal
from .._boundary._gateway import Gateway
from .._boundary._tools import tools_environment
from .._errors import GateError, ReasonCode
from .._pi._rpc import RpcChannel, open_rpc_channel
from .._records import EpochStarted
from .._tasks._workers import EpochRequest, Stopped, TaskWorker

__all__ = ["InProcessWorkers"]


@dataclass(frozen=True, slots=True)
class _DirectGate:
    """Fake-Pi's tool gate answered by the lane's gate journal, without a socket; as Fake-Pi's
    socket client does (``fake_pi/_gate_client.py``), every ``before`` names the call reported
    last (``follows``), so the journal refuses a call that follows a missing outcome (T21), and
    a report the journal refuses (409 on the socket) is written to stderr."""

    journal: RecordingGateJournal
    _follows: list[str] = field(default_factory=list, compare=False)
    """The tool-call id of the call reported last (empty before the first)."""

    async def before(self, call: ToolCall) -> GateDecision:
        follows = self._follows[0] if self._follows else None
        decision = await self.journal.decide(
            GateCall(call.id, call.name, call.arguments), follows=follows
        )
        if isinstance(decision, RunTool):
            return Run()
        if isinstance(decision, Saved):
            return SavedResult(_tool_result(decision.result))
        assert isinstance(decision, Refuse)
        return Refused(_tool_result(decision.result))

    async def after(self, call: ToolCall, result: ToolResult) -> None:
        self._follows[:] = [call.id]
        try:
            reported = GateResult(result.content, is_error=result.is_error, details=result.details)
            asked = GateCall(call.id, call.name, call.arguments)
            await self.journal.record_outcome(asked, reported)
        except GateError as error:
            if error.code is not ReasonCode.GATE_BAD_REQUEST:  # the journal failed: it ends
                raise
            print(f"fake-pi: the tool gate did not record {call.id}: {error}", file=sys.stderr)


def _tool_result(result: GateResult) -> ToolResult:
    return ToolResult(content=result.content, is_error=result.is_error, details=result.details)


@dataclass(eq=False)
class _InProcessWorker:
    rpc: RpcChannel
    fake: FakePi
    record: EpochStarted | None = None
    gateway: Gateway | None = None
    """Fake-Pi calls the scripted model directly: no gateway sees an outage."""
    identity: bool | None = True
    survivors: tuple[int, ...] = ()

    def identity_holds(self) -> bool | None:
        return self.identity if not self.fake.killed else False

    async def stop(self) -> Stopped:
        self.fake.kill()  # stopped dead, as SIGKILL would
        await trio.lowlevel.checkpoint()
        return Stopped(not self.survivors, self.survivors)


@dataclass
class InProcessWorkers:
    """Fake-Pi in this Trio run, for virtual-time tests (``autojump_clock``)."""

    model: ScriptedModel
    behaviours: Mapping[int, Behaviours] = field(default_factory=dict)
    """Per epoch number: what that epoch's Fake-Pi does wrong (hang, exit at a barrier)."""
    identity: Mapping[int, bool | None] = field(default_factory=dict)
    """Per epoch number: what an identity check finds (default: it holds)."""
    survivors: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """Per epoch number: the pids its stop reports as surviving (default: none)."""
    launched: list[int] = field(default_factory=list)

    @property
    def in_host(self) -> bool:
        """Fake-Pi runs in this Trio run: it ends with the host."""
        return True

    @contextlib.asynccontextmanager
    async def open(self, request: EpochRequest) -> AsyncIterator[TaskWorker]:
        _steps, tools = request.journals
        tools.epoch = request.number
        self.launched.append(request.number)
        declared = [n for n in request.runtime_tools if n in request.granted]
        fake_tools = [n for n in ("read", "bash", "edit", "write") if n in request.granted]
        async with (
            open_fake_pi(
                cwd=request.worktree,
                model=self.model,
                session=request.session,
                gate=_DirectGate(tools),
                behaviours=self.behaviours.get(request.number),
                tool_env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                tools=fake_tools,
                runtime_tools=tools_environment(declared),
            ) as fake,
            open_rpc_channel(fake.stdin, fake.stdout) as rpc,
        ):
            yield _InProcessWorker(
                rpc,
                fake,
                identity=self.identity.get(request.number, True),
                survivors=self.survivors.get(request.number, ()),
            )
            fake.kill()
