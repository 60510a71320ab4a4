"""A fault stays in its connection (docs/design/serve.md S2, S3, S5; operations.md O2;
protocol.md P3, P4): each test breaks one connection, frame or file the way a client, a
disk or a bug can, and checks that the answer is an ``error`` frame or a closed connection
— and that the server goes on serving everyone else. trio-websocket runs every connection's
handler in the server's own nursery, so an exception let out of one would stop the host: the
rig's ``async with`` would raise it."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
import trio
from trio_websocket import ConnectionClosed, ConnectionRejected

from runtime._config import config_from_dict
from runtime._errors import ConfigError, DiskFailedError, ReasonCode
from runtime._rooms._worker import RoomWorker
from runtime._server._serve import RoomServer, ServeOptions, _Connection, open_server
from runtime._wire import DeliveryResult

from .._wire import Client, message
from .test_serve import LIMIT, error, rig, still_usable

UPGRADE: Final = (
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n%s\r\n"
)


def _reset_in_the_handshake(port: int, headers: bytes) -> None:
    """A client that sends its upgrade request and resets the connection (``SO_LINGER`` 0)
    before the server answers it."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(UPGRADE % headers)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.mark.parametrize("origin", [b"", b"Origin: https://elsewhere.example\r\n"])
async def test_s2_a_client_that_resets_in_the_handshake_stops_no_one(
    tmp_path: Path, origin: bytes
) -> None:
    """S2: clients that reset their connection right after the upgrade request — on the
    accept path, and on the refusal of a foreign ``Origin`` — end only their own
    connection; a client after them is served, and so is one already connected."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r, r.connect() as before:
            for _ in range(5):
                await trio.to_thread.run_sync(_reset_in_the_handshake, r.server.port, origin)
            async with r.connect() as after:
                await still_usable(after)
            await still_usable(before)


async def test_s1_a_client_that_never_says_hello_is_closed_in_time(tmp_path: Path) -> None:
    """S1: a connection that has not said a valid hello within ``[server] hello_seconds``
    gets ``hello_timeout`` and is closed (1008); one that said hello in time is not."""
    settings = {"server": {"hello_seconds": 0.5}}
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, settings) as r, r.connect() as welcomed:
            async with r.connect(hello=False) as silent:
                refused = error(await silent.receive())
                with pytest.raises(ConnectionClosed) as closed:
                    await silent.receive()
            await still_usable(welcomed)
    assert refused == (ReasonCode.HELLO_TIMEOUT, "hello")
    assert closed.value.reason is not None
    assert closed.value.reason.code == 1008


async def test_s1_idle_clients_cannot_crowd_out_the_others(tmp_path: Path) -> None:
    """S1: with ``[server] max_unauthenticated`` connections that have not said hello, one
    more handshake is refused HTTP 503 ``too_many_connections``; once one of them says
    hello, a new client is served again."""
    settings = {"server": {"max_unauthenticated": 2}}
    with trio.fail_after(LIMIT):
        async with (
            rig(tmp_path, settings) as r,
            r.connect(hello=False) as first,
            r.connect(hello=False),
        ):
            with pytest.raises(ConnectionRejected) as rejected:
                async with r.connect(hello=False):
                    pass
            assert (await first.hello(r.token))["type"] == "welcome"
            async with r.connect() as later:
                await still_usable(later)
    assert rejected.value.status_code == 503
    assert json.loads(rejected.value.body or b"{}")["code"] == ReasonCode.TOO_MANY_CONNECTIONS


async def test_s1_raw_connections_that_never_send_an_upgrade_cannot_crowd_out_the_others(
    tmp_path: Path,
) -> None:
    """S1: before its upgrade request a connection is no websocket yet, so the hello count
    cannot see it. With ``[server] max_unauthenticated`` such connections waiting, one more
    is closed at once, nothing read from it; once one of them has had its upgrade answered, a
    new client is served again. Before, every raw connection was kept for ``hello_seconds``
    (here ten minutes), however many came: a client could use up the host's file descriptors,
    and with them every lane's journal and worker, without saying a word."""
    settings = {"server": {"max_unauthenticated": 2, "hello_seconds": 600}}
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, settings) as r:
            first = await trio.open_tcp_stream("127.0.0.1", r.server.port)
            second = await trio.open_tcp_stream("127.0.0.1", r.server.port)
            async with await trio.open_tcp_stream("127.0.0.1", r.server.port) as crowded:
                assert await crowded.receive_some() == b""  # closed at once, unanswered
            await first.send_all(UPGRADE % b"")  # its upgrade answered: no longer waiting
            assert (await first.receive_some()).startswith(b"HTTP/1.1 101")
            async with r.connect() as later:
                await still_usable(later)
            await first.aclose()
            await second.aclose()


async def test_s1_authenticated_connections_are_capped(tmp_path: Path) -> None:
    """S1: with ``[server] max_authenticated`` connections past their hello, one more valid
    hello is answered ``too_many_authenticated`` (ref ``hello``) and its connection closed
    (1013, try again later) — never welcomed, sent no result; a wrong token over the cap is
    still ``token_invalid`` (the token is checked first). Once a welcomed client goes away, a
    new one is welcomed again. Before, any number of clients holding the token (or one client
    in a loop) could each keep a connection — its result stream, its signal queue, a file
    descriptor — without bound. A cap of 0 is refused at start."""
    settings = {"server": {"max_authenticated": 2}}
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, settings) as r, r.connect() as first:
            await first.send(message("d1"))
            await first.result("d1")  # sent: the server holds its connection
            (first_here,) = r.server.connections
            async with r.connect() as second:
                async with r.connect(hello=False) as wrong:
                    assert error(await wrong.hello("x")) == ("token_invalid", "hello")
                async with r.connect(hello=False) as third:
                    refused = error(await third.hello(r.token))
                    with pytest.raises(ConnectionClosed) as closed:
                        await third.receive()  # no welcome, no result: closed
                await first.ws.aclose()
                await first_here.sent_up_to(2**62)  # returns once the server ended it
                async with r.connect() as later:  # welcomed (r.connect asserts it)
                    await later.result("d1")  # unacknowledged: sent again
                await still_usable(second)
    assert refused == (ReasonCode.TOO_MANY_AUTHENTICATED, "hello")
    assert closed.value.reason is not None
    assert closed.value.reason.code == 1013
    with pytest.raises(ConfigError) as invalid:
        config_from_dict({"server": {"max_authenticated": 0}}, base=tmp_path)
    assert invalid.value.setting == "server.max_authenticated"


async def test_s2_a_fault_in_one_frame_is_answered_and_the_connection_stays_usable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S2: an exception that is no refusal of ours (here a bug put into ``cancel``) is
    answered ``server_fault`` with the frame's ``ref``; the connection and the server go on."""

    async def broken(self: RoomWorker, delivery_id: str) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(RoomWorker, "cancel", broken)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r, r.connect() as client:
            await client.send({"type": "cancel", "delivery_id": "d1"})
            answer = error(await client.until(lambda f: f["type"] == "error"))
            await still_usable(client)
    assert answer == (ReasonCode.SERVER_FAULT, "d1")


async def test_s2_p11_a_worktree_no_one_can_look_at_is_refused(tmp_path: Path) -> None:
    """P11: a ``task_submit`` whose worktree path cannot even be looked at (a name too long
    for the file system: ``ENAMETOOLONG``) is refused ``worktree_missing``."""
    submit = {
        "type": "task_submit",
        "task_id": "t1",
        "prompt": "p",
        "worktree": "/tmp/" + "x" * 5000,
    }
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r, r.connect() as client:
            await client.send(submit)
            answer = error(await client.until(lambda f: f["type"] == "error"))
            await still_usable(client)
    assert answer == (ReasonCode.WORKTREE_MISSING, "t1")


async def test_s3_l17_a_hello_whose_ack_cannot_be_written_is_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3, L17: with the result log failing, a ``hello`` carrying ``ack_seq`` is welcomed and
    its acknowledgement refused with the failure's code (``ref`` ``hello``), as an ``ack``
    frame's is; the connection is usable and the host goes on."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r:
            async with r.connect() as first:
                await first.send(message("d1"))
                seq = (await first.result("d1"))["seq"]
            log = r.server.worker._host.outbox._log

            async def failing(*args: object, **kwargs: object) -> int:
                raise DiskFailedError(ReasonCode.DISK_FAILED, "EIO on results.log")

            monkeypatch.setattr(log, "try_append", failing)
            async with r.connect(hello=False) as client:
                welcome = await client.hello(r.token, ack_seq=seq)
                refused = error(await client.until(lambda f: f["type"] == "error"))
                await still_usable(client)
    assert welcome["type"] == "welcome"
    assert refused == (ReasonCode.DISK_FAILED, "hello")


async def test_o2_a_token_file_made_readable_to_others_refuses_hellos_and_stops_no_one(
    tmp_path: Path,
) -> None:
    """O2: a token file other users may read is refused: a ``hello`` then gets
    ``token_insecure`` and a closed connection (1008), never the host stopped; a client
    already connected goes on, and once the mode is fixed a ``hello`` is welcomed again."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r, r.connect() as before:
            token = r.root / "state" / "token"
            token.chmod(0o644)
            async with r.connect(hello=False) as client:
                refused = error(await client.hello(r.token))
                with pytest.raises(ConnectionClosed) as closed:
                    await client.receive()
            await still_usable(before)
            token.chmod(0o600)
            async with r.connect() as again:
                await still_usable(again)
    assert refused == (ReasonCode.TOKEN_INSECURE, "hello")
    assert closed.value.reason is not None
    assert closed.value.reason.code == 1008


async def test_s3_a_duplicate_right_after_hello_keeps_the_results_in_seq_order(
    tmp_path: Path,
) -> None:
    """S3: twenty results unacknowledged; a new connection retries the last delivery right
    after its ``hello``. Its results arrive in seq order — the stored one is not sent ahead
    of the others, where a cumulative ``ack`` of it would acknowledge results this
    connection was never sent — and each once before it is sent again."""
    count = 20
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r:
            async with r.connect() as first:
                for n in range(count):
                    await first.send(message(f"d{n}"))
                    await first.until(lambda f: f["type"] == "accepted")
                for n in range(count):
                    await first.result(f"d{n}")
            async with r.connect(hello=False) as client:
                await client.send(
                    {"type": "hello", "protocol": 1, "token": r.token, "client": "retry"}
                )
                await client.send(message(f"d{count - 1}"))
                seqs = await _result_seqs(client, count)
    assert seqs == sorted(seqs)
    assert sorted(set(seqs)) == list(range(1, count + 1))


async def _result_seqs(client: Client, count: int) -> list[int]:
    seqs: list[int] = []
    while len(set(seqs)) < count:
        frame = await client.receive()
        if frame["type"] == "result":
            seqs.append(frame["seq"])
    return seqs


async def test_s5_the_flush_waits_for_nothing_when_everything_is_acknowledged(
    tmp_path: Path,
) -> None:
    """S5: a connection opened after every result was acknowledged has nothing to be sent:
    the stop's flush returns at once (it used to wait out its whole time for such a
    connection; here that time is an hour, and the test's deadline a minute)."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r:
            async with r.connect() as first:
                await first.send(message("d1"))
                seq = (await first.result("d1"))["seq"]
                await first.send({"type": "ack", "seq": seq})
                await still_usable(first)
            async with r.connect() as later:
                await still_usable(later)
                await r.server.flush(3600)


@pytest.mark.parametrize(
    ("frame", "wanted"),
    [
        ({"type": "cancel", "delivery_id": "x" * 300}, "cancel"),
        ({"type": "cancel", "delivery_id": "d\n\x1b[31m"}, "cancel"),
        ('{"type": "ack", "seq": 1e400}', "ack"),
    ],
)
async def test_p3_p4_an_unusable_id_or_a_number_out_of_range_is_said_by_the_frame_type(
    tmp_path: Path, frame: dict[str, object] | str, wanted: str
) -> None:
    """P4: a refusal of a frame whose id is unusable (too long, unprintable) says the frame
    type as its ``ref``, never the raw id; P3: a number no float holds is ``wrong_type``,
    not ``not_json`` (it is JSON)."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r, r.connect() as client:
            await client.send(frame)
            code, ref = error(await client.until(lambda f: f["type"] == "error"))
            await still_usable(client)
    assert ref == wanted
    if isinstance(frame, str):
        assert code == ReasonCode.WRONG_TYPE


async def test_o1_o11_a_start_that_fails_to_bind_makes_no_token_and_the_next_one_prints_it(
    tmp_path: Path,
) -> None:
    """O1: a first start that fails — here its port is taken, refused ``config_invalid:
    port`` (O11), not a bare ``errno`` — leaves no token behind, so the next start creates
    it and has it to print (``new_token``); before, the token was made before the bind and
    never shown (only ``token rotate`` could recover it)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = config_from_dict({}, base=tmp_path)
        with trio.fail_after(LIMIT), pytest.raises(ConfigError) as refused:
            async with open_server(config, ServeOptions(port=port), base_dir=tmp_path):
                pass
    assert refused.value.setting == "port"  # O11: the setting named, with its code
    assert refused.value.code is ReasonCode.CONFIG_INVALID
    assert "in use" in refused.value.message
    assert not (tmp_path / "state" / "token").exists()
    with trio.fail_after(LIMIT):
        async with open_server(config, ServeOptions(port=0), base_dir=tmp_path) as server:
            printed = server.new_token
    assert printed is not None
    assert printed == (tmp_path / "state" / "token").read_text()


DEEP: Final = 5_000
"""Deeper than the JSON decoders go (Python's recursion limit, 1,000), in a frame of 10 KB."""


async def test_s2_p3_a_frame_nested_too_deep_is_answered_and_the_connection_stays_usable(
    tmp_path: Path,
) -> None:
    """S2, P3: a small frame nested deeper than the decoder goes — an array of arrays, or a
    ``deliver`` whose ``history`` is one — is answered with its code like any bad frame,
    before and after ``hello``, and the connection stays usable. Before, the decoder's
    ``RecursionError`` escaped: no answer, and the connection was closed as a server fault."""
    deep_array = "[" * DEEP + "]" * DEEP
    deep_field = json.dumps(message("d1")).replace(
        '"text"', '"history": ' + deep_array + ', "text"'
    )
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r:
            async with r.connect(hello=False) as client:
                await client.send(deep_array)
                before = error(await client.receive())
                assert (await client.hello(r.token))["type"] == "welcome"
                await client.send(deep_field)
                after = error(await client.until(lambda f: f["type"] == "error"))
                await still_usable(client)
            assert r.server.worker.pending() == []  # nothing was admitted
    assert before == (ReasonCode.NOT_AN_OBJECT, None)
    assert after == (ReasonCode.WRONG_TYPE, None)


@contextlib.contextmanager
def stream_held_at(
    monkeypatch: pytest.MonkeyPatch, seq: int
) -> Iterator[tuple[trio.Event, trio.Event]]:
    """Every connection's result stream stops before sending result ``seq`` (as behind a
    slow reader) until ``release`` is set: yields ``(reached, release)``, ``reached`` set once
    a stream stopped there."""
    reached, release = trio.Event(), trio.Event()
    checked = RoomServer._checked

    async def held(self: RoomServer, result: DeliveryResult) -> DeliveryResult:
        if result.seq == seq and not release.is_set():
            reached.set()
            await release.wait()
        return await checked(self, result)

    with monkeypatch.context() as patch:
        patch.setattr(RoomServer, "_checked", held)
        try:
            yield reached, release
        finally:
            release.set()


async def test_s3_an_ack_acknowledges_at_most_what_its_connection_was_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3: a connection whose stream is behind (held before result 2) acks seq 2, which it
    was never sent — nor was anyone. The ack acknowledges result 1, the last one it was
    sent; result 2 goes to the next connection. Before, the ack acknowledged result 2 too,
    and no client was ever sent it."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r:
            with stream_held_at(monkeypatch, 2) as (reached, _release):
                async with r.connect() as client:
                    await client.send(message("d1"))
                    assert (await client.result("d1"))["seq"] == 1
                    await client.send(message("d2"))
                    await client.until(lambda f: f["type"] == "accepted")
                    await reached.wait()  # result 2 is published; no stream has sent it
                    await client.send({"type": "ack", "seq": 2})
                    await still_usable(client)  # the ack was acted on before this answer
                    assert r.server.worker.acked_seq == 1
            async with r.connect() as again:
                resent = await again.result("d2")
    assert resent["seq"] == 2


async def test_s3_a_duplicate_acknowledged_elsewhere_waits_for_its_turn_in_the_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3: a connection whose stream is behind (held before result 1) retries d2, whose
    result another connection was sent and acknowledged. The stored result comes in the
    stream, after result 1, once: results on a connection come in seq order. Before, it was
    sent at once, ahead of result 1 (an acknowledged result was taken for one the stream
    skips, but the stream sends every result above where it started), and again in turn."""
    seqs: list[int] = []
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r, r.connect() as first:
            for delivery in ("d1", "d2"):
                await first.send(message(delivery))
                await first.result(delivery)
            with stream_held_at(monkeypatch, 1) as (reached, release):
                async with r.connect() as slow:
                    await reached.wait()
                    await first.send({"type": "ack", "seq": 2})
                    await still_usable(first)
                    await slow.send(message("d2"))
                    accepted = await slow.until(lambda f: f["type"] == "accepted")
                    await slow.send({"type": "status"})  # answered after the retry's frames
                    while (frame := await slow.receive())["type"] != "status":
                        if frame["type"] == "result":
                            seqs.append(frame["seq"])
                    release.set()
                    while 2 not in seqs or 1 not in seqs:
                        if (frame := await slow.receive())["type"] == "result":
                            seqs.append(frame["seq"])
    assert accepted["disposition"] == "duplicate"
    assert seqs == [1, 2]


async def test_s3_an_ack_of_a_result_whose_send_has_not_returned_yet_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3: the client can have a result, and ack it, before the server's send that wrote it
    has returned (the send yields after its bytes are on the socket; the reader may run
    first). That ack is of a result this connection was sent: it counts. A cap at the last
    send that *returned* would drop it — the last result of a quiet host would then stay
    unacknowledged, and be sent again on every reconnect."""
    returned = trio.Event()
    send = _Connection.send

    async def slow_to_return(self: _Connection, frame: Any) -> None:
        await send(self, frame)
        if isinstance(frame, DeliveryResult):
            await returned.wait()  # the bytes are out; the send has not returned

    monkeypatch.setattr(_Connection, "send", slow_to_return)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r, r.connect() as client:
            await client.send(message("d1"))
            assert (await client.result("d1"))["seq"] == 1
            await client.send({"type": "ack", "seq": 1})
            await still_usable(client)  # the ack was acted on before this answer
            acked = r.server.worker.acked_seq
            returned.set()
    assert acked == 1


async def test_s3_an_ack_sent_just_before_a_close_counts_while_a_send_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3: a client acks result 1 and closes its connection while the server is still busy:
    its reader on an earlier frame (here a ``cancel``, held), its result stream about to send
    result 2. The send fails on the closed connection — and the ack, already received, still
    counts: a later connection is sent result 2 first, not result 1 again. Before, the failed
    send ended every part of the connection at once, the reader with it, and the ack it had
    not read yet was dropped: a result the client had acknowledged was sent again."""
    cancelling, release_cancel, ended = trio.Event(), trio.Event(), trio.Event()
    send_failed = trio.Event()
    cancel, serve, send = RoomWorker.cancel, RoomServer._serve, _Connection.send

    async def held_cancel(self: RoomWorker, delivery_id: str) -> None:
        cancelling.set()
        await release_cancel.wait()
        await cancel(self, delivery_id)

    async def noted_serve(self: RoomServer, *args: Any) -> None:
        try:
            await serve(self, *args)
        finally:
            ended.set()

    async def noted_send(self: _Connection, frame: Any) -> None:
        try:
            await send(self, frame)
        except ConnectionClosed:
            if isinstance(frame, DeliveryResult):
                send_failed.set()
            raise

    monkeypatch.setattr(RoomWorker, "cancel", held_cancel)
    monkeypatch.setattr(_Connection, "send", noted_send)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r:
            with stream_held_at(monkeypatch, 2) as (reached, release_stream):
                monkeypatch.setattr(RoomServer, "_serve", noted_serve)
                async with r.connect() as client:
                    await client.send(message("d1"))
                    assert (await client.result("d1"))["seq"] == 1
                    await client.send(message("d2"))
                    await client.until(lambda f: f["type"] == "accepted")
                    await reached.wait()  # result 2 is published; its send is held
                    await client.send({"type": "cancel", "delivery_id": "d1"})
                    await cancelling.wait()  # the reader is busy with the cancel
                    await client.send({"type": "ack", "seq": 1})
                # the client has closed; result 2's send fails on the closed connection
                release_stream.set()
                await send_failed.wait()
                release_cancel.set()
                await ended.wait()
            async with r.connect() as again:
                first = await again.until(lambda f: f["type"] == "result")
    assert first["seq"] == 2


async def test_s1_the_token_reaches_no_log_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """S1: with every logger at DEBUG (trio-websocket's frame logging included), a first
    start, a welcomed ``hello``, hellos that are refused — a wrong token, the token with an
    unknown field, the token in a frame that is no ``hello`` — and a result leave the token in
    no log record: not in a message, its arguments or a traceback."""
    caplog.set_level(logging.DEBUG)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path) as r:
            token = r.token
            async with r.connect() as client:
                await client.send(message("d1"))
                await client.result("d1")
            for frame in (
                {"type": "hello", "protocol": 1, "token": token, "client": "t", "x": token},
                {"type": "ack", "seq": 1, "token": token},
                {"type": token},
                {"type": "hello", "protocol": 1, "token": token[::-1], "client": "t"},
            ):
                async with r.connect(hello=False) as client:
                    await client.send(frame)
                    await client.until(lambda f: f["type"] == "error")
    logged = "\n".join(f"{record.getMessage()} {record.__dict__}" for record in caplog.records)
    assert caplog.records
    assert token not in logged
    assert token not in caplog.text  # formatted, tracebacks included
