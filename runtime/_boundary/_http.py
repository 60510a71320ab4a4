"""A small HTTP/1.1 server and client on Trio, enough for model traffic.

Both the scripted model server (``fake_pi.model_server``) and the runtime's model
gateway speak OpenAI-compatible ``chat/completions`` with server-sent events
over loopback. That needs very little of HTTP — one request, a streamed
response, keep-alive — but it needs full control over the stream: deliver each
chunk as it is produced, hold one back, go silent, or cut the connection in the
middle. A sans-I/O protocol core (:mod:`._h1`, boundaries.md B10) with a thin Trio shell
gives exactly that.

Server: :func:`serve_http` runs ``handler(request, response)`` per request.
Client: :func:`open_request` returns a streamed response on a fresh connection;
:class:`ConnectionPool` does the same on kept-alive ones (the gateway's upstream).
SSE: :func:`iter_sse` turns a byte stream into events (data payloads and comments).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import math
import os
import select
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

import trio

from .._errors import ReasonCode
from ._h1 import (
    END,
    NEED_DATA,
    ClientConnection,
    Data,
    Event,
    LocalProtocolError,
    RemoteProtocolError,
    RequestHead,
    ResponseHead,
    ServerConnection,
)

__all__ = [
    "ConnectionPool",
    "HttpClientError",
    "HttpServer",
    "Request",
    "Response",
    "ResponseWriter",
    "SseEvent",
    "SseParser",
    "drain",
    "iter_sse",
    "open_request",
    "refusal_text",
    "serve_http",
]

_MAX_REQUEST: Final = 64 * 1024 * 1024
_READ: Final = 65536
ARRIVAL_SECONDS: Final = 30.0
"""How long the gateway and the gate give a request to arrive whole, from its first byte to
its last, and a new connection to send its first byte (boundaries.md B8). The worker builds a
request in memory and writes it at once over loopback: a request still arriving after this
long is not a worker's, and a connection that has sent nothing after it neither."""
PENDING_CONNECTIONS: Final = 64
"""How many connections on which no request has been authorized yet the gateway keeps open at
once (boundaries.md B9); one more closes the oldest of them. Far above what a worker opens (its
model requests come one at a time), and a worker's new connection is the newest, never the
oldest: its request's head arrives at once, and with it the secret that takes it off the count."""
_GONE: Final = (trio.BrokenResourceError, trio.ClosedResourceError)
"""What a connection the client dropped (or that was closed under a write) raises."""

logger = logging.getLogger("runtime.http")


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    target: str
    headers: dict[str, str]
    """Lower-cased names; the last value of a repeated header wins."""
    body: bytes
    connection: int = 0
    """Which connection of its server it came on: 1, 2, … in the order they were accepted."""
    peer: str = ""
    """The client's address (its host part, as the socket reports it); empty if unknown."""


class ResponseWriter:
    """Writes one response. Without ``content-length`` the body is chunked."""

    def __init__(
        self, stream: trio.abc.SendStream, conn: ServerConnection, *, head: bool = False
    ) -> None:
        self._stream = stream
        self._conn = conn
        self._head = head
        """The answer to a ``HEAD``: its headers only, whatever body a handler sends."""
        self.started = False
        self.ended = False

    async def start(
        self, status: int, headers: list[tuple[str, str]], data: bytes = b"", *, end: bool = False
    ) -> None:
        """The response's head and, in the same write, ``data``, the body's first bytes (and,
        with ``end``, its end): the peer wakes once for what is ready at once."""
        self.started = True
        await self._write(self._conn.response(status, headers), data, end=end)

    async def send(self, data: bytes) -> None:
        await self._write(b"", data)

    async def end(self, data: bytes = b"") -> None:
        """The body's last bytes, ``data``, and its end, in one write."""
        await self._write(b"", data, end=True)

    async def _write(self, head: bytes, data: bytes, *, end: bool = False) -> None:
        out = head
        if data and not self._head:
            out += self._conn.data(data)
        if end:
            self.ended = True
            out += self._conn.end()
        if out:
            await self._stream.send_all(out)

    async def respond(
        self,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        *,
        close: bool = False,
    ) -> None:
        """A whole, non-streamed response; with ``close``, the connection ends after it. Its
        head and body go in one write."""
        headers = [("content-type", content_type), ("content-length", str(len(body)))]
        await self.start(
            status, [*headers, ("connection", "close")] if close else headers, body, end=True
        )


Handler = Callable[[Request, ResponseWriter], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class HttpServer:
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


async def _next_event(stream: trio.abc.Stream, conn: ServerConnection | ClientConnection) -> Event:
    """The connection's next event, reading from ``stream`` as long as it needs data."""
    while (event := conn.next_event()) is NEED_DATA:
        conn.receive_data(bytes(await stream.receive_some(_READ)))
    return event


class _NoBound:
    """A bound that never fires: what :func:`_bounded` gives for an infinite one, entering no
    cancel scope (a few microseconds each, on every request otherwise)."""

    cancelled_caught: Final = False

    def __enter__(self) -> _NoBound:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None


_NO_BOUND: Final = _NoBound()


def _bounded(seconds: float) -> trio.CancelScope | _NoBound:
    """``trio.move_on_after(seconds)``, or, for an infinite bound, no scope at all."""
    return _NO_BOUND if seconds == math.inf else trio.move_on_after(seconds)


class _Late(Exception):
    """A request that did not arrive whole within its arrival bound (B8)."""


class _Arrival:
    """One request's arrival bound, from its first byte to its last (B8), as a deadline set
    at the first read the request waits for: the cancel scope is entered around those reads
    only, so a request whose bytes are all here already (most are: a worker writes one at
    once) costs none. No time passes between its first byte and that first read but the
    parse of what came: the deadline is the one a scope entered at the first byte sets."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._deadline: float | None = None

    async def receive(self, stream: trio.abc.Stream) -> bytes:
        """The next bytes of ``stream``; :class:`_Late` once the bound is past."""
        if self._deadline is None:
            scope = trio.CancelScope(relative_deadline=self._seconds)
        else:
            scope = trio.CancelScope(deadline=self._deadline)
        with scope:
            if self._deadline is None:
                self._deadline = scope.deadline
            return bytes(await stream.receive_some(_READ))
        raise _Late


Authorize = Callable[[Request], bool]
"""Whether a request may go on, judged by its head alone (its :attr:`Request.body` empty)."""


class _Unauthorized(Exception):
    """A request's head that ``authorize`` refused: its body is not to be read."""


def _admit_any(head: Request) -> bool:
    return True


def _nothing() -> None:
    return None


async def _read_request(
    stream: trio.abc.Stream,
    conn: ServerConnection,
    arrival: _Arrival,
    limit: int = _MAX_REQUEST,
    connection: int = 0,
    peer: str = "",
    authorize: Authorize = _admit_any,
    admitted: Callable[[], None] = _nothing,
) -> Request | None:
    """The next whole request, or ``None`` at the connection's end; :class:`_Late` if it is not
    whole within ``arrival``. Its head goes to ``authorize`` as soon as it has arrived, before
    any of the body is read: refused, this raises :class:`_Unauthorized` (B8); admitted,
    ``admitted()`` is called (B9)."""
    head: RequestHead | None = None
    body = bytearray()
    while True:
        while (event := conn.next_event()) is NEED_DATA:
            conn.receive_data(await arrival.receive(stream))
        if isinstance(event, Data):
            body += event.data
            if len(body) > limit:
                raise RemoteProtocolError("request body too large", 413)
        elif isinstance(event, RequestHead):
            head = event
            if not authorize(
                Request(head.method, head.target, head.headers, b"", connection, peer)
            ):
                raise _Unauthorized
            admitted()
        elif event is END:
            assert head is not None
            return Request(head.method, head.target, head.headers, bytes(body), connection, peer)
        else:  # CLOSED: the client ended the connection between requests
            return None


async def _first_byte(stream: trio.abc.Stream, conn: ServerConnection) -> None:
    """Wait until the next request has begun: a byte of it is in ``conn`` (or its end of
    file, which the request's read then finds)."""
    if not conn.buffered:
        conn.receive_data(bytes(await stream.receive_some(_READ)))


async def _serve_connection(
    stream: trio.abc.Stream,
    handler: Handler,
    limit: int = _MAX_REQUEST,
    connection: int = 0,
    request_seconds: float = math.inf,
    peer: str = "",
    refusal: Callable[[int], bytes] | None = None,
    *,
    arrival_seconds: float = math.inf,
    authorize: Authorize = _admit_any,
    admitted: Callable[[], None] = _nothing,
    slot: _Slot | None = None,
) -> None:
    """Serve one connection. ``request_seconds`` bounds each request's wait and arrival
    together (a keep-alive wait included); ``arrival_seconds`` bounds the wait for a new
    connection's first byte and each request from its first byte to its last, not the wait
    between requests (B8). A request that takes longer is answered ``408`` if its head
    has arrived, and its connection closed. A request whose head ``authorize`` refuses is
    answered ``401`` (``refusal(401)``) before its body is read, and its connection closed
    (B8); ``admitted()`` is called for each head it lets through (B9). With ``slot``, each wait
    for a request's first byte is idle in it, and each request's arrival after its first byte
    is counted in it: a newer connection may close this one then, an arriving one only once
    it is slow, and at no other time (operations.md M9, M11)."""
    conn = ServerConnection()
    try:
        first = True
        while True:
            request: Request | None = None
            try:
                late = False
                with _bounded(request_seconds) as waited:
                    with _bounded(arrival_seconds if first else math.inf) as idle:
                        if slot is None or conn.buffered:
                            await _first_byte(stream, conn)
                        elif not await slot.idle(_first_byte, stream, conn):
                            return  # M9: closed, idle, for a newer connection
                    if not idle.cancelled_caught:
                        read = functools.partial(
                            _read_request,
                            stream,
                            conn,
                            _Arrival(arrival_seconds),
                            limit,
                            connection,
                            peer,
                            authorize,
                            admitted,
                        )
                        try:
                            if slot is None:
                                request = await read()
                            elif (request := await slot.arriving(read)) is None:
                                return  # M11: closed, slow, for a newer connection
                        except _Late:
                            late = True
                if waited.cancelled_caught or idle.cancelled_caught:
                    return  # no whole request in time (a head, a body, an idle keep-alive)
                if late:  # B8: begun, and not whole in time
                    await _refuse_late(stream, conn, refusal)
                    return
                first = False
            except _Unauthorized:  # B8: refused on its head, its body never read
                await _refuse_unauthorized(stream, conn, refusal)
                return
            except RemoteProtocolError as exc:
                with contextlib.suppress(LocalProtocolError, trio.BrokenResourceError):
                    status = exc.status
                    body = refusal(status) if refusal is not None else b'{"error":"bad request"}'
                    writer = ResponseWriter(stream, conn)
                    await writer.respond(status, body, close=True)
                return
            if request is None:
                return
            writer = ResponseWriter(stream, conn, head=request.method == "HEAD")
            try:
                await handler(request, writer)
            except Exception as exc:  # B7: a fault stays in its request (BaseException passes)
                await _handler_failed(exc, request, writer)
                return  # the connection ends: its state is whatever the handler left
            if not writer.ended or not conn.can_continue:
                return  # the handler cut the response, or either side ends the connection
            conn.start_next_cycle()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return
    finally:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.aclose()


_LATE_BODY: Final = b'{"error":"the request did not arrive whole in time"}'
_UNAUTHORIZED_BODY: Final = b'{"error":"the request does not carry the current secret"}'
_DRAIN_BYTES: Final = 4 * 1024 * 1024
"""What of a refused request's body is read, and dropped, before its connection is closed."""
_REFUSED: Final = {
    401: "the request does not carry the current secret",
    408: "the request did not arrive whole in time",
    413: "the request body is too large",
    431: "the request head is too large",
    501: "the request's transfer coding is not supported",
}


def refusal_text(status: int) -> str:
    """What a request refused before its handler saw it is told, by the status it gets."""
    return _REFUSED.get(status, "the request is not valid HTTP")


async def _refuse_late(
    stream: trio.abc.Stream, conn: ServerConnection, refusal: Callable[[int], bytes] | None
) -> None:
    """Answer a request that did not arrive whole in time ``408`` (B8) — when its head has
    arrived, so that there is a request to answer — within a short bound (a client that
    does not read gets the close alone)."""
    if not conn.reading_body:
        return
    with (
        trio.move_on_after(_REFUSE_SECONDS),
        contextlib.suppress(LocalProtocolError, *_GONE),
    ):
        body = refusal(408) if refusal is not None else _LATE_BODY
        await ResponseWriter(stream, conn).respond(408, body, close=True)


async def _refuse_unauthorized(
    stream: trio.abc.Stream, conn: ServerConnection, refusal: Callable[[int], bytes] | None
) -> None:
    """Answer a request whose head ``authorize`` refused ``401`` and end its connection
    without reading its body into memory (B8): what of it comes next is read and dropped —
    a close with unread bytes would reset the connection, the answer perhaps unread — up to
    :data:`_DRAIN_BYTES` and :data:`_REFUSE_SECONDS`, then the connection is closed."""
    with (
        trio.move_on_after(_REFUSE_SECONDS),
        contextlib.suppress(LocalProtocolError, *_GONE),
    ):
        body = refusal(401) if refusal is not None else _UNAUTHORIZED_BODY
        await ResponseWriter(stream, conn).respond(401, body, close=True)
        await drain(stream, _DRAIN_BYTES)


async def drain(stream: trio.abc.Stream, limit: float = math.inf) -> None:
    """Say the end of what is sent (when the stream can), then read and drop what the client
    sends until its end or ``limit`` bytes: a connection closed with unread bytes is reset,
    and the peer may lose the answer sent before the close."""
    if isinstance(stream, trio.abc.HalfCloseableStream):
        await stream.send_eof()
    dropped = 0
    while dropped < limit and (data := await stream.receive_some(_READ)):
        dropped += len(data)


_FAULT_BODY: Final = (
    b'{"ok":false,"code":"%s","message":"the server failed on this request '
    b'(the operator is told)"}' % ReasonCode.SERVER_FAULT.value.encode()
)


def _gone(exc: Exception) -> bool:
    """Whether ``exc`` says only that the connection is gone — also inside an exception
    group (a handler's nursery: a keepalive task's write to a client that went away)."""
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(_GONE)
        return rest is None
    return isinstance(exc, _GONE)


async def _handler_failed(exc: Exception, request: Request, writer: ResponseWriter) -> None:
    """What a handler let out (B7): a connection gone ends quietly; anything else is logged
    with its traceback and answered ``500 server_fault`` — if the response has not started;
    once it has, no status can be given and the connection is cut (the caller closes it)."""
    if _gone(exc):
        return
    logger.error(
        "the HTTP handler failed on %s %s (only this request fails)",
        request.method,
        request.target.split("?", 1)[0],
        exc_info=exc,
        extra={"event": "request_failed", "code": str(ReasonCode.SERVER_FAULT)},
    )
    if writer.started:
        return
    with contextlib.suppress(LocalProtocolError, *_GONE):
        await writer.respond(500, _FAULT_BODY, close=True)


async def serve_http(
    handler: Handler,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    ssl_context: ssl.SSLContext | None = None,
    max_request: int = _MAX_REQUEST,
    request_seconds: float = math.inf,
    max_connections: int | None = None,
    slow_request_seconds: float = math.inf,
    refusal: Callable[[int], bytes] | None = None,
    arrival_seconds: float = math.inf,
    authorize: Authorize = _admit_any,
    max_pending: int | None = None,
    task_status: trio.TaskStatus[HttpServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``handler`` until cancelled; ``task_status.started`` once listening; HTTPS
    with ``ssl_context``; a request body over ``max_request`` bytes is answered 413.

    For a listener anyone may reach (the metrics and the operator page), not the worker's
    own boundaries (Pi keeps its connection to the gate open between calls):
    ``request_seconds`` bounds the TLS handshake and each whole request, a keep-alive's
    wait for the next one included, and closes a connection that takes longer;
    ``max_connections`` bounds the connections open at once, so idle clients cannot take the
    process's file descriptors, nor one client all of them (operations.md M9): one more closes
    the connection idle the longest (waiting for a request's first byte since its opening or
    its last answer), or with none idle the request arriving the longest if it began
    ``slow_request_seconds`` ago or more (M11; never a request that arrived whole), and is
    served, or is answered ``503 too_many_connections`` at once and closed.
    ``refusal`` makes the JSON body answering a request the protocol refuses before the
    handler sees it, from its status (400 malformed, 413 body over ``max_request``, 431 head
    too large, 501 a transfer coding it cannot read, 505 an HTTP version other than 1.x);
    default ``{"error":"bad request"}``.
    Each request carries its client's address (:attr:`Request.peer`).
    ``arrival_seconds`` bounds a new connection's wait for its first byte and each request
    from its first byte to its last, but not the wait between requests (boundaries.md B8:
    the gateway, where a worker keeps its connection between model calls): a request that
    takes longer is answered ``408`` (``refusal(408)``) and its connection closed.

    ``authorize`` judges each request by its head, as soon as the head has arrived: one it
    refuses is answered ``401`` (``refusal(401)``) and its connection closed, its body never
    read into memory (B8: a client without the secret costs no 64 MiB buffer).
    ``max_pending`` is how many connections on which no request's head was authorized yet (a
    connection still silent, in its TLS handshake, or sending its first head) are kept at
    once: one more closes the oldest of them, unanswered (B9: the gateway, where any local user
    can connect, and the worker that holds the secret must still get in). A connection whose
    head was authorized is not counted any more, whatever it does next.

    A handler that returns without ending its response has the connection
    closed under it — the way to simulate a stream cut mid-way.

    A fault stays in its request (boundaries.md B7): an ``Exception`` a handler lets out
    is logged with its traceback (``request_failed``) and answered ``500`` with the JSON
    body ``{"ok": false, "code": "server_fault", …}`` if the response has not started, else
    its connection is cut; a connection gone (``trio.BrokenResourceError`` or
    ``trio.ClosedResourceError``, also inside an exception group) ends quietly. Either way
    the server goes on serving the others; what is no ``Exception`` (``trio.Cancelled``)
    is not caught.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()
    accepted = itertools.count(1)
    pending = _Pending(max_pending)
    connections = _Connections(max_connections, slow_request_seconds)
    async with trio.open_nursery() as nursery:
        task_status.started(HttpServer(host=bound[0], port=bound[1]))

        async def serve(
            stream: trio.SocketStream, scope: trio.CancelScope, slot: _Slot | _Full | None
        ) -> None:
            try:
                with scope:  # cancelled: a newer connection closed it (B9)
                    if isinstance(slot, _Full):  # M9: every connection in a request
                        await _refuse_connection(stream, min(request_seconds, _REFUSE_SECONDS))
                        return
                    try:
                        await _serve_one(stream, scope, slot)
                    finally:
                        if slot is not None:
                            slot.leave()
            finally:
                pending.leave(scope)
                await trio.aclose_forcefully(stream)

        async def _serve_one(
            stream: trio.SocketStream, scope: trio.CancelScope, slot: _Slot | None
        ) -> None:
            connection = next(accepted)
            peer = _peer(stream)
            serve = functools.partial(
                _serve_connection,
                handler=handler,
                limit=max_request,
                connection=connection,
                request_seconds=request_seconds,
                peer=peer,
                refusal=refusal,
                arrival_seconds=arrival_seconds,
                authorize=authorize,
                admitted=functools.partial(pending.leave, scope),
                slot=slot,
            )
            if ssl_context is None:
                await serve(stream)
                return
            tls = trio.SSLStream(stream, ssl_context, server_side=True, https_compatible=True)
            try:
                with trio.move_on_after(request_seconds) as waited:
                    if slot is None:
                        await tls.do_handshake()
                    elif not await slot.idle(tls.do_handshake):
                        return  # M9: still in its handshake, closed for a newer connection
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await trio.aclose_forcefully(stream)  # a failed handshake: nothing to answer
                return
            if waited.cancelled_caught:
                await trio.aclose_forcefully(stream)
                return
            await serve(tls)

        def arrive() -> tuple[trio.CancelScope, _Slot | _Full | None]:
            return pending.arrive(), connections.admit()

        for listener in listeners:
            nursery.start_soon(_accept, listener, arrive, serve, nursery)


async def _accept(
    listener: trio.SocketListener,
    arrive: Callable[[], tuple[trio.CancelScope, _Slot | _Full | None]],
    serve: Callable[[trio.SocketStream, trio.CancelScope, _Slot | _Full | None], Awaitable[None]],
    nursery: trio.Nursery,
) -> None:
    """Accept connections for ever, each served by ``serve`` in ``nursery`` and counted by
    ``arrive`` — in ``pending`` (B9) and in the open connections (M9) — the moment it is
    accepted: in the order of arrival, before any of them runs. As
    :func:`trio.serve_listeners`: out of descriptors or memory, wait and go on."""
    async with listener:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _ACCEPT_CAPACITY:
                    raise
                logger.error(
                    "accept failed (%s); retrying in %s s",
                    os.strerror(exc.errno),
                    _ACCEPT_RETRY,
                    extra={"event": "accept_failed"},
                )
                await trio.sleep(_ACCEPT_RETRY)
                continue
            nursery.start_soon(serve, stream, *arrive())


_ACCEPT_CAPACITY: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
"""What ``accept`` fails with when the host is out of descriptors or memory for now."""
_ACCEPT_RETRY: Final = 0.1


class _Pending:
    """A server's connections on which no request has been authorized yet, oldest first
    (B9): at most ``limit`` of them (``None``: any number); one more closes the oldest."""

    def __init__(self, limit: int | None) -> None:
        self._limit = limit
        self._scopes: dict[trio.CancelScope, None] = {}
        """In the order of arrival (a dict keeps its insertion order)."""

    def arrive(self) -> trio.CancelScope:
        """The scope a new connection is served in, counted; the oldest cancelled if full."""
        scope = trio.CancelScope()
        if self._limit is not None:
            while len(self._scopes) >= self._limit:
                oldest = next(iter(self._scopes))
                del self._scopes[oldest]
                oldest.cancel()
            self._scopes[scope] = None
        return scope

    def leave(self, scope: trio.CancelScope) -> None:
        """``scope``'s connection is not counted any more: authorized, or closed."""
        self._scopes.pop(scope, None)


class _Full:
    """What :meth:`_Connections.admit` gives at the bound with no idle connection to close."""


_FULL: Final = _Full()


class _Connections:
    """A server's open connections, at most ``limit`` of them (``None``: any number, none
    tracked); those of them idle — waiting for a request's first byte, since they were
    opened (a TLS handshake included) or since their last answer — in the order they became
    idle (operations.md M9); and those whose request is arriving — from its first byte until
    it is whole — in the order they began (M11). At the bound, a new connection closes the one
    idle the longest, or with none idle the request arriving the longest, if it began
    ``slow_seconds`` ago or more, and takes its place; a request that has arrived whole is
    never closed for it (its answer being built or sent). Otherwise the new one is refused
    (``503``)."""

    def __init__(self, limit: int | None, slow_seconds: float = math.inf) -> None:
        self.limit = limit
        self.slow_seconds = slow_seconds
        self.open = 0
        self.idle: dict[_Slot, None] = {}
        """Idle the longest first (a dict keeps its insertion order)."""
        self.arriving: dict[_Slot, float] = {}
        """Requests arriving, begun the longest ago first, with when they began."""

    def admit(self) -> _Slot | _Full | None:
        """A slot for a new connection, idle from now; ``None`` without a limit;
        :data:`_FULL` at the bound with nothing to close."""
        if self.limit is None:
            return None
        if self.open >= self.limit:
            if self.idle:
                next(iter(self.idle)).close()
            elif self.arriving and self._slow(next(iter(self.arriving.values()))):
                next(iter(self.arriving)).close()
            else:
                return _FULL
        slot = _Slot(self)
        self.open += 1
        self.idle[slot] = None
        return slot

    def _slow(self, began: float) -> bool:
        return trio.current_time() - began >= self.slow_seconds


class _Slot:
    """One connection counted in :class:`_Connections`."""

    def __init__(self, connections: _Connections) -> None:
        self._connections = connections
        self._scope: trio.CancelScope | None = None
        self.closed = False
        """Closed for a newer connection: whatever it was doing, it ends."""

    async def idle(self, wait: Callable[..., Awaitable[object]], *args: object) -> bool:
        """``await wait(*args)`` idle (the wait for a request's first byte, a TLS
        handshake): ``False`` if the connection was closed for a newer one — before or
        during the wait, or as the wait ended (the byte that came with the close is not
        read further: the client sees a kept-alive connection closed, and sends again)."""
        if not self.closed:
            self._connections.idle[self] = None  # where it was, if idle since its opening
            try:
                with trio.CancelScope() as self._scope:
                    await wait(*args)
            finally:
                self._scope = None
                self._connections.idle.pop(self, None)
        return not self.closed

    async def arriving(self, read: Callable[[], Awaitable[Request | None]]) -> Request | None:
        """``await read()``, the rest of a request whose first byte has come (M11): ``None``
        if the connection was closed for a newer one — before or during the read, or as it
        ended (a request closed for being slow is not answered, as a kept-alive connection
        closed idle is not), or if ``read`` found none (the client closed)."""
        if self.closed:
            return None
        self._connections.arriving[self] = trio.current_time()
        try:
            with trio.CancelScope() as self._scope:
                request = await read()
        finally:
            self._scope = None
            self._connections.arriving.pop(self, None)
        return None if self.closed else request

    def close(self) -> None:
        """Close the connection for a newer one (it is idle, or its request slow): its slot
        is free at once."""
        self.closed = True
        self._connections.idle.pop(self, None)
        self._connections.arriving.pop(self, None)
        self._connections.open -= 1
        if self._scope is not None:
            self._scope.cancel()

    def leave(self) -> None:
        """The connection ended; its slot is free (unless it was freed when closed)."""
        self._connections.idle.pop(self, None)
        self._connections.arriving.pop(self, None)
        if not self.closed:
            self.closed = True
            self._connections.open -= 1


def _peer(stream: trio.SocketStream) -> str:
    """The client's address; empty when the socket no longer knows it (a client gone)."""
    try:
        return str(stream.socket.getpeername()[0])
    except OSError:
        return ""


_REFUSE_SECONDS: Final = 1.0
_TOO_MANY_BODY: Final = (
    b'{"ok":false,"code":"too_many_connections","message":"too many open connections here"}'
)
_TOO_MANY: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_TOO_MANY_BODY), _TOO_MANY_BODY)
)


async def _refuse_connection(stream: trio.SocketStream, seconds: float) -> None:
    """Answer a connection over the cap ``503 too_many_connections`` and close it, within
    ``seconds`` (a client that does not read gets the close alone)."""
    with (
        trio.move_on_after(seconds),
        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
    ):
        await stream.send_all(_TOO_MANY)
        await drain(stream)  # a close with unread bytes would reset it, answer unread
    await trio.aclose_forcefully(stream)


# -- client ---------------------------------------------------------------------------


class HttpClientError(Exception):
    """The connection failed or the response ended early (a cut stream)."""


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    _stream: trio.abc.Stream
    _conn: ClientConnection

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives; :class:`HttpClientError` if it is cut short."""
        while True:
            try:
                event = await _next_event(self._stream, self._conn)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise HttpClientError(f"connection lost: {exc}") from exc
            except RemoteProtocolError as exc:
                raise HttpClientError(f"response cut short: {exc}") from exc
            if isinstance(event, Data):
                yield event.data
            elif event is END:
                return
            else:  # pragma: no cover - a client's connection yields nothing else in a body
                raise HttpClientError(f"unexpected {event!r} in the response body")

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_bytes()])


@functools.cache
def _default_ssl_context() -> ssl.SSLContext:
    """One verifying client context for the process: building one loads the system CA store,
    tens of milliseconds of CPU that must not be paid on every upstream request."""
    return ssl.create_default_context()


@functools.lru_cache(maxsize=64)
def _origin(url: str) -> tuple[str, str, int, str, str]:
    """``(scheme, hostname, port, host header, target)`` of an http(s) URL (kept for the
    URLs used last: the gateway asks for one upstream URL on every request)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"unsupported URL {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
    return parts.scheme, parts.hostname, port, host, target


async def _connect(
    scheme: str, hostname: str, port: int, ssl_context: ssl.SSLContext | None
) -> trio.abc.Stream:
    try:
        tcp = await trio.open_tcp_stream(hostname, port)
    except OSError as exc:
        raise HttpClientError(f"cannot connect to {hostname}:{port}: {exc}") from exc
    if scheme == "https":
        return trio.SSLStream(tcp, ssl_context or _default_ssl_context(), server_hostname=hostname)
    return tcp


async def _exchange(
    stream: trio.abc.Stream,
    conn: ClientConnection,
    method: str,
    url: str,
    headers: list[tuple[str, str]],
    body: bytes,
) -> Response:
    """Send one request on ``stream`` and read its response head."""
    _, _, _, host, target = _origin(url)
    try:
        await stream.send_all(conn.request(method, target, [("host", host), *headers], body))
        event = await _next_event(stream, conn)
    except (
        trio.BrokenResourceError,
        trio.ClosedResourceError,
        RemoteProtocolError,
        LocalProtocolError,
    ) as exc:
        raise HttpClientError(f"request to {url} failed: {exc}") from exc
    if not isinstance(event, ResponseHead):  # pragma: no cover - the head comes first
        raise HttpClientError(f"no response head (got {event!r})")
    return Response(event.status, event.headers, stream, conn)


@contextlib.asynccontextmanager
async def open_request(
    method: str,
    url: str,
    *,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
    ssl_context: ssl.SSLContext | None = None,
) -> AsyncIterator[Response]:
    """Send one request on a fresh connection and stream its response.

    Raises :class:`HttpClientError` if the server cannot be reached or the
    response head never arrives.
    """
    scheme, hostname, port, _, _ = _origin(url)
    stream = await _connect(scheme, hostname, port, ssl_context)
    async with stream:
        conn = ClientConnection()
        yield await _exchange(stream, conn, method, url, headers or [], body)


def _socket_of(stream: trio.abc.Stream) -> trio.socket.SocketType:
    while isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    assert isinstance(stream, trio.SocketStream)
    return stream.socket


def _dropped(stream: trio.abc.Stream) -> bool:
    """Whether an idle kept-alive connection has something to read: the server closed it
    (or sent what no request asked for) — either way it cannot carry the next request.

    ``poll``, not ``select``: select() cannot take a descriptor numbered 1024 or more (a busy
    host with a raised ``RLIMIT_NOFILE``), and its ``ValueError`` is no :class:`HttpClientError`
    — it would escape the request into the server that made it. A hang-up or an error on the
    socket is reported too, and counts as dropped as well."""
    poller = select.poll()
    poller.register(_socket_of(stream).fileno(), select.POLLIN)
    return bool(poller.poll(0))


@dataclass(slots=True)
class _Idle:
    stream: trio.abc.Stream
    conn: ClientConnection
    since: float


class ConnectionPool:
    """Kept-alive connections for a sequence of requests to one or a few origins — a lane's
    model requests, one after another: each :meth:`request` takes an idle connection to the
    URL's origin or opens one, and gives it back once its response was read to its end
    (never one whose response was cut, left unread or ended ``connection: close``).

    An idle connection is used again only while it has been idle under ``idle_seconds``
    (below the keep-alive timeouts servers commonly use, so that the server does not drop it
    just as a request goes out) and only if nothing is readable on it (a server that closed
    it: its end of file is waiting). A request that fails on a used connection fails as on a
    fresh one — :class:`HttpClientError` — and is never sent again by the pool: whether the
    server acted on it is not known here. At most ``max_idle`` idle connections are kept
    per origin. :meth:`aclose` closes the idle ones."""

    def __init__(
        self,
        *,
        idle_seconds: float = 4.0,
        max_idle: int = 2,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.idle_seconds = idle_seconds
        self.max_idle = max_idle
        self._ssl_context = ssl_context
        self._idle: dict[tuple[str, str, int], list[_Idle]] = {}
        self.opened = 0
        """Connections opened so far."""
        self.reused = 0
        """Requests sent on a connection used before."""

    def _take(self, origin: tuple[str, str, int]) -> _Idle | None:
        idle = self._idle.get(origin, [])
        now = trio.current_time()
        while idle:
            found = idle.pop()
            if now - found.since < self.idle_seconds and not _dropped(found.stream):
                return found
            _close_now(found.stream)
        return None

    @contextlib.asynccontextmanager
    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: list[tuple[str, str]] | None = None,
        body: bytes = b"",
    ) -> AsyncIterator[Response]:
        """As :func:`open_request`, on a kept-alive connection when there is one."""
        scheme, hostname, port, _, _ = _origin(url)
        origin = (scheme, hostname, port)
        found = self._take(origin)
        if found is None:
            stream = await _connect(scheme, hostname, port, self._ssl_context)
            conn = ClientConnection()
            self.opened += 1
        else:
            stream, conn = found.stream, found.conn
            self.reused += 1
        kept = False
        try:
            yield await _exchange(stream, conn, method, url, headers or [], body)
            if conn.reusable:
                conn.start_next_cycle()
                idle = self._idle.setdefault(origin, [])
                if len(idle) < self.max_idle:
                    idle.append(_Idle(stream, conn, trio.current_time()))
                    kept = True
        finally:
            if not kept:
                _close_now(stream)

    async def aclose(self) -> None:
        """Close every idle connection (those in use close when their request ends)."""
        idle = [found for kept in self._idle.values() for found in kept]
        self._idle.clear()
        for found in idle:
            _close_now(found.stream)
        await trio.lowlevel.checkpoint()


def _close_now(stream: trio.abc.Stream) -> None:
    """Close a client connection without waiting: its socket (no TLS close_notify — a
    connection given up on needs none, and a client may drop one it will not use again)."""
    _socket_of(stream).close()


# -- server-sent events ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SseEvent:
    """One SSE event: ``data`` (joined data lines) or a ``comment`` (keepalive)."""

    data: str | None = None
    comment: str | None = None


class SseParser:
    """An SSE byte stream, fed as it arrives, into events (data and comments): each
    :meth:`feed` returns the events its bytes completed, in order."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data_lines: list[str] = []

    def feed(self, chunk: bytes) -> list[SseEvent]:
        events: list[SseEvent] = []
        lines = (self._buffer + chunk if self._buffer else chunk).split(b"\n")
        self._buffer = lines.pop()  # after the last newline: not a whole line yet
        data_lines = self._data_lines
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if data_lines:
                    events.append(SseEvent(data="\n".join(data_lines)))
                    data_lines = self._data_lines = []
            elif line.startswith(b"data:"):  # decoding never raises
                data_lines.append(line[5:].removeprefix(b" ").decode(errors="replace"))
            elif line.startswith(b":"):
                events.append(SseEvent(comment=line[1:].decode(errors="replace").strip()))
            # other fields (event:, id:, retry:) are not used by chat completions
        return events

    def end(self) -> list[SseEvent]:
        """The event the stream's end completed (data lines with no blank line after)."""
        lines, self._data_lines = self._data_lines, []
        return [SseEvent(data="\n".join(lines))] if lines else []


async def iter_sse(chunks: AsyncIterator[bytes]) -> AsyncGenerator[SseEvent, None]:
    """Parse an SSE byte stream into events (data and comments), as they complete."""
    parser = SseParser()
    async for chunk in chunks:
        for event in parser.feed(chunk):
            yield event
    for event in parser.end():
        yield event
