"""Putting Fake-Pi together: the subprocess entry point and the in-process one.

Both transports run the same :class:`~fake_pi._agent.Agent` and RPC code; only
the byte streams differ (stdin/stdout of a process, or Trio memory streams).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import os
import signal
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec
import trio
import trio.lowlevel
import trio.testing

from runtime.worker_kit import GATEWAY_SECRET_ENV, SystemWallClock, WallClock, uuid7

from ._agent import Agent, AgentOptions, ModelInfo
from ._behaviours import BarrierExit, BarrierKill, Barriers, Behaviours, FakeConfig, Recorder
from ._compaction import CompactionSettings
from ._conversation import Conversation
from ._gate import AllowAllGate, ToolGate
from ._gate_client import gate_from_environ
from ._model import HttpModelClient, InProcessModelClient, ModelClient
from ._retry import RetrySettings
from ._rpc import read_lines, serve_rpc
from ._tools import builtin_tools, runtime_tools_from_environ
from .model_server import ScriptedModel
from .scenario import _load_document

__all__ = ["FakePi", "main", "open_fake_pi", "parse_args"]

_DRAIN_SECONDS: Final = 5.0
"""How long the process, its stdin ended, waits for stdout to take what is still queued."""

_encode = msgspec.json.Encoder()


def _ignored(flag: str) -> None:
    print(f"fake-pi: {flag} is accepted and ignored", file=sys.stderr)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Pi's own command line (the flags the runtime uses), plus ``--fake-config``."""
    parser = argparse.ArgumentParser(prog="fake-pi", description="A credential-free Pi.")
    parser.add_argument("--mode", default="rpc", choices=["rpc", "json", "text"])
    parser.add_argument("--provider")
    parser.add_argument("--model")
    parser.add_argument("--session")
    parser.add_argument("--session-dir")
    parser.add_argument("--no-session", action="store_true")
    parser.add_argument("-c", "--continue", dest="continue_", action="store_true")
    parser.add_argument("-nc", "--no-context-files", action="store_true")
    parser.add_argument("-ns", "--no-skills", action="store_true")
    parser.add_argument("-np", "--no-prompt-templates", action="store_true")
    parser.add_argument("-ne", "--no-extensions", action="store_true")
    parser.add_argument("--no-mcp", action="store_true")
    parser.add_argument("-na", "--no-approve", action="store_true")
    parser.add_argument("-e", "--extension", action="append", default=[])
    parser.add_argument("--append-system-prompt", action="append", default=[])
    parser.add_argument("--thinking")
    parser.add_argument("--offline", action="store_true")
    parser.add_argument("--version", action="store_true")
    parser.add_argument("--fake-config", help="Fake-Pi test configuration (JSON or TOML)")
    args = parser.parse_args(list(argv))
    for flag, used in (
        ("--continue", args.continue_),
        ("--thinking", args.thinking),
    ):
        if used:
            _ignored(flag)
    for path in args.extension:
        _ignored(f"--extension {path} (Fake-Pi gates its tools natively)")
    return args


def agent_dir() -> Path:
    configured = os.environ.get("PI_CODING_AGENT_DIR")
    return Path(configured) if configured else Path.home() / ".pi" / "agent"


def _read_json(path: Path) -> dict[str, Any]:
    """``settings.json`` of the agent directory (``{}`` when there is none,
    or when it holds no JSON object).

    Error handling: a file that is not a regular file (a FIFO is not waited on), not UTF-8 or
    not JSON is a :class:`ConfigUnusable` naming it (F13)."""
    try:
        data = _load_document(path, Any)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigUnusable(f"cannot load {path}: {_why(exc)}") from None
    except msgspec.DecodeError as exc:
        raise ConfigUnusable(f"cannot load {path}: {' '.join(str(exc).split())}") from None
    return data if isinstance(data, dict) else {}


class ModelEntry(msgspec.Struct, frozen=True):
    """One of a provider's ``models`` in ``models.json`` (the fields Fake-Pi reads, under Pi's
    own camelCase names; Pi's others are ignored)."""

    id: str
    name: str = "Fake Model"
    contextWindow: int = 128_000
    maxTokens: int = 4096


class Provider(msgspec.Struct, frozen=True):
    """A provider of ``models.json``: its endpoint, its key (a ``$NAME`` names a variable) and
    its models."""

    baseUrl: str = ""
    apiKey: str | None = None
    models: tuple[ModelEntry, ...] = ()


def read_providers(path: Path) -> dict[str, Provider]:
    """``providers`` of ``models.json`` (none when the file is missing).

    Error handling: besides :func:`_read_json`'s refusals, a document not of Pi's shape (not an
    object, a provider that is not one, a model without an ``id``, a ``contextWindow`` that
    is not a number...) is a :class:`ConfigUnusable` naming the file and where (F13); before,
    each was a traceback at start."""
    data = _read_json(path)
    try:
        return msgspec.convert(data.get("providers", {}), dict[str, Provider])
    except msgspec.ValidationError as exc:
        message = str(exc)
        where = message.replace("`$", "`$.providers", 1) if " - at `$" in message else message
        where = where if " - at `$" in message else f"{message} - at `$.providers`"
        raise ConfigUnusable(f"cannot load {path}: {' '.join(where.split())}") from None


def _why(exc: OSError) -> str:
    return " ".join((exc.strerror or str(exc)).split())


def _resolve_config_value(value: str | None) -> str | None:
    """Pi's ``$NAME`` / ``${NAME}`` config values name an environment variable
    (resolve-config-value.js); anything else is literal. (Pi's ``!command`` form is
    not supported.) The value is read once, at launch."""
    if value is None or not value.startswith("$"):
        return value
    name = value[2:-1] if value.startswith("${") and value.endswith("}") else value[1:]
    return os.environ.get(name)


def session_file_name(session_id: str, time_ms: int) -> str:
    """Pi's file name: ISO time with ``:`` and ``.`` as ``-``, then the session id."""
    moment = datetime.datetime.fromtimestamp(time_ms / 1000, tz=datetime.UTC)
    stamp = moment.strftime("%Y-%m-%dT%H-%M-%S-") + f"{time_ms % 1000:03d}Z"
    return f"{stamp}_{session_id}.jsonl"


@dataclass
class _Setup:
    options: AgentOptions
    config: FakeConfig
    recorder: Recorder


class ConfigUnusable(Exception):
    """The ``--fake-config`` file cannot be used; the message names it and says why."""


def load_fake_config(args: argparse.Namespace) -> FakeConfig:
    """The configuration ``--fake-config`` (else ``$FAKE_PI_CONFIG``) names, or the default.

    Error handling: a file that is missing, not a regular file (a FIFO is not waited on), not
    UTF-8, not JSON/TOML or not of :class:`FakeConfig`'s shape is a :class:`ConfigUnusable`
    whose one-line message names the file and says why (F13)."""
    label, path = "--fake-config", args.fake_config
    if not path:
        label, path = "$FAKE_PI_CONFIG", os.environ.get("FAKE_PI_CONFIG")
    if not path:
        return FakeConfig()
    try:
        return FakeConfig.load(path)
    except OSError as exc:
        why = exc.strerror or str(exc)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        why = str(exc)
    raise ConfigUnusable(f"cannot load {label} {path}: {' '.join(why.split())}")


def _setup(
    args: argparse.Namespace, *, clock: WallClock, config: FakeConfig | None = None
) -> _Setup:
    """What a Fake-Pi process runs with. Error handling: a file it needs and cannot use (the
    agent directory's, the recording file) is a :class:`ConfigUnusable` (F13)."""
    if config is None:
        config = load_fake_config(args)
    cwd = Path.cwd()
    directory = agent_dir()
    providers = read_providers(directory / "models.json")
    settings = _read_json(directory / "settings.json")
    try:
        recorder = Recorder(config.record)
    except OSError as exc:
        why = "a FIFO with no reader" if exc.errno == errno.ENXIO else _why(exc)
        raise ConfigUnusable(f"cannot open --fake-config's record {config.record}: {why}") from None
    provider_name = args.provider or "fake"
    provider = providers.get(provider_name) or Provider()
    model_id = args.model or "fake-model"
    listed = [m for m in provider.models if m.id == model_id]
    model_entry = listed[0] if listed else ModelEntry(id=model_id)
    client: ModelClient
    if provider.baseUrl:
        client = HttpModelClient(provider.baseUrl, _resolve_config_value(provider.apiKey))
    else:
        scripted = ScriptedModel(directives=config.directives, model_id=model_id)
        if config.scenario is not None:
            scripted.scenario = config.scenario
        client = InProcessModelClient(scripted)
    model = ModelInfo(
        provider=provider_name,
        id=model_id,
        name=model_entry.name,
        base_url=provider.baseUrl,
        context_window=model_entry.contextWindow,
        max_tokens=model_entry.maxTokens,
    )
    now = clock.time_ms()
    session_id = uuid7(now)
    path: Path | None
    if args.no_session:
        path = None
    elif args.session:
        path = Path(args.session).absolute()
    else:
        base = (
            Path(args.session_dir)
            if args.session_dir
            else directory / "sessions" / ("--" + str(cwd).strip("/").replace("/", "-") + "--")
        )
        path = base.absolute() / session_file_name(session_id, now)
    conversation = Conversation(
        path=path,
        cwd=cwd,
        provider=provider_name,
        model_id=model_id,
        clock=clock,
        session_id=session_id,
    )
    # -- the runtime's tool gate (runtime/_boundary/_gate.py; docs/design/gate.md) ---------------
    # When the runtime names a gate socket, every tool asks it first, a round's calls run
    # one after the other (as the Pi extension's executionMode "sequential"), and the gate
    # secret is removed from this process's environment before any tool can inherit it.
    # The runtime's own tools it declares are added as given (they run in the runtime).
    runtime_gate = gate_from_environ(os.environ)
    gate: ToolGate = runtime_gate if runtime_gate is not None else AllowAllGate()
    tools = builtin_tools(config.tools)
    if runtime_gate is not None:
        tools |= runtime_tools_from_environ(os.environ)
    # -- end of the tool-gate block --------------------------------------------------------
    options = AgentOptions(
        cwd=cwd,
        client=client,
        tools=tools,
        gate=gate,
        sequential_tools=runtime_gate is not None,
        clock=clock,
        conversation=conversation,
        barriers=Barriers(config.behaviours, in_process=False),
        model=model,
        retry=RetrySettings.from_settings(settings),
        steering_mode="all" if settings.get("steeringMode") == "all" else "one-at-a-time",
        compaction=CompactionSettings.from_settings(settings, f"{provider_name}/{model_id}"),
        append_system_prompt=list(args.append_system_prompt),
        tool_env={k: v for k, v in os.environ.items() if k != GATEWAY_SECRET_ENV},
        ledger_path=Path(config.ledger) if config.ledger else cwd / ".fake-pi-effects.jsonl",
        recorder=recorder,
    )
    return _Setup(options, config, recorder)


async def _run_process(args: argparse.Namespace, config: FakeConfig) -> int:
    setup = _setup(args, clock=SystemWallClock(), config=config)
    recorder = setup.recorder
    recorder.record("launch", argv=sys.argv, env_keys=sorted(os.environ))
    stdin = trio.lowlevel.FdStream(os.dup(0))
    stdout = trio.lowlevel.FdStream(os.dup(1))
    # lines are encoded when emitted: the agent keeps changing the dicts it emits
    out_send, out_receive = trio.open_memory_channel[bytes](256)

    async def emit(item: dict[str, Any]) -> None:
        await out_send.send(_encode.encode(item) + b"\n")

    exit_code = 0

    drained = trio.Event()

    async def writer() -> None:
        async for line in out_receive:
            await stdout.send_all(line)
        drained.set()

    async def signals(agent: Agent, cancel: trio.CancelScope) -> None:
        nonlocal exit_code
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            async for signum in received:
                if signum == signal.SIGTERM and setup.config.behaviours.ignore_sigterm:
                    await trio.sleep(setup.config.behaviours.ignore_sigterm)
                exit_code = 128 + signum
                await agent.shutdown()
                cancel.cancel()
                return

    agent = Agent(setup.options, emit)
    await setup.options.barriers.reach("startup")
    async with trio.open_nursery() as outer:
        outer.start_soon(writer)
        outer.start_soon(signals, agent, outer.cancel_scope)
        await serve_rpc(
            agent,
            read_lines(stdin),
            emit,
            on_line=lambda line: recorder.record("stdin", line=line.decode(errors="replace")),
        )
        await out_send.aclose()
        # what is queued is written before the exit, as Pi's stdout is flushed (bounded: a
        # reader that stopped reading does not keep the process alive)
        with trio.move_on_after(_DRAIN_SECONDS):
            await drained.wait()
        outer.cancel_scope.cancel()
    setup.options.conversation.close()
    recorder.close()
    return exit_code


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.version:
        print("1.6.0 (fake-pi)")
        return 0
    if args.mode != "rpc":
        print(f"fake-pi: --mode {args.mode} is not supported; use --mode rpc", file=sys.stderr)
        return 2
    try:  # before anything starts, as the --mode refusal (F13)
        config = load_fake_config(args)
        return trio.run(_run_process, args, config)  # its files are read before a command
    except ConfigUnusable as refusal:
        print(f"fake-pi: {refusal}", file=sys.stderr)
        return 2
    except BarrierExit as exc:  # pragma: no cover - subprocess exits via os._exit
        return exc.code


# -- in-process ----------------------------------------------------------------------


class FakePi:
    """An in-process Fake-Pi: write commands to ``stdin``, read ``stdout``.

    The streams carry exactly the bytes a subprocess would, so the runtime's RPC
    client drives both the same way; :meth:`send` and :meth:`receive` are
    conveniences for tests. :meth:`kill` stops it dead, as SIGKILL would.
    """

    def __init__(
        self,
        stdin: trio.abc.SendStream,
        stdout: trio.abc.ReceiveStream,
        agent: Agent,
        scope: trio.CancelScope,
    ) -> None:
        self.stdin = stdin
        self.stdout = stdout
        self.agent = agent
        self._scope = scope
        self._lines = read_lines(stdout)
        self.killed = False

    async def send(self, command: dict[str, Any]) -> None:
        await self.stdin.send_all(_encode.encode(command) + b"\n")

    async def receive(self) -> dict[str, Any]:
        line = await anext(self._lines)
        decoded: dict[str, Any] = msgspec.json.decode(line)
        return decoded

    async def receive_until(self, event_type: str) -> list[dict[str, Any]]:
        """Every object up to and including the first of ``event_type``."""
        seen = []
        while True:
            item = await self.receive()
            seen.append(item)
            if item.get("type") == event_type:
                return seen

    def kill(self) -> None:
        self.killed = True
        self._scope.cancel()


@contextlib.asynccontextmanager
async def open_fake_pi(
    *,
    cwd: Path,
    model: ScriptedModel | None = None,
    session: Path | None = None,
    gate: ToolGate | None = None,
    clock: WallClock | None = None,
    behaviours: Behaviours | None = None,
    retry: RetrySettings | None = None,
    compaction: CompactionSettings | None = None,
    context_window: int | None = None,
    append_system_prompt: Sequence[str] = (),
    tool_env: dict[str, str] | None = None,
    ledger_path: Path | None = None,
    tools: Sequence[str] | None = None,
    runtime_tools: Mapping[str, str] | None = None,
) -> AsyncIterator[FakePi]:
    """Run a Fake-Pi in this Trio run, for virtual-time tests.

    ``model`` defaults to a plain :class:`ScriptedModel`; its delays are Trio
    sleeps, so a MockClock drives them. ``session`` is the session file
    (created on the first message, resumed if it exists); ``None`` keeps the
    session in memory. On exit Fake-Pi sees its stdin closed (an aborting
    shutdown if a run is in flight). ``compaction`` (Pi's defaults) and
    ``context_window`` (128000) set when Fake-Pi auto-compacts.
    ``tools`` names the tools to expose (default: Pi's read, bash, edit, write).
    ``runtime_tools`` is the environment in which the runtime declares its own tools
    (``PI_RUNTIME_TOOLS``, see ``runtime/_boundary/_tools.py``): they are added, and a round's calls
    then run one after the other, as with the runtime's gate in a subprocess.
    """
    clock = clock or SystemWallClock()
    model = model or ScriptedModel()
    in_send, in_receive = trio.testing.memory_stream_one_way_pair()
    out_send, out_receive = trio.testing.memory_stream_one_way_pair()
    conversation = Conversation(
        path=session,
        cwd=cwd,
        provider="fake",
        model_id=model.model_id,
        clock=clock,
        session_id=uuid7(clock.time_ms()),
    )
    options = AgentOptions(
        cwd=cwd,
        client=InProcessModelClient(model),
        tools=builtin_tools(tools) | runtime_tools_from_environ(runtime_tools or {}),
        sequential_tools=runtime_tools is not None,
        clock=clock,
        conversation=conversation,
        barriers=Barriers(behaviours or Behaviours(), in_process=True),
        model=ModelInfo(id=model.model_id, context_window=context_window or 128000),
        gate=gate or AllowAllGate(),
        retry=retry or RetrySettings(),
        compaction=compaction or CompactionSettings(),
        append_system_prompt=list(append_system_prompt),
        tool_env=tool_env if tool_env is not None else dict(os.environ),
        ledger_path=ledger_path or cwd / ".fake-pi-effects.jsonl",
    )
    write_lock = trio.Lock()

    async def send(item: dict[str, Any]) -> None:
        line = _encode.encode(item) + b"\n"  # now: the agent keeps changing what it emits
        async with write_lock:
            await out_send.send_all(line)

    agent = Agent(options, send)

    async def serve(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            try:
                await options.barriers.reach("startup")  # before a command is read, as a process
                await serve_rpc(agent, read_lines(in_receive), send)
            except* (BarrierKill, BarrierExit):
                pass  # stopped dead at a barrier, as a killed process would
        with contextlib.suppress(trio.ClosedResourceError):
            await out_send.aclose()

    try:
        async with trio.open_nursery() as nursery:
            scope = await nursery.start(serve)
            fake = FakePi(in_send, out_receive, agent, scope)
            try:
                yield fake
            finally:
                with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
                    await in_send.aclose()
    finally:
        # after the nursery: a run in flight is aborted by the end of stdin, and its shutdown
        # writes the abort to the session first (F4), as Pi's does
        conversation.close()
