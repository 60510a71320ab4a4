"""The small HTTP/1.1 layer (runtime._boundary._http) over real sockets on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from runtime._boundary._http import (
    HttpClientError,
    Request,
    ResponseWriter,
    SseEvent,
    iter_sse,
    open_request,
    serve_http,
)


async def _handler(request: Request, response: ResponseWriter) -> None:
    if request.target == "/echo":
        await response.respond(200, request.body)
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
