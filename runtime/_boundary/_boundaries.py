"""A lane's worker boundaries wired together: the model gateway and the tool gate.

Three boundaries stand between the runtime and a worker (docs/design/boundaries.md): the process
(``_worker``), the model endpoint (``_gateway``) and the tools (``_gate``). This module is how a
lane uses the last two as one thing, :class:`Boundaries`:

* both serve the delivery that is attached (:meth:`Boundaries.attach`): model steps and tool
  intents land in that delivery's log, and the gate's round is the gateway's current step, so
  a tool call is matched by ``(step, tool_call_id)`` with one numbering (B1);
* every epoch gets fresh secrets for both, and both journals record the epoch number
  (:meth:`Boundaries.begin_epoch`, B2);
* the lane's grants decide which tools run, and which of the runtime's own tools are declared
  to the worker and executed here (B3);
* a model request carrying a tool result is held until that result's outcome is durable (B4);
* :meth:`Boundaries.settle_session` readies a dead epoch's session for the next one: torn tail
  cut, each dangling tool call answered from the gate's journal, fsynced (B6);
* :meth:`Boundaries.launch` points a :class:`~runtime._pi._launch.WorkerLaunch` at both: the
  gateway as its model endpoint with the secret as a ``$NAME`` key, the gate's socket and
  secret and the runtime tools in its environment, and the extension for the real Pi (B5).

The invariants are in ``docs/design/boundaries.md``.

Resource handling: :func:`open_boundaries` runs both servers in its own nursery and stops them
on exit; the gate's socket file is removed. Error handling: a journal failure in either server
is raised out of :func:`open_boundaries` as that :class:`~runtime._errors.PiRuntimeError`,
cancelling the body (the lane then fences the epoch); whatever the body raises (a worker's
launch failure) comes out as itself too, never inside an ``ExceptionGroup``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import trio

from .._clock import WallClock
from .._errors import PiRuntimeError, single_error
from .._journal._interface import Log
from .._pi._launch import ModelRoute, WorkerKind, WorkerLaunch
from .._pi._session_files import aread_session, atruncate_torn_tail
from .._pi._session_settle import (
    RelaunchReport,
    SettledResult,
    aprepare_for_relaunch,
    dangling_tool_calls,
)
from .._records import ReplayClass
from ._calls import GateCall, RuntimeTool
from ._gate import (
    EXTENSION_PATH,
    PI_TOOL_CLASSES,
    Gate,
    GateServer,
    RecordingGateJournal,
    gate_environment,
    serve_gate,
)
from ._gateway import GATEWAY_SECRET_ENV, Gateway, GatewayConfig, serve_gateway
from ._http import HttpServer
from ._steps import DeliveryStepJournal
from ._tools import RUNTIME_TOOLS, tools_environment

__all__ = [
    "Boundaries",
    "BoundaryConfig",
    "carried_tool_results",
    "make_journals",
    "open_boundaries",
    "settle_session",
]

GATE_SOCKET_NAME: Final = "gate.sock"
RequestHook = Callable[[dict[str, Any], int, bool], Awaitable[None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryConfig:
    """What a lane decides about its worker's boundaries."""

    upstream: GatewayConfig
    """The model the gateway calls (base URL, the *name* of the key variable, timeouts)."""
    granted: frozenset[str]
    """The tools this lane may run: Pi's (``read``, ``bash``, ``edit``, ``write``) and the
    runtime's own (``runtime/_boundary/_tools.py``). Everything else is refused at the gate."""
    runtime_tools: Mapping[str, RuntimeTool] = field(default_factory=dict)
    """Handlers of the granted runtime tools; each granted one needs one."""
    classes: Mapping[str, ReplayClass] = field(default_factory=lambda: dict(PI_TOOL_CLASSES))
    """Declared replay classes of the worker's tools (the runtime tools bring their own)."""
    socket_dir: Path
    """A private directory (``Store.runtime_dir``) for the gate's socket."""
    socket_name: str = GATE_SOCKET_NAME
    """The socket's file name: unique among the lanes sharing ``socket_dir``."""
    replay: bool = False
    """Every epoch replays the attached delivery from its first step (room lanes,
    docs/design/recovery.md): a request that leaves an answered step behind is refused (G13), and
    after a replayed tool call that is not the recorded one so is every later call and every
    request the journal has not answered (T14). False
    when an epoch resumes where the last one stopped (task lanes, a settled session)."""

    @property
    def declared_runtime_tools(self) -> tuple[str, ...]:
        """The runtime tools the worker declares: the granted ones, in a stable order."""
        return tuple(name for name in RUNTIME_TOOLS if name in self.granted)


def carried_tool_results(body: Mapping[str, Any]) -> list[str]:
    """The tool-call ids whose results an OpenAI chat request carries (``role: tool``)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    return [
        m["tool_call_id"]
        for m in messages
        if isinstance(m, dict)
        and m.get("role") == "tool"
        and isinstance(m.get("tool_call_id"), str)
    ]


class Boundaries:
    """The gateway and the gate of one lane; obtain it from :func:`open_boundaries`."""

    def __init__(
        self,
        config: BoundaryConfig,
        gateway: Gateway,
        gate: Gate,
        steps: DeliveryStepJournal,
        tools: RecordingGateJournal,
    ) -> None:
        self.config = config
        self.gateway = gateway
        self.gate = gate
        self.steps = steps
        self.tools = tools
        self.epoch = steps.epoch
        self.gateway_server: HttpServer | None = None
        self.gate_server: GateServer | None = None
        self.on_request: RequestHook | None = None
        """Awaited with ``(body, step, replayed)`` for every model request of the attached
        delivery, before it is answered (the lane finds its steers there)."""
        gateway.on_answer = self._answered

    @property
    def failure(self) -> PiRuntimeError | None:
        """The journal failure that stopped the gateway or the gate (the first of them), set
        the moment the append failed — before :func:`open_boundaries` raises it."""
        return self.gateway.failure or self.gate.failure

    async def _answered(self, body: dict[str, Any], digest: str, replayed: bool) -> None:
        hook = self.on_request
        if hook is not None:
            await hook(body, self.steps.current_step, replayed)

    def attach(self, log: Log, *, key: str) -> None:
        """Serve the delivery whose log is ``log`` (key ``key``) from now on (B1): its model
        steps and tool intents are recorded there, and what it already holds is replayed."""
        self.steps, self.tools = _journals(self.config, log, key=key, epoch=self.epoch)
        self.gateway.journal = self.steps
        self.gateway.forget_bodies()  # G1a: another delivery's requests from now on
        self.gate.journal = self.tools

    def release(self) -> None:
        """The attached delivery ended: both journals forget it and refuse whatever its
        worker still asks (G14) until the next :meth:`attach`."""
        self.steps.release()
        self.tools.release()
        self.gateway.forget_bodies()  # G1a: nothing of its turn stays in memory

    def begin_epoch(self, epoch: int) -> None:
        """A new worker epoch (B2): fresh secrets for both servers (the previous epoch's stop
        working at once), and both journals record ``epoch`` from now on."""
        self.epoch = epoch
        self.steps.begin_epoch(epoch)
        self.tools.epoch = epoch
        self.gateway.rotate_secret()
        self.gate.rotate_secret()

    async def settle_session(self, path: Path, *, clock: WallClock) -> RelaunchReport:
        """Make the session of a worker proven dead fit to relaunch on (B6): cut a torn tail,
        answer each dangling tool call from the gate's journal (the recorded outcome; an
        intent without outcome "possibly ran", recorded; a call never let run "did not
        run"), and fsync the file. Call it only after the epoch's tree is gone."""
        return await settle_session(path, self.tools, clock=clock)

    def worker_env(self) -> dict[str, str]:
        """The environment the worker needs for this epoch: the gateway secret (its model key,
        resolved from ``$NAME``), the gate's socket and secret, and the runtime tools it
        declares. The secrets travel only here, never to disk (B5)."""
        assert self.gate_server is not None, "serve first (open_boundaries)"
        return {
            GATEWAY_SECRET_ENV: self.gateway.secret,
            **gate_environment(self.gate_server, self.gate),
            **tools_environment(self.config.declared_runtime_tools),
        }

    def worker_secrets(self) -> tuple[str, ...]:
        """The secrets the worker of this epoch must never be quoted with (G9, B5): the
        upstream key (which it never has, but a provider's error may quote) and the epoch's
        gateway and gate secrets. A lane hands them to ``open_worker(secrets=)``, which blots
        them out of the stderr its exit errors quote."""
        key = self.gateway.upstream_key()
        return tuple(s for s in (key, self.gateway.secret, self.gate.secret) if s)

    def route(self, route: ModelRoute) -> ModelRoute:
        """``route`` pointed at the gateway, with the epoch secret as a ``$NAME`` key."""
        assert self.gateway_server is not None, "serve first (open_boundaries)"
        return dataclasses.replace(
            route, base_url=f"{self.gateway_server.url}/v1", api_key=f"${GATEWAY_SECRET_ENV}"
        )

    def launch(self, launch: WorkerLaunch) -> WorkerLaunch:
        """``launch`` through both boundaries for the current epoch (B5). Its route names the
        model (provider and id); the endpoint and key are replaced by the gateway's."""
        if launch.route is None:
            raise ValueError("the launch needs a model route to point at the gateway")
        extensions = launch.extensions
        if launch.program.kind is WorkerKind.PI and EXTENSION_PATH not in extensions:
            extensions = (*extensions, EXTENSION_PATH)
        return dataclasses.replace(
            launch,
            route=self.route(launch.route),
            extra_env={**launch.extra_env, **self.worker_env()},
            extensions=extensions,
        )


async def settle_session(
    path: Path, tools: RecordingGateJournal, *, clock: WallClock
) -> RelaunchReport:
    """Ready the session of a worker proven dead for the next epoch (B6): cut a torn tail,
    answer each dangling tool call from ``tools`` (the recorded outcome; an intent without
    outcome "possibly ran" — or, for a receipt tool, the guarded write's result — recorded;
    a call never let run "did not run"), and fsync the file."""
    await atruncate_torn_tail(path)
    calls = dangling_tool_calls((await aread_session(path)).session)
    results = {}
    for call in calls:
        result = await tools.settle(GateCall(call.tool_call_id, call.name, call.arguments))
        results[call.tool_call_id] = SettledResult(result.content, result.is_error)
    return await aprepare_for_relaunch(path, results, clock=clock)


def make_journals(
    config: BoundaryConfig, log: Log, *, key: str, epoch: int
) -> tuple[DeliveryStepJournal, RecordingGateJournal]:
    """A lane's step and tool journals on ``log`` (shared step numbering, B1)."""
    return _journals(config, log, key=key, epoch=epoch)


def _journals(
    config: BoundaryConfig, log: Log, *, key: str, epoch: int
) -> tuple[DeliveryStepJournal, RecordingGateJournal]:
    steps = DeliveryStepJournal(log, epoch=epoch, replay=config.replay)
    tools = RecordingGateJournal(
        log,
        key=key,
        epoch=epoch,
        granted=config.granted,
        classes=config.classes,
        existing=log.contents.records,
        step=lambda: steps.current_step,
        runtime_tools={n: h for n, h in config.runtime_tools.items() if n in config.granted},
        # T14: a replayed call that is not the recorded one fails the whole replay (G13)
        on_mismatch=(lambda error: steps.diverge(error.message)) if config.replay else None,
    )
    return steps, tools


@contextlib.asynccontextmanager
async def open_boundaries(
    config: BoundaryConfig,
    log: Log,
    *,
    key: str,
    epoch: int,
    journals: tuple[DeliveryStepJournal, RecordingGateJournal] | None = None,
) -> AsyncIterator[Boundaries]:
    """Serve a lane's gateway (loopback TCP) and gate (Unix socket in ``socket_dir``) with
    the delivery ``log`` (``key``) attached and ``epoch`` begun; both stop on exit.
    ``journals`` (from :func:`make_journals`) are used instead of new ones when a lane keeps
    its journals across epochs whose servers it opens one by one (task lanes)."""
    steps, tools = journals or _journals(config, log, key=key, epoch=epoch)

    async def hold_until_outcomes_durable(body: dict[str, Any]) -> None:  # B4
        await boundaries.tools.wait_outcomes(carried_tool_results(body))

    gateway = Gateway(config.upstream, steps, gate_barrier=hold_until_outcomes_durable)
    boundaries = Boundaries(config, gateway, Gate(tools), steps, tools)
    with single_error():  # what failed comes out as itself (a worker's launch, a journal's)
        async with trio.open_nursery() as nursery:
            boundaries.gateway_server = await nursery.start(serve_gateway, gateway)
            boundaries.gate_server = await nursery.start(
                serve_gate, boundaries.gate, config.socket_dir / config.socket_name
            )
            yield boundaries
            nursery.cancel_scope.cancel()
