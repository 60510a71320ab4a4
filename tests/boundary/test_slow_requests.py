"""A request that never arrives whole, or without the secret (docs/design/boundaries.md B8): the
gateway listens on loopback TCP, where any local user can connect. A client that sends a head
and then its body slowly for ever, or nothing at all, held its connection, its descriptor and
its buffered body for ever, and as many of them as it opened: a host's descriptors (and memory)
taken by someone who has no secret. And the secret was looked at only once the body — up to
64 MiB — had been read and held whole. The worker's own connection must not be cut while it
waits between requests (Pi keeps its connections to the gateway and the gate open between
calls).

Real sockets on the real clock with a short bound (a stalled body: waiting on an event, the
server's close, never sleeping); the trickle — a byte a second for ever — in virtual time.
"""

from __future__ import annotations

import contextlib
import functools
import json
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

import pytest
import trio
import trio.testing

from runtime._boundary._gate import Gate, GateServer, MemoryLog, RecordingGateJournal, serve_gate
from runtime._boundary._gateway import Gateway, GatewayConfig, serve_gateway
from runtime._boundary._http import (
    HttpServer,
    Request,
    ResponseWriter,
    _serve_connection,
)
from runtime._boundary._steps import MemoryStepJournal

from .test_gate import sock_dir as sock_dir

LIMIT: Final = 10.0
ARRIVAL: Final = 0.5
HOUR: Final = 3600.0
"""An arrival bound no test waits out: a reply within :data:`LIMIT` is not the bound's 408."""
BIG: Final = 60 * 1024 * 1024
"""A body under the 64 MiB limit, and far over what a refusal may hold in memory."""
BODY: Final = json.dumps({"model": "m", "stream": True, "messages": []}).encode()


def _head(target: str, length: int, secret: str, *, keep_alive: bool = False) -> bytes:
    return (
        f"POST {target} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\nauthorization: Bearer {secret}\r\n"
        + ("" if keep_alive else "connection: close\r\n")
        + "\r\n"
    ).encode()


async def _until_closed(stream: trio.abc.Stream) -> bytes:
    """Everything the server sends until it closes the connection."""
    reply = bytearray()
    while chunk := await stream.receive_some(65536):
        reply += chunk
    return bytes(reply)


@pytest.fixture
def gateway_config() -> GatewayConfig:
    return GatewayConfig(upstream_url="http://127.0.0.1:9/v1", request_arrival=ARRIVAL)


@contextlib.asynccontextmanager
async def _connected(gateway: Gateway) -> AsyncIterator[trio.SocketStream]:
    """A TCP connection to ``gateway`` served on 127.0.0.1 (stopped after the block)."""
    async with trio.open_nursery() as nursery:
        server: HttpServer = await nursery.start(functools.partial(serve_gateway, gateway))
        async with await trio.open_tcp_stream(server.host, server.port) as stream:
            yield stream
        nursery.cancel_scope.cancel()


async def test_b8_a_gateway_request_whose_body_never_ends_is_dropped(
    gateway_config: GatewayConfig,
) -> None:
    """B8: a client (with the secret: one without it is refused on its head) sends a head
    announcing a body, part of it, and then nothing. Within the arrival bound the gateway
    answers ``408`` and closes the connection, and goes on serving; before, the connection was
    held for ever (no whole-request deadline)."""
    gateway = Gateway(gateway_config, MemoryStepJournal(), environ={})
    with trio.fail_after(LIMIT):
        async with _connected(gateway) as stalled:
            head = _head("/v1/chat/completions", 1000, gateway.secret)
            await stalled.send_all(head + b"{")
            reply = await _until_closed(stalled)
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    assert gateway.statistics().requests == 0  # the handler never saw it


async def test_b8_a_connection_that_sends_nothing_is_dropped(
    gateway_config: GatewayConfig,
) -> None:
    """B8: a client connects and sends nothing: the connection is closed within the bound."""
    gateway = Gateway(gateway_config, MemoryStepJournal(), environ={})
    with trio.fail_after(LIMIT):
        async with _connected(gateway) as silent:
            assert await _until_closed(silent) == b""


async def test_b8_g8_an_unauthorized_request_closes_its_connection(
    gateway_config: GatewayConfig,
) -> None:
    """B8, G8: a request without the secret is answered 401 and its connection is closed: a
    client with no secret cannot keep one open between requests (a keep-alive wait is not
    bounded, since the worker's own connection waits there between its model requests)."""
    gateway = Gateway(gateway_config, MemoryStepJournal(), environ={})
    with trio.fail_after(LIMIT):
        async with _connected(gateway) as stream:
            head = _head("/v1/chat/completions", len(BODY), "nobody", keep_alive=True)
            await stream.send_all(head + BODY)
            reply = await _until_closed(stream)
    assert reply.startswith(b"HTTP/1.1 401 "), reply


async def test_b8_a_gate_request_whose_body_never_ends_is_dropped(sock_dir: Path) -> None:
    """B8, T1: the same at the gate: a ``/before`` whose body never ends is answered 408 and
    closed within the bound, nothing decided."""
    log = MemoryLog()
    gate = Gate(RecordingGateJournal(log, key="k", epoch=1, granted=["bash"]))
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            server: GateServer = await nursery.start(
                functools.partial(serve_gate, arrival_seconds=ARRIVAL), gate, sock_dir / "g.sock"
            )
            stalled = await trio.open_unix_socket(str(server.path))
            async with stalled:
                await stalled.send_all(_head("/before", 1000, gate.secret) + b'{"tool_')
                reply = await _until_closed(stalled)
            nursery.cancel_scope.cancel()
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    assert log.records == []


async def test_b8_g8_a_request_without_the_secret_is_refused_before_its_body() -> None:
    """B8, G8: a client without the secret announces a 60 MiB body and sends none of it. The
    gateway answers 401 ``gateway_unauthorized`` and closes as soon as the head is in, an hour
    before the arrival bound. Before, the secret was checked only once the whole body had
    arrived: the gateway waited for (and read, and held) the body first, and this client was
    answered only by the bound's 408."""
    config = GatewayConfig(upstream_url="http://127.0.0.1:9/v1", request_arrival=HOUR)
    gateway = Gateway(config, MemoryStepJournal(), environ={})
    with trio.fail_after(LIMIT):
        async with _connected(gateway) as stream:
            await stream.send_all(_head("/v1/chat/completions", BIG, "nobody", keep_alive=True))
            reply = await _until_closed(stream)
    assert reply.startswith(b"HTTP/1.1 401 "), reply
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["type"] == "gateway_unauthorized"
    assert gateway.statistics().refused == 1


async def test_b8_t1_a_gate_request_without_the_secret_is_refused_before_its_body(
    sock_dir: Path,
) -> None:
    """B8, T1: the same at the gate: a ``/before`` without the secret announcing a 60 MiB body
    is answered 401 ``gate_unauthorized`` and closed once its head is in, nothing decided."""
    log = MemoryLog()
    gate = Gate(RecordingGateJournal(log, key="k", epoch=1, granted=["bash"]))
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            server: GateServer = await nursery.start(
                functools.partial(serve_gate, arrival_seconds=HOUR), gate, sock_dir / "g.sock"
            )
            async with await trio.open_unix_socket(str(server.path)) as stream:
                await stream.send_all(_head("/before", BIG, "nobody", keep_alive=True))
                reply = await _until_closed(stream)
            nursery.cancel_scope.cancel()
    assert reply.startswith(b"HTTP/1.1 401 "), reply
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "gate_unauthorized"
    assert (gate.refused_unauthorized, log.records) == (1, [])


async def test_b8_a_refused_request_holds_none_of_its_body_in_memory() -> None:
    """B8: a client without the secret sends a 60 MiB body as fast as loopback carries it. The
    gateway's refusal costs it no buffer of that body: the memory Python holds at its peak while
    the request is refused stays under 4 MiB (the client sends slices of one 64 KiB buffer).
    Before, the gateway read the whole body into memory, and copied it, before it looked at
    the secret: a peak of about 127 MiB for one request, and as many as a local user sent."""
    config = GatewayConfig(upstream_url="http://127.0.0.1:9/v1", request_arrival=HOUR)
    gateway = Gateway(config, MemoryStepJournal(), environ={})
    chunk = memoryview(b"x" * 65536)
    reply = bytearray()

    async def send_body(stream: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError):  # the server may close first
            await stream.send_all(_head("/v1/chat/completions", BIG, "nobody"))
            for _ in range(BIG // len(chunk)):
                await stream.send_all(chunk)

    async def read_reply(stream: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError):  # a reset after the reply
            reply.extend(await _until_closed(stream))

    tracemalloc.start()
    try:
        with trio.fail_after(6 * LIMIT):
            async with _connected(gateway) as stream:
                tracemalloc.reset_peak()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(send_body, stream)
                    nursery.start_soon(read_reply, stream)
                _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reply.startswith(b"HTTP/1.1 401 "), bytes(reply[:200])
    assert peak < 4 * 1024 * 1024, f"{peak / 2**20:.1f} MiB held to refuse one request"


async def _answer(request: Request, response: ResponseWriter) -> None:
    await response.respond(200, b'{"ok":true}')


async def test_b8_a_body_trickled_for_ever_is_dropped_but_a_keep_alive_wait_is_not(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """B8, in virtual time: a client that sends its body a byte a second for ever (each read
    arrives well within any per-read deadline) is cut once the request has taken the arrival
    bound from its first byte. A client that waits an hour between two whole requests on one
    kept-alive connection (the worker between two model calls) is served both."""
    bound = 30.0
    trickler, server_side = trio.testing.memory_stream_pair()
    patient, patient_server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            functools.partial(_serve_connection, server_side, _answer, arrival_seconds=bound)
        )
        start = trio.current_time()
        await trickler.send_all(_head("/x", 10_000, "s"))
        with trio.move_on_after(10 * bound):
            while True:
                try:
                    await trickler.send_all(b"x")
                except trio.BrokenResourceError:
                    break
                await trio.sleep(1.0)
        cut_after = trio.current_time() - start

        nursery.start_soon(
            functools.partial(_serve_connection, patient_server, _answer, arrival_seconds=bound)
        )
        for _ in range(2):
            await patient.send_all(_head("/x", 2, "s", keep_alive=True) + b"{}")
            got = bytearray()
            while not got.endswith(b'{"ok":true}'):
                got += await patient.receive_some(65536)
            assert got.startswith(b"HTTP/1.1 200 "), got
            await trio.sleep(3600.0)
        nursery.cancel_scope.cancel()
    assert bound <= cut_after <= bound + 2.0
