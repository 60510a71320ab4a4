"""An adversarial review of ``pi-runtime serve``'s wire protocol and admission
(docs/design/serve.md S1-S4, docs/design/protocol.md P3-P16): each test tries to break one
rule — bad input gets a clear error with a stable code and nothing admitted is lost, a fault
stays where it happened, the token reaches no log or error, every admitted delivery is
answered — against a real server on 127.0.0.1, real websocket clients (some speaking the
websocket framing by hand, to do what no library client does) and a real Fake-Pi worker."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import pytest
import trio
import trio.testing
from trio_websocket import ConnectionClosed

from runtime._errors import ReasonCode
from runtime._server._serve import _Connection
from runtime._wire import Accepted

from .._wire import Client, Frame, message
from .test_serve import LIMIT, error, rig, still_usable
from .test_serve_faults import UPGRADE

BOUND: Final = 8 * 1024
"""A small frame bound the configuration allows (as test_serve_bounds.py's)."""
SMALL: Final[dict[str, Any]] = {
    "server": {"max_frame_bytes": BOUND},
    "attachments": {"max_per_reply": 1},
}


# -- a websocket client by hand ----------------------------------------------------------


def masked(payload: bytes, opcode: int = 0x1) -> bytes:
    """One client websocket frame (FIN set, masked as a client's must be)."""
    head = bytes([0x80 | opcode])
    size = len(payload)
    if size < 126:
        head += bytes([0x80 | size])
    elif size < 2**16:
        head += bytes([0x80 | 126]) + struct.pack("!H", size)
    else:
        head += bytes([0x80 | 127]) + struct.pack("!Q", size)
    key = os.urandom(4)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


class RawClient:
    """A websocket client that does only what a test tells it: it answers no close, reads
    only when asked."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    @classmethod
    @contextlib.asynccontextmanager
    async def upgraded(cls, port: int) -> AsyncIterator[RawClient]:
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            client = cls(stream)
            await stream.send_all(UPGRADE % b"")
            while b"\r\n\r\n" not in client.buffer:
                client.buffer += await stream.receive_some()
            head, client.buffer = client.buffer.split(b"\r\n\r\n", 1)
            assert head.startswith(b"HTTP/1.1 101"), head
            yield client

    async def send(self, payload: bytes, opcode: int = 0x1) -> None:
        await self.stream.send_all(masked(payload, opcode))

    async def frames_until_eof(self) -> list[tuple[int, bytes]]:
        """Every frame the server sends until it closes the TCP connection."""
        while data := await self.stream.receive_some():
            self.buffer += data
        frames = []
        data = self.buffer
        while data:
            opcode, size, at = data[0] & 0x0F, data[1] & 0x7F, 2
            if size == 126:
                (size,), at = struct.unpack("!H", data[2:4]), 4
            elif size == 127:
                (size,), at = struct.unpack("!Q", data[2:10]), 10
            frames.append((opcode, data[at : at + size]))
            data = data[at + size :]
        return frames


# -- S1: a connection refused is let go in time ------------------------------------------


async def test_s1_a_silent_client_that_never_answers_the_close_is_let_go_in_time(
    tmp_path: Path,
) -> None:
    """S1: a client that upgrades, says nothing and answers nothing — not the server's close
    frame either — is sent ``hello_timeout`` and its TCP connection is closed soon after
    ``hello_seconds``. Before, the server sent the close frame and waited for the client's
    answer without end, and the connection, no longer counted among those that have not
    said hello, was held for ever: any number of such clients kept a file descriptor each,
    past ``max_unauthenticated``."""
    settings = {"server": {"hello_seconds": 0.5, "max_unauthenticated": 1}}
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, settings) as r, RawClient.upgraded(r.server.port) as silent:
            with trio.move_on_after(10) as waited:  # the fix lets it go after ~2 x 0.5 s
                frames = await silent.frames_until_eof()
            async with r.connect() as later:
                await still_usable(later)
    assert not waited.cancelled_caught, "the server still holds the silent connection"
    text = [json.loads(payload) for opcode, payload in frames if opcode == 0x1]
    assert [(f["code"], f["ref"]) for f in text] == [(ReasonCode.HELLO_TIMEOUT, "hello")]
    closes = [payload for opcode, payload in frames if opcode == 0x8]
    assert [struct.unpack("!H", payload[:2])[0] for payload in closes] == [1008]


async def test_s1_a_silent_client_counts_until_its_connection_is_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S1: a connection refused for no hello in time counts among those that have not said
    hello until the server has let it go — not from the moment its hello time ran out: the
    refusal is a send and a close, which a client can make last. Held there (the close's
    send waits here), one more handshake is refused ``too_many_connections``. Before, the
    count dropped as the refusal began, so a client could keep any number of them."""
    reached, release = trio.Event(), trio.Event()
    send = _Connection.send

    async def held(self: _Connection, frame: Any) -> None:
        if getattr(frame, "code", None) == ReasonCode.HELLO_TIMEOUT:
            reached.set()
            await release.wait()
        await send(self, frame)

    monkeypatch.setattr(_Connection, "send", held)
    settings = {"server": {"hello_seconds": 0.5, "max_unauthenticated": 1}}
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, settings) as r, r.connect(hello=False) as silent:
            await reached.wait()
            counted = r.server.unauthenticated
            release.set()
            assert error(await silent.receive()) == (ReasonCode.HELLO_TIMEOUT, "hello")
    assert counted == 1


# -- P4, P16: what a bad frame is answered ------------------------------------------------


async def test_p4_an_integer_longer_than_python_reads_is_wrong_type_not_not_json(
    tmp_path: Path,
) -> None:
    """P4: an integer of more digits than Python converts (4,300) is valid JSON, as 1e400
    is: ``wrong_type`` with the frame's ``ref``, not ``not_json``. Before, msgspec's
    "Integer value out of range" was not recognised and the frame was said not to be JSON."""
    huge = "1" + "0" * 5000
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r, r.connect() as client:
            await client.send('{"type": "ack", "seq": ' + huge + "}")
            ack = error(await client.receive())
            await client.send('{"type": "deliver", "delivery_id": "d9", "room": ' + huge + "}")
            deliver = error(await client.receive())
            await still_usable(client)
    assert ack == (ReasonCode.WRONG_TYPE, "ack")
    assert deliver == (ReasonCode.WRONG_TYPE, "d9")


async def test_p16_an_unsupported_protocol_answer_fits_the_frame_bound(tmp_path: Path) -> None:
    """P16: the ``unsupported_protocol`` answer to a hello that offers numbers as long as the
    frame bound lets it send fits the bound. Before, the message carried every offered
    number whole and came out larger than the hello: a client built to the bound lost its
    connection (1009) instead of reading why."""
    shape = '{"type":"hello","protocol":[%s,%s],"token":"","client":""}'
    digits = BOUND - len(shape % ("", ""))  # the hello exactly at the bound
    hello = shape % ("9" * (digits // 2), "8" * (digits - digits // 2))
    assert len(hello) == BOUND
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, SMALL) as r, r.connect(hello=False) as client:
            await client.send(hello)
            text = await client.ws.get_message()
            with pytest.raises(ConnectionClosed):
                await client.receive()
    assert isinstance(text, str)
    assert len(text.encode()) <= BOUND, len(text.encode())
    assert error(json.loads(text)) == (ReasonCode.UNSUPPORTED_PROTOCOL, "hello")


# -- P5: at the bound and one byte over it --------------------------------------------------


@pytest.mark.parametrize("unit", ["x", "é", "\U0001f600"], ids=["ascii", "2-byte", "4-byte"])
async def test_p5_a_frame_at_the_bound_is_read_and_one_byte_over_refused(
    tmp_path: Path, unit: str
) -> None:
    """P5, S2: a frame of exactly ``max_frame_bytes`` UTF-8 bytes is read (a ``status`` of
    a room no one has is answered); one byte more is ``frame_too_large``, and the
    connection stays usable — in characters of one, two and four bytes (the bound counts
    bytes, not characters)."""
    shape = '{"type":"status","room":"room:%s"}'
    room = BOUND - len(shape % "")
    at = shape % (unit * (room // len(unit.encode())) + "x" * (room % len(unit.encode())))
    over = at[:-2] + 'x"}'
    assert len(at.encode()) == BOUND
    assert len(over.encode()) == BOUND + 1
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, SMALL) as r, r.connect() as client:
            await client.send(at)
            answered = await client.receive()
            await client.send(over)
            refused = error(await client.receive())
            await still_usable(client)
    assert (answered["type"], answered["rooms"]) == ("status", [])
    assert refused == (ReasonCode.FRAME_TOO_LARGE, None)


async def test_s2_a_frame_over_four_times_the_bound_closes_only_its_connection(
    tmp_path: Path,
) -> None:
    """S2: four times the bound in characters is read and refused ``frame_too_large``; one
    character more is beyond what the server reads at all: that connection is closed (1009),
    and a connection beside it is served on."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, SMALL) as r, r.connect() as other:
            async with r.connect() as client:
                at = '{"type":"status","room":"%s"}'
                at = at % ("x" * (4 * BOUND - len(at % "")))
                await client.send(at)
                refused = error(await client.receive())
                await client.send(at + " ")
                with pytest.raises(ConnectionClosed) as closed:
                    await client.receive()
            await still_usable(other)
    assert refused == (ReasonCode.FRAME_TOO_LARGE, None)
    assert closed.value.reason is not None
    assert closed.value.reason.code == 1009


# -- S3, L2: one delivery id, two connections at once ----------------------------------------


async def test_s3_the_same_delivery_on_two_connections_at_once_is_admitted_once(
    tmp_path: Path,
) -> None:
    """S3, L2: two connections send the same ``deliver`` at the same moment: one admission
    (one ``started``, one ``duplicate``), one result published, and each connection is sent
    that result once, with the same seq."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r, r.connect() as first, r.connect() as second:
            answers: dict[str, Frame] = {}
            results: dict[str, list[Frame]] = {"first": [], "second": []}

            async def deliver(name: str, client: Client) -> None:
                await client.send(message("d1"))
                answers[name] = await client.until(lambda f: f["type"] in ("accepted", "error"))
                results[name].append(await client.result("d1"))
                await client.send({"type": "status"})  # answered after any second result
                while (frame := await client.receive())["type"] != "status":
                    if frame["type"] == "result":
                        results[name].append(frame)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(deliver, "first", first)
                nursery.start_soon(deliver, "second", second)
            published = r.server.worker.last_seq
    assert sorted(a["disposition"] for a in answers.values()) == ["duplicate", "started"]
    assert published == 1
    assert [[f["seq"] for f in got] for got in results.values()] == [[1], [1]]


async def test_s3_two_requests_under_one_id_at_once_admit_one_and_refuse_the_other(
    tmp_path: Path,
) -> None:
    """L2, S2: the same ``delivery_id`` with two different texts at once, on two
    connections: one is admitted, the other refused ``delivery_conflict`` (``ref`` the
    id) — never both admitted, never both refused."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r, r.connect() as first, r.connect() as second:
            answers: list[Frame] = []

            async def deliver(client: Client, text: str) -> None:
                await client.send(message("d1", text=text))
                answers.append(await client.until(lambda f: f["type"] in ("accepted", "error")))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(deliver, first, "one")
                nursery.start_soon(deliver, second, "two")
            await first.result("d1")
    kinds = sorted((a["type"], a.get("disposition") or a.get("code")) for a in answers)
    assert kinds == [("accepted", "started"), ("error", ReasonCode.DELIVERY_CONFLICT)]


# -- S3: a client gone between admission and answer ----------------------------------------


async def test_s3_a_client_gone_before_its_accepted_gets_the_result_once_it_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3: the client closes after its delivery was admitted (durable) and before its
    ``accepted`` was sent. The admission stands; the turn runs; at its next connection the
    result comes, and the retry of the same ``deliver`` is ``duplicate`` with that result —
    one admission, one result, one seq."""
    admitted, release = trio.Event(), trio.Event()
    send = _Connection.send

    async def held(self: _Connection, frame: Any) -> None:
        if isinstance(frame, Accepted) and not release.is_set():
            admitted.set()
            await release.wait()
        await send(self, frame)

    monkeypatch.setattr(_Connection, "send", held)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r:
            async with r.connect() as client:
                await client.send(message("d1"))
                await admitted.wait()
            release.set()
            async with r.connect() as again:
                result = await again.result("d1")
                await again.send(message("d1"))
                retry = await again.until(lambda f: f["type"] == "accepted")
                resent = await again.result("d1")
                in_flight = [c.in_flight for c in r.server.connections]
            published = r.server.worker.last_seq
    assert (result["outcome"], result["seq"]) == ("reply", 1)
    assert retry["disposition"] == "duplicate"
    assert resent == result
    assert published == 1
    assert in_flight == [set()]  # the retry of a finished delivery holds no place (S4)


# -- S4: a client that never reads ------------------------------------------------------------


async def test_s4_a_client_that_never_reads_holds_up_no_other_room(tmp_path: Path) -> None:
    """S4: a client that sends and never reads — its socket buffers full of status answers
    the server cannot write — holds up only itself: a second client's deliveries, in
    another room and in the slow client's room, are admitted and answered."""
    settings = {"server": {"max_frame_bytes": BOUND}, "attachments": {"max_per_reply": 1}}
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, settings) as r:
            stuck = await trio.open_tcp_stream("127.0.0.1", r.server.port)
            stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await stuck.send_all(UPGRADE % b"")
            head = b""
            while b"\r\n\r\n" not in head:
                head += await stuck.receive_some()
            hello = {"type": "hello", "protocol": 1, "token": r.token, "client": "slow"}
            await stuck.send_all(masked(json.dumps(hello).encode()))
            await stuck.send_all(masked(json.dumps(message("s1", room="dm:slow")).encode()))
            status = masked(json.dumps({"type": "status", "room": "room:" + "x" * 200}).encode())
            flood = socket.socket(fileno=os.dup(stuck.socket.fileno()))
            flood.setblocking(False)
            unsent = status  # what is left of the frame being sent: never a byte skipped
            with flood:
                while True:  # until the server no longer reads it: it cannot send its answers
                    await trio.testing.wait_all_tasks_blocked()
                    with contextlib.suppress(BlockingIOError):
                        while True:
                            unsent = unsent[flood.send(unsent) :] or status
                    await trio.testing.wait_all_tasks_blocked()
                    try:
                        unsent = unsent[flood.send(unsent) :] or status
                    except BlockingIOError:
                        break
            async with r.connect() as other:
                for delivery, room in (("o1", "dm:other"), ("o2", "dm:slow")):
                    await other.send(message(delivery, room=room))
                    assert (await other.result(delivery))["outcome"] == "reply"
                await still_usable(other)
            await stuck.aclose()


# -- S2, P3: unicode at the edges ---------------------------------------------------------


async def test_s2_lone_surrogates_nul_and_wide_characters_get_their_codes(tmp_path: Path) -> None:
    """S2, P3, P4: a lone surrogate escaped in a room id or a text is ``not_json`` (no
    string holds it); a NUL in a room id is ``room_invalid``, in a delivery id
    ``delivery_invalid`` said by the frame type (the id is not printable); a NUL in a text is
    a text like another: admitted and answered. A delivery id of 200 four-byte characters is
    admitted; one more character is refused. Nothing refused was admitted, and the
    connection stays usable throughout."""
    wide = "\U0001f600" * 200
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r, r.connect() as client:
            codes = []
            for raw in (
                json.dumps(message("s1"))[:-1] + ', "history": [{"author": {"id": "u"}, '
                '"text": "\\ud800"}]}',
                json.dumps(message("s2")).replace('"dm:1"', '"room:\\udfff"'),
            ):
                await client.send(raw)
                codes.append(error(await client.receive()))
            for frame in (
                message("n1", room="room:a\x00b"),
                message("n2\x00"),
                {**message(wide + "x"), "message_id": "m"},
            ):
                await client.send(frame)
                codes.append(error(await client.receive()))
            await client.send(message("n3", text="before\x00after"))
            nul = await client.result("n3")
            await client.send({**message(wide), "message_id": "m"})
            wide_result = await client.result(wide)
            refused = ("s1", "s2", "n1", "n2\x00")
            pending_refused = [d for d in refused if r.server.worker.result_of(d)]
            await still_usable(client)
    assert codes == [
        (ReasonCode.NOT_JSON, None),
        (ReasonCode.NOT_JSON, None),
        (ReasonCode.ROOM_INVALID, "n1"),
        (ReasonCode.DELIVERY_INVALID, "deliver"),
        (ReasonCode.DELIVERY_INVALID, "deliver"),
    ]
    assert nul["outcome"] == "reply"
    assert wide_result["outcome"] == "reply"
    assert pending_refused == []


async def test_s2_a_text_frame_that_is_not_utf8_ends_only_its_connection(tmp_path: Path) -> None:
    """S2, protocol.md "Errors": a text frame whose bytes are not UTF-8 fails the websocket
    (RFC 6455 8.1; trio-websocket/wsproto end it before the server sees a message): that
    connection is closed, no frame of it is acted on, and the connection beside it is
    served on. (``not_json`` for bytes that are not UTF-8 is ``decode_client_frame``'s answer
    to bytes handed to it; over a websocket, such a frame never reaches it.)"""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r, r.connect() as other:
            async with RawClient.upgraded(r.server.port) as raw:
                hello = {"type": "hello", "protocol": 1, "token": r.token, "client": "raw"}
                await raw.send(json.dumps(hello).encode())
                await raw.send(json.dumps(message("u1"))[:-1].encode() + b', "x": "\xff"}')
                frames = await raw.frames_until_eof()
            await still_usable(other)
            admitted = r.server.worker.pending(), r.server.worker.result_of("u1")
    assert [json.loads(p)["type"] for opcode, p in frames if opcode == 0x1] in ([], ["welcome"])
    assert admitted == ([], None)


# -- S1: the token in malformed frames -----------------------------------------------------


async def test_s1_the_token_in_malformed_frames_reaches_no_log_and_no_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """S1: the token, in hellos and frames malformed every way that keeps it in the frame
    — cut short, with a field of the wrong type, an unsupported protocol, a NUL, a lone
    surrogate, twice, over the bound, as binary — is in no log record at any level and in
    no answer's text; only the errors' codes come back. (A client that puts the token
    where a value is shown — a ``type`` or a task action, cut at 80 characters — is told
    its own value back, on its own connection: not covered here.)"""
    caplog.set_level(logging.DEBUG)
    answers: list[str | bytes] = []
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, SMALL) as r:
            token = r.token
            hello = json.dumps({"type": "hello", "protocol": 1, "token": token, "client": "t"})
            for frame in (
                hello[: len(hello) // 2],
                hello[:-1] + f', "ack_seq": "{token}"}}',
                hello.replace('"protocol": 1', '"protocol": [7]'),
                hello.replace(token, token + "\\u0000"),
                hello.replace(token, token + "\\ud800"),
                hello[:-1] + f', "token": "{token[::-1]}"}}',  # the last one counts
                hello[:-1] + f', "client": "{"x" * BOUND}"}}',
                hello.encode(),
                hello.replace(token, token[:-1]),
            ):
                async with r.connect(hello=False) as client:
                    await client.send(frame)
                    with contextlib.suppress(ConnectionClosed):
                        while True:
                            answers.append(await client.ws.get_message())
                            if json.loads(answers[-1])["type"] == "error":
                                break
    codes = [json.loads(answer)["code"] for answer in answers]
    logged = "\n".join(f"{record.getMessage()} {record.__dict__}" for record in caplog.records)
    assert token not in logged
    assert token not in caplog.text
    assert not [answer for answer in answers if token in str(answer)]
    assert codes == [
        ReasonCode.NOT_JSON,
        ReasonCode.WRONG_TYPE,
        ReasonCode.UNSUPPORTED_PROTOCOL,
        ReasonCode.TOKEN_INVALID,
        ReasonCode.NOT_JSON,
        ReasonCode.TOKEN_INVALID,
        ReasonCode.FRAME_TOO_LARGE,
        ReasonCode.BINARY_FRAME,
        ReasonCode.TOKEN_INVALID,
    ]
