"""The RPC channel (``runtime/_pi/_rpc.py``); test names cite ``docs/design/rpc.md`` (R1…).

Three speeds: the pure core (sync); the Trio shell in-process, against a scripted wire or an
in-process Fake-Pi, under ``autojump_clock``; and real processes (Fake-Pi as a subprocess and
the real Pi 1.6.0) on the real clock, every wait bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import hypothesis.strategies as st
import pytest
import trio
import trio.testing
from hypothesis import given

from fake_pi.model_server import ScriptedModel, serve_model
from fake_pi.scenario import Call, Scenario, Step, Text, ToolCalls
from runtime import MockWallClock, ReasonCode
from runtime._boundary._http import HttpServer
from runtime._errors import (
    RpcClosedError,
    RpcCommandError,
    RpcLineTooLongError,
    WorkerExitedError,
    WorkerLaunchError,
)
from runtime._pi._rpc import RpcChannel, open_rpc_channel
from runtime._pi._rpc_protocol import (
    COMMAND_GUARD,
    MALFORMED_LINE,
    Event,
    LineSplitter,
    ProtocolState,
    UiCancel,
    UiConfirm,
    UiReply,
    UiRequest,
    UiValue,
    chat_text,
    ui_response,
)
from runtime.testing import GateDecision, Run, ToolCall, ToolResult, open_fake_pi

from .._pi import real_pi

REPO: Final = Path(__file__).resolve().parents[2]
BUSY: Final = (
    "Agent is already processing. Specify streamingBehavior ('steer' or 'followUp') "
    "to queue the message."
)
PROCESS_LIMIT: Final = 60.0
"""Bound for one real-process test (a cold Node start on a loaded box takes seconds)."""

# ------------------------------------------------------------------------------ pure core


def test_r1_splits_on_lf_only() -> None:
    splitter = LineSplitter()
    text = '{"t":"a\u2028b\u2029c\\u2028"}'.encode()
    assert splitter.feed(text + b"\n{") == [text]
    assert splitter.feed(b'"x":1}\r\n\n') == [b'{"x":1}\r', b""]
    assert splitter.feed(b"tail") == []
    assert splitter.finish() == b"tail"
    assert splitter.finish() is None


@given(
    lines=st.lists(st.binary().map(lambda b: b.replace(b"\n", b"\xe2\x80\xa8")), max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=10),
)
def test_r1_any_chunking_gives_the_same_lines(lines: list[bytes], cuts: list[int]) -> None:
    data = b"".join(line + b"\n" for line in lines)
    splitter = LineSplitter()
    out: list[bytes] = []
    start = 0
    for cut in [*sorted(c % (len(data) + 1) for c in cuts), len(data)]:
        out += splitter.feed(data[start:cut])
        start = max(start, cut)
    assert out == lines
    assert splitter.finish() is None


def test_r2_five_megabyte_line_in_small_chunks() -> None:
    line = b'{"type":"agent_end","text":"' + b"x\xe2\x80\xa8" * (5 * 1024 * 1024 // 4) + b'"}'
    splitter = LineSplitter()
    got: list[bytes] = []
    for offset in range(0, len(line), 4096):
        got += splitter.feed(line[offset : offset + 4096])
    got += splitter.feed(b"\n")
    assert got == [line]
    assert splitter.longest == len(line)


def test_r2_a_line_past_the_limit_is_refused() -> None:
    splitter = LineSplitter(max_line=10)
    assert splitter.feed(b"0123456789\n") == [b"0123456789"]
    with pytest.raises(RpcLineTooLongError) as caught:
        splitter.feed(b"0123456789A")
    assert caught.value.code == ReasonCode.RPC_LINE_TOO_LONG


def _line(record: dict[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=False).encode()


def test_r3_ids_are_fresh_and_responses_matched_by_id() -> None:
    state = ProtocolState()
    first = state.command({"type": "get_state"})
    second = state.command({"type": "get_messages"})
    assert (first["id"], second["id"]) == ("rpc-1", "rpc-2")
    with pytest.raises(ValueError, match="no 'id'"):
        state.command({"type": "get_state", "id": "mine"})
    with pytest.raises(ValueError, match="string 'type'"):
        state.command({"message": "hi"})
    reply = state.receive(
        _line(
            {
                "id": "rpc-2",
                "type": "response",
                "command": "get_messages",
                "success": True,
                "data": {"messages": []},
            }
        )
    )
    assert reply.response is not None
    assert reply.response.id == "rpc-2"
    assert reply.event is None
    assert state.pending == {"rpc-1": "get_state"}


def test_r3_abandoned_responses_are_dropped_and_strangers_are_events() -> None:
    state = ProtocolState()
    rid = state.command({"type": "get_state"})["id"]
    state.abandon(rid)
    late = state.receive(
        _line({"id": rid, "type": "response", "command": "get_state", "success": True})
    )
    assert (late.response, late.event) == (None, None)
    stranger = state.receive(
        _line(
            {
                "type": "response",
                "command": "parse",
                "success": False,
                "error": "Failed to parse command: x",
            }
        )
    )
    assert stranger.response is None
    assert stranger.event is not None
    assert stranger.event.type == "response"
    assert stranger.event.seq == 1


def test_r7_run_tracking_in_stream_order() -> None:
    state = ProtocolState()
    rid = state.command({"type": "prompt", "message": "hi"})["id"]
    started = state.receive(
        _line(
            {
                "id": rid,
                "type": "response",
                "command": "prompt",
                "success": True,
                "data": {"disposition": "started"},
            }
        )
    )
    assert started.settled_before == 0
    running = [state.running]
    state.receive(_line({"type": "agent_start"}))
    state.receive(_line({"type": "agent_end", "messages": [], "willRetry": True}))
    running.append(state.running)
    settled = state.receive(_line({"type": "agent_settled", "aborted": False}))
    running.append(state.running)
    assert running == [True, True, False]
    assert settled.settled_before == 0
    assert [e.record for e in state.settled] == [{"type": "agent_settled", "aborted": False}]
    again = state.command({"type": "prompt", "message": "again"})["id"]
    queued = state.receive(
        _line(
            {
                "id": again,
                "type": "response",
                "command": "prompt",
                "success": True,
                "data": {"disposition": "handled"},
            }
        )
    )
    assert queued.settled_before == 1
    assert [*running, state.running] == [True, True, False, False]


def test_r8_ui_response_shapes() -> None:
    assert ui_response("u1", UiValue(value="beta")) == {
        "type": "extension_ui_response",
        "id": "u1",
        "value": "beta",
    }
    assert ui_response("u2", UiConfirm(confirmed=True)) == {
        "type": "extension_ui_response",
        "id": "u2",
        "confirmed": True,
    }
    assert ui_response("u3", UiCancel()) == {
        "type": "extension_ui_response",
        "id": "u3",
        "cancelled": True,
    }


def test_r8_dialogs_need_answers_notices_do_not() -> None:
    state = ProtocolState()
    dialog = state.receive(
        _line(
            {
                "type": "extension_ui_request",
                "id": "u1",
                "method": "confirm",
                "title": "t",
                "message": "m",
            }
        )
    )
    assert dialog.ui is not None
    assert dialog.ui.method == "confirm"
    assert dialog.event is not None  # the layers above see it too
    for method in ("notify", "setStatus", "setWidget", "setTitle", "set_editor_text"):
        notice = state.receive(_line({"type": "extension_ui_request", "id": "n", "method": method}))
        assert notice.ui is None
        assert notice.event is not None
    future = state.receive(
        _line({"type": "extension_ui_request", "id": "u9", "method": "someFutureDialog"})
    )
    assert future.ui is not None


def test_r9_chat_text_guards_a_leading_slash_only() -> None:
    assert COMMAND_GUARD == " "
    assert chat_text("/compact now") == " /compact now"
    assert chat_text("/") == " /"
    assert chat_text("hello /there") == "hello /there"
    assert chat_text(" /already") == " /already"
    assert chat_text("") == ""


DEEP: Final = b'{"type":"message_update","args":' + b"[" * 5000 + b"]" * 5000 + b"}"
"""Valid JSON nested deeper than any decoder here goes (a model's tool arguments can be)."""


def test_r10_malformed_lines_become_events_and_js_escapes_decode() -> None:
    state = ProtocolState()
    for raw in (b"not json", b"[1,2]", b'{"no":"type"}', DEEP):
        received = state.receive(raw)
        assert received.event is not None
        assert received.event.type == MALFORMED_LINE
        assert raw.decode().startswith(received.event.record["line"])  # (a long one cut)
    assert state.malformed == 4
    blank = state.receive(b"  ")
    assert (blank.event, blank.response) == (None, None)
    surrogate = state.receive(b'{"type":"message_update","delta":"\\ud800x"}')
    assert surrogate.event is not None
    assert surrogate.event.record["delta"] == "\ud800x"
    assert state.records == 5


# -------------------------------------------------------------- shell, on a scripted wire


@dataclass
class Wire:
    """The worker's ends of the two pipes, driven by the test."""

    stdin: trio.abc.ReceiveStream
    stdout: trio.abc.SendStream
    splitter: LineSplitter = field(default_factory=LineSplitter)
    lines: list[bytes] = field(default_factory=list)

    async def read(self) -> dict[str, Any]:
        """The next line the channel wrote, decoded."""
        while not self.lines:
            data = await self.stdin.receive_some()
            assert data, "the channel closed stdin"
            self.lines += self.splitter.feed(data)
        value: dict[str, Any] = json.loads(self.lines.pop(0))
        return value

    async def read_raw(self) -> bytes:
        while not self.lines:
            data = await self.stdin.receive_some()
            assert data, "the channel closed stdin"
            self.lines += self.splitter.feed(data)
        return self.lines.pop(0)

    async def write(self, record: dict[str, Any]) -> None:
        await self.stdout.send_all(_line(record) + b"\n")

    async def respond(self, command: dict[str, Any], data: Any = None) -> None:
        await self.write(
            {
                "id": command["id"],
                "type": "response",
                "command": command["type"],
                "success": True,
                "data": data,
            }
        )


def wire_pair(
    one_way: Callable[[], tuple[trio.abc.SendStream, trio.abc.ReceiveStream]] = (
        trio.testing.memory_stream_one_way_pair
    ),
) -> tuple[trio.abc.SendStream, trio.abc.ReceiveStream, Wire]:
    """(channel stdin, channel stdout, the worker's side)."""
    stdin_send, stdin_receive = trio.testing.memory_stream_one_way_pair()
    stdout_send, stdout_receive = one_way()
    return stdin_send, stdout_receive, Wire(stdin=stdin_receive, stdout=stdout_send)


async def test_r2_five_megabyte_lines_through_the_channel(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stdin, stdout, wire = wire_pair()
    big = "entry\u2028line\u2029" * (5 * 1024 * 1024 // 15 + 1)  # 15 bytes each
    async with open_rpc_channel(stdin, stdout) as channel, trio.open_nursery() as nursery:

        async def worker() -> None:
            command = await wire.read()
            data = _line({"type": "agent_end", "messages": [{"text": big}], "willRetry": False})
            data += (
                b"\n"
                + _line(
                    {
                        "id": command["id"],
                        "type": "response",
                        "command": "get_entries",
                        "success": True,
                        "data": {"entries": [{"text": big}]},
                    }
                )
                + b"\n"
            )
            for offset in range(0, len(data), 7001):
                await wire.stdout.send_all(data[offset : offset + 7001])

        nursery.start_soon(worker)
        response = await channel.request({"type": "get_entries"})
        assert response.data["entries"][0]["text"] == big
        event = await channel.next_event()
        assert event.type == "agent_end"
        assert event.record["messages"][0]["text"] == big
        assert channel.statistics().longest_line > 5 * 1024 * 1024


async def test_r4_the_reader_drains_stdout_while_nobody_consumes_events(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # lockstep: every send_all of the worker blocks until the channel has read it
    stdin, stdout, wire = wire_pair(trio.testing.lockstep_stream_one_way_pair)
    async with open_rpc_channel(stdin, stdout) as channel, trio.open_nursery() as nursery:

        async def worker() -> None:
            command = await wire.read()
            for n in range(2000):
                await wire.write({"type": "message_update", "n": n})
            await wire.respond(command, {"ok": True})

        nursery.start_soon(worker)
        with trio.fail_after(5):
            assert (await channel.request({"type": "get_state"})).data == {"ok": True}
        assert channel.statistics().events_buffered == 2000
        assert [(await channel.next_event()).record["n"] for _ in range(3)] == [0, 1, 2]


async def test_r3_concurrent_requests_on_a_wire_answered_out_of_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stdin, stdout, wire = wire_pair()
    results: dict[str, Any] = {}
    async with open_rpc_channel(stdin, stdout) as channel, trio.open_nursery() as nursery:

        async def ask(kind: str) -> None:
            results[kind] = (await channel.request({"type": kind})).data

        for kind in ("get_state", "get_messages", "get_tree"):
            nursery.start_soon(ask, kind)
        commands = [await wire.read() for _ in range(3)]
        assert sorted(c["id"] for c in commands) == ["rpc-1", "rpc-2", "rpc-3"]
        for command in reversed(commands):  # Pi handles commands concurrently
            await wire.respond(command, {"for": command["type"]})
    assert results == {k: {"for": k} for k in ("get_state", "get_messages", "get_tree")}


async def test_r3_w10_a_fence_leaves_a_write_the_worker_never_reads(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R3, W10: a line's write is shielded (never half a line), but a worker that has
    stopped reading its stdin cannot hold it for ever: a fence (the cancel at 1 s) leaves
    the block once the write's bound (``stdin_stall``, 5 s here) has run out — the worker
    taken as gone, stdin closed — instead of never, so the tree can be stopped."""
    stdin, never_read = trio.testing.lockstep_stream_one_way_pair()  # a send waits for a read
    _, stdout = trio.testing.memory_stream_one_way_pair()
    began = trio.current_time()
    with trio.move_on_after(1) as fence:
        async with open_rpc_channel(stdin, stdout, stdin_stall=5) as channel:
            await channel.prompt("x")
    assert fence.cancelled_caught
    assert trio.current_time() - began == pytest.approx(5)  # (before: never)
    with pytest.raises(trio.ClosedResourceError):  # closed: no line may follow half a one
        await stdin.send_all(b"{}\n")
    assert never_read is not None


async def test_r3_r5_a_worker_taken_as_gone_fails_every_waiter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R3, R5, R11: a run is in flight (``agent_start`` read) when the worker stops reading
    its stdin; a ``steer``'s write runs out of its bound (``stdin_stall``) and the worker is
    taken as gone (``worker_exited``). Before, only that writer was told: the channel stayed
    ``running``, a task waiting for the run's ``agent_settled`` waited for ever, and so did
    the block's normal end (``aclose`` waits for idle) — a stop of the lane never ended.
    Now every waiter learns the same error at once, a new command too, and the block ends."""
    stdin, never_read = trio.testing.lockstep_stream_one_way_pair()  # a send waits for a read
    worker, stdout = trio.testing.memory_stream_one_way_pair()
    await worker.send_all(_line({"type": "agent_start"}) + b"\n")
    with trio.move_on_after(60) as hung:
        async with open_rpc_channel(stdin, stdout, stdin_stall=5) as channel:
            await trio.testing.wait_all_tasks_blocked()
            assert channel.running
            async with trio.open_nursery() as nursery:
                waited: list[BaseException] = []

                async def wait_for_the_run() -> None:
                    try:
                        await channel.wait_settled(0)
                    except WorkerExitedError as error:
                        waited.append(error)

                nursery.start_soon(wait_for_the_run)
                with pytest.raises(WorkerExitedError) as stalled:
                    await channel.steer("x")
            assert waited == [stalled.value]
            assert (channel.idle, channel.running) == (True, False)
            with pytest.raises(WorkerExitedError):
                await channel.request({"type": "get_state"})
            assert (await channel.next_event()).type == "agent_start"  # what was read
            with pytest.raises(WorkerExitedError):
                await channel.next_event()
    assert not hung.cancelled_caught
    assert never_read is not None


async def test_r3_a_cancelled_request_drops_its_late_response(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stdin, stdout, wire = wire_pair()
    async with open_rpc_channel(stdin, stdout) as channel:
        with trio.move_on_after(1):
            await channel.request({"type": "get_state"})
        command = await wire.read()
        await wire.respond(command)
        await wire.write(
            {
                "type": "response",
                "command": "parse",
                "success": False,
                "error": "Failed to parse command: x",
            }
        )
        orphan = await channel.next_event()
        assert (orphan.type, orphan.record["command"]) == ("response", "parse")
        assert channel.idle


async def test_r10_hostile_bytes_are_events_and_the_channel_goes_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R1, R3, R10: invalid UTF-8, a NUL byte and a response to an id never asked, sent one
    byte at a time, become events in stdout order; the pending request is still answered
    (its response CRLF-terminated)."""
    stdin, stdout, wire = wire_pair()
    async with open_rpc_channel(stdin, stdout) as channel, trio.open_nursery() as nursery:

        async def worker() -> None:
            command = await wire.read()
            stray = {"id": "rpc-99", "type": "response", "command": "get_state", "success": True}
            answer = {"id": command["id"], "type": "response", "command": "get_state"}
            hostile = b"\xff\xfe{\n" + b'{"type":"x\x00"}\n' + _line(stray) + b"\n"
            for byte in hostile + _line({**answer, "success": True}) + b"\r\n":
                await wire.stdout.send_all(bytes([byte]))

        nursery.start_soon(worker)
        assert (await channel.request({"type": "get_state"})).success
        events = [await channel.next_event() for _ in range(3)]
        assert [e.type for e in events] == [MALFORMED_LINE, MALFORMED_LINE, "response"]
        assert [e.seq for e in events] == [0, 1, 2]
        assert events[0].record["length"] == 3
        assert events[2].record["id"] == "rpc-99"
        assert channel.statistics().malformed_lines == 2


async def test_r5_worker_exits_mid_request(autojump_clock: trio.testing.MockClock) -> None:
    stdin, stdout, wire = wire_pair()
    async with open_rpc_channel(stdin, stdout) as channel, trio.open_nursery() as nursery:

        async def worker() -> None:
            await wire.respond(await wire.read(), {"disposition": "started"})
            await wire.write({"type": "agent_start"})
            await wire.read()  # get_state: never answered
            await wire.stdout.aclose()

        nursery.start_soon(worker)
        prompted = await channel.prompt("hi")
        assert channel.running
        with pytest.raises(WorkerExitedError) as caught:
            await channel.request({"type": "get_state"})
        assert caught.value.code == ReasonCode.WORKER_EXITED
        assert not isinstance(caught.value, WorkerLaunchError)
        assert (await channel.next_event()).type == "agent_start"  # buffered events first
        with pytest.raises(WorkerExitedError):
            await channel.next_event()
        with pytest.raises(WorkerExitedError):
            await channel.wait_settled(prompted.settled_before)
        with pytest.raises(WorkerExitedError):
            await channel.request({"type": "get_state"})
        assert channel.idle
        assert not channel.running


async def test_r6_launch_error_quotes_the_stderr_stream(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stdin, stdout, wire = wire_pair()
    err_send, err_receive = trio.testing.memory_stream_one_way_pair()
    message = b'Error: Failed to load extension "/x/gate.ts": boom\nHint: Start without ...\n'
    async with open_rpc_channel(stdin, stdout, stderr=err_receive) as channel:
        await err_send.send_all(message)
        await err_send.aclose()
        await wire.stdout.aclose()
        with pytest.raises(WorkerLaunchError) as caught:
            await channel.request({"type": "get_state"})
    assert caught.value.code == ReasonCode.WORKER_LAUNCH_FAILED
    assert caught.value.stderr == message
    assert 'Failed to load extension "/x/gate.ts": boom' in str(caught.value)
    assert channel.stderr_tail == message


async def test_r6_launch_error_quotes_captured_stderr(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stdin, stdout, wire = wire_pair()
    async with open_rpc_channel(stdin, stdout, stderr=lambda: b"node: bad option\n") as channel:
        await wire.stdout.aclose()
        with pytest.raises(WorkerLaunchError, match="node: bad option"):
            await channel.request({"type": "get_state"})


async def test_r2_a_line_past_the_limit_fails_pending_requests(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stdin, stdout, wire = wire_pair()
    async with open_rpc_channel(stdin, stdout, max_line=1000) as channel:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wire.stdout.send_all, b"x" * 2000)
            with pytest.raises(RpcLineTooLongError):
                await channel.request({"type": "get_state"})
        with pytest.raises(RpcLineTooLongError):
            await channel.next_event()


DIALOGS: Final[list[dict[str, Any]]] = [
    {
        "type": "extension_ui_request",
        "id": "u1",
        "method": "confirm",
        "title": "Confirm title",
        "message": "Confirm message?",
    },
    {
        "type": "extension_ui_request",
        "id": "u2",
        "method": "select",
        "title": "Pick one",
        "options": ["alpha", "beta"],
    },
    {
        "type": "extension_ui_request",
        "id": "u3",
        "method": "input",
        "title": "Your name",
        "placeholder": "placeholder-text",
    },
    {
        "type": "extension_ui_request",
        "id": "u4",
        "method": "editor",
        "title": "Edit this",
        "prefill": "line1\nline2",
    },
    {
        "type": "extension_ui_request",
        "id": "u5",
        "method": "notify",
        "message": "hello",
        "notifyType": "info",
    },
    {"type": "extension_ui_request", "id": "u6", "method": "someFutureDialog"},
]
"""The exact lines Pi 1.6.0 wrote in the spike (pi-observed.md), plus an unknown method."""


async def _answers(wire: Wire, count: int) -> dict[str, bytes]:
    raw = [await wire.read_raw() for _ in range(count)]
    return {json.loads(line)["id"]: line for line in raw}


async def _no_more_answers(channel: RpcChannel, wire: Wire) -> None:
    """The next line after the answers is a command: nothing else was written (notify)."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(channel.request, {"type": "get_state"})
        command = await wire.read()
        assert command["type"] == "get_state"
        await wire.respond(command)


async def test_r8_every_dialog_is_cancelled_by_default(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stdin, stdout, wire = wire_pair()
    async with open_rpc_channel(stdin, stdout) as channel:
        for record in DIALOGS:
            await wire.write(record)
        answers = await _answers(wire, 5)
        assert answers == {
            uid: b'{"type":"extension_ui_response","id":"%s","cancelled":true}' % uid.encode()
            for uid in ("u1", "u2", "u3", "u4", "u6")
        }
        await _no_more_answers(channel, wire)
        seen = [(await channel.next_event()).record for _ in DIALOGS]
        assert seen == DIALOGS  # the layers above see every request, notices included
        assert channel.statistics().ui_answered == 5


async def test_r8_a_policy_answers_in_pis_shapes(autojump_clock: trio.testing.MockClock) -> None:
    asked: list[str] = []

    async def policy(request: UiRequest) -> UiReply:
        asked.append(request.method)
        await trio.sleep(1)  # a policy may take its time
        match request.method:
            case "confirm":
                return UiConfirm(confirmed=True)
            case "select":
                return UiValue(value=request.record["options"][1])
            case "input":
                return UiValue(value="Ada")
            case "editor":
                return UiValue(value=request.record["prefill"] + "\nline3")
        return UiCancel()

    stdin, stdout, wire = wire_pair()
    async with open_rpc_channel(stdin, stdout, ui_policy=policy) as channel:
        for record in DIALOGS:
            await wire.write(record)
        answers = await _answers(wire, 5)
        assert answers == {
            "u1": b'{"type":"extension_ui_response","id":"u1","confirmed":true}',
            "u2": b'{"type":"extension_ui_response","id":"u2","value":"beta"}',
            "u3": b'{"type":"extension_ui_response","id":"u3","value":"Ada"}',
            "u4": b'{"type":"extension_ui_response","id":"u4","value":"line1\\nline2\\nline3"}',
            "u6": b'{"type":"extension_ui_response","id":"u6","cancelled":true}',
        }
        await _no_more_answers(channel, wire)
    assert sorted(asked) == ["confirm", "editor", "input", "select", "someFutureDialog"]


async def test_r8_a_slow_policy_is_cut_short_with_a_cancel(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def forever(request: UiRequest) -> UiReply:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    stdin, stdout, wire = wire_pair()
    async with open_rpc_channel(stdin, stdout, ui_policy=forever, ui_timeout=30) as channel:
        await wire.write(DIALOGS[0])
        before = trio.current_time()
        answer = await wire.read()
        assert answer == {"type": "extension_ui_response", "id": "u1", "cancelled": True}
        assert trio.current_time() - before == pytest.approx(30)
        assert channel.statistics().ui_answered == 1


async def test_r8_a_failing_policy_still_answers_then_raises_plainly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def broken(request: UiRequest) -> UiReply:
        raise ValueError("policy bug")

    stdin, stdout, wire = wire_pair()
    answers: list[dict[str, Any]] = []

    async def run() -> None:
        async with open_rpc_channel(stdin, stdout, ui_policy=broken):
            await wire.write(DIALOGS[0])
            answers.append(await wire.read())
            await trio.sleep_forever()

    with pytest.raises(ValueError, match="policy bug"):  # not an ExceptionGroup
        await run()
    assert answers == [{"type": "extension_ui_response", "id": "u1", "cancelled": True}]


# ------------------------------------------------------------- shell, in-process Fake-Pi


class RecordingStdin(trio.abc.SendStream):
    """Wraps the worker's stdin: keeps every byte written and notes when it was closed."""

    def __init__(self, inner: trio.abc.SendStream) -> None:
        self.inner = inner
        self.data = bytearray()
        self.closed = False
        self.on_close: Callable[[], None] = lambda: None

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.data += data
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        self.closed = True
        self.on_close()
        await self.inner.aclose()

    def commands(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.data.splitlines()]


class HoldGate:
    """A tool gate that holds every call until ``release`` is set (the tool is "running")."""

    def __init__(self) -> None:
        self.release = trio.Event()
        self.seen: list[ToolCall] = []

    async def before(self, call: ToolCall) -> GateDecision:
        self.seen.append(call)
        await self.release.wait()
        return Run()

    async def after(self, call: ToolCall, result: ToolResult) -> None:
        return None


@contextlib.asynccontextmanager
async def fake_channel(
    tmp_path: Path, steps: Sequence[Step], *, gate: HoldGate | None = None
) -> AsyncIterator[tuple[RpcChannel, ScriptedModel, RecordingStdin]]:
    model = ScriptedModel(scenario=Scenario(steps=list(steps)))
    (tmp_path / "notes.txt").write_text("the notes\n")
    async with open_fake_pi(cwd=tmp_path, model=model, gate=gate, clock=MockWallClock()) as fake:
        stdin = RecordingStdin(fake.stdin)
        async with open_rpc_channel(stdin, fake.stdout) as channel:
            yield channel, model, stdin


async def _until(channel: RpcChannel, event_type: str) -> list[Event]:
    seen = []
    async for event in channel:
        seen.append(event)
        if event.type == event_type:
            return seen
    raise AssertionError(f"no {event_type} before the channel closed")


def _user_texts(body: dict[str, Any]) -> list[str]:
    texts = []
    for message in body["messages"]:
        if message["role"] == "user":
            content = message["content"]
            texts.append(
                content if isinstance(content, str) else "".join(p["text"] for p in content)
            )
    return texts


READ_THEN_ANSWER: Final[list[Step]] = [
    ToolCalls(calls=[Call(name="read", arguments={"path": "notes.txt"})]),
    Text(text="I read the notes."),
]


async def test_r7_a_prompt_with_a_tool_round_in_order(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with fake_channel(tmp_path, READ_THEN_ANSWER) as (channel, model, stdin):
        prompted = await channel.prompt("read the notes")
        assert prompted.disposition == "started"
        settled = await channel.wait_settled(prompted.settled_before)
        assert settled.record == {"type": "agent_settled", "aborted": False}
        assert not channel.running
        events = await _until(channel, "agent_settled")
        kinds = [e.type for e in events if e.type != "message_update"]
        assert kinds[0] == "agent_start"
        assert kinds[-2:] == ["agent_end", "agent_settled"]
        assert kinds.index("tool_execution_start") < kinds.index("tool_execution_end")
        assert [e.seq for e in events] == sorted({e.seq for e in events})
        state = await channel.request({"type": "get_state"})
        assert state.data["isStreaming"] is False
        assert len(model.requests) == 2
    assert stdin.closed


async def test_r3_concurrent_requests_to_fake_pi(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    kinds = ["get_state", "get_messages", "get_session_stats", "get_commands", "get_tree"]
    answers: dict[str, str] = {}
    async with fake_channel(tmp_path, []) as (channel, _, stdin):

        async def ask(kind: str) -> None:
            answers[kind] = (await channel.request({"type": kind})).command

        async with trio.open_nursery() as nursery:
            for kind in kinds:
                nursery.start_soon(ask, kind)
    assert answers == {k: k for k in kinds}
    ids = [c["id"] for c in stdin.commands()]
    assert sorted(ids) == sorted({f"rpc-{n}" for n in range(1, 6)})


async def test_r5_error_responses_carry_pis_text(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    gate = HoldGate()
    async with fake_channel(tmp_path, READ_THEN_ANSWER, gate=gate) as (channel, _, _stdin):
        with pytest.raises(RpcCommandError) as caught:
            await channel.request({"type": "no_such_command"})
        assert caught.value.code == ReasonCode.RPC_COMMAND_FAILED
        assert caught.value.pi_error == "Unknown command: no_such_command"
        with pytest.raises(RpcCommandError, match="Entry not found: nope"):
            await channel.request({"type": "get_entries", "since": "nope"})
        prompted = await channel.prompt("read the notes")
        with pytest.raises(RpcCommandError) as busy:
            await channel.prompt("another")
        assert busy.value.pi_error == BUSY
        gate.release.set()
        await channel.wait_settled(prompted.settled_before)


async def test_r9_a_steer_during_a_tool_reaches_the_next_request_as_text(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    gate = HoldGate()
    async with fake_channel(tmp_path, READ_THEN_ANSWER, gate=gate) as (channel, model, _):
        prompted = await channel.prompt("/read the notes")
        assert prompted.text == " /read the notes"
        await _until(channel, "tool_execution_start")
        assert await channel.steer("/also count the lines") == "queued"
        assert await channel.follow_up("/and then stop") == "queued"
        gate.release.set()
        await channel.wait_settled(prompted.settled_before)
    steered = model.requests[1].body  # the request after the tool round
    assert [m["role"] for m in steered["messages"][-2:]] == ["tool", "user"]
    assert _user_texts(steered) == [" /read the notes", " /also count the lines"]
    assert _user_texts(model.requests[-1].body)[-1] == " /and then stop"


async def test_r7_abort_during_a_tool_returns_after_settled(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    gate = HoldGate()  # never released: the tool "runs" until aborted
    async with fake_channel(tmp_path, READ_THEN_ANSWER, gate=gate) as (channel, _, stdin):
        prompted = await channel.prompt("read the notes")
        await _until(channel, "tool_execution_start")
        assert channel.statistics().running
        await channel.abort()
        assert not channel.statistics().running
        assert channel.statistics().settled == prompted.settled_before + 1
        settled = await channel.wait_settled(prompted.settled_before)
        assert settled.record["aborted"] is True
        events = await _until(channel, "agent_settled")
        end = next(e for e in events if e.type == "tool_execution_end")
        assert end.record["isError"] is True
        assert not stdin.closed


async def test_r11_aclose_waits_for_the_run_to_settle(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    slow = [Text(text="one two three four five six", delay=10.0)]
    async with fake_channel(tmp_path, slow) as (channel, _, stdin):
        settled_at_close: list[int] = []
        stdin.on_close = lambda: settled_at_close.append(channel.statistics().settled)
        await channel.prompt("talk slowly")
        with trio.move_on_after(5):  # a cancelled aclose leaves stdin open
            await channel.aclose()
        assert not stdin.closed
        assert channel.statistics().running
        with pytest.raises(RpcClosedError):  # closing: new commands are refused
            await channel.request({"type": "get_state"})
        await channel.aclose()
        assert settled_at_close == [1]  # closed, and only after agent_settled
        events = [e async for e in channel]  # ends cleanly after aclose
        ends = [e.record["message"] for e in events if e.type == "message_end"]
        assert ends[-1]["role"] == "assistant"
        assert ends[-1]["stopReason"] == "stop"
        await channel.aclose()  # idempotent


async def test_r11_an_error_in_the_block_closes_stdin_only_when_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen: list[RecordingStdin] = []

    async def fail(*, mid_run: bool) -> None:
        raw_stdin, stdout, wire = wire_pair()
        stdin = RecordingStdin(raw_stdin)
        seen.append(stdin)
        async with open_rpc_channel(stdin, stdout) as channel:
            if mid_run:
                await wire.write({"type": "agent_start"})
                await trio.testing.wait_all_tasks_blocked()
                assert channel.running
            raise KeyError("the caller failed")

    with pytest.raises(KeyError, match="the caller failed"):  # plain, not a group
        await fail(mid_run=True)
    with pytest.raises(KeyError, match="the caller failed"):
        await fail(mid_run=False)
    assert [stdin.closed for stdin in seen] == [False, True]


# --------------------------------------------------------------------- real processes


@dataclass(frozen=True)
class Sandbox:
    root: Path

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def agent(self) -> Path:
        return self.root / "home" / "agent"

    @classmethod
    def create(cls, root: Path, server: HttpServer) -> Sandbox:
        sandbox = cls(root)
        for sub in ("home/agent", "work", "sessions", "tmp"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        settings = {"enableInstallTelemetry": False, "retry": {"baseDelayMs": 50}}
        (sandbox.agent / "settings.json").write_text(json.dumps(settings))
        model = {
            "id": "fake-model",
            "name": "Fake Model",
            "reasoning": False,
            "input": ["text"],
            "contextWindow": 128000,
            "maxTokens": 4096,
            "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
        }
        provider = {
            "baseUrl": f"{server.url}/v1",
            "api": "openai-completions",
            "apiKey": "dummy-key",
            "models": [model],
        }
        (sandbox.agent / "models.json").write_text(json.dumps({"providers": {"fake": provider}}))
        return sandbox

    def env(self) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.root / "home"),
            "PI_CODING_AGENT_DIR": str(self.agent),
            "TMPDIR": str(self.root / "tmp"),
            "PI_OFFLINE": "1",
            "PI_TELEMETRY": "0",
            "PI_SKIP_VERSION_CHECK": "1",
            "LANG": "C.UTF-8",
        }

    def argv(self, kind: str, *extra: str) -> list[str]:
        args = [
            "--mode",
            "rpc",
            "--provider",
            "fake",
            "--model",
            "fake-model",
            "--session-dir",
            str(self.root / "sessions"),
            "-nc",
            "-ns",
            "-np",
            "-ne",
            "--no-mcp",
            *extra,
        ]
        if kind == "pi":
            return real_pi().argv(*args)
        return [sys.executable, "-m", "fake_pi", *args]


@contextlib.asynccontextmanager
async def real_model(steps: Sequence[Step]) -> AsyncIterator[tuple[ScriptedModel, HttpServer]]:
    model = ScriptedModel(scenario=Scenario(steps=list(steps)))
    async with trio.open_nursery() as nursery:
        server: HttpServer = await nursery.start(serve_model, model)
        yield model, server
        nursery.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def launch(
    argv: list[str], sandbox: Sandbox, **options: Any
) -> AsyncIterator[tuple[trio.Process, RpcChannel]]:
    """Start a worker process and a channel on its pipes; stop it by PID however this ends."""
    process = await trio.lowlevel.open_process(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=str(sandbox.work),
        env=sandbox.env(),
    )
    assert process.stdin is not None
    assert process.stdout is not None
    try:
        async with open_rpc_channel(
            process.stdin, process.stdout, stderr=process.stderr, **options
        ) as channel:
            yield process, channel
        with trio.fail_after(10):  # stdin closed when idle: an orderly exit
            await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True), trio.fail_after(10):
                await process.wait()


KINDS: Final = ("fake", "pi")
BASH_THEN_ANSWER: Final[list[Step]] = [
    ToolCalls(calls=[Call(name="bash", arguments={"command": "echo hi"})]),
    Text(text="done"),
]


@pytest.mark.parametrize("kind", KINDS)
async def test_real_r7_prompt_with_a_tool_round_to_settled(kind: str, tmp_path: Path) -> None:
    with trio.fail_after(PROCESS_LIMIT):
        async with real_model(BASH_THEN_ANSWER) as (model, server):
            sandbox = Sandbox.create(tmp_path, server)
            async with launch(sandbox.argv(kind), sandbox) as (process, channel):
                prompted = await channel.prompt("say hi")
                assert prompted.disposition == "started"
                settled = await channel.wait_settled(prompted.settled_before)
                assert settled.record["aborted"] is False
                events = await _until(channel, "agent_settled")
                kinds = [e.type for e in events]
                assert kinds[0] == "agent_start"
                assert kinds.index("tool_execution_start") < kinds.index("tool_execution_end")
                end = next(e for e in events if e.type == "tool_execution_end")
                assert end.record["isError"] is False
                state = await channel.request({"type": "get_state"})
                assert state.data["isStreaming"] is False
                assert state.data["model"]["id"] == "fake-model"
            assert process.returncode == 0
            assert len(model.requests) == 2


@pytest.mark.parametrize("kind", KINDS)
async def test_real_r7_abort_during_a_tool(kind: str, tmp_path: Path) -> None:
    sleep = [ToolCalls(calls=[Call(name="bash", arguments={"command": "sleep 30"})])]
    with trio.fail_after(PROCESS_LIMIT):
        async with real_model(sleep) as (_, server):
            sandbox = Sandbox.create(tmp_path, server)
            async with launch(sandbox.argv(kind), sandbox) as (_, channel):
                prompted = await channel.prompt("sleep a while")
                await _until(channel, "tool_execution_start")
                await channel.abort()
                assert channel.statistics().settled == 1  # read before the abort response
                assert not channel.statistics().running
                settled = await channel.wait_settled(prompted.settled_before)
                assert settled.record["aborted"] is True
                end = (await _until(channel, "tool_execution_end"))[-1]
                assert end.record["isError"] is True


@pytest.mark.parametrize("kind", KINDS)
async def test_real_r5_error_responses(kind: str, tmp_path: Path) -> None:
    with trio.fail_after(PROCESS_LIMIT):
        async with real_model([]) as (_, server):
            sandbox = Sandbox.create(tmp_path, server)
            async with launch(sandbox.argv(kind), sandbox) as (_, channel):
                with pytest.raises(RpcCommandError) as caught:
                    await channel.request({"type": "no_such_command"})
                assert caught.value.pi_error == "Unknown command: no_such_command"
                with pytest.raises(RpcCommandError) as missing:
                    await channel.request({"type": "get_entries", "since": "nope"})
                assert missing.value.pi_error == "Entry not found: nope"
                assert (await channel.request({"type": "get_state"})).success


@pytest.mark.parametrize("kind", KINDS)
async def test_real_r9_slash_text_reaches_the_model_as_text(kind: str, tmp_path: Path) -> None:
    with trio.fail_after(PROCESS_LIMIT):
        async with real_model([Text(text="ok")]) as (model, server):
            sandbox = Sandbox.create(tmp_path, server)
            extension = _hello_extension(tmp_path)  # Fake-Pi ignores -e
            async with launch(sandbox.argv(kind, "-e", str(extension)), sandbox) as (_, channel):
                prompted = await channel.prompt("/hello there\u2028friend")
                assert prompted.disposition == "started"
                await channel.wait_settled(prompted.settled_before)
                events = await _until(channel, "agent_settled")
                assert not [e for e in events if e.type == "extension_ui_request"]
    assert _user_texts(model.requests[0].body) == [" /hello there\u2028friend"]


@pytest.mark.parametrize("kind", KINDS)
async def test_real_r2_megabyte_lines(kind: str, tmp_path: Path) -> None:
    big = "two megabytes\u2028of chat\u2029" * (2 * 1024 * 1024 // 24)
    with trio.fail_after(PROCESS_LIMIT):
        async with real_model([Text(text="ok")]) as (model, server):
            sandbox = Sandbox.create(tmp_path, server)
            async with launch(sandbox.argv(kind), sandbox) as (_, channel):
                prompted = await channel.prompt(big)
                await channel.wait_settled(prompted.settled_before)
                entries = (await channel.request({"type": "get_entries"})).data["entries"]
                users = [e for e in entries if e.get("message", {}).get("role") == "user"]
                assert users[0]["message"]["content"][0]["text"] == big
                assert channel.statistics().longest_line > 2 * 1024 * 1024
    assert _user_texts(model.requests[0].body) == [big]


@pytest.mark.parametrize("kind", KINDS)
async def test_real_r5_worker_killed_mid_request(kind: str, tmp_path: Path) -> None:
    with trio.fail_after(PROCESS_LIMIT):
        async with real_model([]) as (_, server):
            sandbox = Sandbox.create(tmp_path, server)
            async with launch(sandbox.argv(kind), sandbox) as (process, channel):
                await channel.request({"type": "get_state"})  # up and answering
                os.kill(process.pid, signal.SIGSTOP)  # it cannot answer what comes next
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_kill_when_pending, channel, process)
                    with pytest.raises(WorkerExitedError) as caught:
                        await channel.request({"type": "get_state"})
                assert channel.idle
                assert caught.value.code == ReasonCode.WORKER_EXITED
                assert process.returncode == -signal.SIGKILL


async def _kill_when_pending(channel: RpcChannel, process: trio.Process) -> None:
    await trio.testing.wait_all_tasks_blocked()  # the request is written and waiting
    assert channel.statistics().pending_requests == 1
    process.kill()
    await process.wait()


async def test_real_r6_a_worker_that_exits_at_launch(tmp_path: Path) -> None:
    script = (
        "import sys; sys.stderr.write('Error: Failed to load extension \"gate.ts\": boom\\n');"
        " sys.exit(1)"
    )
    sandbox = Sandbox(tmp_path)
    sandbox.work.mkdir()
    with trio.fail_after(PROCESS_LIMIT):
        async with launch([sys.executable, "-c", script], sandbox) as (process, channel):
            with pytest.raises(WorkerLaunchError) as caught:
                await channel.request({"type": "get_state"})
            assert await process.wait() == 1
    assert caught.value.code == ReasonCode.WORKER_LAUNCH_FAILED
    assert 'Error: Failed to load extension "gate.ts": boom' in str(caught.value)


async def test_real_r6_pi_with_a_broken_extension(tmp_path: Path) -> None:
    with trio.fail_after(PROCESS_LIMIT):
        async with real_model([]) as (_, server):
            sandbox = Sandbox.create(tmp_path, server)
            argv = sandbox.argv("pi", "-e", str(tmp_path / "missing.ts"))
            async with launch(argv, sandbox) as (process, channel):
                with pytest.raises(WorkerLaunchError) as caught:
                    await channel.request({"type": "get_state"})
                assert await process.wait() == 1
    assert "Failed to load extension" in str(caught.value)


def _hello_extension(root: Path) -> Path:
    """A Pi extension with a ``/hello`` command that opens two dialogs and reports."""
    path = root / "hello.ts"
    path.write_text(
        """export default function (pi: any) {
  pi.registerCommand("hello", {
    description: "a command that chat text must never run",
    handler: async (args: string, ctx: any) => {
      const c = await ctx.ui.confirm("Run hello?", args);
      const s = await ctx.ui.select("Pick one", ["alpha", "beta"]);
      ctx.ui.notify(`hello ran: ${JSON.stringify({ args, c, s })}`, "info");
    },
  });
}
"""
    )
    return path


async def _hello_notice(channel: RpcChannel, policy_answers: int) -> str:
    """Run ``/hello`` raw (as a command, on purpose) and return what the handler reported."""
    response = await channel.request({"type": "prompt", "message": "/hello there"})
    assert response.data == {"disposition": "handled"}  # no run: the command ran instead
    events = await _until(channel, "extension_ui_request")
    while events[-1].record["method"] != "notify":
        events += await _until(channel, "extension_ui_request")
    assert [e.record["method"] for e in events if e.type == "extension_ui_request"] == [
        "confirm",
        "select",
        "notify",
    ]
    assert channel.statistics().ui_answered == policy_answers
    message: str = events[-1].record["message"]
    return message


async def test_real_r8_pi_dialogs_are_cancelled_by_default(tmp_path: Path) -> None:
    with trio.fail_after(PROCESS_LIMIT):
        async with real_model([]) as (model, server):
            sandbox = Sandbox.create(tmp_path, server)
            argv = sandbox.argv("pi", "-e", str(_hello_extension(tmp_path)))
            async with launch(argv, sandbox) as (_, channel):
                notice = await _hello_notice(channel, 2)
    assert notice == 'hello ran: {"args":"there","c":false}'
    assert model.requests == []


async def test_real_r8_pi_dialogs_answered_by_a_policy(tmp_path: Path) -> None:
    async def policy(request: UiRequest) -> UiReply:
        if request.method == "confirm":
            return UiConfirm(confirmed=True)
        return UiValue(value=request.record["options"][-1])

    with trio.fail_after(PROCESS_LIMIT):
        async with real_model([]) as (_, server):
            sandbox = Sandbox.create(tmp_path, server)
            argv = sandbox.argv("pi", "-e", str(_hello_extension(tmp_path)))
            async with launch(argv, sandbox, ui_policy=policy) as (_, channel):
                notice = await _hello_notice(channel, 2)
    assert notice == 'hello ran: {"args":"there","c":true,"s":"beta"}'
