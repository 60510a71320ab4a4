"""How a task lane gets a worker epoch: the :class:`WorkerFactory` protocol and a real process.

A task lane (``runtime/_tasks/_lane.py``) needs the same few things from either kind of worker:
an RPC channel, an identity it can check before a fence, and a bounded stop that takes the
whole tree down. :class:`ProcessWorkers` launches the real Pi or Fake-Pi behind the lane's
gateway and gate (``runtime/_boundary/_boundaries.py``), one pair of servers per epoch, so a
parked lane holds no file descriptor. Tests use
:class:`runtime.testing._in_process.InProcessWorkers` instead: Fake-Pi as a task of their Trio
run, so whole watchdog scenarios run under ``autojump_clock`` in milliseconds.

Resource handling: each ``open`` is an async context manager; leaving it stops the epoch
(TERM, bounded KILL of the tree, reap — :meth:`runtime._pi._worker.Epoch.stop`) and, for a
process, the epoch's servers.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .._boundary._boundaries import BoundaryConfig, open_boundaries
from .._boundary._gate import RecordingGateJournal
from .._boundary._gateway import Gateway, GatewayConfig
from .._boundary._steps import DeliveryStepJournal
from .._errors import ReasonCode, WorkerError
from .._journal._interface import Log
from .._linux._proc import boot_id, process_start_time
from .._linux._proctree import carries_nonce
from .._pi._launch import ModelRoute, RetrySettings, WorkerLaunch, WorkerProgram
from .._pi._rpc import RpcChannel, open_rpc_channel
from .._pi._worker import Epoch, StopPolicy, StopReport, open_worker
from .._records import EpochStarted

__all__ = ["EpochRequest", "ProcessWorkers", "Stopped", "TaskWorker", "WorkerFactory"]


@dataclass(frozen=True, slots=True)
class Stopped:
    """What stopping an epoch's tree proved."""

    clean: bool
    """Nothing of the tree is alive (proven)."""
    survivors: tuple[int, ...] = ()
    """Pids still alive, or not decided, when the bound ran out."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochRequest:
    """What the lane asks for: epoch ``number`` on ``session`` in ``worktree``."""

    number: int
    session: Path
    worktree: Path
    home: Path
    tmp: Path
    granted: frozenset[str]
    runtime_tools: Mapping[str, Any]
    journals: tuple[DeliveryStepJournal, RecordingGateJournal]
    log: Log
    started_ms: Callable[[], int]
    policy: StopPolicy
    nonce: str | None = None
    """The epoch's nonce, journaled before the launch (W13); ``None``: a fresh one."""


class TaskWorker(Protocol):
    """One live epoch as the lane sees it."""

    rpc: RpcChannel
    record: EpochStarted | None
    """The lane-log record that identifies the process tree (``None`` in-process)."""
    gateway: Gateway | None
    """The epoch's model gateway, whose :attr:`~Gateway.upstream_failure` says whether a
    turn met an unavailable provider (PB6); ``None`` when the worker calls its model directly."""

    def identity_holds(self) -> bool | None:
        """Whether the live process is exactly the recorded one (WD10); ``None``: unknown."""
        ...

    async def stop(self) -> Stopped:
        """TERM, bounded KILL of the whole tree, reap; what survived, if anything."""
        ...


class WorkerFactory(Protocol):
    @property
    def in_host(self) -> bool:
        """Its workers run inside the host's process: one dies with its host, so a restart
        has nothing of it to kill (a process worker's tree may outlive the host)."""

    def open(self, request: EpochRequest) -> contextlib.AbstractAsyncContextManager[TaskWorker]: ...


# ------------------------------------------------------------------------------- process


@dataclass(eq=False)
class _ProcessWorker:
    epoch: Epoch
    rpc: RpcChannel
    record: EpochStarted | None
    gateway: Gateway | None
    stopped: bool = False
    """``stop()`` was called: its caller has the report (clean or not)."""

    def identity_holds(self) -> bool | None:
        record = self.record
        if record is None:
            return None
        if self.epoch.process.returncode is not None:
            return False  # exited: nothing to fence, and its pid may be reused
        try:
            same = (
                record.boot_id == boot_id()
                and process_start_time(record.pid) == record.start_time
                and carries_nonce(record.pid, record.nonce)
            )
        except OSError:
            return None
        return same

    async def stop(self) -> Stopped:
        report = await self.epoch.stop()
        self.stopped = True
        return Stopped(report.clean, report.kill.survivors + report.kill.undecided)


@dataclass
class ProcessWorkers:
    """Real worker processes behind a gateway and a gate opened per epoch."""

    @property
    def in_host(self) -> bool:
        return False

    program: WorkerProgram
    route: ModelRoute
    upstream: GatewayConfig
    socket_dir: Path
    """A short private directory (``runtime._journal._store.runtime_dir``) for the gate sockets."""
    socket_name: str | None = None
    """The gate socket's file name; ``None`` (the default): named by the lane's key, so the
    lanes sharing one runner (and ``socket_dir``) never collide."""
    state_dir: Path | None = None
    retry: RetrySettings = field(default_factory=RetrySettings)
    """The worker's own retry settings (``settings.json``)."""
    epoch_env: Mapping[int, Mapping[str, str]] = field(default_factory=dict)
    """Per epoch number: more environment for that epoch's worker (Fake-Pi behaviours:
    ``FAKE_PI_CONFIG``)."""
    identity_override: Callable[[EpochStarted], EpochStarted] | None = None
    """Test hook: replace the recorded identity (a stale wrapper report, PID reuse)."""
    launched: list[EpochStarted] = field(default_factory=list)
    """The true identity of every epoch launched, in order (whatever the override says)."""
    reports: dict[int, StopReport] = field(default_factory=dict)
    """How each epoch (by number) was stopped, once it was."""

    @contextlib.asynccontextmanager
    async def open(self, request: EpochRequest) -> AsyncIterator[TaskWorker]:
        steps, tools = request.journals
        steps.begin_epoch(request.number)
        tools.epoch = request.number
        config = BoundaryConfig(
            upstream=self.upstream,
            granted=request.granted,
            runtime_tools=request.runtime_tools,
            socket_dir=self.socket_dir,
            socket_name=self.socket_name or f"{tools.key[:20]}-task.sock",
        )
        async with open_boundaries(
            config, request.log, key=tools.key, epoch=request.number, journals=(steps, tools)
        ) as boundaries:
            launch = boundaries.launch(
                WorkerLaunch(
                    program=self.program,
                    cwd=request.worktree,
                    home=request.home,
                    agent_dir=request.home / "agent",
                    tmp_dir=request.tmp,
                    session=request.session,
                    route=self.route,
                    state_dir=self.state_dir,
                    retry=self.retry,
                    extra_env=dict(self.epoch_env.get(request.number, {})),
                )
            )
            worker: _ProcessWorker | None = None
            try:
                async with open_worker(
                    launch,
                    nonce=request.nonce,
                    policy=request.policy,
                    secrets=boundaries.worker_secrets(),
                ) as epoch:
                    record = epoch.record(request.number, started_ms=request.started_ms())
                    self.launched.append(record)
                    if self.identity_override is not None:
                        record = self.identity_override(record)
                    try:
                        async with open_rpc_channel(
                            epoch.stdin, epoch.stdout, stderr=epoch.stderr_tail
                        ) as rpc:
                            worker = _ProcessWorker(epoch, rpc, record, boundaries.gateway)
                            yield worker
                    finally:
                        self.reports[request.number] = await epoch.stop()
            except WorkerError as error:
                # The lane learns of survivors from ``stop()`` and holds; the same news
                # raised again as the epoch's block ends must not crash the lane's task.
                if error.code != ReasonCode.WORKER_TREE_SURVIVED or worker is None:
                    raise
                if not worker.stopped:
                    raise
