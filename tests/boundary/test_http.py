"""The small HTTP/1.1 layer (runtime._boundary._http) over real sockets on 127.0.0.1."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import h11
import pytest
import trio
import trio.testing

from runtime._boundary._http import (
    ConnectionPool,
    HttpClientError,
    HttpServer,
    Request,
    ResponseWriter,
    SseEvent,
    SseParser,
    _serve_connection,
    iter_sse,
    open_request,
    serve_http,
)


async def _handler(request: Request, response: ResponseWriter) -> None:
    if request.target == "/echo":
        await response.respond(200, request.body)
    elif request.target == "/connection":
        await response.respond(200, str(request.connection).encode())
    elif request.target == "/close":
        await response.start(200, [("content-length", "2"), ("connection", "close")])
        await response.send(b"ok")
        await response.end()
    elif request.target == "/stream":
        await response.start(200, [("content-type", "text/event-stream")])
        for i in range(3):
            await response.send(f"data: {i}\n\n".encode())
            await response.send(b": keepalive\n\n")
        await response.send(b"data: [DONE]\n\n")
        await response.end()
    elif request.target == "/cut":
        await response.start(200, [("content-type", "text/event-stream")])
        await response.send(b"data: partial\n\n")
        # return without end(): the server drops the connection
    else:
        await response.respond(404, b"{}")


async def test_request_response_and_sse() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_http, _handler)
            async with open_request("POST", f"{server.url}/echo", body=b"hello") as response:
                assert response.status == 200
                assert await response.read() == b"hello"
            async with open_request("GET", f"{server.url}/stream") as response:
                events = [event async for event in iter_sse(response.iter_bytes())]
            assert [e.data for e in events if e.data is not None] == ["0", "1", "2", "[DONE]"]
            assert SseEvent(comment="keepalive") in events
            async with open_request("GET", f"{server.url}/missing") as response:
                assert response.status == 404
            nursery.cancel_scope.cancel()


async def test_cut_stream_is_reported() -> None:
    """A response that ends without its terminating chunk is an error, not an end."""
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_http, _handler)
            received: list[str | None] = []

            async def consume() -> None:
                async with open_request("GET", f"{server.url}/cut") as response:
                    async for event in iter_sse(response.iter_bytes()):
                        received.append(event.data)

            with pytest.raises(HttpClientError):
                await consume()
            assert received == ["partial"]
            nursery.cancel_scope.cancel()


async def test_unreachable_server() -> None:
    with trio.fail_after(10):
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        port = listener.socket.getsockname()[1]
        await listener.aclose()
        with pytest.raises(HttpClientError):
            async with open_request("GET", f"http://127.0.0.1:{port}/"):
                pass  # pragma: no cover


async def test_sse_parser_handles_split_lines() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for piece in (b"da", b'ta: {"a"', b":1}\r\n\r", b"\n: ping\n\ndata: x\ndata: y\n\n"):
            yield piece

    events = [event async for event in iter_sse(chunks())]
    assert events == [SseEvent(data='{"a":1}'), SseEvent(comment="ping"), SseEvent(data="x\ny")]


# -- kept-alive connections (docs/design/gateway.md G17) ---------------------------------


async def _connections(pool: ConnectionPool, url: str, n: int) -> list[int]:
    """The server's connection number for each of ``n`` requests in turn."""
    seen = []
    for _ in range(n):
        async with pool.request("POST", f"{url}/connection") as response:
            seen.append(int(await response.read()))
    return seen


async def test_g17_requests_in_turn_share_one_kept_alive_connection() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server: HttpServer = await nursery.start(functools.partial(serve_http, _handler))
            pool = ConnectionPool()
            seen = await _connections(pool, server.url, 3)
            await pool.aclose()
            nursery.cancel_scope.cancel()
    assert seen == [1, 1, 1]
    assert (pool.opened, pool.reused) == (1, 2)


async def test_g17_a_cut_unread_closing_or_stale_connection_is_never_taken_again() -> None:
    """A connection goes back only when its response was read to its end and left it open;
    an idle one only while idle under ``idle_seconds``."""
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server: HttpServer = await nursery.start(functools.partial(serve_http, _handler))
            pool = ConnectionPool()
            with pytest.raises(HttpClientError):
                async with pool.request("GET", f"{server.url}/cut") as response:
                    await response.read()
            after_cut = await _connections(pool, server.url, 1)
            async with pool.request("GET", f"{server.url}/stream") as response:
                pass  # the body left unread
            after_unread = await _connections(pool, server.url, 1)
            async with pool.request("GET", f"{server.url}/close") as response:
                assert await response.read() == b"ok"
            after_close = await _connections(pool, server.url, 1)
            stale = ConnectionPool(idle_seconds=0.0)
            stale_seen = await _connections(stale, server.url, 2)
            nursery.cancel_scope.cancel()
    # each of cut / unread / closing ran on the connection kept before it, and was its last
    assert after_cut == [2]
    assert after_unread == [3]
    assert after_close == [4]
    assert stale_seen == [5, 6]


@dataclass
class _DroppingServer:
    """A raw HTTP/1.1 server on loopback: each connection answers ``answers`` requests
    (``content-length``, no ``connection: close``), then — with ``read_one_more`` — reads
    one more request, and closes without a word: a server dropping a kept-alive
    connection, idle or with a request in it."""

    answers: int
    read_one_more: bool = False
    requests: list[bytes] = field(default_factory=list)
    dropped: trio.Event = field(default_factory=trio.Event)

    async def _read(self, stream: trio.SocketStream, conn: h11.Connection) -> bool:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    return False
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                self.requests.append(bytes(event.target))
            elif isinstance(event, h11.EndOfMessage):
                return True

    async def serve(self, stream: trio.SocketStream) -> None:
        answers, read_one_more = self.answers, self.read_one_more
        conn = h11.Connection(h11.SERVER)
        async with stream:
            for _ in range(answers):
                if not await self._read(stream, conn):
                    break
                await stream.send_all(
                    conn.send(h11.Response(status_code=200, headers=[("content-length", "2")]))
                    + conn.send(h11.Data(data=b"ok"))
                    + conn.send(h11.EndOfMessage())
                )
                conn.start_next_cycle()
            else:
                if read_one_more:
                    await self._read(stream, conn)
        self.dropped.set()


@contextlib.asynccontextmanager
async def serving(server: _DroppingServer) -> AsyncIterator[str]:
    """``server`` on a loopback port: its base URL."""
    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(
            functools.partial(trio.serve_tcp, server.serve, 0, host="127.0.0.1")
        )
        yield f"http://127.0.0.1:{listener.socket.getsockname()[1]}"
        nursery.cancel_scope.cancel()


async def test_g17_a_connection_the_server_dropped_while_idle_is_not_used() -> None:
    """The server closed the idle connection: its end of file is waiting, so the pool
    opens a new one instead of sending the request into a closed connection."""
    server = _DroppingServer(answers=1)
    with trio.fail_after(10):
        async with serving(server) as url:
            pool = ConnectionPool()
            for n in range(3):
                async with pool.request("POST", f"{url}/{n}") as response:
                    assert await response.read() == b"ok"
                await server.dropped.wait()
                server.dropped = trio.Event()
    assert server.requests == [b"/0", b"/1", b"/2"]
    assert (pool.opened, pool.reused) == (3, 0)


async def test_g17_a_request_lost_on_a_kept_alive_connection_is_not_sent_again() -> None:
    """A request that fails on a used connection fails — whether the server acted on it is
    not known — and the pool never sends it a second time."""
    server = _DroppingServer(answers=1, read_one_more=True)
    with trio.fail_after(10):
        async with serving(server) as url:
            pool = ConnectionPool()
            async with pool.request("POST", f"{url}/first") as response:
                assert await response.read() == b"ok"
            with pytest.raises(HttpClientError):
                async with pool.request("POST", f"{url}/second") as response:
                    await response.read()
    assert server.requests == [b"/first", b"/second"]
    assert (pool.opened, pool.reused) == (1, 1)


def test_the_sse_parser_returns_what_each_read_completed() -> None:
    """What one read completed comes back from its ``feed``, in order (the gateway passes it
    on in one write); a partial line waits for the next read; the end completes the rest."""
    parser = SseParser()
    assert parser.feed(b"data: 1\n\n: ping\ndata: 2\n\ndata: 3") == [
        SseEvent(data="1"),
        SseEvent(comment="ping"),
        SseEvent(data="2"),
    ]
    assert parser.feed(b"\r\n") == []
    assert parser.feed(b"data: 4\n\n") == [SseEvent(data="3\n4")]
    assert parser.feed(b"data: 5\n") == []
    assert parser.end() == [SseEvent(data="5")]


# -- B10: the shell's own codec on a real socket, read by h11 --------------------------------


async def _exchange_raw(server: HttpServer, wire: bytes) -> list[h11.Event]:
    """Send ``wire`` on a fresh connection in one write and read until the server closes the
    connection (each case here must end with the close: the test's bound fails one that
    does not); every event h11, as the client, reads from what came back."""
    stream = await trio.open_tcp_stream(server.host, server.port)
    async with stream:
        await stream.send_all(wire)
        received = bytearray()
        while data := await stream.receive_some(65536):
            received += data
    client = h11.Connection(h11.CLIENT)
    client.receive_data(bytes(received))
    client.receive_data(b"")  # the server's close, after all of it
    events: list[h11.Event] = []
    for _ in range(wire.count(b" HTTP/1.")):
        client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
        client.send(h11.EndOfMessage())
        while True:
            event = client.next_event()
            assert isinstance(event, h11.Event), event  # all of it is here: never NEED_DATA
            events.append(event)
            if isinstance(event, h11.EndOfMessage):
                break
        if client.our_state is h11.MUST_CLOSE or client.their_state is h11.MUST_CLOSE:
            break
        client.start_next_cycle()
    return events


_LENGTH_3 = b"content-length: 3\r\n\r\n"


def _bodies(events: list[h11.Event]) -> list[bytes]:
    bodies: list[bytes] = []
    for event in events:
        if isinstance(event, h11.Response):
            bodies.append(b"")
        elif isinstance(event, h11.Data):
            bodies[-1] += bytes(event.data)
    return bodies


async def test_b10_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    """B10: two requests in one write are two answers, in order, on the one connection (the
    second waits in the codec's buffer for the first's cycle to end) — never the second lost
    or answered first."""
    wire = (
        b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nfirst"
        b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 6\r\nconnection: close\r\n\r\nsecond"
    )
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            server: HttpServer = await nursery.start(functools.partial(serve_http, _handler))
            events = await _exchange_raw(server, wire)  # the second says close: it ends there
            nursery.cancel_scope.cancel()
    assert _bodies(events) == [b"first", b"second"]


async def test_b10_an_http_1_0_client_gets_a_stream_ended_by_the_close() -> None:
    """B10: an HTTP/1.0 client cannot read chunked: a response of no length goes to it
    unframed, with ``connection: close``, and ends with the connection."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            server: HttpServer = await nursery.start(functools.partial(serve_http, _handler))
            events = await _exchange_raw(server, b"GET /stream HTTP/1.0\r\n\r\n")
            nursery.cancel_scope.cancel()
    response = events[0]
    assert isinstance(response, h11.Response)
    headers = dict(response.headers)
    assert b"transfer-encoding" not in headers
    assert headers[b"connection"] == b"close"
    assert b"".join(_bodies(events)).endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize(
    ("wire", "status"),
    [
        (b"GET / HTTP/1.1\r\nhost: x\r\nx: folded\r\n  on\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\n", 501),
        (b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n" + _LENGTH_3, 400),
        (b"GET / HTTP/2.0\r\nhost: x\r\n\r\n", 505),
        (b"GET / HTTP/1.1\r\nhost: x\r\n" + b"x: " + b"y" * 17_000 + b"\r\n\r\n", 431),
    ],
    ids=["folded", "gzip", "te-and-cl", "http-2", "head-too-large"],
)
async def test_b10_a_request_the_codec_refuses_is_answered_its_status_and_closed(
    wire: bytes, status: int
) -> None:
    """B10: a request outside the grammar never reaches the handler: it is answered the status
    the codec names (``refusal(status)``'s body) and its connection is closed — nothing after
    it is read as a request."""
    seen: list[str] = []

    async def handler(request: Request, response: ResponseWriter) -> None:
        seen.append(request.target)
        await response.respond(200, b"{}")

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            server: HttpServer = await nursery.start(
                functools.partial(
                    serve_http, handler, refusal=lambda code: b'{"refused":%d}' % code
                )
            )
            events = await _exchange_raw(server, wire + b"GET /after HTTP/1.1\r\nhost: x\r\n\r\n")
            nursery.cancel_scope.cancel()
    response = events[0]
    assert isinstance(response, h11.Response)
    assert response.status_code == status
    assert _bodies(events)[0] == b'{"refused":%d}' % status
    assert dict(response.headers)[b"connection"] == b"close"
    assert seen == []


class _Writes(trio.abc.Stream):
    """A server's side of a connection that keeps each write it is given, as one item."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self.writes: list[bytes] = []

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self._stream.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self._stream.aclose()


async def _streamed(request: Request, response: ResponseWriter) -> None:
    if request.target == "/whole":
        await response.respond(200, b'{"ok":true}')
        return
    await response.start(200, [("content-type", "text/event-stream")], b"data: 0\n\n")
    await response.send(b"data: 1\n\n")
    await response.end(b"data: [DONE]\n\n")


async def test_b10_a_whole_answer_is_one_write_and_a_stream_s_head_goes_with_its_first_bytes() -> (
    None
):
    """B10: what a handler has ready at once goes in one write, so the peer wakes once for it
    (each write is a system call and, on the worker's side, a wake-up): a whole answer's head
    and body together; a stream's head with its first bytes, its last bytes with its end."""
    client, server_side = trio.testing.memory_stream_pair()
    server = _Writes(server_side)
    requests = b"".join(
        b"GET %b HTTP/1.1\r\nhost: x\r\n\r\n" % target for target in (b"/whole", b"/stream")
    )
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve_connection, server, _streamed)
            await client.send_all(requests)
            received = b""
            while not received.endswith(b"0\r\n\r\n"):
                received += await client.receive_some()
            nursery.cancel_scope.cancel()
    whole, head, middle, last = server.writes
    assert whole.startswith(b"HTTP/1.1 200 ")
    assert whole.endswith(b'\r\n\r\n{"ok":true}')
    assert head.startswith(b"HTTP/1.1 200 ")
    assert head.endswith(b"\r\n\r\n9\r\ndata: 0\n\n\r\n")
    assert middle == b"9\r\ndata: 1\n\n\r\n"
    assert last == b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
