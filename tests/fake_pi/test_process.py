"""Fake-Pi as a real subprocess: ``python -m fake_pi --mode rpc …``, driven like Pi.

Issue items 4-6 as a process: the scripted model served over HTTP (item 4), the tools it runs
(item 5), and the process behaviours — session files, barriers (``kill``, ``exit:CODE``,
``hang``), SIGTERM, stdin EOF, ``ignore_sigterm``, the recorder (item 6) — checked against Pi
1.6.0's observed behaviour (docs/design/fake-pi.md; "pi-observed.md §n" cites the section of the
Pi research report a fact comes from, and the real Pi's own files are in tests/data/pi-1.6.0/).

Every test runs in its own sandbox: HOME, an agent dir whose ``models.json`` points at a
``serve_model`` server in the test's Trio run and whose ``settings.json`` sets
``retry.baseDelayMs`` to 20, a work dir as the cwd and a ``--session-dir``. Processes are opened
with :func:`trio.lowlevel.open_process`; stdout is drained continuously and split on ``b"\\n"``
only; every wait is bounded by :func:`trio.fail_after` and waits for output lines or the exit,
never on a sleep; every process is stopped (stdin closed, then SIGKILL) when its block ends.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest
import trio
import trio.lowlevel

from fake_pi.model_server import ScriptedModel, serve_model
from fake_pi.scenario import Call, HttpError, Scenario, Step, Text, ToolCalls
from runtime._boundary._http import HttpServer

Record = dict[str, Any]

LIMIT: Final = 20.0
"""Bound on any one wait for output or exit (a loaded CI box included)."""
SILENCE: Final = 1.0
"""How long a hung process is given to answer before we call it silent."""
FLAGS: Final = ("--mode", "rpc", "--provider", "fake", "--model", "fake-model")
QUIET: Final = ("-nc", "-ns", "-np", "-ne", "--no-mcp")
SESSION_NAME: Final = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d-\d\d-\d\d-\d{3}Z_([0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12})\.jsonl$"
)


def read_jsonl_bytes(data: bytes) -> list[Record]:
    return [json.loads(line) for line in data.split(b"\n") if line.strip()]


def read_jsonl(path: Path) -> list[Record]:
    return read_jsonl_bytes(path.read_bytes())


# ------------------------------------------------------------------------------- model


@dataclass
class Model:
    scripted: ScriptedModel
    server: HttpServer

    def script(self, *steps: Step) -> None:
        self.scripted.scenario = Scenario(steps=list(steps))


@pytest.fixture
async def model(nursery: trio.Nursery) -> Model:
    """A fresh scripted model (no scenario, no directives) served on 127.0.0.1 for the test."""
    scripted = ScriptedModel()
    server: HttpServer = await nursery.start(serve_model, scripted)
    return Model(scripted, server)


# ----------------------------------------------------------------------------- sandbox


@dataclass(frozen=True)
class Sandbox:
    root: Path

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def agent_dir(self) -> Path:
        return self.home / "agent"

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def sessions(self) -> Path:
        return self.root / "sessions"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """An allow-listed environment: nothing from the caller but PATH."""
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "PI_CODING_AGENT_DIR": str(self.agent_dir),
            "TMPDIR": str(self.tmp),
            "LANG": "C.UTF-8",
            **(extra or {}),
        }

    def config(self, config: Record, name: str = "fake-config.json") -> Path:
        """Write a Fake-Pi test configuration (``--fake-config``)."""
        path = self.root / name
        path.write_text(json.dumps(config))
        return path

    def session_files(self) -> list[Path]:
        return sorted(self.sessions.glob("*.jsonl"))

    def only_session(self) -> Path:
        files = self.session_files()
        assert len(files) == 1, files
        return files[0]


@pytest.fixture
async def sandbox(tmp_path: Path, model: Model) -> Sandbox:
    """Private directories; ``models.json`` points provider ``fake`` at ``model``."""
    box = Sandbox(tmp_path)
    for directory in (box.agent_dir, box.work, box.sessions, box.tmp):
        directory.mkdir(parents=True)
    provider = {
        "baseUrl": f"{model.server.url}/v1",
        "api": "openai-completions",
        "apiKey": "dummy-key",
        "models": [{"id": "fake-model", "name": "Fake Model", "contextWindow": 128000}],
    }
    (box.agent_dir / "models.json").write_text(json.dumps({"providers": {"fake": provider}}))
    (box.agent_dir / "settings.json").write_text(json.dumps({"retry": {"baseDelayMs": 20}}))
    return box


# ---------------------------------------------------------------------------- process


class WorkerDied(AssertionError):
    """Stdout ended while a test waited for a record."""


@dataclass
class Worker:
    """One Fake-Pi process: its stdout records, in order, and helpers to drive it."""

    process: trio.Process
    argv: list[str]
    records: list[Record] = field(default_factory=list)
    sent: list[bytes] = field(default_factory=list)
    stderr: bytearray = field(default_factory=bytearray)
    eof: bool = False
    _changed: trio.Event = field(default_factory=trio.Event)
    _counter: int = 0
    _stdin_closed: bool = False

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def drain_stdout(self) -> None:
        assert self.process.stdout is not None
        buffer = bytearray()
        while data := await self.process.stdout.receive_some(65536):
            buffer += data
            while (end := buffer.find(b"\n")) >= 0:
                line = bytes(buffer[:end])
                del buffer[: end + 1]
                if line.strip():
                    self.records.append(json.loads(line))
                    self._notify()
        assert not buffer.strip(), f"an unterminated last line: {bytes(buffer)!r}"
        self.eof = True
        self._notify()

    async def drain_stderr(self) -> None:
        assert self.process.stderr is not None
        while data := await self.process.stderr.receive_some(65536):
            self.stderr += data

    def describe(self, what: str) -> str:
        tail = "\n  ".join(json.dumps(r)[:300] for r in self.records[-8:])
        return (
            f"{what}; rc={self.process.returncode}; stderr={bytes(self.stderr[-3000:])!r}; "
            f"last records:\n  {tail}"
        )

    def mark(self) -> int:
        return len(self.records)

    async def wait_for(
        self, predicate: Callable[[Record], bool], *, since: int = 0, limit: float = LIMIT
    ) -> Record:
        """The first record at or after index ``since`` that matches."""
        with trio.fail_after(limit):
            index = since
            while True:
                while index < len(self.records):
                    if predicate(self.records[index]):
                        return self.records[index]
                    index += 1
                if self.eof:
                    raise WorkerDied(self.describe("stdout ended while waiting"))
                await self._changed.wait()

    async def wait_type(self, kind: str, *, since: int = 0, limit: float = LIMIT) -> Record:
        return await self.wait_for(lambda r: r.get("type") == kind, since=since, limit=limit)

    async def send(self, command: Record) -> str:
        """Send one command line with a fresh id; returns the id."""
        assert self.process.stdin is not None
        self._counter += 1
        command = {"id": f"c{self._counter}", **command}
        line = json.dumps(command).encode()
        self.sent.append(line)
        await self.process.stdin.send_all(line + b"\n")
        return str(command["id"])

    async def request(self, command: Record, *, limit: float = LIMIT) -> Record:
        """Send ``command`` and wait for its response (events keep flowing)."""
        since = self.mark()
        command_id = await self.send(command)
        return await self.wait_for(
            lambda r: r.get("type") == "response" and r.get("id") == command_id,
            since=since,
            limit=limit,
        )

    async def call(self, command: Record) -> Any:
        """:meth:`request`, which must succeed; returns its ``data``."""
        response = await self.request(command)
        assert response["success"] is True, self.describe(f"{command} failed: {response}")
        return response.get("data")

    async def prompt(self, message: str) -> int:
        """Start a run; returns the index of its first record (a cursor)."""
        since = self.mark()
        data = await self.call({"type": "prompt", "message": message})
        assert data == {"disposition": "started"}
        return since

    async def prompt_and_settle(self, message: str) -> list[Record]:
        """Prompt and wait for ``agent_settled``; returns the run's events."""
        since = await self.prompt(message)
        await self.wait_type("agent_settled", since=since)
        return self.events(since)

    def events(self, since: int = 0) -> list[Record]:
        return [r for r in self.records[since:] if r.get("type") != "response"]

    async def close_stdin(self) -> None:
        if not self._stdin_closed:
            self._stdin_closed = True
            assert self.process.stdin is not None
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self.process.stdin.aclose()

    async def wait_exit(self, limit: float = LIMIT) -> int:
        with trio.fail_after(limit):
            return await self.process.wait()

    async def wait_eof(self, limit: float = LIMIT) -> None:
        """Until stdout ended (everything printed before the exit is in ``records``)."""
        with trio.fail_after(limit):
            while not self.eof:
                await self._changed.wait()

    async def finish(self) -> int:
        """Close stdin, wait for the exit and the end of stdout; the return code."""
        await self.close_stdin()
        returncode = await self.wait_exit()
        await self.wait_eof()
        return returncode


@contextlib.asynccontextmanager
async def launch(
    sandbox: Sandbox,
    *args: str,
    config: Record | None = None,
    env: dict[str, str] | None = None,
    session_dir: bool = True,
) -> AsyncIterator[Worker]:
    """Start ``python -m fake_pi --mode rpc …`` in the sandbox's work dir; stop it after."""
    argv = [sys.executable, "-m", "fake_pi", *FLAGS]
    if session_dir:
        argv += ["--session-dir", str(sandbox.sessions)]
    argv += [*QUIET, *args]
    if config is not None:
        argv += ["--fake-config", str(sandbox.config(config))]
    process = await trio.lowlevel.open_process(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=str(sandbox.work),
        env=sandbox.env(env),
    )
    worker = Worker(process, argv)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker.drain_stdout)
            nursery.start_soon(worker.drain_stderr)
            try:
                yield worker
            finally:
                with trio.CancelScope(shield=True):
                    await worker.close_stdin()
                    with trio.move_on_after(LIMIT):
                        await process.wait()
                    if process.returncode is None:
                        process.kill()
                        with trio.move_on_after(LIMIT):
                            await process.wait()
                nursery.cancel_scope.cancel()
    finally:
        if process.returncode is None:  # only if something above went wrong
            process.kill()
            with trio.CancelScope(shield=True), trio.move_on_after(LIMIT):
                await process.wait()


# ------------------------------------------------------------------------------ /proc


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of a live process, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return fields[0], int(fields[2])


def is_alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    members = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[1] == pgid and stat[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


def descendants(pid: int) -> set[int]:
    """``pid``'s children, grandchildren, … from /proc/<pid>/task/*/children."""
    found: set[int] = set()
    pending = [pid]
    while pending:
        current = pending.pop()
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                for child in children.read_text().split():
                    if int(child) not in found:
                        found.add(int(child))
                        pending.append(int(child))
    return found


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


# ----------------------------------------------------------------------------- helpers


def messages_of(entries: Sequence[Record]) -> list[Record]:
    return [e["message"] for e in entries if e.get("type") == "message"]


def roles(entries: Sequence[Record]) -> list[str]:
    return [m["role"] for m in messages_of(entries)]


def text_of(message: Record) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content or [] if b.get("type") == "text")


SLEEPER: Final = "sleep 30 & echo $$ $!; wait; echo never"
"""A bash command that starts a ``sleep`` well past any bound here, prints its own pid (the
tool's process group: Pi starts bash detached) and the sleep's, and waits."""


async def running_sleeper(worker: Worker, since: int) -> tuple[int, set[int]]:
    """Wait until the SLEEPER tool printed its pids; the shell's pid (the group) and the
    process tree (the shell and its ``sleep``)."""
    update = await worker.wait_for(
        lambda r: (
            r.get("type") == "tool_execution_update"
            and re.match(r"\d+ \d+\n", text_of(r["partialResult"])) is not None
        ),
        since=since,
    )
    shell, sleeper = map(int, text_of(update["partialResult"]).split()[:2])
    tree = {shell} | descendants(shell)
    assert tree == {shell, sleeper}, {p: cmdline(p) for p in tree}
    assert set(group_members(shell)) == tree
    return shell, tree


def assert_no_survivors(shell: int, tree: set[int]) -> None:
    alive = {pid: cmdline(pid) for pid in tree if is_alive(pid)}
    assert alive == {}, f"tool processes survived: {alive}"
    assert group_members(shell) == [], "a member of the tool's process group survived"


def assert_aborted_tool_tail(entries: list[Record], call_id: str) -> None:
    """The session ends toolCall → toolResult "Command aborted" → aborted assistant."""
    tail = messages_of(entries)[-3:]
    assert [m["role"] for m in tail] == ["assistant", "toolResult", "assistant"]
    assert [b["id"] for b in tail[0]["content"] if b["type"] == "toolCall"] == [call_id]
    result = tail[1]
    assert result["toolCallId"] == call_id
    assert result["isError"] is True
    assert text_of(result).endswith("Command aborted")
    assert "never" not in text_of(result)
    assert tail[2]["stopReason"] == "aborted"
    assert tail[2]["content"] == []
    assert entries[-1]["message"] is tail[2]


# ====================================================================== sessions and events


async def test_prompt_runs_to_agent_settled_and_writes_a_pi_session(
    sandbox: Sandbox, model: Model
) -> None:
    """Item 6: one plain prompt gives Pi's event sequence up to ``agent_settled`` and a
    Pi-shaped session file in ``--session-dir``: header, model_change, thinking_level_change,
    then the system, user and assistant messages, each entry a child of the one before."""
    async with launch(sandbox) as worker:
        events = await worker.prompt_and_settle("hello there")
        state = await worker.call({"type": "get_state"})
        assert await worker.finish() == 0

    kinds = [e["type"] for e in events]
    assert kinds[:8] == [
        "agent_start",
        "turn_start",
        "message_start",
        "message_end",
        "message_start",
        "message_end",
        "message_start",
        "message_update",
    ]
    assert kinds[-5:] == ["message_update", "message_end", "turn_end", "agent_end", "agent_settled"]
    assert set(kinds[7:-4]) == {"message_update"}
    ends = [e["message"] for e in events if e["type"] == "message_end"]
    assert [m["role"] for m in ends] == ["system", "user", "assistant"]
    assert events[-1] == {"type": "agent_settled", "aborted": False}
    assert events[-2]["willRetry"] is False
    deltas = [
        e["assistantMessageEvent"]["delta"]
        for e in events
        if e["type"] == "message_update" and e["assistantMessageEvent"]["type"] == "text_delta"
    ]
    assert "".join(deltas) == "You said: hello there"

    path = sandbox.only_session()
    match = SESSION_NAME.match(path.name)
    assert match is not None, path.name
    assert state["sessionFile"] == str(path)
    assert state["sessionId"] == match.group(1)
    assert state["isStreaming"] is False
    assert not (sandbox.agent_dir / "sessions").exists()

    entries = read_jsonl(path)
    assert [e["type"] for e in entries] == [
        "session",
        "model_change",
        "thinking_level_change",
        "message",
        "message",
        "message",
    ]
    header = entries[0]
    assert header["version"] == 3
    assert header["id"] == state["sessionId"]
    assert header["cwd"] == str(sandbox.work)
    assert entries[1]["provider"] == "fake"
    assert entries[1]["modelId"] == "fake-model"
    assert entries[1]["parentId"] is None
    assert entries[2]["thinkingLevel"] == "off"
    for parent, child in itertools.pairwise(entries[1:]):
        assert child["parentId"] == parent["id"]
        assert re.fullmatch(r"[0-9a-f]{8}", child["id"])
    system, user, assistant = messages_of(entries)
    assert system["role"] == "system"
    assert str(sandbox.work) in system["sections"]["cwd"]
    assert user == ends[1]
    assert text_of(user) == "hello there"
    assert assistant["stopReason"] == "stop"
    assert text_of(assistant) == "You said: hello there"
    assert assistant["responseId"] == "chatcmpl-fake-1"
    assert assistant == ends[2]
    assert model.scripted.request_count == 1


async def test_relaunch_with_session_resumes_and_appends(sandbox: Sandbox, model: Model) -> None:
    """Item 6: ``--session FILE`` resumes the same session (same id and file; the leaf is the
    last line) and only appends the new user and assistant messages (no new header,
    model_change or system entry), as Pi does."""
    async with launch(sandbox) as worker:
        await worker.prompt_and_settle("first")
        first_id = (await worker.call({"type": "get_state"}))["sessionId"]
        assert await worker.finish() == 0
    path = sandbox.only_session()
    before = path.read_bytes()
    last_id = read_jsonl(path)[-1]["id"]

    async with launch(sandbox, "--session", str(path), session_dir=False) as worker:
        state = await worker.call({"type": "get_state"})
        assert state["sessionId"] == first_id
        assert state["sessionFile"] == str(path)
        entries = await worker.call({"type": "get_entries"})
        assert entries["leafId"] == last_id
        assert [e["id"] for e in entries["entries"]] == [e["id"] for e in read_jsonl(path)[1:]]
        await worker.prompt_and_settle("second")
        leaf = (await worker.call({"type": "get_entries"}))["leafId"]
        assert await worker.finish() == 0

    after = path.read_bytes()
    assert after.startswith(before)
    appended = read_jsonl(path)[len(read_jsonl_bytes(before)) :]
    assert [e["type"] for e in appended] == ["message", "message"]
    assert roles(appended) == ["user", "assistant"]
    assert appended[0]["parentId"] == last_id
    assert appended[1]["parentId"] == appended[0]["id"]
    assert leaf == appended[-1]["id"]
    assert text_of(appended[1]["message"]) == "You said: second"
    assert sandbox.session_files() == [path]
    # the resumed context went to the model: both user messages, one system message
    second_request = model.scripted.requests[-1].body["messages"]
    assert [m["role"] for m in second_request] == ["system", "user", "assistant", "user"]


async def test_no_session_writes_no_file(sandbox: Sandbox, model: Model) -> None:
    """Item 6: with ``--no-session`` the run works (the context is kept in memory) but no
    session file is written anywhere, and ``get_state`` has no ``sessionFile``."""
    async with launch(sandbox, "--no-session") as worker:
        await worker.prompt_and_settle("one")
        await worker.prompt_and_settle("two")
        state = await worker.call({"type": "get_state"})
        assert await worker.finish() == 0
    assert "sessionFile" not in state
    assert state["messageCount"] == 5  # system, user, assistant, user, assistant
    assert list(sandbox.root.rglob("*.jsonl")) == []
    assert not (sandbox.agent_dir / "sessions").exists()
    assert model.scripted.request_count == 2


async def test_model_server_counts_exactly_the_requests_of_the_run(
    sandbox: Sandbox, model: Model
) -> None:
    """Items 4 and 6: the model server counted exactly the requests the run made — one per
    assistant message, each body once — and each assistant message carries the response id
    of its own request; the second request carries the tool result of the first's call."""
    model.script(ToolCalls(calls=[Call(name="bash", arguments={"command": "echo hi"})]))
    async with launch(sandbox) as worker:
        events = await worker.prompt_and_settle("run something")
        await worker.prompt_and_settle("and again")
        assert await worker.finish() == 0

    entries = read_jsonl(sandbox.only_session())
    assistants = [m for m in messages_of(entries) if m["role"] == "assistant"]
    requests = model.scripted.requests
    assert len(requests) == len(assistants) == 3
    assert [m["responseId"] for m in assistants] == [f"chatcmpl-fake-{n}" for n in (1, 2, 3)]
    assert all(model.scripted.count(r.digest) == 1 for r in requests)
    tool_message = requests[1].body["messages"][-1]
    assert tool_message["role"] == "tool"
    assert tool_message["tool_call_id"] == "call_1"
    assert tool_message["content"] == "hi\n"
    assert [e["type"] for e in events].count("tool_execution_end") == 1
    assert text_of(assistants[1]) == "The tool said: hi"


# =================================================================================== barriers


async def test_sigkill_before_the_first_tool_leaves_the_dangling_tool_call(
    sandbox: Sandbox, model: Model
) -> None:
    """Item 6: ``kill`` at ``before_tool:1`` kills the process by SIGKILL before the tool
    starts: the session's last line is the assistant's toolCall message and there is no
    toolResult (Pi's "SIGKILL mid-tool" file), and the tool never ran."""
    model.script(ToolCalls(calls=[Call(name="bash", arguments={"command": "touch ran.txt"})]))
    config = {"behaviours": {"at": {"before_tool:1": "kill"}}}
    async with launch(sandbox, config=config) as worker:
        await worker.prompt("do the thing")
        assert await worker.wait_exit() == -signal.SIGKILL
        await worker.wait_eof()
    kinds = [e["type"] for e in worker.events()]
    assert "tool_execution_start" not in kinds
    assert "agent_settled" not in kinds
    entries = read_jsonl(sandbox.only_session())
    assert "toolResult" not in roles(entries)
    last = entries[-1]["message"]
    assert last["role"] == "assistant"
    assert last["stopReason"] == "toolUse"
    assert [b["type"] for b in last["content"]] == ["toolCall"]
    assert last["content"][0]["name"] == "bash"
    assert not (sandbox.work / "ran.txt").exists()
    assert model.scripted.request_count == 1


async def test_sigkill_mid_stream_leaves_the_user_message_last(
    sandbox: Sandbox, model: Model
) -> None:
    """Item 6: ``kill`` at ``mid_stream:1`` (after the first chunk of the first response) dies
    by SIGKILL with the assistant message unwritten: the session's last line is the user
    message, as in Pi's "SIGKILL while streaming" file."""
    model.script(Text(text="a long answer that never lands"))
    config = {"behaviours": {"at": {"mid_stream:1": "kill"}}}
    async with launch(sandbox, config=config) as worker:
        await worker.prompt("stream to me")
        assert await worker.wait_exit() == -signal.SIGKILL
        await worker.wait_eof()
    entries = read_jsonl(sandbox.only_session())
    assert roles(entries) == ["system", "user"]
    assert text_of(entries[-1]["message"]) == "stream to me"
    assert "message_end" in [e["type"] for e in worker.events()]  # system and user only
    assert model.scripted.request_count == 1


async def test_sigkill_mid_tool_orphans_the_tool_group(sandbox: Sandbox, model: Model) -> None:
    """Item 6: SIGKILL from outside while ``bash`` runs leaves the tool's process group alive
    (Pi spawns bash detached; pi-observed.md §8: a supervisor must kill the group itself) and the
    session ending with the dangling toolCall; the test then kills the group and waits on
    pidfds until every member is gone."""
    model.script(ToolCalls(calls=[Call(name="bash", arguments={"command": SLEEPER}, id="call_o")]))
    async with launch(sandbox) as worker:
        since = await worker.prompt("sleep a while")
        shell, tree = await running_sleeper(worker, since)
        pidfds = [os.pidfd_open(pid) for pid in sorted(tree)]
        try:
            worker.process.kill()
            assert await worker.wait_exit() == -signal.SIGKILL
            await worker.wait_eof()
            survivors = set(group_members(shell))
            assert survivors == tree, (survivors, tree)
            os.killpg(shell, signal.SIGKILL)
            with trio.fail_after(LIMIT):
                for fd in pidfds:
                    await trio.lowlevel.wait_readable(fd)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(shell, signal.SIGKILL)
            for fd in pidfds:
                os.close(fd)
        assert_no_survivors(shell, tree)
    last = read_jsonl(sandbox.only_session())[-1]["message"]
    assert last["role"] == "assistant"
    assert [b["id"] for b in last["content"]] == ["call_o"]


async def test_exit_code_at_after_model(sandbox: Sandbox, model: Model) -> None:
    """Item 6: ``exit:3`` at ``after_model:1`` exits with code 3 right after the first model
    response was persisted (nothing more is requested or printed)."""
    config = {"behaviours": {"at": {"after_model:1": "exit:3"}}}
    async with launch(sandbox, config=config) as worker:
        await worker.prompt("hi")
        assert await worker.wait_exit() == 3
        await worker.wait_eof()
    kinds = [e["type"] for e in worker.events()]
    assert "message_end" in kinds
    assert "turn_end" not in kinds
    entries = read_jsonl(sandbox.only_session())
    assert roles(entries) == ["system", "user", "assistant"]
    assert text_of(entries[-1]["message"]) == "You said: hi"
    assert model.scripted.request_count == 1


async def test_hang_at_startup_answers_nothing_until_killed(sandbox: Sandbox, model: Model) -> None:
    """Item 6: ``hang`` at ``startup`` (configured through ``$FAKE_PI_CONFIG``) leaves a live
    process that answers nothing — a ``get_state`` gets no response and its stdin line is never
    even read — until the test kills it.

    The recording file is a FIFO, so the test knows when the process reached the barrier (the
    launch record is written just before it) and only then starts the silence window."""
    recording = sandbox.root / "recording.fifo"
    os.mkfifo(recording)
    # read-write: the FIFO always has a writer, so reading blocks instead of seeing EOF
    records = trio.lowlevel.FdStream(os.open(recording, os.O_RDWR | os.O_NONBLOCK))
    config = {"behaviours": {"at": {"startup": "hang"}}, "record": str(recording)}
    config_path = sandbox.config(config, "hang.json")
    async with records, launch(sandbox, env={"FAKE_PI_CONFIG": str(config_path)}) as worker:
        received = b""
        with trio.fail_after(LIMIT):
            while b"\n" not in received:
                received += await records.receive_some(65536)
        launch_line, rest = received.split(b"\n", 1)
        assert json.loads(launch_line)["kind"] == "launch"
        assert rest == b""

        await worker.send({"type": "get_state"})
        heard: list[object] = []
        with trio.move_on_after(SILENCE):
            async with trio.open_nursery() as listen:

                async def on_stdout() -> None:
                    heard.append(await worker.wait_for(lambda r: True))
                    listen.cancel_scope.cancel()

                async def on_recording() -> None:
                    heard.append(await records.receive_some(65536))
                    listen.cancel_scope.cancel()

                listen.start_soon(on_stdout)
                listen.start_soon(on_recording)
        assert heard == [], worker.describe("a hung Fake-Pi answered or read its stdin")
        assert worker.process.returncode is None
        worker.process.kill()
        assert await worker.wait_exit() == -signal.SIGKILL
        await worker.wait_eof()
    assert worker.records == []
    assert sandbox.session_files() == []
    assert model.scripted.request_count == 0


# ============================================================================ signals and EOF


async def test_sigterm_during_a_tool_aborts_it_and_exits_143(
    sandbox: Sandbox, model: Model
) -> None:
    """Item 6 (and 5, bash): SIGTERM while ``bash`` runs is Pi's orderly but aborting shutdown:
    exit code 143, no process of the tool's group survives (the shell and its ``sleep``), the
    session holds the toolResult "Command aborted" and an aborted assistant message, and no
    ``agent_settled`` is printed."""
    model.script(ToolCalls(calls=[Call(name="bash", arguments={"command": SLEEPER}, id="call_s")]))
    async with launch(sandbox) as worker:
        since = await worker.prompt("sleep a while")
        shell, tree = await running_sleeper(worker, since)
        worker.process.send_signal(signal.SIGTERM)
        assert await worker.wait_exit() == 143
        await worker.wait_eof()
        assert_no_survivors(shell, tree)
    kinds = [e["type"] for e in worker.events()]
    assert "agent_settled" not in kinds
    assert "agent_end" not in kinds
    assert_aborted_tool_tail(read_jsonl(sandbox.only_session()), "call_s")
    assert model.scripted.request_count == 1


async def test_stdin_closed_during_a_tool_aborts_it_and_exits_0(
    sandbox: Sandbox, model: Model
) -> None:
    """Item 6: closing stdin while ``bash`` runs is the same aborting shutdown with exit code 0:
    the tool's group is killed, "Command aborted" and an aborted assistant message are
    persisted, nothing more is printed, and the model is not asked again."""
    model.script(ToolCalls(calls=[Call(name="bash", arguments={"command": SLEEPER}, id="call_e")]))
    async with launch(sandbox) as worker:
        since = await worker.prompt("sleep a while")
        shell, tree = await running_sleeper(worker, since)
        await worker.close_stdin()
        assert await worker.wait_exit() == 0
        await worker.wait_eof()
        assert_no_survivors(shell, tree)
    kinds = [e["type"] for e in worker.events()]
    assert "agent_settled" not in kinds
    assert_aborted_tool_tail(read_jsonl(sandbox.only_session()), "call_e")
    assert model.scripted.request_count == 1


async def test_ignore_sigterm_keeps_answering_then_exits(sandbox: Sandbox, model: Model) -> None:
    """Item 6: with ``ignore_sigterm: 1.0`` the process is still alive and answering right after
    SIGTERM (a ``get_state`` sent after the signal is answered), then exits 143 no sooner than
    a second after the signal. (Only lower time bounds are asserted: a loaded box may be slow,
    never early.)"""
    config = {"behaviours": {"ignore_sigterm": 1.0}}
    async with launch(sandbox, config=config) as worker:
        await worker.call({"type": "get_state"})  # up and serving
        signalled = trio.current_time()
        worker.process.send_signal(signal.SIGTERM)
        state = await worker.call({"type": "get_state"})
        assert state["isStreaming"] is False
        assert worker.process.returncode is None
        assert await worker.wait_exit() == 143
        exited = trio.current_time()
        await worker.wait_eof()
    assert exited - signalled >= 1.0
    assert sandbox.session_files() == []


async def test_sigterm_when_idle_exits_143(sandbox: Sandbox, model: Model) -> None:
    """Item 6: an idle Fake-Pi (no ``ignore_sigterm``) exits with 128 + SIGTERM on SIGTERM,
    having printed nothing more and written no session (there was no message)."""
    async with launch(sandbox) as worker:
        await worker.call({"type": "get_state"})
        since = worker.mark()
        worker.process.send_signal(signal.SIGTERM)
        assert await worker.wait_exit() == 143
        await worker.wait_eof()
    assert worker.records[since:] == []
    assert sandbox.session_files() == []


async def test_retry_delay_comes_from_settings_json(sandbox: Sandbox, model: Model) -> None:
    """Items 4 and 6: a 500 from the model is retried after ``retry.baseDelayMs`` from the
    agent dir's ``settings.json`` (20 ms here): ``auto_retry_start{delayMs: 20}``, the failed
    reply hidden by a ``context_edit``, a second request, ``auto_retry_end{success: true}``."""
    model.script(HttpError())
    async with launch(sandbox) as worker:
        events = await worker.prompt_and_settle("try hard")
        assert await worker.finish() == 0
    start = next(e for e in events if e["type"] == "auto_retry_start")
    assert start["attempt"] == 1
    assert start["delayMs"] == 20
    assert start["errorMessage"].startswith("500: ")
    assert next(e for e in events if e["type"] == "auto_retry_end")["success"] is True
    assert [e["willRetry"] for e in events if e["type"] == "agent_end"] == [True, False]
    entries = read_jsonl(sandbox.only_session())
    assert "context_edit" in [e["type"] for e in entries]
    stops = [m.get("stopReason") for m in messages_of(entries) if m["role"] == "assistant"]
    assert stops == ["error", "stop"]
    assert model.scripted.request_count == 2


# =================================================================================== recorder


async def test_recorder_keeps_argv_env_keys_stdin_and_tools_but_no_env_values(
    sandbox: Sandbox, model: Model
) -> None:
    """Item 6: the recording file holds the launch argv, the environment's KEYS only (a
    secret's value is in neither the recording nor the session file), every stdin line as
    sent (a bad line too), and each tool execution with its id, name and arguments."""
    recording = sandbox.root / "recording.jsonl"
    model.script(ToolCalls(calls=[Call(name="bash", arguments={"command": "echo recorded"})]))
    config = {"record": str(recording)}
    async with launch(sandbox, config=config, env={"FAKE_SECRET": "hunter2"}) as worker:
        await worker.prompt_and_settle("record this")
        await worker.call({"type": "get_state"})
        since = worker.mark()
        bad = b"this is not json"
        worker.sent.append(bad)
        assert worker.process.stdin is not None
        await worker.process.stdin.send_all(bad + b"\n")
        parse_error = await worker.wait_type("response", since=since)
        assert await worker.finish() == 0
    assert parse_error["command"] == "parse"
    assert parse_error["success"] is False

    raw = recording.read_bytes()
    records = read_jsonl(recording)
    launch_record = records[0]
    assert launch_record["kind"] == "launch"
    assert launch_record["argv"][1:] == worker.argv[3:]
    assert launch_record["argv"][0].endswith("fake_pi/__main__.py")
    env_keys = launch_record["env_keys"]
    assert env_keys == sorted(env_keys)
    assert {"FAKE_SECRET", "PATH", "HOME", "PI_CODING_AGENT_DIR"} <= set(env_keys)
    assert set(launch_record) == {"kind", "argv", "env_keys"}

    stdin_lines = [r["line"] for r in records if r["kind"] == "stdin"]
    assert stdin_lines == [line.decode() for line in worker.sent]

    tools = [r for r in records if r["kind"] == "tool"]
    assert tools == [
        {"kind": "tool", "id": "call_1", "name": "bash", "args": {"command": "echo recorded"}}
    ]
    assert {r["kind"] for r in records} == {"launch", "stdin", "tool"}

    assert b"hunter2" not in raw
    assert b"hunter2" not in sandbox.only_session().read_bytes()
    assert all("hunter2" not in json.dumps(r.body) for r in model.scripted.requests)


# ===================================================================================== tools


async def test_effect_tool_appends_one_ledger_line(sandbox: Sandbox, model: Model) -> None:
    """Item 5: the ``effect`` test tool, called by the model in a Fake-Pi process, appends
    exactly one line to the configured ledger (key, intent = the tool call id, pid of the
    process) and reports ``effect k1 applied``."""
    ledger = sandbox.root / "ledger.jsonl"
    model.script(ToolCalls(calls=[Call(name="effect", arguments={"key": "k1"}, id="call_k")]))
    tools = ["read", "bash", "edit", "write", "effect"]
    async with launch(sandbox, config={"ledger": str(ledger), "tools": tools}) as worker:
        events = await worker.prompt_and_settle("apply it")
        pid = worker.process.pid
        assert await worker.finish() == 0
    end = next(e for e in events if e["type"] == "tool_execution_end")
    assert end["isError"] is False, (
        f"the effect tool did not run in the subprocess: {end['result']['content']}"
    )
    assert text_of(end["result"]) == "effect k1 applied"
    lines = read_jsonl(ledger)
    assert lines == [{"key": "k1", "intent": "call_k", "pid": pid}]


async def test_commands_sent_before_stdin_closes_are_all_answered(
    sandbox: Sandbox, model: Model
) -> None:
    """Item 6: fifty commands written, then stdin closed: each gets its response before the
    process exits, as with Pi 1.6.0 (measured: 50 of 50). Fake-Pi stopped its writer one
    scheduler pass after the end of stdin and dropped what was still queued (26 of 50)."""
    async with launch(sandbox) as worker:
        await worker.call({"type": "get_state"})  # up and serving
        since = worker.mark()
        ids = [await worker.send({"type": "get_state"}) for _ in range(50)]
        await worker.close_stdin()
        assert await worker.wait_exit() == 0
        await worker.wait_eof()
    answered = [r.get("id") for r in worker.records[since:] if r.get("type") == "response"]
    assert answered == ids


DEEP: Final = 100_000
"""Levels of nesting past any recursive JSON decoder (Node's ``JSON.parse`` has no limit)."""


async def test_f1_a_line_nested_too_deeply_is_answered_and_the_next_one_served(
    sandbox: Sandbox, model: Model
) -> None:
    """F1: an input line nested 100,000 levels deep — an array in arrays, an object in
    objects — is answered as Pi 1.6.0 answers it (Node parses it: a value that is no command,
    ``Unknown command: undefined`` with no ``command`` and no id), and the next command is
    served. Before, the decoder's ``RecursionError`` escaped the RPC loop and ended the
    process with a traceback, unanswered."""
    not_a_command = {"type": "response", "success": False, "error": "Unknown command: undefined"}
    lines = (
        b"[" * DEEP + b"]" * DEEP,
        b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    )
    async with launch(sandbox) as worker:
        await worker.call({"type": "get_state"})
        assert worker.process.stdin is not None
        for line in lines:
            since = worker.mark()
            await worker.process.stdin.send_all(line + b"\n")
            assert await worker.wait_type("response", since=since) == not_a_command
            assert (await worker.call({"type": "get_state"}))["isStreaming"] is False
        assert await worker.finish() == 0
    assert b"Traceback" not in worker.stderr
