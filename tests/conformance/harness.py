"""Drive the real Pi 1.6.0 and Fake-Pi the same way, in one Trio run.

A :class:`Sandbox` is one run's private directories (home, agent dir, work dir,
sessions dir, TMPDIR). :func:`open_model` serves a fresh :class:`ScriptedModel`
on loopback. :func:`open_worker` launches one worker (``"pi"`` or ``"fake"``)
with :func:`trio.lowlevel.open_process`, drains its stdout continuously (split
on ``b"\\n"`` only, as Pi's docs require), and stops it on exit: stdin closed,
a bounded wait, then SIGKILL by PID. Every wait is bounded with
:func:`trio.fail_after`; nothing here sleeps.

The real Pi is installed (idempotently) by :func:`runtime._pi._pi_install.install_pi`
into ``<repo>/.cache/pi`` (``PI_RUNTIME_PI_HOME`` overrides). If that fails the
tests fail with the installer's message: they never skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import trio
import trio.lowlevel

from fake_pi.model_server import ReceivedRequest, ScriptedModel, serve_model
from fake_pi.scenario import Scenario, Step
from runtime._boundary._http import HttpServer
from runtime._pi._pi_install import PiInstall, install_pi

__all__ = [
    "WORKERS",
    "Record",
    "Sandbox",
    "Worker",
    "WorkerDied",
    "WorkerKind",
    "open_model",
    "open_worker",
    "pi_install",
    "read_jsonl",
]

WorkerKind = Literal["pi", "fake"]
WORKERS: Final[tuple[WorkerKind, ...]] = ("pi", "fake")
REPO: Final = Path(__file__).resolve().parents[2]
Record = dict[str, Any]

COMMON_FLAGS: Final = ("--mode", "rpc", "--provider", "fake", "--model", "fake-model")
QUIET_FLAGS: Final = ("-nc", "-ns", "-np", "-ne", "--no-mcp")
"""No context files, skills, prompt templates, extensions or MCP (pi-observed.md §10.6)."""

START_TIMEOUT: Final = 30.0
"""The first response of a cold Node start (compile cache empty) on a loaded CI box."""
STEP_TIMEOUT: Final = 20.0
STOP_TIMEOUT: Final = 10.0

_install_lock = threading.Lock()
_install: PiInstall | None = None


def pi_home() -> Path:
    configured = os.environ.get("PI_RUNTIME_PI_HOME")
    return Path(configured) if configured else REPO / ".cache" / "pi"


def pi_install() -> PiInstall:
    """The real Pi, installed on first use (a :class:`PiInstallError` fails the test)."""
    global _install
    with _install_lock:
        if _install is None:
            _install = install_pi(pi_home())
        return _install


def read_jsonl(path: Path) -> list[Record]:
    """The JSON objects of a JSONL file (blank lines skipped)."""
    return [json.loads(line) for line in path.read_bytes().split(b"\n") if line.strip()]


# ------------------------------------------------------------------------------- sandbox


@dataclass(frozen=True)
class Sandbox:
    """One run's directories; ``settings`` goes to ``<agent>/settings.json``."""

    root: Path
    home: Path
    agent_dir: Path
    work: Path
    sessions: Path
    tmp: Path

    @classmethod
    def create(cls, root: Path, *, retry_base_delay_ms: int = 50) -> Sandbox:
        home = root / "home"
        sandbox = cls(
            root=root,
            home=home,
            agent_dir=home / "agent",
            work=root / "work",
            sessions=root / "sessions",
            tmp=root / "tmp",
        )
        for directory in (sandbox.agent_dir, sandbox.work, sandbox.sessions, sandbox.tmp):
            directory.mkdir(parents=True, exist_ok=True)
        settings = {"enableInstallTelemetry": False, "retry": {"baseDelayMs": retry_base_delay_ms}}
        (sandbox.agent_dir / "settings.json").write_text(json.dumps(settings))
        return sandbox

    def point_at(self, server: HttpServer) -> None:
        """Write models.json: provider ``fake`` (openai-completions) at ``server``."""
        models = {
            "providers": {
                "fake": {
                    "baseUrl": f"{server.url}/v1",
                    "api": "openai-completions",
                    "apiKey": "dummy-key",
                    "models": [
                        {
                            "id": "fake-model",
                            "name": "Fake Model",
                            "reasoning": False,
                            "input": ["text"],
                            "contextWindow": 128000,
                            "maxTokens": 4096,
                            "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                        }
                    ],
                }
            }
        }
        (self.agent_dir / "models.json").write_text(json.dumps(models))

    def env(self) -> dict[str, str]:
        """The same environment for both workers: nothing from the caller but PATH."""
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "PI_CODING_AGENT_DIR": str(self.agent_dir),
            "TMPDIR": str(self.tmp),
            "PI_OFFLINE": "1",
            "PI_TELEMETRY": "0",
            "PI_SKIP_VERSION_CHECK": "1",
            "LANG": "C.UTF-8",
        }


def worker_argv(kind: WorkerKind, sandbox: Sandbox, extra: Sequence[str] = ()) -> list[str]:
    args = [*COMMON_FLAGS, "--session-dir", str(sandbox.sessions), *QUIET_FLAGS, *extra]
    if kind == "pi":
        return pi_install().argv(*args)
    return [sys.executable, "-m", "fake_pi", *args]


# ---------------------------------------------------------------------------------- model


@dataclass
class Model:
    scripted: ScriptedModel
    server: HttpServer

    @property
    def requests(self) -> list[ReceivedRequest]:
        return self.scripted.requests

    def bodies(self) -> list[dict[str, Any]]:
        return [r.body for r in self.scripted.requests]


@contextlib.asynccontextmanager
async def open_model(steps: Iterable[Step] = ()) -> AsyncIterator[Model]:
    """A fresh scripted model on 127.0.0.1, served until the block ends."""
    scripted = ScriptedModel(scenario=Scenario(steps=list(steps)), directives=False)
    async with trio.open_nursery() as nursery:
        server: HttpServer = await nursery.start(serve_model, scripted)
        try:
            yield Model(scripted, server)
        finally:
            nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------------- worker


class WorkerDied(Exception):
    """Stdout ended while we were waiting for something."""


@dataclass
class Worker:
    """One running worker: its records (stdout objects, in order) and helpers."""

    kind: WorkerKind
    process: trio.Process
    sandbox: Sandbox
    records: list[Record] = field(default_factory=list)
    stderr: bytearray = field(default_factory=bytearray)
    sent: list[bytes] = field(default_factory=list)
    eof: bool = False
    returncode: int | None = None
    _changed: trio.Event = field(default_factory=trio.Event)
    _counter: int = 0
    _stdin_closed: bool = False

    # -- reading -----------------------------------------------------------------------

    def _push(self, record: Record) -> None:
        self.records.append(record)
        self._changed.set()
        self._changed = trio.Event()

    async def _drain_stdout(self) -> None:
        assert self.process.stdout is not None
        buffer = bytearray()
        while True:
            data = await self.process.stdout.receive_some(65536)
            if not data:
                break
            buffer += data
            while (end := buffer.find(b"\n")) >= 0:
                line = bytes(buffer[:end])
                del buffer[: end + 1]
                if line.strip():
                    self._push(_decode(line))
        if buffer.strip():
            self._push(_decode(bytes(buffer)))
        self.eof = True
        self._changed.set()

    async def _drain_stderr(self) -> None:
        assert self.process.stderr is not None
        while data := await self.process.stderr.receive_some(65536):
            self.stderr += data

    def mark(self) -> int:
        """The index of the next record (a cursor for :meth:`wait_for`)."""
        return len(self.records)

    async def wait_for(
        self, predicate: Callable[[Record], bool], *, since: int = 0, limit: float = STEP_TIMEOUT
    ) -> tuple[int, Record]:
        """The first record at or after ``since`` that matches, and its index."""
        with trio.fail_after(limit):
            index = since
            while True:
                while index < len(self.records):
                    record = self.records[index]
                    if predicate(record):
                        return index, record
                    index += 1
                if self.eof:
                    raise WorkerDied(self._describe("stdout ended while waiting"))
                await self._changed.wait()

    async def wait_type(
        self, event_type: str, *, since: int = 0, limit: float = STEP_TIMEOUT
    ) -> tuple[int, Record]:
        return await self.wait_for(lambda r: r.get("type") == event_type, since=since, limit=limit)

    async def settled(self, *, since: int = 0, limit: float = STEP_TIMEOUT) -> Record:
        """The first ``agent_settled`` at or after ``since`` (the real "done" signal)."""
        return (await self.wait_type("agent_settled", since=since, limit=limit))[1]

    def _describe(self, what: str) -> str:
        tail = [json.dumps(r)[:300] for r in self.records[-8:]]
        return (
            f"{self.kind}: {what}; rc={self.process.returncode}; "
            f"stderr={bytes(self.stderr[-2000:])!r}; last records:\n  " + "\n  ".join(tail)
        )

    # -- writing -----------------------------------------------------------------------

    async def send_line(self, line: bytes) -> None:
        assert self.process.stdin is not None
        self.sent.append(line)
        await self.process.stdin.send_all(line + b"\n")

    async def send(self, command: Record) -> str:
        """Send ``command`` with a fresh id (unless it has one); returns the id."""
        self._counter += 1
        command_id = str(command.get("id") or f"{self.kind}-{self._counter}")
        await self.send_line(json.dumps({"id": command_id, **command}).encode())
        return command_id

    async def request(self, command: Record, *, limit: float = STEP_TIMEOUT) -> tuple[int, Record]:
        """Send ``command`` and wait for the response with its id (events keep flowing)."""
        since = self.mark()
        command_id = await self.send(command)
        return await self.wait_for(
            lambda r: r.get("type") == "response" and r.get("id") == command_id,
            since=since,
            limit=limit,
        )

    async def call(self, command: Record, *, limit: float = STEP_TIMEOUT) -> Record:
        """:meth:`request`, and the response must be a success."""
        _, response = await self.request(command, limit=limit)
        if response.get("success") is not True:
            raise AssertionError(self._describe(f"{command['type']} failed: {response}"))
        return response

    async def prompt_and_settle(self, message: str, *, limit: float = STEP_TIMEOUT) -> int:
        """Prompt, then wait for ``agent_settled``; returns the index of the prompt's first
        record (use it as ``since``)."""
        since = self.mark()
        await self.call({"type": "prompt", "message": message})
        await self.settled(since=since, limit=limit)
        return since

    # -- stopping ----------------------------------------------------------------------

    async def close_stdin(self) -> None:
        if not self._stdin_closed:
            self._stdin_closed = True
            assert self.process.stdin is not None
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self.process.stdin.aclose()

    async def wait_exit(self, limit: float = STOP_TIMEOUT) -> int:
        with trio.fail_after(limit):
            self.returncode = await self.process.wait()
        return self.returncode

    async def stop(self) -> None:
        """Close stdin, wait (bounded), SIGKILL by PID if it is still there."""
        await self.close_stdin()
        with trio.move_on_after(STOP_TIMEOUT):
            self.returncode = await self.process.wait()
            return
        self.process.kill()
        with trio.fail_after(STOP_TIMEOUT):
            self.returncode = await self.process.wait()


def _decode(line: bytes) -> Record:
    try:
        value = json.loads(line)
    except ValueError:
        return {"type": "_unparsed", "line": line.decode("utf-8", "replace")}
    return value if isinstance(value, dict) else {"type": "_not_an_object", "value": value}


@contextlib.asynccontextmanager
async def open_worker(
    kind: WorkerKind, sandbox: Sandbox, extra: Sequence[str] = ()
) -> AsyncIterator[Worker]:
    """Launch a worker in ``sandbox.work``; it is stopped when the block ends."""
    argv = worker_argv(kind, sandbox, extra)
    process = await trio.lowlevel.open_process(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=str(sandbox.work),
        env=sandbox.env(),
    )
    worker = Worker(kind=kind, process=process, sandbox=sandbox)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker._drain_stdout)
            nursery.start_soon(worker._drain_stderr)
            try:
                yield worker
            finally:
                with trio.CancelScope(shield=True):
                    await worker.stop()
                    with trio.move_on_after(STOP_TIMEOUT):
                        while not worker.eof:  # keep what it printed while exiting
                            await worker._changed.wait()
                nursery.cancel_scope.cancel()
    finally:
        if process.returncode is None:  # only if something above failed
            process.kill()
            with trio.CancelScope(shield=True), trio.move_on_after(STOP_TIMEOUT):
                await process.wait()
