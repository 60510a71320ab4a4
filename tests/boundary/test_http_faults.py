"""A handler's fault stays in its request (``docs/design/boundaries.md`` B7): the HTTP shell
(``runtime/_boundary/_http.py``) serving the gateway, the gate, the metrics listener and
Fake-Pi's model server, over real sockets on 127.0.0.1 (real clock, every wait bounded by
``trio.fail_after`` and driven by events)."""

from __future__ import annotations

import json
import socket
import struct
from typing import Final

import pytest
import trio

from runtime._boundary._http import (
    HttpClientError,
    HttpServer,
    Request,
    ResponseWriter,
    open_request,
    serve_http,
)
from runtime._boundary._steps import MemoryStepJournal
from runtime._boundary._stream import DONE, sse_data

from .test_gateway import BODY, LIMIT, SSE, answering, chunk, data, exchange, rig

FAULT: Final = "request_failed"


class _Stop(BaseException):
    """Not an ``Exception``: what the shell must let through (as it does ``trio.Cancelled``)."""


async def _faulty(request: Request, response: ResponseWriter) -> None:
    if request.target == "/bug":
        raise RuntimeError("a bug in the handler")
    if request.target == "/late-bug":
        await response.start(200, SSE)
        await response.send(b"data: partial\n\n")
        raise RuntimeError("a bug once the response has started")
    if request.target == "/stop":
        raise _Stop
    await response.respond(200, b"served")


async def _get(server: HttpServer, target: str) -> tuple[int, bytes]:
    async with open_request("GET", f"{server.url}{target}") as response:
        return response.status, await response.read()


async def test_b7_a_handler_that_raises_is_answered_server_fault_and_the_server_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A plain bug (a ``RuntimeError``) in a handler, before its response started: that
    request is answered ``500 server_fault``, the traceback is in the log, and the server
    serves the next connection — before, the error left the connection's task and ended
    the whole server (the gateway's or the gate's: the lane's boundaries)."""
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            server: HttpServer = await nursery.start(serve_http, _faulty)
            status, body = await _get(server, "/bug")
            assert status == 500
            answer = json.loads(body)
            assert answer["code"] == "server_fault"
            assert "a bug in the handler" not in body.decode()  # the log has it, not the client
            assert await _get(server, "/ok") == (200, b"served")
            nursery.cancel_scope.cancel()
    (logged,) = [r for r in caplog.records if getattr(r, "event", None) == FAULT]
    assert logged.exc_info is not None
    assert "a bug in the handler" in caplog.text


async def test_b7_a_handler_that_raises_mid_response_cuts_only_its_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A bug once the response has started: no status can be given any more, so that
    connection is cut (the client sees a response cut short, never a clean end) and
    logged; the server goes on."""
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            server: HttpServer = await nursery.start(serve_http, _faulty)
            with pytest.raises(HttpClientError):
                await _get(server, "/late-bug")
            assert await _get(server, "/ok") == (200, b"served")
            nursery.cancel_scope.cancel()
    (logged,) = [r for r in caplog.records if getattr(r, "event", None) == FAULT]
    assert logged.exc_info is not None


def _reset(sock: socket.socket) -> None:
    """Close with an RST (linger 0): the peer's next write fails, not just its next read."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


async def _ask_and_reset(server: HttpServer, target: str) -> None:
    """Send a request, read the head of its answer, then reset the connection."""
    stream = await trio.open_tcp_stream(server.host, server.port)
    await stream.send_all(f"GET {target} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
    got = b""
    while b"\r\n\r\n" not in got:
        got += await stream.receive_some(65536)
    assert got.startswith(b"HTTP/1.1 200")
    _reset(stream.socket)  # type: ignore[arg-type]  # trio's socket wraps a stdlib one


async def test_b7_a_connection_broken_inside_an_exception_group_ends_only_itself(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A handler that writes from a task of its own nursery (as the gateway's keepalive
    does) to a client that reset the connection: the ``BrokenResourceError`` leaves the
    handler inside an ``ExceptionGroup``, which ``except trio.BrokenResourceError`` does not
    catch. It ends that connection quietly (no fault logged); the server goes on."""
    wrote_after_reset = trio.Event()

    async def writing(request: Request, response: ResponseWriter) -> None:
        if request.target != "/stream":
            await response.respond(200, b"served")
            return

        async def keepalives() -> None:
            await response.start(200, SSE)
            while True:  # until the client's reset breaks a write
                try:
                    await response.send(b": keepalive\n\n" * 1024)
                except trio.BrokenResourceError:
                    wrote_after_reset.set()
                    raise

        async with trio.open_nursery() as nursery:
            nursery.start_soon(keepalives)

    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            server: HttpServer = await nursery.start(serve_http, writing)
            await _ask_and_reset(server, "/stream")
            await wrote_after_reset.wait()
            assert await _get(server, "/ok") == (200, b"served")
            nursery.cancel_scope.cancel()
    assert FAULT not in [getattr(r, "event", None) for r in caplog.records]


async def test_b7_a_base_exception_of_a_handler_is_not_swallowed() -> None:
    """What is no ``Exception`` (``trio.Cancelled``, ``KeyboardInterrupt``, …) is not the
    request's to keep: it leaves the server as before."""
    with trio.fail_after(LIMIT), pytest.RaisesGroup(_Stop, flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            server: HttpServer = await nursery.start(serve_http, _faulty)
            with pytest.raises(HttpClientError):
                await _get(server, "/stop")
            await trio.sleep_forever()  # the server's end ends this


class _BuggyOnceJournal(MemoryStepJournal):
    """A journal whose first look-up fails with what no journal error is: a bug."""

    failed = False

    async def lookup(self, digest: str) -> list[str] | None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("a bug in the journal's look-up")
        return await super().lookup(digest)


async def test_b7_g12_a_bug_under_the_gateway_fails_its_request_not_the_lane(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fault in the gateway's handler that is no journal failure of G12 (here a bug in a
    look-up, raised through the handler's keepalive nursery as an ``ExceptionGroup``):
    the request is answered ``500 server_fault`` and the gateway serves the next one —
    before, it ended ``serve_gateway``, the lane's boundaries with it."""
    steps = [[chunk({"content": "hi"}), chunk({}, "stop"), DONE]]
    with trio.fail_after(LIMIT):
        async with rig(journal=_BuggyOnceJournal(), upstream=answering(*steps)) as r:
            status, events = await exchange(r)
            assert status == 500
            assert json.loads(events[0].data or "")["code"] == "server_fault"
            status, events = await exchange(r)
            assert status == 200
            assert data(events) == steps[0]
            assert r.gateway.failure is None
    assert "a bug in the journal's look-up" in caplog.text


class _Recorded(MemoryStepJournal):
    def __init__(self) -> None:
        super().__init__()
        self.done = trio.Event()

    async def record_response(self, digest: str, chunks: list[str]) -> None:
        await super().record_response(digest, chunks)
        self.done.set()


async def test_b7_a_worker_that_resets_mid_stream_ends_only_its_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker that resets its connection while the gateway's keepalives and the upstream's
    chunks are being written to it: its connection ends quietly, the step is still read to
    its end and journaled (the gateway's rule for a worker gone), and the gateway serves
    the next request — from the journal."""
    more = trio.Event()

    async def upstream(request: Request, response: ResponseWriter) -> None:
        await response.start(200, SSE)
        await response.send(sse_data(chunk({"content": "hel"})))
        await more.wait()
        for _ in range(64):  # writes the gateway relays to a reset connection
            await response.send(sse_data(chunk({"content": "lo"})))
        await response.send(sse_data(chunk({}, "stop")) + sse_data(DONE))
        await response.end()

    journal = _Recorded()
    with trio.fail_after(LIMIT):
        async with rig(upstream=upstream, journal=journal, keepalive_interval=0.001) as r:
            stream = await trio.open_tcp_stream(r.server.host, r.server.port)
            request = json.dumps(BODY).encode()
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                f"authorization: Bearer {r.gateway.secret}\r\n"
                f"content-length: {len(request)}\r\n\r\n"
            ).encode()
            await stream.send_all(head + request)
            got = b""
            while b"hel" not in got:
                got += await stream.receive_some(65536)
            _reset(stream.socket)  # type: ignore[arg-type]
            more.set()
            await journal.done.wait()
            status, events = await exchange(r)
            assert status == 200
            assert data(events)[-1] == DONE
            assert r.gateway.statistics().replayed == 1
    assert FAULT not in [getattr(r, "event", None) for r in caplog.records]
