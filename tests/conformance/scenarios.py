"""The conformance scenarios: what each one scripts, drives and expects.

A scenario is three things: the model's scripted steps (a fresh
:class:`ScriptedModel` per run), ``drive`` (the RPC conversation, waiting on
events, never sleeping) and ``check`` (behavioural facts, written from what
the real Pi 1.6.0 does: pi-observed.md, the research transcripts and runs of this
suite). :func:`run_scenario` runs one scenario on one worker and returns a
:class:`Capture`; the test compares two captures with :mod:`.shapes`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import trio
import trio.lowlevel

from fake_pi.scenario import Call, Cut, HttpError, Step, Text, Thinking, ToolCalls, UsageLimit
from runtime._clock import SystemWallClock
from runtime._pi._session_files import SessionWriter, create_session, read_session

from .harness import (
    Model,
    Record,
    Sandbox,
    Worker,
    WorkerKind,
    open_model,
    open_worker,
    read_jsonl,
)

__all__ = ["SCENARIOS", "Capture", "Run", "Scenario", "run_scenario"]


# ------------------------------------------------------------------------------ plumbing


@dataclass
class Run:
    """One scenario on one worker: its sandbox, model, launches and collected facts."""

    kind: WorkerKind
    sandbox: Sandbox
    model: Model
    launches: list[Worker] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    @contextlib.asynccontextmanager
    async def launch(self, *extra: str) -> AsyncIterator[Worker]:
        async with open_worker(self.kind, self.sandbox, extra) as worker:
            self.launches.append(worker)
            yield worker

    def session_path(self) -> Path | None:
        files = sorted(self.sandbox.sessions.glob("*.jsonl"))
        assert len(files) <= 1, f"{self.kind}: more than one session file: {files}"
        return files[0] if files else None


@dataclass
class Capture:
    """Everything a run produced, for checks and comparisons."""

    kind: WorkerKind
    launches: list[list[Record]]
    """The stdout records of each process launch, in order."""
    stderr: list[bytes]
    returncodes: list[int | None]
    requests: list[dict[str, Any]]
    """Bodies of the model requests, in arrival order."""
    session: list[Record]
    """The session file's lines (header first) at the end; ``[]`` if none was written."""
    facts: dict[str, Any]
    sandbox: Sandbox

    @property
    def records(self) -> list[Record]:
        """All launches' records, concatenated."""
        return [r for launch in self.launches for r in launch]

    def session_file(self) -> Path:
        files = sorted(self.sandbox.sessions.glob("*.jsonl"))
        assert len(files) == 1, files
        return files[0]

    def of_type(self, event_type: str) -> list[Record]:
        return [r for r in self.records if r.get("type") == event_type]

    def responses(self, command: str) -> list[Record]:
        return [
            r for r in self.records if r.get("type") == "response" and r.get("command") == command
        ]

    def messages(self, role: str) -> list[dict[str, Any]]:
        """``message_end`` messages of ``role``."""
        return [
            r["message"]
            for r in self.records
            if r.get("type") == "message_end" and r["message"].get("role") == role
        ]

    def entries(self, role: str | None = None) -> list[Record]:
        """Session entries (no header); with ``role``, only messages of that role."""
        entries = [e for e in self.session if e.get("type") != "session"]
        if role is None:
            return entries
        return [e for e in entries if e.get("type") == "message" and e["message"]["role"] == role]

    def conversation(self, request: int) -> list[tuple[str, Any]]:
        """Request ``request``'s messages as ``(role, text-or-calls)``, system left out."""
        out: list[tuple[str, Any]] = []
        for message in self.requests[request]["messages"]:
            role = message["role"]
            if role == "system":
                continue
            if message.get("tool_calls"):
                calls = [
                    (c["function"]["name"], c["function"]["arguments"])
                    for c in message["tool_calls"]
                ]
                out.append((role, calls))
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content)
            out.append((role, content))
        return out


Drive = Callable[[Run], Awaitable[None]]
Check = Callable[[Capture], None]


@dataclass(frozen=True)
class Scenario:
    name: str
    steps: tuple[Step, ...]
    drive: Drive
    check: Check
    files: tuple[tuple[str, str], ...] = ()
    """Files to create in the work directory first."""
    retry_base_delay_ms: int = 50
    """Pi's ``retry.baseDelayMs`` in the sandbox's ``settings.json``."""


SCENARIO_TIMEOUT: Final = 60.0


async def run_scenario(scenario: Scenario, kind: WorkerKind, root: Path) -> Capture:
    """Run ``scenario`` on ``kind`` in a fresh sandbox under ``root``."""
    sandbox = Sandbox.create(root, retry_base_delay_ms=scenario.retry_base_delay_ms)
    for name, text in scenario.files:
        (sandbox.work / name).write_text(text)
    with trio.fail_after(SCENARIO_TIMEOUT):
        async with open_model(scenario.steps) as model:
            sandbox.point_at(model.server)
            run = Run(kind, sandbox, model)
            await scenario.drive(run)
    return _capture(run)


def _capture(run: Run) -> Capture:
    path = run.facts.get("session_file") or run.session_path()
    return Capture(
        kind=run.kind,
        launches=[w.records for w in run.launches],
        stderr=[bytes(w.stderr) for w in run.launches],
        returncodes=[w.returncode for w in run.launches],
        requests=run.model.bodies(),
        session=read_jsonl(Path(path)) if path and Path(path).exists() else [],
        facts=run.facts,
        sandbox=run.sandbox,
    )


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if p.get("type") == "text")


def _expect(condition: bool, what: str, capture: Capture) -> None:
    if not condition:
        raise AssertionError(f"{capture.kind}: {what}")


def _eq(actual: Any, expected: Any, what: str, capture: Capture) -> None:
    if actual != expected:
        raise AssertionError(f"{capture.kind}: {what}: expected {expected!r}, got {actual!r}")


def _settles(capture: Capture, *aborted: bool) -> None:
    """One ``agent_settled`` per run, with these ``aborted`` flags (default: one, False)."""
    settled = capture.of_type("agent_settled")
    _eq([s.get("aborted") for s in settled], list(aborted or [False]), "agent_settled", capture)


def descendants(pid: int) -> list[int]:
    """PIDs below ``pid`` right now (from /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rfind(")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


async def wait_gone(pidfds: list[int], limit: float) -> list[int]:
    """Wait (bounded) until the processes behind ``pidfds`` exited; returns the ones that
    were left, after killing them (a worker's leftovers must not outlive the test)."""
    left = list(pidfds)
    with trio.move_on_after(limit):
        while left:
            await trio.lowlevel.wait_readable(left[0])
            left.pop(0)
    for fd in left:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    return left


@contextlib.contextmanager
def pidfds_of(pids: list[int]) -> Iterator[list[int]]:
    """pidfds for ``pids`` (those still alive), closed on exit."""
    fds: list[int] = []
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                fds.append(os.pidfd_open(pid))
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


# ----------------------------------------------------------------------- simple scenarios


async def _prompt_once(run: Run) -> None:
    async with run.launch() as worker:
        await worker.call({"type": "get_state"}, limit=30)
        await worker.prompt_and_settle("say something")


def _check_text(capture: Capture) -> None:
    _settles(capture)
    assistant = capture.messages("assistant")
    _eq([m["stopReason"] for m in assistant], ["stop"], "assistant stopReasons", capture)
    _eq(assistant[0]["content"], [{"type": "text", "text": "hello there world"}], "text", capture)
    _eq(len(capture.requests), 1, "model requests", capture)
    _eq(capture.responses("prompt")[0].get("data"), {"disposition": "started"}, "prompt", capture)
    _eq(
        [e["message"]["role"] for e in capture.entries() if e["type"] == "message"],
        ["system", "user", "assistant"],
        "session message roles",
        capture,
    )


def _check_thinking(capture: Capture) -> None:
    _settles(capture)
    (assistant,) = capture.messages("assistant")
    _eq([b["type"] for b in assistant["content"]], ["thinking", "text"], "blocks", capture)
    _eq(assistant["content"][0]["thinking"], "let me think", "thinking text", capture)
    _eq(assistant["content"][1]["text"], "done thinking", "answer text", capture)


def _check_tool(capture: Capture) -> None:
    _settles(capture)
    (end,) = capture.of_type("tool_execution_end")
    _eq(end["result"]["content"], [{"type": "text", "text": "hi\n"}], "bash result", capture)
    _eq(end["isError"], False, "isError", capture)
    _eq(len(capture.requests), 2, "model requests", capture)
    _eq(
        capture.conversation(1),
        [
            ("user", "say something"),
            ("assistant", [("bash", '{"command":"echo hi"}')]),
            ("tool", "hi\n"),
        ],
        "second request",
        capture,
    )
    _eq(capture.requests[1]["messages"][-1]["tool_call_id"], "call_1", "tool_call_id", capture)


def _check_two_tools(capture: Capture) -> None:
    _settles(capture)
    results = capture.messages("toolResult")
    _eq([m["toolCallId"] for m in results], ["call_1", "call_2"], "result order", capture)
    _eq([_text(m) for m in results], ["hi\n", "file content\n"], "results", capture)
    _eq(
        capture.conversation(1),
        [
            ("user", "say something"),
            ("assistant", [("bash", '{"command":"echo hi"}'), ("read", '{"path":"f.txt"}')]),
            ("tool", "hi\n"),
            ("tool", "file content\n"),
        ],
        "second request",
        capture,
    )
    starts = [r["toolCallId"] for r in capture.of_type("tool_execution_start")]
    _eq(starts, ["call_1", "call_2"], "tool starts", capture)


# ------------------------------------------------------------------ steering and queueing

SLOW_TOOL: Final = ToolCalls(
    calls=[Call(name="bash", arguments={"command": "sleep 1; echo slept"})]
)


async def _steer(run: Run) -> None:
    async with run.launch() as worker:
        since = worker.mark()
        await worker.call({"type": "prompt", "message": "run a slow command"}, limit=30)
        await worker.wait_type("tool_execution_start", since=since)
        run.facts["steer"] = await worker.call({"type": "steer", "message": "change of plan"})
        await worker.settled(since=since)


def _check_steer(capture: Capture) -> None:
    _settles(capture)
    _eq(capture.facts["steer"].get("data"), {"disposition": "queued"}, "steer response", capture)
    (end,) = capture.of_type("tool_execution_end")
    _eq((_text(end["result"]), end["isError"]), ("slept\n", False), "tool not interrupted", capture)
    _eq(len(capture.requests), 2, "model requests", capture)
    _eq(
        capture.conversation(1)[-2:],
        [("tool", "slept\n"), ("user", "change of plan")],
        "steer text delivered after the tool",
        capture,
    )
    _eq(len(capture.of_type("agent_start")), 1, "agent_start count", capture)


async def _follow_up(run: Run) -> None:
    async with run.launch() as worker:
        since = worker.mark()
        await worker.call({"type": "prompt", "message": "run a slow command"}, limit=30)
        await worker.wait_type("tool_execution_start", since=since)
        run.facts["follow_up"] = await worker.call({"type": "follow_up", "message": "then this"})
        await worker.settled(since=since)


def _check_follow_up(capture: Capture) -> None:
    _settles(capture)
    _eq(capture.facts["follow_up"].get("data"), {"disposition": "queued"}, "response", capture)
    _eq(len(capture.requests), 3, "model requests", capture)
    _eq(capture.conversation(1)[-1], ("tool", "slept\n"), "request 2 ends with the tool", capture)
    _eq(
        capture.conversation(2)[-2:],
        [("assistant", "first answer"), ("user", "then this")],
        "follow-up delivered when the agent would stop",
        capture,
    )
    _eq(len(capture.of_type("agent_start")), 1, "agent_start count", capture)
    _eq(len(capture.of_type("agent_end")), 1, "agent_end count", capture)


BUSY_ERROR: Final = (
    "Agent is already processing. Specify streamingBehavior ('steer' or 'followUp') "
    "to queue the message."
)


async def _busy_prompt(run: Run) -> None:
    async with run.launch() as worker:
        since = worker.mark()
        await worker.call({"type": "prompt", "message": "run a slow command"}, limit=30)
        await worker.wait_type("tool_execution_start", since=since)
        run.facts["busy"] = (await worker.request({"type": "prompt", "message": "no behaviour"}))[1]
        run.facts["queued"] = await worker.call(
            {"type": "prompt", "message": "queued by prompt", "streamingBehavior": "followUp"}
        )
        run.facts["running_state"] = (await worker.call({"type": "get_state"}))["data"]
        await worker.settled(since=since)


def _check_busy_prompt(capture: Capture) -> None:
    _settles(capture)
    busy = capture.facts["busy"]
    _eq((busy["success"], busy.get("error")), (False, BUSY_ERROR), "busy prompt", capture)
    _eq("data" in busy, False, "busy response has no data", capture)
    _eq(capture.facts["queued"].get("data"), {"disposition": "queued"}, "followUp", capture)
    running = capture.facts["running_state"]
    _eq(
        (running["isStreaming"], running["pendingMessageCount"]),
        (True, 1),
        "get_state while running",
        capture,
    )
    _eq(len(capture.requests), 3, "model requests", capture)
    _eq(capture.conversation(2)[-1], ("user", "queued by prompt"), "queued prompt", capture)
    users = [_text(e["message"]) for e in capture.entries("user")]
    _eq(users, ["run a slow command", "queued by prompt"], "user entries", capture)


# --------------------------------------------------------------------------------- abort

LATE_TOOL: Final = ToolCalls(
    calls=[Call(name="bash", arguments={"command": "echo started; sleep 10; echo late > late.txt"})]
)


async def _wait_tool_running(worker: Worker, since: int) -> None:
    """Until the tool printed ``started`` (its process is up)."""
    await worker.wait_for(
        lambda r: (
            r.get("type") == "tool_execution_update"
            and "started" in _text(r.get("partialResult") or {})
        ),
        since=since,
    )


async def _abort_tool(run: Run) -> None:
    async with run.launch() as worker:
        since = worker.mark()
        await worker.call({"type": "prompt", "message": "run a long command"}, limit=30)
        await _wait_tool_running(worker, since)
        with pidfds_of(descendants(worker.process.pid)) as fds:
            run.facts["tool_processes"] = len(fds)
            index, response = await worker.request({"type": "abort"})
            run.facts["abort"] = response
            settled_at, _ = await worker.wait_type("agent_settled", since=since)
            run.facts["settled_before_abort_response"] = settled_at < index
            run.facts["survivors"] = len(await wait_gone(fds, 5.0))
        await worker.prompt_and_settle("again")


def _check_abort_tool(capture: Capture) -> None:
    _expect(capture.facts["tool_processes"] >= 1, "the tool process was seen", capture)
    _eq(capture.facts["survivors"], 0, "tool processes left after abort", capture)
    abort = capture.facts["abort"]
    _eq({k: v for k, v in abort.items() if k != "id"}, ABORT_RESPONSE, "abort response", capture)
    _expect(capture.facts["settled_before_abort_response"], "settled before response", capture)
    _settles(capture, True, False)
    (end,) = capture.of_type("tool_execution_end")
    _eq(end["isError"], True, "aborted tool isError", capture)
    _eq(_text(end["result"]).endswith("Command aborted"), True, "Command aborted", capture)
    aborted = [m for m in capture.messages("assistant") if m["stopReason"] == "aborted"]
    _eq(len(aborted), 1, "aborted assistant messages", capture)
    _eq(aborted[0]["content"], [], "aborted message content", capture)
    _eq(aborted[0].get("errorMessage"), "This operation was aborted", "errorMessage", capture)
    _eq(
        capture.conversation(1),
        [
            ("user", "run a long command"),
            ("assistant", [("bash", LATE_ARGUMENTS)]),
            ("tool", "started\n\n\nCommand aborted"),
            ("user", "again"),
        ],
        "context after abort (aborted reply left out)",
        capture,
    )
    _expect(not (capture.sandbox.work / "late.txt").exists(), "late.txt not written", capture)


LATE_ARGUMENTS: Final = '{"command":"echo started; sleep 10; echo late > late.txt"}'
ABORT_RESPONSE: Final = {"type": "response", "command": "abort", "success": True}


async def _abort_stream(run: Run) -> None:
    async with run.launch() as worker:
        since = worker.mark()
        await worker.call({"type": "prompt", "message": "stream slowly"}, limit=30)
        await worker.wait_for(
            lambda r: (
                r.get("type") == "message_update"
                and r["assistantMessageEvent"]["type"] == "text_delta"
            ),
            since=since,
        )
        index, response = await worker.request({"type": "abort"})
        run.facts["abort"] = response
        settled_at, _ = await worker.wait_type("agent_settled", since=since)
        run.facts["settled_before_abort_response"] = settled_at < index
        await worker.prompt_and_settle("again")


def _check_abort_stream(capture: Capture) -> None:
    abort = capture.facts["abort"]
    _eq({k: v for k, v in abort.items() if k != "id"}, ABORT_RESPONSE, "abort response", capture)
    _expect(capture.facts["settled_before_abort_response"], "settled before response", capture)
    _settles(capture, True, False)
    aborted = [m for m in capture.messages("assistant") if m["stopReason"] == "aborted"]
    _eq(len(aborted), 1, "aborted assistant messages", capture)
    _eq(aborted[0].get("errorMessage"), "Request was aborted", "errorMessage", capture)
    _eq([b["type"] for b in aborted[0]["content"]], ["text"], "partial text kept", capture)
    _expect(SLOW_TEXT.startswith(_text(aborted[0])), "partial text is a prefix", capture)
    _expect(_text(aborted[0]) != SLOW_TEXT, "the stream was really cut short", capture)
    _eq(
        capture.conversation(1),
        [("user", "stream slowly"), ("user", "again")],
        "aborted reply left out of the next request",
        capture,
    )
    _eq(len(capture.entries("assistant")), 2, "aborted reply persisted", capture)


SLOW_TEXT: Final = "one two three four five six seven eight"


# --------------------------------------------------------------------------------- errors


def _error_message(capture: Capture) -> str:
    errors = [m for m in capture.messages("assistant") if m["stopReason"] == "error"]
    _expect(len(errors) >= 1, "an error assistant message", capture)
    return str(errors[0].get("errorMessage"))


HTTP_500_MESSAGE: Final = '500: {"message":"boom","type":"server_error","code":null}'


def _check_retry_500(capture: Capture) -> None:
    _settles(capture)
    _eq(len(capture.requests), 2, "model requests", capture)
    _eq(capture.requests[0], capture.requests[1], "retry body identical", capture)
    (start,) = capture.of_type("auto_retry_start")
    _eq(
        {k: start.get(k) for k in ("attempt", "maxAttempts", "delayMs")},
        {"attempt": 1, "maxAttempts": 3, "delayMs": 50},
        "auto_retry_start",
        capture,
    )
    _eq(start.get("errorMessage"), _error_message(capture), "retry errorMessage", capture)
    _eq(_error_message(capture), HTTP_500_MESSAGE, "errorMessage", capture)
    (end,) = capture.of_type("auto_retry_end")
    _eq(end, {"type": "auto_retry_end", "success": True, "attempt": 1}, "retry end", capture)
    _eq([r.get("willRetry") for r in capture.of_type("agent_end")], [True, False], "ends", capture)
    kinds = [(e["type"], e.get("message", {}).get("stopReason")) for e in capture.entries()]
    _eq(
        kinds[-3:],
        [("message", "error"), ("context_edit", None), ("message", "stop")],
        "entries",
        capture,
    )
    failed, edit = capture.entries()[-3:-1]
    _eq((edit["targetId"], edit["replacement"]), (failed["id"], None), "context_edit", capture)
    (appended,) = capture.of_type("entry_appended")
    _eq(appended["entry"], edit, "entry_appended carries the context_edit", capture)


RETRY_STEER_DELAY_MS: Final = 1000
"""The retry wait of ``retry_steer``: the two steers are sent as soon as
``auto_retry_start`` is printed and must be answered within it (checked)."""


async def _retry_steer(run: Run) -> None:
    async with run.launch() as worker:
        since = worker.mark()
        await worker.call({"type": "prompt", "message": "say something"}, limit=30)
        await worker.wait_type("auto_retry_start", since=since)
        for key, text in (("steer_1", "first steer"), ("steer_2", "second steer")):
            run.facts[key] = await worker.call({"type": "steer", "message": text})
        run.facts["requests_at_steers"] = len(run.model.requests)
        await worker.settled(since=since)


def _check_retry_steer(capture: Capture) -> None:
    """Pi's auto-retry is ``agent.continue()``, whose loop polls the steering queue before
    its first request: a steer queued while Pi waits to retry goes into the retried
    request, after the failed request's messages (one steer: ``steeringMode``
    one-at-a-time); the next one waits for the end of that turn."""
    _eq(
        capture.facts["requests_at_steers"],
        1,
        "both steers answered during the retry wait (if not, the machine was too slow for "
        f"the {RETRY_STEER_DELAY_MS} ms wait)",
        capture,
    )
    for key in ("steer_1", "steer_2"):
        _eq(capture.facts[key].get("data"), {"disposition": "queued"}, key, capture)
    _settles(capture)
    _eq(len(capture.requests), 3, "model requests", capture)
    _eq(capture.conversation(0), [("user", "say something")], "failed request", capture)
    _eq(
        capture.conversation(1),
        [("user", "say something"), ("user", "first steer")],
        "the retried request carries the first steer after the prompt",
        capture,
    )
    _eq(
        capture.conversation(2),
        [
            ("user", "say something"),
            ("user", "first steer"),
            ("assistant", "recovered"),
            ("user", "second steer"),
        ],
        "the second steer is the next turn's",
        capture,
    )
    (end,) = capture.of_type("auto_retry_end")
    _eq(end, {"type": "auto_retry_end", "success": True, "attempt": 1}, "retry end", capture)
    _eq([r.get("willRetry") for r in capture.of_type("agent_end")], [True, False], "ends", capture)
    _eq(len(capture.of_type("agent_start")), 2, "agent_start count", capture)
    records = capture.records
    at = next(
        i
        for i, r in enumerate(records)
        if r.get("type") == "message_start" and _text(r["message"]) == "first steer"
    )
    retry_start = next(i for i, r in enumerate(records) if r.get("type") == "auto_retry_start")
    _eq(
        [r.get("type") for r in records[at - 3 : at]],
        ["agent_start", "turn_start", "queue_update"],
        "the retry run opens with the steer (queue_update just before its message_start)",
        capture,
    )
    _expect(at > retry_start, "the steer is delivered after auto_retry_start", capture)
    _eq(records[at - 1].get("steering"), ["second steer"], "queue at delivery", capture)
    _eq(
        [(r["steering"], r["followUp"]) for r in capture.of_type("queue_update")],
        [
            (["first steer"], []),
            (["first steer", "second steer"], []),
            (["second steer"], []),
            ([], []),
        ],
        "queue updates",
        capture,
    )
    roles = [
        (e["message"]["role"], e["message"].get("stopReason"), _text(e["message"]))
        if e["type"] == "message"
        else (e["type"], None, None)
        for e in capture.entries()
        if e["type"] in ("message", "context_edit") and e.get("message", {}).get("role") != "system"
    ]
    _eq(
        roles,
        [
            ("user", None, "say something"),
            ("assistant", "error", ""),
            ("context_edit", None, None),
            ("user", None, "first steer"),
            ("assistant", "stop", "recovered"),
            ("user", None, "second steer"),
            ("assistant", "stop", "second answer"),
        ],
        "session entries",
        capture,
    )


USAGE_LIMIT_MESSAGE: Final = (
    '429: {"message":"You exceeded your current quota, please check your plan and billing '
    'details.","type":"insufficient_quota","code":"insufficient_quota"}'
)


def _check_usage_limit(capture: Capture) -> None:
    _settles(capture)
    _eq(len(capture.requests), 1, "model requests (no retry)", capture)
    _eq(capture.of_type("auto_retry_start"), [], "no retry", capture)
    _eq(_error_message(capture), USAGE_LIMIT_MESSAGE, "errorMessage", capture)
    _eq([r.get("willRetry") for r in capture.of_type("agent_end")], [False], "agent_end", capture)


CUT_MESSAGE: Final = "terminated: other side closed (UND_ERR_SOCKET)"


def _check_cut(capture: Capture) -> None:
    _settles(capture)
    _eq(len(capture.requests), 2, "model requests", capture)
    _eq(_error_message(capture), CUT_MESSAGE, "errorMessage", capture)
    (end,) = capture.of_type("auto_retry_end")
    _eq(end.get("success"), True, "retry succeeded", capture)
    final = capture.messages("assistant")[-1]
    _eq((final["stopReason"], _text(final)), ("stop", "complete answer"), "final", capture)


# ------------------------------------------------------------------------------ protocol


async def _bad_json(run: Run) -> None:
    async with run.launch() as worker:
        await worker.call({"type": "get_state"}, limit=30)
        since = worker.mark()
        await worker.send_line(b"this is not json")
        _, run.facts["parse"] = await worker.wait_type("response", since=since)
        await worker.call({"type": "get_state"})


PARSE_ERROR: Final = (
    "Failed to parse command: Unexpected token 'h', \"this is not json\" is not valid JSON"
)


def _check_bad_json(capture: Capture) -> None:
    _eq(
        capture.facts["parse"],
        {"type": "response", "command": "parse", "success": False, "error": PARSE_ERROR},
        "parse error response",
        capture,
    )


async def _unknown_command(run: Run) -> None:
    async with run.launch() as worker:
        await worker.call({"type": "get_state"}, limit=30)
        _, run.facts["unknown"] = await worker.request({"type": "no_such_command"})
        await worker.call({"type": "get_state"})


def _check_unknown_command(capture: Capture) -> None:
    unknown = dict(capture.facts["unknown"])
    unknown.pop("id")
    _eq(
        unknown,
        {
            "type": "response",
            "command": "no_such_command",
            "success": False,
            "error": "Unknown command: no_such_command",
        },
        "unknown command response",
        capture,
    )


async def _malformed(run: Run) -> None:
    async with run.launch() as worker:
        await worker.call({"type": "get_state"}, limit=30)
        answers: list[Record] = []
        for line in MALFORMED_LINES:
            since = worker.mark()
            await worker.send_line(line)
            answers.append((await worker.wait_type("response", since=since))[1])
        for command in MALFORMED_COMMANDS:
            answer = dict((await worker.request(command))[1])
            answer.pop("id")
            answers.append(answer)
        run.facts["malformed"] = answers
        await worker.call({"type": "get_state"})


MALFORMED_LINES: Final = (b"", b"   ", b"42", b"[1,2]", b'"text"')
"""Lines that are not a command object: blank, and JSON values of other types (``null``
makes Pi 1.6.0 exit, so it is not sent)."""
MALFORMED_COMMANDS: Final = (
    {"type": "steer"},
    {"type": "follow_up", "message": 5},
    {"type": "prompt"},
)
_EMPTY: Final = "Failed to parse command: Unexpected end of JSON input"
_UNDEFINED: Final = "Cannot read properties of undefined (reading 'startsWith')"


def _check_malformed(capture: Capture) -> None:
    def refused(command: str, error: str) -> Record:
        return {"type": "response", "command": command, "success": False, "error": error}

    not_a_command = {"type": "response", "success": False, "error": "Unknown command: undefined"}
    _eq(
        capture.facts["malformed"],
        [
            refused("parse", _EMPTY),
            refused("parse", _EMPTY),
            not_a_command,
            not_a_command,
            not_a_command,
            refused("steer", _UNDEFINED),
            refused("follow_up", "text.startsWith is not a function"),
            refused("prompt", _UNDEFINED),
        ],
        "answers to malformed commands",
        capture,
    )


QUERIES: Final = (
    "get_state",
    "get_messages",
    "get_entries",
    "get_tree",
    "get_session_stats",
    "get_last_assistant_text",
)


async def _queries(run: Run) -> None:
    async with run.launch() as worker:
        for command in QUERIES:
            run.facts[f"before:{command}"] = (await worker.call({"type": command}, limit=30))[
                "data"
            ]
        await worker.prompt_and_settle("say something")
        for command in QUERIES:
            run.facts[command] = (await worker.call({"type": command}))["data"]


def _check_queries(capture: Capture) -> None:
    before = capture.facts
    _eq(before["before:get_state"]["messageCount"], 0, "fresh messageCount", capture)
    _eq(before["before:get_messages"], {"messages": []}, "fresh get_messages", capture)
    _eq(before["before:get_last_assistant_text"], {}, "fresh last text (text undefined)", capture)
    state = capture.facts["get_state"]
    _eq(state["sessionFile"], str(capture.session_file()), "sessionFile", capture)
    _eq(state["sessionId"], capture.session[0]["id"], "sessionId", capture)
    _eq(state["messageCount"], 5, "messageCount", capture)
    _eq(state["isStreaming"], False, "isStreaming", capture)
    roles = [m["role"] for m in capture.facts["get_messages"]["messages"]]
    _eq(roles, ["system", "user", "assistant", "toolResult", "assistant"], "roles", capture)
    entries = capture.facts["get_entries"]
    _eq(entries["entries"], capture.session[1:], "get_entries == the file's entries", capture)
    _eq(entries["leafId"], capture.session[-1]["id"], "leafId = last line", capture)
    tree = capture.facts["get_tree"]
    _eq(tree["leafId"], entries["leafId"], "tree leafId", capture)
    _eq(len(tree["tree"]), 1, "one root", capture)
    _eq(tree["tree"][0]["entry"], capture.session[1], "root entry", capture)
    stats = capture.facts["get_session_stats"]
    _eq(
        {k: stats[k] for k in ("userMessages", "assistantMessages", "toolCalls", "toolResults")},
        {"userMessages": 1, "assistantMessages": 2, "toolCalls": 1, "toolResults": 1},
        "session stats",
        capture,
    )
    _eq(stats["totalMessages"], 5, "totalMessages (system included)", capture)
    _eq(stats["sessionId"], state["sessionId"], "stats sessionId", capture)
    _eq(capture.facts["get_last_assistant_text"], {"text": "all done"}, "last text", capture)


# ---------------------------------------------------------------------- stdin closed, resume


async def _stdin_eof(run: Run) -> None:
    async with run.launch() as worker:
        since = worker.mark()
        await worker.call({"type": "prompt", "message": "run a long command"}, limit=30)
        await _wait_tool_running(worker, since)
        with pidfds_of(descendants(worker.process.pid)) as fds:
            run.facts["tool_processes"] = len(fds)
            closed_at = worker.mark()
            start = trio.current_time()
            await worker.close_stdin()
            run.facts["returncode"] = await worker.wait_exit()
            run.facts["exit_seconds"] = trio.current_time() - start
            run.facts["survivors"] = len(await wait_gone(fds, 5.0))
        run.facts["closed_at"] = closed_at


def _check_stdin_eof(capture: Capture) -> None:
    _eq(capture.facts["returncode"], 0, "exit code after stdin EOF", capture)
    _expect(capture.facts["exit_seconds"] < 5, "exits promptly (no waiting for the tool)", capture)
    _eq(capture.facts["survivors"], 0, "tool processes left", capture)
    after = [r.get("type") for r in capture.records[capture.facts["closed_at"] :]]
    _expect("agent_end" not in after, f"no agent_end printed after EOF: {after}", capture)
    _expect("agent_settled" not in after, "no agent_settled printed after EOF", capture)
    entries = capture.entries()
    last = [(e["message"]["role"], e["message"].get("stopReason")) for e in entries[-3:]]
    _eq(
        last,
        [("assistant", "toolUse"), ("toolResult", None), ("assistant", "aborted")],
        "persisted abort",
        capture,
    )
    _expect(_text(entries[-2]["message"]).endswith("Command aborted"), "Command aborted", capture)
    _eq(entries[-2]["message"]["isError"], True, "toolResult isError", capture)


async def _resume(run: Run) -> None:
    async with run.launch() as worker:
        await worker.prompt_and_settle("first prompt", limit=30)
        state = (await worker.call({"type": "get_state"}))["data"]
    path = Path(state["sessionFile"])
    run.facts["first_state"] = state
    run.facts["lines_before"] = await trio.Path(path).read_bytes()
    async with run.launch("--session", str(path)) as worker:
        run.facts["state"] = (await worker.call({"type": "get_state"}, limit=30))["data"]
        run.facts["entries"] = (await worker.call({"type": "get_entries"}))["data"]
        run.facts["messages"] = (await worker.call({"type": "get_messages"}))["data"]
        await worker.prompt_and_settle("second prompt")
    run.facts["session_file"] = str(path)


def _check_resume(capture: Capture) -> None:
    first, state = capture.facts["first_state"], capture.facts["state"]
    _eq(state["sessionId"], first["sessionId"], "same session id", capture)
    _eq(state["sessionFile"], first["sessionFile"], "same session file", capture)
    before = [e for e in capture.facts["lines_before"].split(b"\n") if e]
    path = Path(capture.facts["session_file"])
    _expect(path.read_bytes().startswith(capture.facts["lines_before"]), "appends only", capture)
    old_leaf = read_jsonl(path)[len(before) - 1]
    _eq(capture.facts["entries"]["leafId"], old_leaf["id"], "leaf = last line", capture)
    new = capture.session[len(before) :]
    _eq(
        [(e["type"], e["message"]["role"]) for e in new],
        [("message", "user"), ("message", "assistant")],
        "only the new messages are appended",
        capture,
    )
    _eq(new[0]["parentId"], old_leaf["id"], "new entries hang below the old leaf", capture)
    roles = [m["role"] for m in capture.facts["messages"]["messages"]]
    _eq(roles, ["system", "user", "assistant"], "resumed get_messages", capture)
    _eq(
        capture.conversation(1),
        [("user", "first prompt"), ("assistant", "one"), ("user", "second prompt")],
        "resumed context",
        capture,
    )


# ------------------------------------------------------------------- the session module


def _module_session(run: Run) -> Path:
    path = run.sandbox.sessions / "module-created.jsonl"
    create_session(
        path,
        cwd=str(run.sandbox.work),
        provider="fake",
        model_id="fake-model",
        clock=SystemWallClock(),
    )
    return path


async def _module_created(run: Run) -> None:
    path = _module_session(run)
    run.facts["module_bytes"] = await trio.Path(path).read_bytes()
    run.facts["module_ids"] = [e.id for e in read_session(path).require_clean().entries]
    async with run.launch("--session", str(path)) as worker:
        run.facts["entries_at_launch"] = (await worker.call({"type": "get_entries"}, limit=30))[
            "data"
        ]
        run.facts["bytes_at_launch"] = await trio.Path(path).read_bytes()
        await worker.prompt_and_settle("hello module")
        run.facts["entries"] = (await worker.call({"type": "get_entries"}))["data"]
    run.facts["session_file"] = str(path)


def _check_module_created(capture: Capture) -> None:
    facts = capture.facts
    module_ids = facts["module_ids"]
    leaf = module_ids[-1]
    at_launch = facts["entries_at_launch"]
    _eq([e["id"] for e in at_launch["entries"]][: len(module_ids)], module_ids, "ids", capture)
    launch_path = _path_ids(at_launch["entries"], at_launch["leafId"])
    _expect(leaf in launch_path, "the module's leaf is on Pi's path at launch", capture)
    # Pi 1.6.0 treats a session without messages as new: at launch, before any prompt,
    # it appends (to the file too) its own model_change + thinking_level_change below
    # the module's leaf.
    _eq(
        [e["type"] for e in at_launch["entries"][len(module_ids) :]],
        ["model_change", "thinking_level_change"],
        "entries Pi adds at launch",
        capture,
    )
    at_launch_bytes = facts["bytes_at_launch"]
    _expect(at_launch_bytes.startswith(facts["module_bytes"]), "module lines kept", capture)
    written = [json.loads(x) for x in at_launch_bytes[len(facts["module_bytes"]) :].splitlines()]
    _eq(written, at_launch["entries"][len(module_ids) :], "written at launch", capture)
    path = Path(facts["session_file"])
    _expect(path.read_bytes().startswith(facts["module_bytes"]), "module lines kept", capture)
    session = read_session(path).require_clean()
    added = session.entries[len(module_ids) :]
    _expect(len(added) >= 2, "Pi appended entries", capture)
    _eq(added[0].parent_id, leaf, "appended below the module's leaf", capture)
    final_leaf = session.entries[-1].id
    _eq(facts["entries"]["leafId"], final_leaf, "leafId = last line", capture)
    _expect(leaf in [e.id for e in session.path_to_root()], "module leaf on the path", capture)
    _eq([e.role for e in added][-2:], ["user", "assistant"], "prompt and answer", capture)
    _eq(capture.conversation(0), [("user", "hello module")], "request", capture)


def _path_ids(entries: list[Record], leaf: str) -> list[str]:
    parents = {e["id"]: e.get("parentId") for e in entries}
    path: list[str] = []
    node: str | None = leaf
    while node is not None and node in parents and node not in path:
        path.append(node)
        node = parents[node]
    return path[::-1]


async def _module_branched(run: Run) -> None:
    path = _module_session(run)
    async with run.launch("--session", str(path)) as worker:
        await worker.prompt_and_settle("first prompt", limit=30)
        await worker.prompt_and_settle("second prompt")
    session = read_session(path).require_clean()
    first_answer = next(e for e in session.entries if e.role == "assistant")
    clock = SystemWallClock()
    with SessionWriter.open(path, clock=clock) as writer:
        branch = writer.append(
            {"type": "custom", "customType": "conformance", "data": {"why": "branch"}},
            parent_id=first_answer.id,
        )
        writer.fsync()
    computed = read_session(path).require_clean()
    run.facts["branch_point"] = first_answer.id
    run.facts["branch"] = branch.id
    run.facts["computed_leaf"] = computed.leaf.id  # type: ignore[union-attr]
    run.facts["computed_path"] = [e.id for e in computed.path_to_root()]
    run.facts["entry_count"] = len(computed.entries)
    async with run.launch("--session", str(path)) as worker:
        run.facts["entries_at_launch"] = (await worker.call({"type": "get_entries"}, limit=30))[
            "data"
        ]
        run.facts["tree_at_launch"] = (await worker.call({"type": "get_tree"}))["data"]
        run.facts["messages_at_launch"] = (await worker.call({"type": "get_messages"}))["data"]
        await worker.prompt_and_settle("third prompt")
    run.facts["session_file"] = str(path)


def _tree_ids(nodes: list[dict[str, Any]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    todo = list(nodes)
    while todo:
        node = todo.pop()
        out[node["entry"]["id"]] = [c["entry"]["id"] for c in node["children"]]
        todo.extend(node["children"])
    return out


def _check_module_branched(capture: Capture) -> None:
    facts = capture.facts
    _eq(facts["entries_at_launch"]["leafId"], facts["computed_leaf"], "Pi's leaf", capture)
    _eq(facts["computed_leaf"], facts["branch"], "the branch is the leaf", capture)
    tree = _tree_ids(facts["tree_at_launch"]["tree"])
    _eq(len(tree[facts["branch_point"]]), 2, "two branches below the branch point", capture)
    _eq(facts["tree_at_launch"]["leafId"], facts["branch"], "tree leafId", capture)
    roles = [m["role"] for m in facts["messages_at_launch"]["messages"]]
    _eq(roles, ["system", "user", "assistant"], "active-branch messages", capture)
    _eq(len(capture.requests), 3, "model requests", capture)
    _eq(
        capture.conversation(2),
        [("user", "first prompt"), ("assistant", "one"), ("user", "third prompt")],
        "context = root…branch point + the new prompt",
        capture,
    )
    session = read_session(Path(facts["session_file"])).require_clean()
    added = session.entries[facts["entry_count"] :]
    _eq(added[0].parent_id, facts["branch"], "new entries hang below the branch", capture)
    path = [e.id for e in session.path_to_root()]
    _eq(path[: len(facts["computed_path"])], facts["computed_path"], "active path", capture)


# ------------------------------------------------------------------------------ registry


def _scenarios() -> dict[str, Scenario]:
    items = [
        Scenario("text", (Text(text="hello there world"),), _prompt_once, _check_text),
        Scenario(
            "thinking",
            (Thinking(thinking="let me think", text="done thinking"),),
            _prompt_once,
            _check_thinking,
        ),
        Scenario(
            "tool_call",
            (
                ToolCalls(calls=[Call(name="bash", arguments={"command": "echo hi"})]),
                Text(text="all done"),
            ),
            _prompt_once,
            _check_tool,
        ),
        Scenario(
            "two_tool_calls",
            (
                ToolCalls(
                    calls=[
                        Call(name="bash", arguments={"command": "echo hi"}),
                        Call(name="read", arguments={"path": "f.txt"}),
                    ]
                ),
                Text(text="all done"),
            ),
            _prompt_once,
            _check_two_tools,
            files=(("f.txt", "file content\n"),),
        ),
        Scenario("steer", (SLOW_TOOL, Text(text="steered")), _steer, _check_steer),
        Scenario(
            "follow_up",
            (SLOW_TOOL, Text(text="first answer"), Text(text="second answer")),
            _follow_up,
            _check_follow_up,
        ),
        Scenario(
            "busy_prompt",
            (SLOW_TOOL, Text(text="done"), Text(text="followed")),
            _busy_prompt,
            _check_busy_prompt,
        ),
        Scenario(
            "abort_tool", (LATE_TOOL, Text(text="after abort")), _abort_tool, _check_abort_tool
        ),
        Scenario(
            "abort_stream",
            (Text(text=SLOW_TEXT, delay=0.25), Text(text="after abort")),
            _abort_stream,
            _check_abort_stream,
        ),
        Scenario(
            "retry_500",
            (HttpError(status=500, message="boom"), Text(text="recovered")),
            _prompt_once,
            _check_retry_500,
        ),
        Scenario(
            "retry_steer",
            (
                HttpError(status=500, message="boom"),
                Text(text="recovered"),
                Text(text="second answer"),
            ),
            _retry_steer,
            _check_retry_steer,
            retry_base_delay_ms=RETRY_STEER_DELAY_MS,
        ),
        Scenario("usage_limit", (UsageLimit(),), _prompt_once, _check_usage_limit),
        Scenario(
            "stream_cut",
            (
                Cut(text="this answer is cut off in the middle", after_chunks=2),
                Text(text="complete answer"),
            ),
            _prompt_once,
            _check_cut,
        ),
        Scenario("bad_json", (), _bad_json, _check_bad_json),
        Scenario("unknown_command", (), _unknown_command, _check_unknown_command),
        Scenario("malformed_commands", (), _malformed, _check_malformed),
        Scenario(
            "queries",
            (
                ToolCalls(calls=[Call(name="bash", arguments={"command": "echo hi"})]),
                Text(text="all done"),
            ),
            _queries,
            _check_queries,
        ),
        Scenario("stdin_eof_during_tool", (LATE_TOOL,), _stdin_eof, _check_stdin_eof),
        Scenario("resume", (Text(text="one"), Text(text="two")), _resume, _check_resume),
        Scenario(
            "module_created_session", (Text(text="hi"),), _module_created, _check_module_created
        ),
        Scenario(
            "module_branched_session",
            (Text(text="one"), Text(text="two"), Text(text="three")),
            _module_branched,
            _check_module_branched,
        ),
    ]
    return {s.name: s for s in items}


SCENARIOS: Final = _scenarios()
