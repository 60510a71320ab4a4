"""Fake-Pi in-process, under virtual time: Pi's event sequences and session shapes.

Each test names the Pi behaviour it mirrors: the invariants of ``docs/design/fake-pi.md``, which
the conformance suite checks against the real Pi ("pi-observed.md §n" cites the section of the Pi
research report a fact comes from; the real Pi's own files are in ``tests/data/pi-1.6.0/``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from fake_pi._app import FakePi, open_fake_pi
from fake_pi._behaviours import Behaviours, FakeConfig
from fake_pi._gate import GateDecision, Refused, Run, SavedResult, ToolCall, ToolResult
from fake_pi._retry import RetrySettings
from fake_pi.model_server import ScriptedModel
from fake_pi.scenario import (
    Call,
    Cut,
    HttpError,
    Scenario,
    Text,
    ToolCalls,
    UsageLimit,
)
from runtime._clock import MockWallClock
from runtime._pi._session_files import read_session


def _kinds(events: list[dict[str, Any]]) -> list[str]:
    """Event types, with roles/stop reasons, update runs compressed."""
    out: list[str] = []
    for e in events:
        kind = e["type"]
        if kind in ("message_start", "message_end"):
            message = e["message"]
            kind += f":{message['role']}"
            if message["role"] == "assistant" and kind.startswith("message_end"):
                kind += f":{message['stopReason']}"
        elif kind == "message_update":
            kind = "update:" + e["assistantMessageEvent"]["type"].split("_")[0]
        elif kind == "response":
            kind = f"response:{e['command']}:{'ok' if e['success'] else 'error'}"
        if not out or out[-1] != kind or not kind.startswith(("update:", "tool_execution_update")):
            out.append(kind)
    return out


async def _prompt(fake: FakePi, text: str) -> list[dict[str, Any]]:
    await fake.send({"id": "p", "type": "prompt", "message": text})
    return await fake.receive_until("agent_settled")


def _model(*steps: Any) -> ScriptedModel:
    return ScriptedModel(scenario=Scenario(steps=list(steps)))


async def test_plain_answer_sequence(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """pi-observed.md §4: one prompt, one text answer, system message on the first request."""
    session = tmp_path / "s.jsonl"
    async with open_fake_pi(cwd=tmp_path, session=session, clock=MockWallClock()) as fake:
        events = await _prompt(fake, "hello")
    assert _kinds(events) == [
        "response:prompt:ok",
        "agent_start",
        "turn_start",
        "message_start:system",
        "message_end:system",
        "message_start:user",
        "message_end:user",
        "message_start:assistant",
        "update:text",
        "message_end:assistant:stop",
        "turn_end",
        "agent_end",
        "agent_settled",
    ]
    assert events[-1] == {"type": "agent_settled", "aborted": False}
    final = events[-4]["message"]
    assert final["content"] == [{"type": "text", "text": "You said: hello"}]
    lines = read_session(session).session
    assert [e.type for e in lines.entries] == [
        "model_change",
        "thinking_level_change",
        "message",
        "message",
        "message",
    ]
    assert [e.role for e in lines.entries[2:]] == ["system", "user", "assistant"]


async def test_tool_round_then_answer(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """pi-observed.md §4: tool call, tool execution events, toolResult, second turn."""
    model = _model(
        ToolCalls(calls=[Call(name="write", arguments={"path": "a.txt", "content": "x"})])
    )
    async with open_fake_pi(cwd=tmp_path, model=model) as fake:
        events = await _prompt(fake, "write it")
    kinds = _kinds(events)
    assert kinds[kinds.index("message_end:assistant:toolUse") :] == [
        "message_end:assistant:toolUse",
        "tool_execution_start",
        "tool_execution_end",
        "message_start:toolResult",
        "message_end:toolResult",
        "turn_end",
        "turn_start",
        "message_start:assistant",
        "update:text",
        "message_end:assistant:stop",
        "turn_end",
        "agent_end",
        "agent_settled",
    ]
    assert (tmp_path / "a.txt").read_text() == "x"
    second = model.requests[1].body["messages"]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "tool"]
    assert second[2]["content"] is None
    assert second[2]["tool_calls"][0]["function"]["name"] == "write"
    assert second[3]["tool_call_id"] == second[2]["tool_calls"][0]["id"]


class _HoldingGate:
    """A gate that holds the first call until released (a long-running tool)."""

    def __init__(self) -> None:
        self.entered = trio.Event()
        self.release = trio.Event()

    async def before(self, call: ToolCall) -> GateDecision:
        if not self.entered.is_set():
            self.entered.set()
            await self.release.wait()
        return Run()

    async def after(self, call: ToolCall, result: ToolResult) -> None:
        return None


async def test_steer_during_a_tool_is_delivered_after_it(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """pi-observed.md §7: a steer does not interrupt the tool; the next request holds it."""
    gate = _HoldingGate()
    model = _model(ToolCalls(calls=[Call(name="read", arguments={"path": "x"})]))
    (tmp_path / "x").write_text("content")
    async with open_fake_pi(cwd=tmp_path, model=model, gate=gate) as fake:
        await fake.send({"id": "p", "type": "prompt", "message": "go"})
        events = await fake.receive_until("tool_execution_start")
        await gate.entered.wait()
        await fake.send({"id": "s", "type": "steer", "message": "change of plan"})
        queued = await fake.receive_until("response")
        assert queued[-2] == {
            "type": "queue_update",
            "steering": ["change of plan"],
            "followUp": [],
        }
        assert queued[-1]["data"] == {"disposition": "queued"}
        gate.release.set()
        events += queued + await fake.receive_until("agent_settled")
    last = model.requests[-1].body["messages"]
    assert [m["role"] for m in last[-3:]] == ["assistant", "tool", "user"]
    assert last[-1]["content"] == [{"type": "text", "text": "change of plan"}]
    assert model.request_count == 2
    assert {"type": "queue_update", "steering": [], "followUp": []} in events


async def test_follow_up_runs_when_the_agent_would_stop(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """pi-observed.md §7: a follow-up is its own turn within the same run."""
    model = _model(Text(text="first answer", delay=5))
    async with open_fake_pi(cwd=tmp_path, model=model) as fake:
        await fake.send({"id": "p", "type": "prompt", "message": "one"})
        await fake.receive_until("message_start")
        await fake.send(
            {"id": "f", "type": "prompt", "message": "two", "streamingBehavior": "followUp"}
        )
        events = await fake.receive_until("agent_settled")
    assert _kinds(events).count("agent_start") == 0  # one run
    assert model.request_count == 2
    assert model.requests[1].body["messages"][-1]["content"][0]["text"] == "two"


async def test_prompt_while_running_needs_streaming_behaviour(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """pi-observed.md §6: a bare prompt during a run is refused with Pi's text."""
    async with open_fake_pi(cwd=tmp_path, model=_model(Text(text="slow", delay=30))) as fake:
        await fake.send({"id": "1", "type": "prompt", "message": "a"})
        await fake.receive_until("message_start")
        await fake.send({"id": "2", "type": "prompt", "message": "b"})
        reply = await fake.receive_until("response")
        await fake.receive_until("agent_settled")
    assert reply[-1]["id"] == "2"
    assert reply[-1]["success"] is False
    assert reply[-1]["error"].startswith("Agent is already processing.")


async def test_abort_while_streaming_keeps_partial_text(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """pi-observed.md §7: abort mid-stream → aborted message with the partial text, then the
    response."""
    model = _model(Text(text="one two three four five", delay=10))
    session = tmp_path / "s.jsonl"
    async with open_fake_pi(cwd=tmp_path, model=model, session=session) as fake:
        await fake.send({"id": "p", "type": "prompt", "message": "talk"})
        await fake.receive_until("message_update")
        await fake.send({"id": "a", "type": "abort"})
        events = await fake.receive_until("response")
    assert _kinds(events)[-5:] == [
        "message_end:assistant:aborted",
        "turn_end",
        "agent_end",
        "agent_settled",
        "response:abort:ok",
    ]
    assert events[-2] == {"type": "agent_settled", "aborted": True}
    aborted = events[-5]["message"]
    assert aborted["errorMessage"] == "Request was aborted"  # Pi's text mid-stream
    assert aborted["content"][0]["text"].startswith("one")
    leaf = read_session(session).session.leaf
    assert leaf is not None
    assert leaf.raw["message"]["stopReason"] == "aborted"


async def test_a_hang_at_the_abort_barrier_is_a_worker_that_ignores_the_abort(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """fake-pi.md "Process behaviours": ``abort:1 = hang`` is a wedged worker — the first abort
    is neither carried out nor answered, and the run goes on to its end (``agent_settled`` not
    aborted); the second abort passes the barrier and is answered."""
    model = _model(Text(text="one two three", delay=10))
    behaviours = Behaviours(at={"abort:1": "hang"})
    async with open_fake_pi(cwd=tmp_path, model=model, behaviours=behaviours) as fake:
        await fake.send({"id": "p", "type": "prompt", "message": "talk"})
        await fake.receive_until("message_update")
        await fake.send({"id": "a1", "type": "abort"})
        events = await fake.receive_until("agent_settled")
        await fake.send({"id": "a2", "type": "abort"})
        answered = await fake.receive_until("response")
    assert "message_end:assistant:stop" in _kinds(events)
    assert events[-1] == {"type": "agent_settled", "aborted": False}
    assert not any(e["type"] == "response" for e in events)  # the first abort: no answer
    assert answered[-1]["id"] == "a2"
    assert answered[-1]["success"] is True


async def test_a_hang_at_the_prompt_barrier_is_a_worker_that_never_answers_its_prompt(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """fake-pi.md "Process behaviours": ``prompt:1 = hang`` is a worker that never answers its
    prompt — no response, no run, nothing emitted for an hour of virtual time, and no command
    after it is handled either (an ``abort`` included)."""
    model = _model(Text(text="never said"))
    behaviours = Behaviours(at={"prompt:1": "hang"})
    with trio.move_on_after(3600) as waited:  # the hung worker is only ever cancelled
        async with open_fake_pi(cwd=tmp_path, model=model, behaviours=behaviours) as fake:
            await fake.send({"id": "p", "type": "prompt", "message": "talk"})
            await fake.send({"id": "a", "type": "abort"})
            await fake.receive_until("response")
    assert waited.cancelled_caught
    assert model.request_count == 0


async def test_abort_during_a_tool(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """pi-observed.md §7: abort during a tool → "Command aborted" result, then an aborted reply."""
    gate = _HoldingGate()
    model = _model(ToolCalls(calls=[Call(name="read", arguments={"path": "x"})]))
    async with open_fake_pi(cwd=tmp_path, model=model, gate=gate) as fake:
        await fake.send({"id": "p", "type": "prompt", "message": "go"})
        events = await fake.receive_until("tool_execution_start")
        await gate.entered.wait()
        await fake.send({"id": "a", "type": "abort"})
        events += await fake.receive_until("response")
    kinds = _kinds(events)
    assert kinds[kinds.index("tool_execution_end") :] == [
        "tool_execution_end",
        "message_start:toolResult",
        "message_end:toolResult",
        "turn_end",
        "turn_start",
        "message_start:assistant",
        "message_end:assistant:aborted",
        "turn_end",
        "agent_end",
        "agent_settled",
        "response:abort:ok",
    ]
    end = next(e for e in events if e["type"] == "tool_execution_end")
    assert end["isError"] is True
    assert model.request_count == 1


async def test_http_500_then_success_is_retried(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """pi-observed.md §7: 500 → error reply, agent_end{willRetry}, auto_retry_*, context_edit."""
    model = _model(HttpError())
    retry = RetrySettings(base_delay_ms=500)
    session = tmp_path / "s.jsonl"
    async with open_fake_pi(cwd=tmp_path, model=model, retry=retry, session=session) as fake:
        events = await _prompt(fake, "hi")
    kinds = _kinds(events)
    assert kinds[kinds.index("message_end:assistant:error") :] == [
        "message_end:assistant:error",
        "turn_end",
        "agent_end",
        "auto_retry_start",
        "entry_appended",
        "agent_start",
        "turn_start",
        "message_start:assistant",
        "update:text",
        "message_end:assistant:stop",
        "auto_retry_end",
        "turn_end",
        "agent_end",
        "agent_settled",
    ]
    start = next(e for e in events if e["type"] == "auto_retry_start")
    assert start["delayMs"] == 500
    assert start["errorMessage"].startswith("500: ")
    assert [e["willRetry"] for e in events if e["type"] == "agent_end"] == [True, False]
    # the failed reply is hidden from the retried request
    assert [m["role"] for m in model.requests[1].body["messages"]] == ["system", "user"]
    entries = read_session(session).session.entries
    assert entries[-2].type == "context_edit"
    assert entries[-2].raw["targetId"] == entries[-3].id


async def test_usage_limit_is_not_retried(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Pi does not retry a quota error: one request, an error reply, settled."""
    model = _model(UsageLimit())
    async with open_fake_pi(cwd=tmp_path, model=model) as fake:
        events = await _prompt(fake, "hi")
    assert "auto_retry_start" not in _kinds(events)
    assert model.request_count == 1
    error = next(
        e for e in events if e["type"] == "message_end" and e["message"]["role"] == "assistant"
    )
    assert "insufficient_quota" in error["message"]["errorMessage"]


async def test_cut_stream_is_retried(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A stream cut mid-way is a retryable error (Pi retries connection errors)."""
    model = _model(Cut(after_chunks=2))
    async with open_fake_pi(
        cwd=tmp_path, model=model, retry=RetrySettings(base_delay_ms=10)
    ) as fake:
        events = await _prompt(fake, "hi")
    assert "auto_retry_start" in _kinds(events)
    assert model.request_count == 2
    assert events[-1] == {"type": "agent_settled", "aborted": False}


async def test_saved_and_refused_results_reach_the_model(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """pi-observed.md: a saved result is handed to the model verbatim, a refusal as an error."""

    class Gate:
        async def before(self, call: ToolCall) -> GateDecision:
            if call.name == "bash":
                return SavedResult(ToolResult.text("saved-output-123\nline2\n"))
            return Refused(ToolResult.text("refused by runtime", is_error=True))

        async def after(self, call: ToolCall, result: ToolResult) -> None:
            raise AssertionError("no tool ran")

    model = _model(
        ToolCalls(
            calls=[
                Call(name="bash", arguments={"command": "touch should-not-exist"}),
                Call(name="write", arguments={"path": "nope.txt", "content": "x"}),
            ]
        )
    )
    async with open_fake_pi(cwd=tmp_path, model=model, gate=Gate()) as fake:
        await _prompt(fake, "go")
    tools = [m for m in model.requests[1].body["messages"] if m["role"] == "tool"]
    assert [t["content"] for t in tools] == ["saved-output-123\nline2\n", "refused by runtime"]
    assert not (tmp_path / "should-not-exist").exists()
    assert not (tmp_path / "nope.txt").exists()


async def test_resume_appends_to_the_same_session(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """pi-observed.md §8: relaunch on the session file: same id, appends, leaf = last line."""
    session = tmp_path / "s.jsonl"
    async with open_fake_pi(cwd=tmp_path, session=session) as fake:
        await _prompt(fake, "first")
        await fake.send({"id": "s", "type": "get_state"})
        state = (await fake.receive_until("response"))[-1]["data"]
    first = read_session(session).session
    async with open_fake_pi(cwd=tmp_path, session=session) as fake:
        await fake.send({"id": "s", "type": "get_state"})
        again = (await fake.receive_until("response"))[-1]["data"]
        events = await _prompt(fake, "second")
    assert again["sessionId"] == state["sessionId"] == first.id
    assert "message_start:system" not in _kinds(events)
    resumed = read_session(session).session
    assert resumed.entries[: len(first.entries)] == first.entries
    assert resumed.entries[len(first.entries)].parent_id == first.leaf.id  # type: ignore[union-attr]


async def test_killed_mid_tool_leaves_the_dangling_call(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """pi-observed.md §8: killed mid-tool, the session ends with the assistant toolCall;
    the next request answers it with "No result provided"."""
    session = tmp_path / "s.jsonl"
    model = _model(ToolCalls(calls=[Call(name="read", arguments={"path": "x"})]))
    behaviours = Behaviours(at={"before_tool:1": "kill"})
    async with open_fake_pi(
        cwd=tmp_path, model=model, session=session, behaviours=behaviours
    ) as fake:
        await fake.send({"id": "p", "type": "prompt", "message": "go"})
        with trio.fail_after(5):
            seen = []
            async for line in _drain(fake):
                seen.append(line)
    leaf = read_session(session).session.leaf
    assert leaf is not None
    assert leaf.raw["message"]["content"][0]["type"] == "toolCall"
    async with open_fake_pi(cwd=tmp_path, model=model, session=session) as fake:
        await _prompt(fake, "again")
    messages = model.requests[-1].body["messages"]
    assert [m["role"] for m in messages[-3:]] == ["assistant", "tool", "user"]
    assert messages[-2]["content"] == "No result provided"


async def _drain(fake: FakePi) -> Any:
    """Every line until Fake-Pi's stdout ends."""
    while True:
        try:
            yield await fake.receive()
        except StopAsyncIteration:
            return


async def test_bad_input_is_answered_like_pi(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """pi-observed.md §6: parse errors and unknown commands get Pi's error responses."""
    async with open_fake_pi(cwd=tmp_path) as fake:
        await fake.stdin.send_all(b"{not json\n")
        parse = await fake.receive()
        await fake.send({"id": "u", "type": "no_such_command"})
        unknown = await fake.receive()
        await fake.send({"id": "e", "type": "get_entries", "since": "nope"})
        missing = await fake.receive()
    assert parse["command"] == "parse"
    assert parse["success"] is False
    assert parse["error"].startswith("Failed to parse command:")
    assert unknown == {
        "id": "u",
        "type": "response",
        "command": "no_such_command",
        "success": False,
        "error": "Unknown command: no_such_command",
    }
    assert missing["error"] == "Entry not found: nope"


async def test_views_have_pis_shapes(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """pi-observed.md §6: get_state, get_entries, get_tree, stats, last text, fork messages."""
    async with open_fake_pi(cwd=tmp_path, session=tmp_path / "s.jsonl") as fake:
        await _prompt(fake, "hello")
        data = {}
        for command in (
            "get_state",
            "get_entries",
            "get_tree",
            "get_session_stats",
            "get_last_assistant_text",
            "get_fork_messages",
            "get_messages",
        ):
            await fake.send({"id": command, "type": command})
            data[command] = (await fake.receive())["data"]
    assert list(data["get_state"]) == [
        "model",
        "thinkingLevel",
        "isStreaming",
        "isCompacting",
        "steeringMode",
        "followUpMode",
        "sessionFile",
        "sessionId",
        "autoCompactionEnabled",
        "messageCount",
        "pendingMessageCount",
    ]
    assert data["get_entries"]["leafId"] == data["get_entries"]["entries"][-1]["id"]
    assert data["get_tree"]["tree"][0]["entry"]["type"] == "model_change"
    assert data["get_session_stats"]["userMessages"] == 1
    assert data["get_last_assistant_text"] == {"text": "You said: hello"}
    assert data["get_fork_messages"]["messages"][0]["text"] == "hello"
    assert [m["role"] for m in data["get_messages"]["messages"]] == ["system", "user", "assistant"]


async def test_f12_a_kill_at_the_settled_barrier_ends_a_run_before_its_agent_settled(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """F12: ``settled:N`` is the N-th ``agent_settled``, as ``_behaviours.py`` documents: with
    ``settled:2 = kill`` the first run settles, the second ends (``agent_end``, its reply in
    the session) and the worker dies before it says ``agent_settled``. Before, no code passed
    this barrier: the behaviour was silently ignored and both runs settled."""
    session = tmp_path / "s.jsonl"
    behaviours = Behaviours(at={"settled:2": "kill"})
    model = _model(Text(text="one"), Text(text="two"))
    async with open_fake_pi(
        cwd=tmp_path, model=model, session=session, behaviours=behaviours
    ) as fake:
        first = await _prompt(fake, "first")
        await fake.send({"id": "p2", "type": "prompt", "message": "second"})
        with trio.fail_after(5):
            second = [line async for line in _drain(fake)]
    assert first[-1] == {"type": "agent_settled", "aborted": False}
    assert [e["type"] for e in second][-1] == "agent_end"
    assert not any(e["type"] == "agent_settled" for e in second)
    leaf = read_session(session).session.leaf
    assert leaf is not None
    assert leaf.raw["message"]["content"][0]["text"] == "two"


async def test_f12_the_startup_barrier_acts_in_process_too(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """F12: ``startup = kill`` in-process is a worker that dies before it reads a command (its
    stdout ends unanswered), as the subprocess does. Before, only the subprocess passed the
    ``startup`` barrier: an in-process Fake-Pi (``open_fake_pi``, ``InProcessWorkers``)
    ignored it and answered."""
    async with open_fake_pi(cwd=tmp_path, behaviours=Behaviours(at={"startup": "kill"})) as fake:
        await fake.send({"id": "s", "type": "get_state"})
        with trio.fail_after(5):
            seen = [line async for line in _drain(fake)]
    assert seen == []


@pytest.mark.parametrize(
    "at",
    [
        {"settle:1": "hang"},  # a misspelt barrier
        {"before_tools:1": "kill"},
        {"before_tool": "kill"},  # a counted barrier without its count
        {"before_tool:0": "kill"},  # counted from 1
        {"after_model:x": "kill"},
        {"startup:1": "hang"},  # startup is passed once, uncounted
        {"before_tool:1": "explode"},
        {"before_tool:1": "exit:x"},
        {"before_tool:1": "exit:256"},
        {"before_tool:1": "delay:-1"},
        {"before_tool:1": "delay:nan"},
    ],
)
def test_f12_a_behaviour_no_barrier_can_carry_out_is_refused(
    tmp_path: Path, at: dict[str, str]
) -> None:
    """F12: a behaviour at a barrier that does not exist, or with an action no barrier can
    carry out, is refused when it is made (``ValueError``) and when ``--fake-config`` is read
    (``msgspec.ValidationError``). Before, a misspelt barrier was never reached — the test
    that used it passed without its fault ever happening — and a bad action raised only once
    the barrier was reached, mid-run."""
    with pytest.raises(ValueError, match="behaviour"):
        Behaviours(at=at)
    config = tmp_path / "fake.json"
    config.write_text(json.dumps({"behaviours": {"at": at}}))
    with pytest.raises(msgspec.ValidationError):
        FakeConfig.load(config)


def test_f12_every_documented_barrier_and_action_is_accepted() -> None:
    """F12: the barriers and actions ``_behaviours.py`` documents are all accepted."""
    kinds = ["before_tool", "after_tool", "before_model", "after_model", "mid_stream"]
    kinds += ["settled", "agent_start", "abort", "prompt"]
    at = {f"{kind}:{n}": "hang" for n, kind in enumerate(kinds, start=1)}
    at |= {"startup": "delay:0.5", "prompt:20": "exit:0", "abort:3": "exit:255"}
    at |= {"before_tool:7": "kill", "after_tool:9": "delay:inf"}
    assert Behaviours(at=at, ignore_sigterm=2.0).at == at
