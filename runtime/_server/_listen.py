"""The websocket server's listeners, capped before the upgrade (docs/design/serve.md S1).

A connection is no websocket until its upgrade request has been answered, so the hello count
of :class:`~runtime._server._serve.RoomServer` cannot see it. :class:`UpgradeCap` wraps each
listener: at most ``cap`` accepted connections may be waiting for their upgrade to be
answered; one more is closed as it is accepted, nothing read from it. A connection stops
waiting at the server's first write to it — the answer to its upgrade request (101, or a
refusal) — or when it closes.
"""

from __future__ import annotations

import logging
import ssl
from typing import Final

import trio
from trio_websocket import Endpoint

from .._errors import ReasonCode
from .._logs import fields

__all__ = ["UpgradeCap", "open_websocket_listeners"]

logger: Final = logging.getLogger("runtime.serve")


class UpgradeCap(trio.abc.Listener[trio.abc.Stream]):
    """``listener``, with at most ``cap`` of its connections waiting for their upgrade (S1)."""

    def __init__(self, listener: trio.abc.Listener[trio.abc.Stream], cap: int) -> None:
        self.listener = listener
        self.cap = cap
        self.waiting = 0
        """Connections accepted whose upgrade has not been answered yet."""

    @property
    def port(self) -> int:
        """The port of the socket underneath."""
        inner = self.listener
        if isinstance(inner, trio.SSLListener):
            inner = inner.transport_listener
        assert isinstance(inner, trio.SocketListener)
        port: int = inner.socket.getsockname()[1]
        return port

    async def accept(self) -> trio.abc.Stream:
        while True:
            stream = await self.listener.accept()
            if self.waiting < self.cap:
                self.waiting += 1
                return _Upgrading(stream, self)
            logger.warning(
                "closed a connection at once: %d connections are waiting for their upgrade",
                self.waiting,
                extra=fields("handshake_refused", code=ReasonCode.TOO_MANY_CONNECTIONS),
            )
            await trio.aclose_forcefully(stream)

    async def aclose(self) -> None:
        await self.listener.aclose()


class _Upgrading(trio.abc.Stream):
    """An accepted connection, counted in its :class:`UpgradeCap` until the server first
    writes to it (the answer to its upgrade request) or it closes."""

    def __init__(self, stream: trio.abc.Stream, cap: UpgradeCap) -> None:
        self.stream = stream
        self._cap: UpgradeCap | None = cap
        self._peer = _peer(stream)

    def __repr__(self) -> str:
        """The client's address, as trio-websocket shows a socket's (its log names it so)."""
        return self._peer

    def _answered(self) -> None:
        if self._cap is not None:
            self._cap.waiting -= 1
            self._cap = None

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self._answered()
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.stream.receive_some(max_bytes)

    async def aclose(self) -> None:
        self._answered()
        await self.stream.aclose()


def _peer(stream: trio.abc.Stream) -> str:
    is_ssl = isinstance(stream, trio.SSLStream)
    transport = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    try:
        assert isinstance(transport, trio.SocketStream)
        address, port, *_ = transport.socket.getpeername()
    except (AssertionError, OSError):  # gone already, or not a socket
        return "a client already gone"
    return str(Endpoint(address, port, is_ssl))


async def open_websocket_listeners(
    host: str, port: int, ssl_context: ssl.SSLContext | None, *, cap: int
) -> list[UpgradeCap]:
    """The listeners ``serve_websocket`` would open (TCP, or TLS over TCP), each capped (S1)."""
    listeners: list[trio.abc.Listener[trio.abc.Stream]]
    if ssl_context is None:
        listeners = list(await trio.open_tcp_listeners(port, host=host))
    else:
        listeners = list(
            await trio.open_ssl_over_tcp_listeners(
                port, ssl_context, host=host, https_compatible=True
            )
        )
    return [UpgradeCap(listener, cap) for listener in listeners]
