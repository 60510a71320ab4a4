"""A flood of connections without the secret (docs/design/boundaries.md B9): the gateway listens
on loopback TCP, which any local user can reach. Each connection is bounded in time (B8), but
any number could be open at once — descriptors and memory taken by someone who has no secret.
At most ``pending_connections`` connections on which no request has been authorized are kept;
one more closes the oldest of them. The worker must never be locked out: its kept-alive
connection is authorized and not counted, and a connection it opens anew is the newest, whose
request's head arrives at once.

Real sockets on 127.0.0.1, real clock: every wait is on the server's close or its answer, bounded
by ``trio.fail_after`` (the arrival bound is an hour, so nothing here is closed by it).
"""

from __future__ import annotations

import contextlib
import functools
import select
from collections.abc import AsyncIterator
from typing import Final

import trio

from runtime._boundary._gateway import Gateway, GatewayConfig, serve_gateway
from runtime._boundary._http import HttpServer
from runtime._boundary._steps import MemoryStepJournal

LIMIT: Final = 20.0
CAP: Final = 4
HOUR: Final = 3600.0


@contextlib.asynccontextmanager
async def _serving() -> AsyncIterator[tuple[Gateway, HttpServer]]:
    """A gateway keeping at most :data:`CAP` connections without an authorized request."""
    config = GatewayConfig(
        upstream_url="http://127.0.0.1:9/v1", request_arrival=HOUR, pending_connections=CAP
    )
    gateway = Gateway(config, MemoryStepJournal(), environ={})
    async with trio.open_nursery() as nursery:
        server: HttpServer = await nursery.start(functools.partial(serve_gateway, gateway))
        yield gateway, server
        nursery.cancel_scope.cancel()


async def _connect(server: HttpServer) -> trio.SocketStream:
    return await trio.open_tcp_stream(server.host, server.port)


def _request(secret: str, *, body: bytes = b"") -> bytes:
    """A kept-alive request the gateway answers 404 (not a chat completion) once authorized."""
    return (
        f"POST /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {secret}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _answer(stream: trio.SocketStream) -> bytes:
    """One whole response (its head and its ``content-length`` body)."""
    got = bytearray()
    while b"\r\n\r\n" not in got:
        chunk = await stream.receive_some(65536)
        assert chunk, f"closed before an answer: {bytes(got)!r}"
        got += chunk
    head, _, body = bytes(got).partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        assert chunk, "closed in the middle of an answer"
        body += chunk
    return head


async def _served(stream: trio.SocketStream, secret: str) -> None:
    """The worker's request on ``stream`` is answered (``404``: authorized, not a model call)."""
    await stream.send_all(_request(secret))
    head = await _answer(stream)
    assert head.startswith(b"HTTP/1.1 404 "), head


async def _closed(stream: trio.SocketStream) -> None:
    """Wait for the server to close ``stream`` without a word."""
    assert await stream.receive_some(65536) == b""


def _open(stream: trio.SocketStream) -> bool:
    """Whether ``stream`` is still open: nothing (no end of file) is readable on it now."""
    poller = select.poll()
    poller.register(stream.socket.fileno(), select.POLLIN)
    return not poller.poll(0)


async def test_b9_connections_past_the_cap_close_the_oldest() -> None:
    """B9: seven connections that send nothing, one after another, to a gateway keeping four.
    The three oldest are closed by the server, unanswered; the four newest stay open. Before,
    all seven were held until the arrival bound (30 s each, and any number at once)."""
    with trio.fail_after(LIMIT):
        async with _serving() as (_, server):
            silent = [await _connect(server) for _ in range(CAP + 3)]
            for oldest in silent[:3]:
                await _closed(oldest)
            assert all(_open(stream) for stream in silent[3:])
            for stream in silent:
                await stream.aclose()


async def test_b9_a_flood_never_locks_out_the_worker() -> None:
    """B9: the worker has a kept-alive connection (authorized once, so not counted) when a local
    user opens forty silent connections. The cap holds — all but the newest four are closed —
    and the worker is served throughout: again on its kept-alive connection, on a connection it
    opens anew (the newest: it closes the oldest of the flood, and its head arrives at once),
    and on one it opens and keeps silent while three more of the flood arrive after it (then
    the oldest still waiting, not closed)."""
    with trio.fail_after(LIMIT):
        async with _serving() as (gateway, server):
            kept = await _connect(server)
            await _served(kept, gateway.secret)

            flood = [await _connect(server) for _ in range(40)]
            for stream in flood[:-CAP]:
                await _closed(stream)
            await _served(kept, gateway.secret)  # its kept-alive connection: untouched

            fresh = await _connect(server)  # closes the oldest of the flood's four
            await _served(fresh, gateway.secret)

            slow = await _connect(server)
            later = [await _connect(server) for _ in range(CAP - 1)]
            for stream in flood[-CAP:]:
                await _closed(stream)  # every later arrival closed one of the flood, not `slow`
            await _served(slow, gateway.secret)
            assert all(_open(stream) for stream in later)
            for stream in [kept, fresh, slow, *flood, *later]:
                await stream.aclose()


async def test_b9_a_request_authorized_by_its_head_is_not_closed_while_its_body_arrives() -> None:
    """B9: the worker's head is authorized (its secret is checked as the head arrives, B8) and
    its body is still coming when a flood arrives: its connection no longer counts against the
    cap, so the flood closes only its own connections and the request is answered whole."""
    body = b'{"model": "m"}'
    with trio.fail_after(LIMIT):
        async with _serving() as (gateway, server):
            worker = await _connect(server)
            await worker.send_all(_request(gateway.secret, body=body)[: -len(body) + 1])
            first = await _connect(server)  # the server has read the worker's head …
            await _served(first, gateway.secret)  # … since it answered a later connection
            flood = [await _connect(server) for _ in range(3 * CAP)]
            for stream in flood[:-CAP]:
                await _closed(stream)
            await worker.send_all(body[1:])
            head = await _answer(worker)
            assert head.startswith(b"HTTP/1.1 404 "), head
            for stream in [worker, first, *flood]:
                await stream.aclose()
