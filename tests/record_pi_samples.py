"""Record the real-Pi samples in ``tests/data/pi-1.6.0/`` (run by ``scripts/record-pi-samples``).

The installed real Pi 1.6.0 runs in RPC mode against the project's scripted model
(:class:`fake_pi.model_server.ScriptedModel`), driven the way the conformance suite drives it
(:mod:`tests.conformance.harness`): each scenario has its own sandbox and a fresh model with a
fixed list of steps. The recorder writes

* ``session_<name>.jsonl`` for basic, steer, abort, retry, killed_midtool, branched and fork,
* ``llm_request_first_full.json``: the first request Pi sent to the model (method, path, the
  non-secret headers, the body),
* ``facts.json``: what the tests need to know about the files that the files do not say
  themselves (:class:`tests._samples.SampleFacts`).

Every scenario checks the shape of what Pi wrote (entry types, roles, stop reasons, parents) and
that the model got exactly its scripted requests, so a recording is the same in shape each time;
only ids, timestamps and the sandbox paths differ. Nothing is written to the output directory
unless every scenario succeeded. Every wait is bounded by :func:`trio.fail_after` and waits on
what Pi prints or on process exits; slow tools block on a FIFO the recorder holds, and the
recorder never sleeps. Every process started here is stopped by PID: Pi by the harness (or by
SIGKILL in ``killed_midtool``), tool processes by Pi's abort or, when Pi was killed, by the
recorder through pidfds.

Usage: ``python -m tests.record_pi_samples [--out DIR]`` (from the repository root).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import trio
import trio.lowlevel

from fake_pi.model_server import ScriptedModel
from fake_pi.scenario import Call, HttpError, Scenario, Step, Text, ToolCalls
from runtime._boundary._http import HttpServer, Request, ResponseWriter, serve_http
from runtime._clock import SystemWallClock
from runtime._pi._pijson import iso_timestamp
from runtime._pi._session_files import read_session

from ._samples import (
    FACTS,
    FIRST_REQUEST,
    PI_VERSION,
    SAMPLES,
    DanglingCallFact,
    InjectedLineFact,
    SampleFacts,
)
from .conformance.harness import Model, Record, Sandbox, Worker, open_worker, pi_install
from .conformance.scenarios import descendants, pidfds_of

__all__ = ["RecordingError", "main", "record"]

START_LIMIT: Final = 30.0
"""The first response of a cold Node start."""
STEP_LIMIT: Final = 30.0
SCENARIO_LIMIT: Final = 180.0
REAP_LIMIT: Final = 10.0

GATE: Final = "release.fifo"
"""A FIFO in the work directory; a gated tool command blocks reading a line from it."""
GATED: Final = f"read -r line < {GATE}"
API_KEY: Final = "dummy-key"
"""The key ``Sandbox.point_at`` gives Pi; it must appear in no sample."""
KEPT_HEADERS: Final = frozenset(
    {"accept", "accept-encoding", "accept-language", "connection", "content-type"}
    | {"sec-fetch-mode", "user-agent"}
)
"""Request headers worth keeping (plus ``x-stainless-*``); credentials, the host (a random
port) and the length are left out."""

INJECTED_ID: Final = "b0b0b0b0"


class RecordingError(Exception):
    """Pi did not do what the scenario expects; nothing was written."""


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise RecordingError(what)


# ------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class SeenRequest:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


@dataclass
class RecordingModel:
    """A scripted model served on loopback that also keeps each request's head and bytes."""

    model: Model
    seen: list[SeenRequest] = field(default_factory=list)

    def expect_requests(self, steps: Sequence[Step]) -> None:
        count = self.model.scripted.request_count
        expect(count == len(steps), f"the model got {count} requests, {len(steps)} scripted")


@contextlib.asynccontextmanager
async def open_recording_model(steps: Sequence[Step]) -> AsyncIterator[RecordingModel]:
    scripted = ScriptedModel(scenario=Scenario(steps=list(steps)), directives=False)
    seen: list[SeenRequest] = []

    async def handle(request: Request, response: ResponseWriter) -> None:
        if request.method == "POST":
            seen.append(SeenRequest(request.method, request.target, request.headers, request.body))
        await scripted.handle(request, response)

    async with trio.open_nursery() as nursery:
        server: HttpServer = await nursery.start(serve_http, handle)
        try:
            yield RecordingModel(Model(scripted, server), seen)
        finally:
            nursery.cancel_scope.cancel()


def first_request(seen: SeenRequest) -> dict[str, Any]:
    """The sample form of a request: no credentials, no host or length."""
    headers = {
        name: value
        for name, value in seen.headers.items()
        if name in KEPT_HEADERS or name.startswith("x-stainless-")
    }
    expect(all(API_KEY not in value for value in headers.values()), "a kept header has the key")
    body = json.loads(seen.body)
    expect(isinstance(body.get("tools"), list), "the first request declares tools")
    return {"method": seen.method, "path": seen.target, "headers": headers, "body": body}


# ------------------------------------------------------------------------------- plumbing


class Gate:
    """The FIFO gated tools read. The recorder holds it open read-write, so a tool's open never
    blocks and a line written before the tool reads still reaches it; ``release`` lets one
    reader go. A tool that is never released blocks until it is killed."""

    def __init__(self, work: Path) -> None:
        path = work / GATE
        os.mkfifo(path, 0o600)
        self._fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)

    def release(self) -> None:
        os.write(self._fd, b"go\n")

    def close(self) -> None:
        os.close(self._fd)


@contextlib.contextmanager
def gate_in(sandbox: Sandbox) -> Iterator[Gate]:
    gate = Gate(sandbox.work)
    try:
        yield gate
    finally:
        gate.close()


def _text(value: dict[str, Any] | None) -> str:
    content = (value or {}).get("content")
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if p.get("type") == "text")


async def wait_tool_output(worker: Worker, since: int, text: str) -> None:
    """Until a running tool's output holds ``text`` (its process is up)."""
    await worker.wait_for(
        lambda r: r.get("type") == "tool_execution_update" and text in _text(r["partialResult"]),
        since=since,
        limit=STEP_LIMIT,
    )


async def reap(pidfds: Sequence[int], *, kill: bool) -> None:
    """Wait until the processes behind ``pidfds`` exited, SIGKILLing them first with ``kill``.
    Any still there after :data:`REAP_LIMIT` are killed and the recording fails."""
    if kill:
        for fd in pidfds:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
    left = list(pidfds)
    with trio.move_on_after(REAP_LIMIT):
        while left:
            await trio.lowlevel.wait_readable(left[0])
            left.pop(0)
    for fd in left:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    expect(not left, f"{len(left)} tool processes outlived the scenario (killed now)")


async def prompt(worker: Worker, message: str, **extra: Any) -> int:
    """Send a prompt that must start a run; returns the index of its first record."""
    since = worker.mark()
    response = await worker.call({"type": "prompt", "message": message, **extra}, limit=STEP_LIMIT)
    expect(response.get("data") == {"disposition": "started"}, f"prompt: {response}")
    return since


async def settled(worker: Worker, since: int, *, aborted: bool = False) -> None:
    record = await worker.settled(since=since, limit=STEP_LIMIT)
    expect(record.get("aborted") is aborted, f"agent_settled: {record}")


async def queued(worker: Worker, command: Record) -> None:
    response = await worker.call(command, limit=STEP_LIMIT)
    expect(response.get("data") == {"disposition": "queued"}, f"{command['type']}: {response}")


async def session_file(worker: Worker) -> Path:
    state = (await worker.call({"type": "get_state"}, limit=STEP_LIMIT))["data"]
    return Path(state["sessionFile"])


async def leaf_id(worker: Worker) -> str:
    entries = (await worker.call({"type": "get_entries"}, limit=START_LIMIT))["data"]
    return str(entries["leafId"])


def shape(data: bytes) -> list[str]:
    """Each entry as ``type``, or the message's ``role`` (``role:stopReason`` for replies)."""
    out: list[str] = []
    for line in data.splitlines()[1:]:
        entry = json.loads(line)
        if entry["type"] != "message":
            out.append(entry["type"])
            continue
        message = entry["message"]
        stop = message.get("stopReason")
        out.append(f"{message['role']}:{stop}" if stop else message["role"])
    return out


def expect_shape(name: str, data: bytes, expected: Sequence[str], *, linear: bool = True) -> None:
    """The entry shape, a version-3 header and (with ``linear``) one chain in line order."""
    header = json.loads(data.splitlines()[0])
    expect((header["type"], header["version"]) == ("session", 3), f"{name}: header {header}")
    actual = shape(data)
    expect(actual == list(expected), f"{name}: entries {actual}, expected {list(expected)}")
    if linear:
        entries = [json.loads(line) for line in data.splitlines()[1:]]
        parents = [e["parentId"] for e in entries]
        expect(parents == [None, *(e["id"] for e in entries[:-1])], f"{name}: not one chain")


HEAD: Final = ("model_change", "thinking_level_change", "system")
"""What Pi writes before the first user message of a new session."""


# ------------------------------------------------------------------------------ recording


@dataclass
class Recording:
    """What the scenarios produced, written out only when all of them succeeded."""

    sessions: dict[str, bytes] = field(default_factory=dict)
    first_request: dict[str, Any] | None = None
    dangling_call: DanglingCallFact | None = None
    injected_line: InjectedLineFact | None = None


@contextlib.asynccontextmanager
async def scenario(
    root: Path, name: str, steps: Sequence[Step]
) -> AsyncIterator[tuple[Sandbox, RecordingModel]]:
    """A fresh sandbox and model for one scenario, bounded; the model must get every step."""
    with trio.fail_after(SCENARIO_LIMIT):
        sandbox = Sandbox.create(root / name)
        async with open_recording_model(steps) as model:
            sandbox.point_at(model.model.server)
            yield sandbox, model
            model.expect_requests(steps)


BASIC_PROMPT: Final = "please append hi to out.txt"
BASIC_STEPS: Final = (
    ToolCalls(
        calls=[
            Call(
                id="call_basic",
                name="bash",
                arguments={"command": "echo hi >> out.txt; cat out.txt"},
            )
        ]
    ),
    Text(text="I appended hi to out.txt"),
    Text(text="The direct bash printed direct-bash"),
)


async def record_basic(root: Path, out: Recording) -> None:
    """A tool call and an answer, an RPC ``bash``, a second prompt, ``set_session_name``."""
    async with scenario(root, "basic", BASIC_STEPS) as (sandbox, model):
        async with open_worker("pi", sandbox) as pi:
            await pi.call({"type": "get_state"}, limit=START_LIMIT)
            await settled(pi, await prompt(pi, BASIC_PROMPT))
            bash = await pi.call({"type": "bash", "command": "echo direct-bash"})
            expect(bash["data"]["output"] == "direct-bash\n", f"bash: {bash}")
            await settled(pi, await prompt(pi, "what did the direct bash print?"))
            await pi.call({"type": "set_session_name", "name": "basic-demo"})
            path = await session_file(pi)
        expect((sandbox.work / "out.txt").read_text() == "hi\n", "out.txt")
    data = path.read_bytes()
    expect_shape(
        "basic",
        data,
        [
            *HEAD,
            *("user", "assistant:toolUse", "toolResult", "assistant:stop"),
            "bashExecution",
            *("user", "assistant:stop"),
            "session_info",
        ],
    )
    expect(model.seen[0].target == "/v1/chat/completions", f"path {model.seen[0].target}")
    out.sessions["basic"] = data
    out.first_request = first_request(model.seen[0])


STEER_STEPS: Final = (
    ToolCalls(
        calls=[Call(id="call_steer", name="bash", arguments={"command": f"{GATED}; echo slept"})]
    ),
    Text(text="steered"),
    Text(text="followed up"),
    Text(text="followed up by a prompt"),
)


async def record_steer(root: Path, out: Recording) -> None:
    """While the tool runs: ``steer``, ``follow_up`` and a ``prompt`` with ``followUp``; the
    tool is released only after all three are queued."""
    async with scenario(root, "steer", STEER_STEPS) as (sandbox, _):
        with gate_in(sandbox) as gate:
            async with open_worker("pi", sandbox) as pi:
                await pi.call({"type": "get_state"}, limit=START_LIMIT)
                since = await prompt(pi, "run a slow command")
                await pi.wait_type("tool_execution_start", since=since, limit=STEP_LIMIT)
                await queued(pi, {"type": "steer", "message": "change of plan"})
                await queued(pi, {"type": "follow_up", "message": "afterwards"})
                await queued(
                    pi, {"type": "prompt", "message": "and then", "streamingBehavior": "followUp"}
                )
                gate.release()
                await settled(pi, since)
                path = await session_file(pi)
    data = path.read_bytes()
    expect_shape(
        "steer",
        data,
        [*HEAD, "user", "assistant:toolUse", "toolResult"] + ["user", "assistant:stop"] * 3,
    )
    out.sessions["steer"] = data


SLOW_TEXT: Final = " ".join(f"word{i}" for i in range(60))
ABORT_STEPS: Final = (
    ToolCalls(
        calls=[
            Call(
                id="call_abort_1",
                name="bash",
                arguments={"command": f"echo started; {GATED}; echo late >> out.txt"},
            )
        ]
    ),
    Text(text=SLOW_TEXT, delay=0.5),
    ToolCalls(
        calls=[
            Call(
                id="call_abort_2",
                name="bash",
                arguments={"command": f"echo started; {GATED}; echo late >> out.txt"},
            )
        ]
    ),
    Text(text="after the aborts"),
)


async def _abort_tool(pi: Worker, since: int) -> None:
    """Abort the running gated tool; Pi must kill its processes."""
    await wait_tool_output(pi, since, "started")
    with pidfds_of(descendants(pi.process.pid)) as fds:
        expect(bool(fds), "no tool process seen")
        await pi.call({"type": "abort"}, limit=STEP_LIMIT)
        await settled(pi, since, aborted=True)
        await reap(fds, kill=False)


async def record_abort(root: Path, out: Recording) -> None:
    """Abort during a tool, abort while streaming, ``clear_queue`` and abort during a second
    tool, then a prompt after the aborts."""
    async with scenario(root, "abort", ABORT_STEPS) as (sandbox, _):
        with gate_in(sandbox):
            async with open_worker("pi", sandbox) as pi:
                await pi.call({"type": "get_state"}, limit=START_LIMIT)
                await _abort_tool(pi, await prompt(pi, "run a long command"))
                since = await prompt(pi, "stream slowly")
                await pi.wait_for(
                    lambda r: (
                        r.get("type") == "message_update"
                        and r["assistantMessageEvent"]["type"] == "text_delta"
                    ),
                    since=since,
                    limit=STEP_LIMIT,
                )
                await pi.call({"type": "abort"}, limit=STEP_LIMIT)
                await settled(pi, since, aborted=True)
                since = await prompt(pi, "run another long command")
                await pi.wait_type("tool_execution_start", since=since, limit=STEP_LIMIT)
                await queued(pi, {"type": "steer", "message": "queued steer"})
                await queued(pi, {"type": "follow_up", "message": "queued follow-up"})
                cleared = await pi.call({"type": "clear_queue"}, limit=STEP_LIMIT)
                expected = {"steering": ["queued steer"], "followUp": ["queued follow-up"]}
                expect(cleared.get("data") == expected, f"clear_queue: {cleared}")
                await _abort_tool(pi, since)
                await settled(pi, await prompt(pi, "after the aborts"))
                path = await session_file(pi)
        expect(not (sandbox.work / "out.txt").exists(), "an aborted tool ran to its end")
    data = path.read_bytes()
    aborted_tool = ["user", "assistant:toolUse", "toolResult", "assistant:aborted"]
    expect_shape(
        "abort",
        data,
        [
            *HEAD,
            *aborted_tool,
            *("user", "assistant:aborted"),
            *aborted_tool,
            *("user", "assistant:stop"),
        ],
    )
    out.sessions["abort"] = data


RETRY_STEPS: Final = (
    HttpError(status=500, message="fake transient failure"),
    Text(text="recovered after the retry"),
)


async def record_retry(root: Path, out: Recording) -> None:
    """The provider answers HTTP 500 once; Pi hides the failed reply and retries."""
    async with (
        scenario(root, "retry", RETRY_STEPS) as (sandbox, _),
        open_worker("pi", sandbox) as pi,
    ):
        await pi.call({"type": "get_state"}, limit=START_LIMIT)
        since = await prompt(pi, "please answer despite a failure")
        await pi.wait_type("auto_retry_start", since=since, limit=STEP_LIMIT)
        _, end = await pi.wait_type("auto_retry_end", since=since, limit=STEP_LIMIT)
        expect(end.get("success") is True, f"auto_retry_end: {end}")
        await settled(pi, since)
        path = await session_file(pi)
    data = path.read_bytes()
    expect_shape(
        "retry", data, [*HEAD, "user", "assistant:error", "context_edit", "assistant:stop"]
    )
    out.sessions["retry"] = data


KILLED_CALL: Final = Call(
    id="call_killed",
    name="bash",
    arguments={"command": f"echo started; {GATED}; echo done >> out.txt"},
)
CHAIN_STEPS: Final = (
    Text(text="first answer"),
    ToolCalls(calls=[KILLED_CALL]),
    Text(text="answer after the restart"),
    Text(text="answer on the branch"),
    Text(text="answer in the fork"),
)
FIRST_PROMPT: Final = "first turn"


async def _kill_mid_tool(sandbox: Sandbox) -> tuple[Path, bytes, DanglingCallFact]:
    """A first turn, then a prompt whose tool blocks; SIGKILL Pi by PID while it runs, then
    the orphaned tool processes. Returns the session file, its bytes right after the kill and
    the dangling call."""
    async with open_worker("pi", sandbox) as pi:
        await pi.call({"type": "get_state"}, limit=START_LIMIT)
        await settled(pi, await prompt(pi, FIRST_PROMPT))
        path = await session_file(pi)
        since = await prompt(pi, "this will be killed")
        await wait_tool_output(pi, since, "started")
        assistant = await leaf_id(pi)
        with pidfds_of(descendants(pi.process.pid)) as fds:
            expect(bool(fds), "no tool process seen")
            os.kill(pi.process.pid, signal.SIGKILL)
            returncode = await pi.wait_exit()
            expect(returncode == -signal.SIGKILL, f"Pi exited with {returncode}")
            data = path.read_bytes()
            await reap(fds, kill=True)
    call = DanglingCallFact(
        tool_call_id=KILLED_CALL.id or "",
        name=KILLED_CALL.name,
        arguments=KILLED_CALL.arguments,
        assistant_entry_id=assistant,
    )
    return path, data, call


def _inject_branch(path: Path) -> tuple[int, str]:
    """Append, as another program would, a ``custom`` line under the first assistant answer:
    written with ``json.dumps``'s separators, so it is not Pi's encoding. Returns its line
    number and its parent (the branch point)."""
    session = read_session(path).require_clean()
    point = next(e for e in session.entries if e.role == "assistant")
    expect(INJECTED_ID not in session.by_id, f"{INJECTED_ID} is taken")
    line = {
        "type": "custom",
        "id": INJECTED_ID,
        "parentId": point.id,
        "timestamp": iso_timestamp(SystemWallClock().time_ms()),
        "customType": "external-branch-marker",
        "data": {"note": "branch from the first answer"},
    }
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
    return session.line_count + 1, point.id


async def record_chain(root: Path, out: Recording) -> None:
    """killed_midtool, then branched and fork from the same session.

    After the kill: reopen the file and prompt once (below the dangling call); append the
    branch line; reopen and prompt on the branch; ``fork`` from the first user message and
    prompt in the fork."""
    async with scenario(root, "chain", CHAIN_STEPS) as (sandbox, _):
        with gate_in(sandbox):
            path, killed, call = await _kill_mid_tool(sandbox)
        async with open_worker("pi", sandbox, ("--session", str(path))) as pi:
            reopened = await leaf_id(pi)
            expect(reopened == call.assistant_entry_id, f"leaf after restart {reopened}")
            await settled(pi, await prompt(pi, "after the restart"))
        line, point = _inject_branch(path)
        async with open_worker("pi", sandbox, ("--session", str(path))) as pi:
            leaf = await leaf_id(pi)
            expect(leaf == INJECTED_ID, f"leaf after the branch line {leaf}")
            await settled(pi, await prompt(pi, "on the new branch"))
            first_user = next(e for e in read_session(path).session.entries if e.role == "user")
            forked = await pi.call({"type": "fork", "entryId": first_user.id}, limit=STEP_LIMIT)
            expected = {"text": FIRST_PROMPT, "cancelled": False}
            expect(forked.get("data") == expected, f"fork: {forked}")
            fork_path = await session_file(pi)
            expect(fork_path != path, "fork kept the session file")
            await settled(pi, await prompt(pi, "in the fork"))
        expect(not (sandbox.work / "out.txt").exists(), "the killed tool ran to its end")
    turn = ["user", "assistant:stop"]
    killed_shape = [*HEAD, *turn, "user", "assistant:toolUse"]
    expect_shape("killed_midtool", killed, killed_shape)
    branched = path.read_bytes()
    expect(branched.startswith(killed), "branched does not continue killed_midtool")
    expect_shape("branched", branched, [*killed_shape, *turn, "custom", *turn], linear=False)
    expect(json.loads(branched.splitlines()[-2])["parentId"] == INJECTED_ID, "branch prompt")
    fork = fork_path.read_bytes()
    expect_shape("fork", fork, [*HEAD, *turn])
    expect(json.loads(fork.splitlines()[0]).get("parentSession") == str(path), "parentSession")
    out.sessions["killed_midtool"] = killed
    out.sessions["branched"] = branched
    out.sessions["fork"] = fork
    out.dangling_call = call
    out.injected_line = InjectedLineFact(
        line=line, id=INJECTED_ID, parent_id=point, leaf_at_reopen=leaf
    )


# ---------------------------------------------------------------------------------- output


def _write(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def write_recording(recording: Recording, out_dir: Path, version: str) -> list[Path]:
    """Write the samples and ``facts.json`` into ``out_dir``; returns the paths written."""
    assert recording.first_request is not None
    assert recording.dangling_call is not None
    assert recording.injected_line is not None
    facts = SampleFacts(
        pi_version=version,
        recorded=datetime.datetime.now(datetime.UTC).date().isoformat(),
        dangling_call=recording.dangling_call,
        injected_line=recording.injected_line,
    )
    files = {out_dir / f"session_{name}.jsonl": data for name, data in recording.sessions.items()}
    request = json.dumps(recording.first_request, indent=1, ensure_ascii=False) + "\n"
    files[out_dir / FIRST_REQUEST.name] = request.encode()
    files[out_dir / FACTS.name] = msgspec.json.format(msgspec.json.encode(facts), indent=2) + b"\n"
    for path, data in files.items():
        expect(API_KEY.encode() not in data, f"{path.name} holds the API key")
    out_dir.mkdir(parents=True, exist_ok=True)
    for path, data in files.items():
        _write(path, data)
    return list(files)


async def record(out_dir: Path) -> list[Path]:
    """Run every scenario under a temporary directory, then write the samples."""
    install = pi_install()
    expect(install.version == PI_VERSION, f"Pi {install.version} is installed, not {PI_VERSION}")
    recording = Recording()
    with tempfile.TemporaryDirectory(prefix="pi-samples-") as tmp:
        root = Path(tmp)
        for run in (record_basic, record_steer, record_abort, record_retry, record_chain):
            print(f"recording {run.__name__.removeprefix('record_')}", flush=True)
            await run(root, recording)
    return write_recording(recording, out_dir, install.version)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/record-pi-samples",
        description="Record the real-Pi samples the tests read, with the installed Pi "
        f"{PI_VERSION} and the scripted model.",
    )
    default = SAMPLES.relative_to(Path.cwd()) if SAMPLES.is_relative_to(Path.cwd()) else SAMPLES
    parser.add_argument(
        "--out", type=Path, default=SAMPLES, help=f"output directory (default {default})"
    )
    args = parser.parse_args(argv)
    try:
        written = trio.run(record, args.out)
    except RecordingError as exc:
        print(f"record-pi-samples: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
