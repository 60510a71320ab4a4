"""An adversary's tests of the RPC channel (``runtime/_pi/_rpc.py``, docs/design/rpc.md R1…).

Each test tries to break one rule with input a worker could really write: a late answer to
an abandoned request, a response twice, a line past the limit in one chunk, JSON that is no
object, a dialog open when the channel closes, a stdout that ends while stderr runs on. The
scripted wire of ``test_rpc.py`` plays the worker, under ``autojump_clock``.
"""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing

from runtime import ReasonCode
from runtime._errors import RpcLineTooLongError, WorkerExitedError
from runtime._pi._rpc import open_rpc_channel
from runtime._pi._rpc_protocol import (
    MALFORMED_LINE,
    LineSplitter,
    ProtocolState,
    UiConfirm,
    UiReply,
    UiRequest,
)

from .test_rpc import _line, wire_pair

# ------------------------------------------------------------------------------ pure core


def test_r2_a_whole_line_past_the_limit_in_one_chunk_is_refused() -> None:
    """R2: the limit holds for a line that arrives whole in one read, not only for the
    unfinished rest of one (a reader's chunk is 64 KiB: any limit below that was a limit on
    nothing)."""
    splitter = LineSplitter(max_line=10)
    assert splitter.feed(b"0123456789\n") == [b"0123456789"]
    with pytest.raises(RpcLineTooLongError) as caught:
        splitter.feed(b"0123456789A\n")
    assert caught.value.code == ReasonCode.RPC_LINE_TOO_LONG
    splitter = LineSplitter(max_line=10)  # the lines before the long one are not lost
    assert splitter.feed(b"ok\n" + b"x" * 20 + b"\nrest\n") == [b"ok"]
    assert splitter.overflowed
    with pytest.raises(RpcLineTooLongError):
        splitter.feed(b"more\n")
    with pytest.raises(RpcLineTooLongError):
        splitter.finish()


def test_r10_json_that_is_no_object_with_a_string_type_is_a_malformed_line() -> None:
    """R10: valid JSON that is not an object with a string ``type`` is a malformed line,
    counted; never an exception, never a record of another kind."""
    state = ProtocolState()
    hostile = [b"null", b"5", b'"response"', b"true", b'{"type":5}', b'{"type":null}', b"[]"]
    for raw in hostile:
        received = state.receive(raw)
        assert received.response is None
        assert received.ui is None
        assert received.event is not None
        assert received.event.type == MALFORMED_LINE
    assert state.malformed == len(hostile)


def test_r3_a_response_twice_is_the_callers_once_then_an_event() -> None:
    """R3: the second copy of a response, and one with an id no request has (a number, an
    id the channel never gave), are events of type ``response``, never a match."""
    state = ProtocolState()
    rid = state.command({"type": "get_state"})["id"]
    answer = {"id": rid, "type": "response", "command": "get_state", "success": True}
    first = state.receive(_line(answer))
    assert first.response is not None
    assert first.event is None
    for record in (answer, {**answer, "id": 1}, {**answer, "id": "rpc-7"}):
        again = state.receive(_line(record))
        assert again.response is None
        assert again.event is not None
        assert again.event.type == "response"


# -------------------------------------------------------------- shell, on a scripted wire


async def test_r2_the_records_before_a_line_past_the_limit_are_read_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R2, R10: a record and a too-long line in one write: the record is an event, then the
    pending request fails with ``rpc_line_too_long``, and so does the next read."""
    stdin, stdout, wire = wire_pair()
    async with open_rpc_channel(stdin, stdout, max_line=100) as channel:
        async with trio.open_nursery() as nursery:
            data = _line({"type": "agent_start"}) + b"\n" + b"x" * 200 + b"\n"
            nursery.start_soon(wire.stdout.send_all, data)
            with pytest.raises(RpcLineTooLongError), trio.fail_after(10):
                await channel.request({"type": "get_state"})
        assert (await channel.next_event()).type == "agent_start"
        with pytest.raises(RpcLineTooLongError):
            await channel.next_event()


async def test_r3_a_late_answer_to_an_abandoned_request_is_never_the_next_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R3: a request given up on (its caller timed out) and then the next request: the late
    answer to the first, arriving first, is dropped; the second gets its own answer only,
    and a copy of that answer is an event."""
    stdin, stdout, wire = wire_pair()
    async with open_rpc_channel(stdin, stdout) as channel, trio.open_nursery() as nursery:
        with trio.move_on_after(1):
            await channel.request({"type": "get_state"})
        abandoned = await wire.read()

        async def worker() -> None:
            second = await wire.read()
            assert second["id"] != abandoned["id"]
            await wire.respond(abandoned, {"who": "first"})
            await wire.respond(second, {"who": "second"})
            await wire.respond(second, {"who": "second, again"})

        nursery.start_soon(worker)
        response = await channel.request({"type": "get_state"})
        assert response.data == {"who": "second"}
        copy = await channel.next_event()
        assert (copy.type, copy.record["data"]) == ("response", {"who": "second, again"})
        assert channel.idle


async def test_r8_r11_the_channel_closes_stdin_only_after_an_open_dialog_is_answered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R8, R11: a dialog open while no run is in flight and no request pending (an
    extension asks at session start; the policy asks someone) is still answered when the
    block ends: the channel waits for the answer, then closes stdin. Before, ``aclose()``
    closed stdin at once and the answer was never written."""
    stdin, stdout, wire = wire_pair()
    asked = trio.Event()
    decided = trio.Event()

    async def policy(request: UiRequest) -> UiReply:
        asked.set()
        await decided.wait()
        return UiConfirm(confirmed=True)

    async with trio.open_nursery() as nursery:

        async def decide_later() -> None:
            await asked.wait()
            await trio.sleep(5)
            decided.set()

        nursery.start_soon(decide_later)
        async with open_rpc_channel(stdin, stdout, ui_policy=policy) as channel:
            await wire.write(
                {"type": "extension_ui_request", "id": "u1", "method": "confirm", "title": "?"}
            )
            await asked.wait()
        answer = await wire.read()
        assert answer == {"type": "extension_ui_response", "id": "u1", "confirmed": True}
        assert await wire.stdin.receive_some() == b""  # then stdin was closed
        assert channel.statistics().ui_answered == 1


async def test_r8_a_dialog_that_comes_after_stdin_closed_is_not_counted_answered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R8: a dialog request read after the channel closed stdin cannot be answered; the
    statistics do not say it was."""
    stdin, stdout, wire = wire_pair()
    async with open_rpc_channel(stdin, stdout) as channel:
        await channel.aclose()  # stdin closed; stdout still open (the worker has not exited)
        await wire.write(
            {"type": "extension_ui_request", "id": "u1", "method": "confirm", "title": "?"}
        )
        event = await channel.next_event()
        assert event.type == "extension_ui_request"
        await trio.sleep(1)
        assert channel.statistics().ui_answered == 0
        await wire.stdout.aclose()


async def test_r5_stdout_ends_while_stderr_runs_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R5: the worker closes stdout but goes on writing stderr and never closes it: a
    pending request still fails within ``exit_grace``, quoting what stderr said so far."""
    stdin, stdout, wire = wire_pair()
    err_send, err_receive = trio.testing.memory_stream_one_way_pair()
    async with trio.open_nursery() as nursery:

        async def chatter() -> None:
            while True:
                await err_send.send_all(b"still here\n")
                await trio.sleep(0.5)

        nursery.start_soon(chatter)
        async with open_rpc_channel(stdin, stdout, stderr=err_receive, exit_grace=3) as channel:
            await wire.write({"type": "agent_start"})
            await wire.stdout.aclose()
            start = trio.current_time()
            with pytest.raises(WorkerExitedError) as caught:
                await channel.request({"type": "get_state"})
            assert trio.current_time() - start <= 3.5
            assert "still here" in str(caught.value)
        nursery.cancel_scope.cancel()


async def test_r3_text_with_a_lone_surrogate_is_sent_as_javascript_writes_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R3: chat text holding a lone surrogate (a model's or a session's text, read through
    ``_pijson.loads``, can) is sent as ``JSON.stringify`` writes it, a ``\\udxxx`` escape
    that Pi's ``JSON.parse`` reads back; never a raw ``UnicodeEncodeError`` out of
    ``prompt``."""
    stdin, stdout, wire = wire_pair()
    async with open_rpc_channel(stdin, stdout) as channel, trio.open_nursery() as nursery:

        async def worker() -> None:
            raw = await wire.read_raw()
            assert raw == b'{"id":"rpc-1","type":"prompt","message":"half \\ud83d of it"}'
            command = json.loads(raw)
            assert command["message"] == "half \ud83d of it"
            await wire.respond(command, {"disposition": "queued"})

        nursery.start_soon(worker)
        prompted = await channel.prompt("half \ud83d of it")
        assert prompted.disposition == "queued"
