"""``pi-runtime serve``: the room worker behind a websocket (docs/design/index.md, protocol.md,
serve.md).

One process owns one state directory. It runs a :class:`~runtime._rooms._worker.RoomWorker`,
answers the wire protocol of ``docs/design/protocol.md`` on every websocket connection, and
answers the admin socket (``runtime/_server/_admin.py``) for the command line, which turns
``serve``'s flags into the configuration and :class:`ServeOptions` (``runtime/_cli/_serve.py``)
and calls :func:`serve_until_signalled`. The invariants (S1…) are in ``docs/design/serve.md``;
in short:

* a connection is served only after a ``hello`` carrying the state directory's current token
  (compared in constant time, re-read per hello so ``token rotate`` acts at once) and a
  protocol version both sides speak; a handshake with a foreign ``Origin`` is refused, and so
  is a connection past the caps on those not past their hello yet and on those past it (S1);
* every bad frame is answered with an ``error`` frame with a stable code, and the connection
  stays usable wherever the protocol allows (S2);
* ``accepted`` is sent only once the admission is durable (the worker's ``deliver``); results
  go to every authenticated connection in seq order, and each ``hello`` re-sends everything
  not acknowledged, with its seq (S3);
* each connection has a bounded number of deliveries in flight; one more is refused
  ``too_many_in_flight`` (S4);
* SIGINT/SIGTERM stop admitting, let running turns finish for up to the drain timeout, then
  stop; what is unfinished stays pending for the next start (S5);
* task lanes (``runtime/_tasks/_service.py``) run beside the room worker on the same store: the
  ``task_*`` frames submit, answer, control and show them, and every task's ``task_event`` goes
  to every authenticated connection (P11-P13 of ``docs/design/protocol.md``). Unfinished tasks
  are resumed at the next start.

Resource handling: :func:`open_server` owns the room worker, the task service, the admin
socket, the websocket listener and a task per connection; leaving it closes them all (worker
trees are fenced by the room worker and the task lanes). Connections' failures are logged and
never end the server.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import itertools
import logging
import os
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import msgspec
import trio
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    WebSocketRequest,
    WebSocketServer,
)

from .._config import RoomWorkerConfig, metrics_address, validate_config
from .._errors import (
    AttachmentError,
    ConfigError,
    DeliveryError,
    PiRuntimeError,
    ProtocolError,
    ReasonCode,
    raises_one_error,
)
from .._journal._attachments import SHARED_ATTACHMENTS, AttachmentStore
from .._logs import fields
from .._records import Outcome
from .._rooms._worker import RoomWorker, open_room_worker
from .._tasks._policy import loud_logging, watchdog_policy
from .._tasks._runner import SharedTasks
from .._tasks._service import TaskService, open_task_service
from .._wire import DeliveryResult, RoomEvent, RoomStatus, TaskEvent, fit_result
from ._frame_fit import encode, fit_prefix, fit_task_list, fit_task_view, sorted_after
from ._heap import HeapPolicy, keep_heap
from ._listen import open_websocket_listeners
from ._metrics import is_loopback, open_metrics
from ._protocol import (
    Ack,
    AttachmentData,
    Cancel,
    ClientFrame,
    Deliver,
    ErrorFrame,
    FetchAttachment,
    Hello,
    ServerFrame,
    StatusReport,
    StatusRequest,
    TaskAccepted,
    TaskControl,
    TaskReplyFrame,
    TaskShow,
    TaskSubmit,
    TaskViewFrame,
    Welcome,
    decode_client_frame,
    encode_server_frame,
    error_frame,
    frame_ref,
    frame_type,
    negotiate,
    reject_binary_frame,
)
from ._token import ensure_token, read_token, token_matches

__all__ = [
    "RoomServer",
    "ServeOptions",
    "check_bind",
    "heap_policy",
    "open_server",
    "serve_until_signalled",
]

logger = logging.getLogger("runtime.serve")

STATUS_CHUNK: Final = 2000
"""Room statuses the admin socket's ``status`` builds between two checkpoints (~5 ms)."""
ATTACHMENT_CHUNK: Final = 48 * 1024
"""Bytes of an attachment per ``attachment_data`` frame (64 KiB of base64), or fewer where
``[server] max_frame_bytes`` is smaller (P15)."""
EVENT_QUEUE: Final = 256
"""Signals (typing, text updates, tool activity) buffered per connection; a connection that
falls further behind loses the oldest kind of thing there is to lose: signals, never results."""
FLUSH_SECONDS: Final = 5.0
"""After a drain, how long connected clients get to receive the results published so far."""
SHOWN_CHARS: Final = 80
"""Characters of a client's own text a log line shows (P19), as an error frame does (P16)."""
POLICY_VIOLATION: Final = 1008
"""The websocket close code after a refused token or an unsupported protocol."""
TRY_AGAIN_LATER: Final = 1013
"""The websocket close code after a valid hello over ``[server] max_authenticated`` (S1): the
client did nothing wrong and may connect again later."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeOptions:
    """Where and how to listen (the command line's options)."""

    host: str = "127.0.0.1"
    port: int = 8765
    ssl_context: ssl.SSLContext | None = None
    insecure_bind: bool = False
    """Allow a non-loopback address without TLS (docs/design/serve.md: otherwise refused)."""
    unsafe_test_timescale: float = 1.0
    """Tests only: divide every task-lane watchdog threshold by this (WD9); said loudly."""


def check_bind(options: ServeOptions, config: RoomWorkerConfig | None = None) -> None:
    """Refuse a non-loopback bind without TLS unless ``insecure_bind`` (S6); the metrics
    listener's non-loopback bind needs ``insecure_bind`` whatever its TLS (the metrics have no
    token; its operator page answers there only over TLS, OP4)."""
    if config is not None and config.metrics.listen is not None and not options.insecure_bind:
        host, _port = metrics_address(config.metrics.listen)
        if not is_loopback(host):
            raise ConfigError(
                "metrics.listen",
                f"{host} is not a loopback address: the metrics have no token; pass "
                "--insecure-bind to serve them to the network (the operator page is then "
                "served only over TLS)",
            )
    if options.ssl_context is not None or options.insecure_bind or is_loopback(options.host):
        return
    raise ConfigError(
        "host",
        f"{options.host} is not a loopback address: serve it with TLS (--tls-cert, --tls-key) "
        "or pass --insecure-bind to accept plain websockets from the network",
    )


@dataclass(eq=False)
class _Connection:
    """One authenticated websocket: what it may still send, and what it has in flight."""

    ws: WebSocketConnection
    peer: str
    in_flight: set[str] = field(default_factory=set)
    events: tuple[
        trio.MemorySendChannel[RoomEvent | TaskEvent],
        trio.MemoryReceiveChannel[RoomEvent | TaskEvent],
    ] = field(default_factory=lambda: trio.open_memory_channel[RoomEvent | TaskEvent](EVENT_QUEUE))
    dropped_events: int = 0
    sent_seq: int = 0
    """The seq of the last result sent on this connection (at first, the acknowledged seq
    its stream starts above: every result up to it is sent or acknowledged)."""
    sending_seq: int = 0
    """The seq of the last result whose send began here: what an ``ack`` on this connection
    may cover (S3). Not :attr:`sent_seq`: the client can have a result, and ack it, before
    the send that wrote it has returned."""
    sent_more: trio.Event = field(default_factory=trio.Event)
    closed: bool = False
    """Its websocket closed: nothing more will be sent here."""
    authenticated: bool = False
    """It holds one of the server's ``max_authenticated`` places (S1), from the welcome on."""

    async def send(self, frame: ServerFrame) -> None:
        """Send one frame. No lock of ours: the connection's own (FIFO) lock around the
        socket already keeps concurrent senders' frames whole and in the order they were
        sent; a second one cost every frame a scheduler pass."""
        await self.ws.send_message(encode_server_frame(frame))

    async def sent_up_to(self, seq: int) -> None:
        """Return once every result up to ``seq`` was sent here, or the connection closed."""
        while self.sent_seq < seq and not self.closed:
            await self.sent_more.wait()

    def close(self) -> None:
        """The websocket closed: whoever waits for a send here stops waiting."""
        self.closed = True
        self.sent_more.set()


class RoomServer:
    """The websocket side of a running room worker; obtain it from :func:`open_server`."""

    def __init__(
        self,
        worker: RoomWorker,
        state_dir: Path,
        *,
        worker_id: str,
        tasks: TaskService,
    ) -> None:
        self.worker = worker
        self.tasks = tasks
        """The task lanes beside the room worker (under leases on a shared store, S30)."""
        self.state_dir = state_dir
        self.worker_id = worker_id
        self.server = worker.config.server
        self.connections: set[_Connection] = set()
        self.port = 0
        """The bound port (useful with ``port=0``)."""
        self.new_token: str | None = None
        """The token, when this start created it (the command line prints it once, O1)."""
        self.attachments = AttachmentStore(worker.config.attachment_root())  # A1
        self.metrics_port: int | None = None
        """The metrics listener's bound port, when ``[metrics] listen`` is set."""
        self.fetch_rate = worker.config.attachments.fetch_bytes_per_second
        self.frames_received = 0
        """Client frames received on every connection so far (the heap keeper's quiet, S7)."""
        self.unauthenticated = 0
        """Connections accepted that have not said a valid ``hello`` yet (S1)."""
        self.authenticated = 0
        """Connections welcomed and not ended yet, at most ``max_authenticated`` (S1)."""
        self._told: set[tuple[str, int]] = set()
        """``(what, seq)`` of each problem of a result logged and not acknowledged yet — one
        unsendable (P17), an attachment lost (A7), a reply cut to the frame bound (P14): each
        is logged once, not at every re-send (P20)."""

    # -- the admin socket's handler (runtime/_server/_admin.py) --------------------------------

    async def status(self) -> dict[str, Any]:
        """Every room, one row each: built a chunk of :data:`STATUS_CHUNK` at a time, the
        loop going on between two (a host of 50,000 rooms is not stalled for the whole)."""
        await trio.lowlevel.checkpoint()
        report: dict[str, Any] = msgspec.to_builtins(
            StatusReport(worker_id=self.worker_id, pending=len(self.worker.pending()), rooms=[])
        )
        rooms: list[Any] = []
        after: str | None = None
        while chunk := list(itertools.islice(self.worker.statuses(after=after), STATUS_CHUNK)):
            rooms += msgspec.to_builtins(chunk)
            after = chunk[-1].room
            await trio.lowlevel.checkpoint()
        report["rooms"] = rooms
        report |= {"connections": len(self.connections), "admitting": self.worker.admitting}
        report |= self.tasks.status()
        return report

    async def cancel(self, delivery_id: str) -> dict[str, Any]:
        await self.worker.cancel(delivery_id)
        return {"delivery_id": delivery_id, "cancelled": True}

    def _status(
        self, room: str | None, *, after: str | None = None, bound: int | None = None
    ) -> StatusReport:
        """The rooms (``room`` only, or those sorted ``after`` one), as many as a frame of
        ``bound`` bytes holds (P15), and how many more there are."""
        worker = self.worker
        if room is not None:
            rooms: Iterable[RoomStatus] = sorted_after(
                worker.status(room), lambda status: status.room, after
            )
            total = len(list(rooms))
        else:  # only the statuses it carries are built (and one more: the first left out)
            rooms, total = worker.statuses(after=after), worker.rooms_after(after)
        report = StatusReport(
            worker_id=self.worker_id,
            pending=len(worker.pending()),
            rooms=[],
            rooms_left_out=total,  # its widest: the count only shrinks
        )
        if bound is None:
            return msgspec.structs.replace(report, rooms=list(rooms), rooms_left_out=0)
        carried = fit_prefix(rooms, bound - len(encode(report)))
        return msgspec.structs.replace(report, rooms=carried, rooms_left_out=total - len(carried))

    # -- signals to every connection ---------------------------------------------------

    async def fan_out_events(self) -> None:
        """Copy the worker's signals to every authenticated connection (S3: results are
        followed per connection; signals are not durable, a full queue drops them)."""
        async for event in self.worker.events():
            self._fan_out(event)

    async def fan_out_task_events(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Copy every task's ``task_event`` to every authenticated connection (P12), like the
        room signals: a task's durable state is always in its ``task_view``."""
        async with self.tasks.runner.events(buffer=EVENT_QUEUE * 4) as events:
            task_status.started()
            async for event in events:
                self._fan_out(event)

    def _fan_out(self, event: RoomEvent | TaskEvent) -> None:
        for connection in list(self.connections):
            try:
                connection.events[0].send_nowait(event)
            except trio.WouldBlock:
                connection.dropped_events += 1

    # -- one connection ----------------------------------------------------------------

    async def handle(self, request: WebSocketRequest) -> None:
        """The websocket handler: the ``Origin`` check, then the connection's life. Whatever
        goes wrong with one connection ends that connection only (S2): trio-websocket runs
        every handler in the server's own nursery, so an exception let out of here — a client
        that resets in the handshake, a bug — would stop the whole host."""
        peer = "a client"
        try:
            peer = _peer(request)
            if await self._refused_origin(request):
                return
            if self.unauthenticated >= self.server.max_unauthenticated:
                await self._refuse_crowd(request)
                return
            with self._until_hello() as said_hello:  # counted from here, no await before
                ws = await request.accept()
                await self._serve(ws, peer, said_hello)
        except ConnectionClosed:
            pass  # the client went away: what it admitted goes on (S3)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            logger.info("connection from %s lost: %s", peer, exc, extra=fields("connection_lost"))
        except Exception:
            logger.exception(
                "connection from %s failed (only it is closed)",
                peer,
                extra=fields("connection_failed", code=ReasonCode.SERVER_FAULT),
            )
        finally:
            logger.info("connection from %s closed", peer, extra=fields("connection_closed"))

    async def _refused_origin(self, request: WebSocketRequest) -> bool:
        """Refuse a browser's handshake from an ``Origin`` not allowed (S1): whether it was."""
        origin = _header(request, b"origin")
        if origin is None or origin in self.server.allowed_origins:
            return False
        logger.warning(
            "refused a handshake from origin %s",
            _shown(origin),
            extra=fields("handshake_refused", code=ReasonCode.ORIGIN_REFUSED),
        )
        body = msgspec.json.encode(
            {"code": ReasonCode.ORIGIN_REFUSED, "message": "this Origin is not allowed"}
        )
        await request.reject(403, extra_headers=[(b"content-type", b"application/json")], body=body)
        return True

    @contextlib.contextmanager
    def _until_hello(self) -> Iterator[Callable[[], None]]:
        """Count a connection among those that have not said hello (S1) until the callable
        it yields is called (its hello was welcomed) or it ends."""
        self.unauthenticated += 1
        counted = True

        def said_hello() -> None:
            nonlocal counted
            if counted:
                counted = False
                self.unauthenticated -= 1

        try:
            yield said_hello
        finally:
            said_hello()

    async def _refuse_crowd(self, request: WebSocketRequest) -> None:
        """Refuse a handshake while ``max_unauthenticated`` connections have not said hello
        (S1): HTTP 503, ``too_many_connections``."""
        logger.warning(
            "refused a handshake: %d connections have not said hello yet",
            self.unauthenticated,
            extra=fields("handshake_refused", code=ReasonCode.TOO_MANY_CONNECTIONS),
        )
        body = msgspec.json.encode(
            {
                "code": ReasonCode.TOO_MANY_CONNECTIONS,
                "message": "too many connections have not said hello yet; try again later",
            }
        )
        await request.reject(503, extra_headers=[(b"content-type", b"application/json")], body=body)

    async def _serve(
        self, ws: WebSocketConnection, peer: str, said_hello: Callable[[], None]
    ) -> None:
        connection = _Connection(ws, peer)
        try:
            await self._serve_connection(connection, said_hello)
        finally:
            if connection.authenticated:  # its place is free for another (S1)
                connection.authenticated = False
                self.authenticated -= 1

    async def _serve_connection(
        self, connection: _Connection, said_hello: Callable[[], None]
    ) -> None:
        with trio.move_on_after(self.server.hello_seconds) as waited:
            hello = await self._handshake(connection)
        if waited.cancelled_caught:  # still counted until let go (S1): its close takes time
            timeout = ErrorFrame(
                code=ReasonCode.HELLO_TIMEOUT,
                message=f"no valid hello within {self.server.hello_seconds:g} s",
                ref="hello",
            )
            await self._refuse_and_close(connection, timeout, POLICY_VIOLATION, "no hello in time")
            return
        if hello is None:
            return
        said_hello()
        if hello.ack_seq is not None:
            try:
                await self.worker.ack(hello.ack_seq)
            except PiRuntimeError as error:  # the result log failed (L17): said, not fatal
                await connection.send(error_frame(error, ref="hello"))
        # its stream starts above it (S3)
        connection.sent_seq = connection.sending_seq = self.worker.acked_seq
        self.connections.add(connection)
        try:
            async with trio.open_nursery() as nursery:
                for part in (self._send_results, self._send_events):
                    nursery.start_soon(self._until_closed, part, connection, None)
                nursery.start_soon(self._until_closed, self._read, connection, nursery.cancel_scope)
        finally:
            self.connections.discard(connection)
            connection.close()

    @staticmethod
    async def _until_closed(
        part: Callable[[_Connection], Awaitable[None]],
        connection: _Connection,
        scope: trio.CancelScope | None,
    ) -> None:
        """Run one part of a connection until the websocket closes. The reader's end (it
        read every frame the client sent before its close, S3) ends every part; a sender's
        ends that sender only: the reader may still have frames to act on — an ``ack``."""
        try:
            await part(connection)
        except ConnectionClosed:
            connection.close()  # nothing more is sent here: a flush need not wait (S5)
            if scope is not None:
                scope.cancel()

    async def _handshake(self, connection: _Connection) -> Hello | None:
        """Frames until a valid ``hello``: ``welcome`` and the hello, or ``None`` once the
        connection is closed for a refused token or protocol."""
        while True:
            hello = await self._next_frame(connection)
            if hello is None:
                continue
            if not isinstance(hello, Hello):
                await connection.send(
                    ErrorFrame(
                        code=ReasonCode.HELLO_REQUIRED,
                        message="send hello {protocol, token, client} first",
                        ref=frame_type(hello),
                    )
                )
                continue
            try:
                expected = await trio.to_thread.run_sync(read_token, self.state_dir)
            except (PiRuntimeError, OSError) as exc:  # O2: refused, for every client
                await self._token_unreadable(connection, exc)
                return None
            if expected is None or not token_matches(expected, hello.token):
                refusal = ErrorFrame(
                    code=ReasonCode.TOKEN_INVALID,
                    message="the token is missing or wrong (it is in the state "
                    "directory's token file)",
                    ref="hello",
                )
                await self._refuse_and_close(connection, refusal, POLICY_VIOLATION, "token refused")
                return None
            try:
                version = negotiate(hello.protocol)
            except ProtocolError as error:
                await self._refuse_and_close(
                    connection, error_frame(error), POLICY_VIOLATION, "unsupported protocol"
                )
                return None
            if self.authenticated >= self.server.max_authenticated:
                await self._refuse_authenticated(connection)
                return None
            self.authenticated += 1  # no await since the count was looked at
            connection.authenticated = True
            await connection.send(Welcome(protocol=version, worker_id=self.worker_id))
            logger.info(  # the client's name shown short (P19); its token never
                "connection from %s: hello from %s",
                connection.peer,
                _shown(hello.client),
                extra=fields("connection_opened"),
            )
            return hello

    async def _refuse_and_close(
        self, connection: _Connection, refusal: ErrorFrame, code: int, reason: str
    ) -> None:
        """Send ``refusal`` and close the websocket with ``code`` — for at most
        ``hello_seconds``, then the TCP connection is closed all the same (S1).
        trio-websocket's close waits for the client's answering close frame without end, and
        the send for a client that reads; a client that does neither would otherwise keep its
        connection, and a file descriptor, for ever."""
        with trio.move_on_after(self.server.hello_seconds):
            with contextlib.suppress(ConnectionClosed):  # gone already: closed below
                await connection.send(refusal)
            await connection.ws.aclose(code, reason)  # cancelled: it closes the TCP stream
            return
        await trio.aclose_forcefully(connection.ws)  # the send took all the time

    async def _refuse_authenticated(self, connection: _Connection) -> None:
        """A valid hello while ``max_authenticated`` connections are past theirs (S1):
        ``too_many_authenticated`` and the connection closed, 1013 (try again later)."""
        logger.warning(
            "refused a hello from %s: %d connections are authenticated already",
            connection.peer,
            self.authenticated,
            extra=fields("handshake_refused", code=ReasonCode.TOO_MANY_AUTHENTICATED),
        )
        refusal = ErrorFrame(
            code=ReasonCode.TOO_MANY_AUTHENTICATED,
            message=f"this server has {self.server.max_authenticated} connections past "
            "their hello already ([server] max_authenticated); connect again later",
            ref="hello",
        )
        await self._refuse_and_close(connection, refusal, TRY_AGAIN_LATER, "too many connections")

    async def _token_unreadable(
        self, connection: _Connection, exc: PiRuntimeError | OSError
    ) -> None:
        """The token file cannot be used (O2: not private, not a token, unreadable): the
        operator is told in the log; the client gets the code and a closed connection."""
        code = exc.code if isinstance(exc, PiRuntimeError) else ReasonCode.SERVER_FAULT
        logger.error(
            "refused a hello: the state directory's token file cannot be used: %s",
            exc,
            extra=fields("token_unusable", code=code),
        )
        refusal = ErrorFrame(
            code=str(code),
            message="the server cannot check tokens now (its token file cannot be used; "
            "the operator is told)",
            ref="hello",
        )
        await self._refuse_and_close(connection, refusal, POLICY_VIOLATION, "token file unusable")

    async def _next_frame(self, connection: _Connection) -> ClientFrame | None:
        """The next client frame, or ``None`` after answering a bad one with its error (S2)."""
        message = await connection.ws.get_message()
        self.frames_received += 1
        try:
            if isinstance(message, bytes):
                reject_binary_frame(message)
            return decode_client_frame(message, max_size=self.server.max_frame_bytes)
        except ProtocolError as error:
            if error.code is ReasonCode.UNSUPPORTED_PROTOCOL:
                await self._refuse_and_close(
                    connection, error_frame(error), POLICY_VIOLATION, "unsupported protocol"
                )
                return None
            with contextlib.suppress(ConnectionClosed):  # the next read says it is closed
                await connection.send(error_frame(error))
            return None

    async def _read(self, connection: _Connection) -> None:
        """Act on every frame the client sends, until the websocket is closed and every frame
        it sent before its close was acted on (S3: an ``ack`` just before a close counts),
        however an answer's send fails meanwhile; only then does the read end."""
        while True:
            frame = await self._next_frame(connection)  # ConnectionClosed: nothing left
            if frame is not None:
                with contextlib.suppress(ConnectionClosed):  # the next read says it is closed
                    await self._answer(connection, frame)

    async def _answer(self, connection: _Connection, frame: ClientFrame) -> None:
        """Act on one frame; a refusal or a fault is answered with its code (S2)."""
        try:
            await self._act(connection, frame)
        except PiRuntimeError as error:
            await connection.send(error_frame(error, ref=frame_ref(frame)))
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            raise  # the connection itself is gone
        except Exception:  # a fault stays with its frame: answered, the connection usable
            logger.exception(
                "the server failed on a %s frame from %s",
                frame_type(frame),
                connection.peer,
                extra=fields("frame_failed", code=ReasonCode.SERVER_FAULT),
            )
            fault = ErrorFrame(
                code=ReasonCode.SERVER_FAULT,
                message="the server failed on this frame (the operator is told); "
                "the connection stays usable",
                ref=frame_ref(frame),
            )
            await connection.send(fault)

    async def _act(self, connection: _Connection, frame: ClientFrame) -> None:
        if isinstance(frame, Deliver):
            await self._deliver(connection, frame)
        elif isinstance(frame, Cancel):
            await self.worker.cancel(frame.delivery_id)
        elif isinstance(frame, Ack):
            # at most what this connection was sent (S3): a result it was not sent yet (its
            # stream is behind, or the client guessed) stays unacknowledged and comes in turn
            await self.worker.ack(min(frame.seq, connection.sending_seq))
        elif isinstance(frame, StatusRequest):
            bound = self.server.max_frame_bytes
            await connection.send(self._status(frame.room, after=frame.after, bound=bound))
        elif isinstance(frame, TaskSubmit | TaskReplyFrame | TaskControl | TaskShow):
            await self._task_frame(connection, frame)
        elif isinstance(frame, FetchAttachment):
            await self._fetch(connection, frame.id)
        else:  # a second hello: the connection is already authenticated
            await connection.send(
                ErrorFrame(
                    code=ReasonCode.HELLO_REQUIRED,
                    message="this connection already said hello",
                    ref="hello",
                )
            )

    async def _task_frame(
        self, connection: _Connection, frame: TaskSubmit | TaskReplyFrame | TaskControl | TaskShow
    ) -> None:
        """One task frame (P11): a refusal is a ``TaskError`` with its code (``_read`` sends
        it as ``error`` with ``ref`` = the task id)."""
        tasks = self.tasks
        if isinstance(frame, TaskSubmit):
            request: dict[str, Any] = msgspec.to_builtins(frame)
            view, new = await tasks.submit(request)
            await connection.send(
                TaskAccepted(
                    task_id=view.task_id,
                    state=view.state,
                    disposition="started" if new else "duplicate",
                )
            )
            return
        bound = self.server.max_frame_bytes
        if isinstance(frame, TaskShow):
            if frame.task_id is None:  # the tasks after ``after`` that fit, by id (P15)
                listed = sorted_after(tasks.tasks(), lambda view: view.task_id, frame.after)
                await connection.send(fit_task_list(listed, bound))
                return
            view = tasks.show(frame.task_id)
        elif isinstance(frame, TaskReplyFrame):
            view = await tasks.reply(frame.task_id, frame.text, frame.correlation)
        else:
            view = await tasks.control(
                frame.task_id,
                frame.action,
                reason=frame.reason,
                epochs=frame.epochs,
                seconds=frame.seconds,
            )
        await connection.send(TaskViewFrame.of(fit_task_view(view, bound)))

    async def _deliver(self, connection: _Connection, frame: Deliver) -> None:
        delivery_id = frame.delivery_id
        if (  # S4: the cap is on what this frame would admit; a finished one admits nothing
            delivery_id not in connection.in_flight
            and len(connection.in_flight) >= self.server.max_in_flight
            and self.worker.result_of(delivery_id) is None
        ):
            raise DeliveryError(
                ReasonCode.TOO_MANY_IN_FLIGHT,
                f"this connection already has {self.server.max_in_flight} deliveries in "
                "flight; wait for results before sending more",
            )
        accepted = await self.worker.deliver(frame.request())
        stored = self.worker.result_of(delivery_id)
        if stored is None:
            connection.in_flight.add(delivery_id)
        await connection.send(accepted)
        # a duplicate's stored result again, with its seq (S3) — now only if this
        # connection's stream has passed it (its start included: everything below it is
        # acknowledged); one further on comes in the stream, in seq order — acknowledged
        # since or not, the stream sends every result above its start — so results reach a
        # connection in seq order and each once before it is sent again
        if (
            accepted.disposition == "duplicate"
            and stored is not None
            and stored.seq <= connection.sent_seq
        ):
            await connection.send(await self._checked(stored))

    async def _send_results(self, connection: _Connection) -> None:
        # every result up to its start (``_serve`` sets it) is acknowledged
        async for result in self.worker.results(after=connection.sent_seq):
            connection.in_flight.discard(result.delivery_id)
            checked = await self._checked(result)
            connection.sending_seq = result.seq  # its ack may come before the send returns
            await connection.send(checked)
            connection.sent_seq = result.seq
            connection.sent_more.set()
            connection.sent_more = trio.Event()

    # -- attachments (docs/design/attachments.md) --------------------------------------

    async def _checked(self, result: DeliveryResult) -> DeliveryResult:
        """``result`` as it may be sent now (:meth:`_prepared`), or — when preparing it
        failed unexpectedly — as truthful a frame as can still be built (P21): the record's
        own words, its attachments unchecked (:meth:`_unchecked`); only when that fails too,
        marked unsendable (P17): ``failed`` with ``server_fault``, its seq and ids, nothing
        else. Results go out in seq order and again at every reconnect until acknowledged,
        so a fault let out of here would end the connection at this result every time and
        hold back every later one. The fault is logged once per result (with its traceback —
        both, when the second frame failed too), not at every re-send (P20)."""
        try:
            return await self._prepared(result)
        except Exception as fault:
            first: BaseException = fault
        try:
            sent = self._unchecked(result)
            how = "as recorded, its attachments marked unchecked (lost, server_fault)"
        except Exception as second:
            second.__context__ = first  # the traceback logged shows both
            first = second
            sent, how = self._unsendable(result), "as failed (server_fault)"
        if self._first_time("unsendable", result.seq):
            logger.error(
                "result %d could not be prepared for sending: it is sent %s; its record is "
                "unchanged",
                result.seq,
                how,
                exc_info=first,
                extra=fields(
                    "result_unsendable",
                    delivery_id=result.delivery_id,
                    code=ReasonCode.SERVER_FAULT,
                    seq=result.seq,
                ),
            )
        return sent

    def _unchecked(self, result: DeliveryResult) -> DeliveryResult:
        """``result`` as its record says, no attachment checked (P21): each attachment
        marked ``lost`` with ``server_fault`` — the server could not find it intact, so it
        is never shown as there — and the frame fitted to the bound as any result is (P14)."""
        unchecked = [
            msgspec.structs.replace(attachment, lost=True, code=str(ReasonCode.SERVER_FAULT))
            for attachment in result.attachments
        ]
        return fit_result(
            msgspec.structs.replace(result, attachments=unchecked), self.server.max_frame_bytes
        )

    @staticmethod
    def _unsendable(result: DeliveryResult) -> DeliveryResult:
        """P17's frame: ``failed`` with ``server_fault``, its seq and ids, nothing else — it
        cannot fail and fits any bound."""
        return DeliveryResult(
            seq=result.seq,
            delivery_id=result.delivery_id,
            room=result.room,
            outcome=Outcome.FAILED,
            code=str(ReasonCode.SERVER_FAULT),
        )

    def _first_time(self, what: str, seq: int) -> bool:
        """Whether ``what`` about result ``seq`` is to be logged now: the first time, not
        again while the result is re-sent unacknowledged (P20)."""
        if (what, seq) in self._told:
            return False
        acked = self.worker.acked_seq
        self._told = {told for told in self._told if told[1] > acked}
        self._told.add((what, seq))
        return True

    async def _prepared(self, result: DeliveryResult) -> DeliveryResult:
        """``result`` as it may be sent now (A7): each attachment whose bytes are not there
        intact is marked ``lost`` with its code; the words go out unchanged — unless the
        result was recorded under a larger ``max_frame_bytes`` than this server's: then its
        text is cut to fit, and attachments that leave no room are left out (P14)."""
        shown = await self._with_attachments_checked(result)
        sent = fit_result(shown, self.server.max_frame_bytes)
        if sent is not shown and self._first_time("truncated", result.seq):
            logger.warning(
                "result %d was recorded under a larger frame bound: it is sent with the first "
                "%d of %d characters and %d of %d attachments",
                result.seq,
                len(sent.text or ""),
                len(result.text or ""),
                len(sent.attachments),
                len(result.attachments),
                extra=fields("reply_truncated", delivery_id=result.delivery_id, seq=result.seq),
            )
        return sent

    async def _with_attachments_checked(self, result: DeliveryResult) -> DeliveryResult:
        if not result.attachments:
            return result
        shown = []
        for attachment in result.attachments:
            problem = await self._intact(attachment.sha256, attachment.size)
            if problem is not None:
                if self._first_time(f"lost:{attachment.id}", result.seq):
                    logger.warning(
                        "result %d: attachment %s is lost (%s)",
                        result.seq,
                        attachment.id,
                        problem,
                        extra=fields("attachment_lost", code=problem, seq=result.seq),
                    )
                attachment = msgspec.structs.replace(attachment, lost=True, code=str(problem))
            shown.append(attachment)
        return msgspec.structs.replace(result, attachments=shown)

    async def _intact(self, sha256: str, size: int) -> ReasonCode | None:
        """``None`` when the attachment is there intact, else why not (A3): by its file's
        identity while the file is the one a read verified and unchanged since — one ``stat``,
        no hash (A13) — else by its bytes, hashed a piece at a time (none kept)."""
        if await trio.to_thread.run_sync(self.attachments.unchanged, sha256, size):
            return None
        problem = await trio.to_thread.run_sync(self.attachments.check, sha256, size)
        if problem is None or await self._kept_from_the_store(sha256, size) is None:
            return problem
        return None

    async def _kept_from_the_store(self, sha256: str, size: int) -> bytes | None:
        """On a store several hosts share, the intact bytes of an attachment this host's root
        lacks (or holds damaged), taken from the store and kept here (A11); ``None`` when
        there is no such store, it has no intact copy, or it cannot answer."""
        if self.worker.config.store.url is None:
            return None
        try:
            shared = await self.worker.store.read_document(SHARED_ATTACHMENTS + sha256)
        except PiRuntimeError as error:
            logger.warning(
                "attachment %s: the store cannot give it: %s",
                sha256,
                error,
                extra=fields("attachment_unavailable", code=error.code),
            )
            return None
        if shared is None or len(shared) != size or hashlib.sha256(shared).hexdigest() != sha256:
            return None
        try:
            await trio.to_thread.run_sync(self.attachments.put, shared)
        except OSError as exc:  # not kept here (a full disk): the intact bytes still go out
            logger.warning(
                "attachment %s: could not keep the store's copy here: %s",
                sha256,
                exc,
                extra=fields("attachment_not_kept"),
            )
        return shared

    async def _pieces(self, sha256: str, size: int) -> _Pieces | ReasonCode:
        """An attachment to be read in pieces, found intact (A3), or why not: this host's
        file (:meth:`AttachmentStore.open`: one piece held at a time) — on a store several
        hosts share, the store's copy once kept here (A11), or held in memory when it could
        not be kept."""
        opened = await trio.to_thread.run_sync(self.attachments.open, sha256, size)
        if not isinstance(opened, ReasonCode):
            return opened
        shared = await self._kept_from_the_store(sha256, size)
        if shared is None:
            return opened
        kept = await trio.to_thread.run_sync(self.attachments.open, sha256, size)
        return _HeldPieces(shared) if isinstance(kept, ReasonCode) else kept

    async def _fetch(self, connection: _Connection, attachment_id: str) -> None:
        """``fetch_attachment`` (A9): the bytes of an attachment a published result names,
        checked against its sha256 before the first chunk, in ``attachment_data`` chunks paced
        at the configured rate. A chunk is read when it is sent, and what is read is hashed
        again: the chunk marked ``last`` goes only when every byte sent was the sha256's, else
        the fetch ends ``attachment_damaged`` after the chunks already sent. Held meanwhile:
        one chunk, never the file — whatever its send waits for."""
        ref = self.worker.attachment(attachment_id)
        if ref is None:
            raise AttachmentError(ReasonCode.ATTACHMENT_UNKNOWN, "no result names this attachment")
        pieces = await self._pieces(ref.sha256, ref.size)
        if isinstance(pieces, ReasonCode):
            raise AttachmentError(
                pieces, "its bytes are not there intact; the reply's words were sent"
            )
        step = _chunk_bytes(ref.id, ref.size, self.server.max_frame_bytes)
        try:
            while True:
                offset = pieces.offset
                chunk = await trio.to_thread.run_sync(pieces.next, step)
                if isinstance(chunk, ReasonCode):
                    raise AttachmentError(
                        chunk,
                        f"its file changed while it was sent: discard the {offset} bytes sent "
                        "before this error (a new fetch checks the file again)",
                    )
                last = pieces.offset >= ref.size
                frame = AttachmentData(
                    id=ref.id,
                    offset=offset,
                    size=ref.size,
                    data=base64.b64encode(chunk).decode("ascii"),
                    last=last,
                )
                del chunk  # held while the send waits: the frame only
                await connection.send(frame)
                if last:
                    return
                await trio.sleep((pieces.offset - offset) / self.fetch_rate)
        finally:
            pieces.close()

    async def flush(self, seconds: float) -> None:
        """Let every connection receive the results published so far, for up to ``seconds``
        (a drained turn's result goes out before the server stops; S5)."""
        last = self.worker.last_seq
        with trio.move_on_after(seconds):
            for connection in list(self.connections):
                await connection.sent_up_to(last)

    async def _send_events(self, connection: _Connection) -> None:
        async for event in connection.events[1]:
            await connection.send(event)


class _Pieces(Protocol):
    """An attachment read in order a piece at a time (:class:`AttachmentReader`)."""

    @property
    def offset(self) -> int: ...

    def next(self, limit: int) -> bytes | ReasonCode: ...

    def close(self) -> None: ...


class _HeldPieces:
    """Checked bytes held in memory, read as :class:`AttachmentReader` reads a file: the
    store's copy of an attachment this host could not keep (A11, a full disk)."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.offset = 0

    def next(self, limit: int) -> bytes | ReasonCode:
        piece = self._data[self.offset : self.offset + limit]
        self.offset += len(piece)
        return piece

    def close(self) -> None:
        self._data = b""


def _chunk_bytes(attachment_id: str, size: int, max_frame_bytes: int) -> int:
    """Bytes of an attachment per ``attachment_data`` frame: :data:`ATTACHMENT_CHUNK`, or
    fewer so that the frame, its base64 included, fits ``max_frame_bytes`` (P15)."""
    empty = AttachmentData(id=attachment_id, offset=size, size=size, data="", last=False)
    room = max_frame_bytes - len(encode(empty))
    return max(1, min(ATTACHMENT_CHUNK, room // 4 * 3))  # base64: 4 characters for 3 bytes


@contextlib.contextmanager
def _listening(setting: str, address: str) -> Iterator[None]:
    """A listener that cannot bind (the port taken, an address not this host's) is the
    setting's refusal, ``config_invalid`` naming it (O11), not a bare ``errno``."""
    try:
        yield
    except OSError as exc:
        raise ConfigError(setting, f"cannot listen on {address}: {exc.strerror}") from None


def _shown(text: str) -> str:
    """A client's own text as a log line shows it (P19): escaped (``%r``: no line breaks of
    its own), at most :data:`SHOWN_CHARS` characters, with its length when cut — a ``hello``'s
    ``client`` may be as long as a frame."""
    if len(text) <= SHOWN_CHARS:
        return repr(text)
    return f"{text[:SHOWN_CHARS]!r}... ({len(text)} characters)"


def _peer(request: WebSocketRequest) -> str:
    """The client's address, for the log (a client already gone has none: ``ENOTCONN``)."""
    try:
        return f"{request.remote}"
    except OSError:
        return "a client already gone"


def _header(request: WebSocketRequest, name: bytes) -> str | None:
    for key, value in request.headers:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


@raises_one_error
@contextlib.asynccontextmanager
async def open_server(
    config: RoomWorkerConfig,
    options: ServeOptions = ServeOptions(),
    *,
    base_dir: Path | None = None,
) -> AsyncIterator[RoomServer]:
    """Run the room worker on ``config`` behind a websocket on ``options.host``:``port``
    and the admin socket in its state directory, until the block ends.

    The token is created at first start (``created`` is logged, never the token itself: the
    command line prints it once). Raises :class:`ConfigError` for a refused bind (S6) and
    ``watchdog_config_invalid`` for a ``[watchdog]`` table that breaks a rule (WD9), both
    before anything starts. Task lanes run beside the room worker on the same store.
    """
    from ._admin import serve_admin

    config = validate_config(config, base=base_dir)
    check_bind(options, config)
    watchdog_policy(config, timescale=options.unsafe_test_timescale)
    state_dir = Path(config.state_dir)
    worker_id = f"{socket.gethostname()}:{os.getpid()}"
    async with contextlib.AsyncExitStack() as stack:
        worker = await stack.enter_async_context(open_room_worker(config, base_dir=base_dir))
        shared = None
        if worker.leases is not None:  # several hosts: task lanes under leases (S30-S32)
            shared = SharedTasks(
                store=worker.leases.store,
                lease_seconds=config.store.lease_seconds,
                poll_seconds=config.store.poll_seconds,
                shared_worktrees=config.store.shared_worktrees,
                takeover_seconds=config.store.task_takeover_seconds,
            )
        tasks = await stack.enter_async_context(
            open_task_service(
                config,
                store=worker.store,
                receipts=worker.receipts,
                timescale=options.unsafe_test_timescale,
                shared=shared,
            )
        )
        server = RoomServer(worker, state_dir, worker_id=worker_id, tasks=tasks)
        async with trio.open_nursery() as nursery:
            grace = config.thresholds.abort_grace_seconds  # a cancel's deadline (O7)
            admin = functools.partial(serve_admin, tasks=tasks, abort_grace=grace)
            await nursery.start(admin, state_dir, server)
            nursery.start_soon(server.fan_out_events)
            await nursery.start(server.fan_out_task_events)
            with _listening("port", f"{options.host}:{options.port}"):
                listeners = await open_websocket_listeners(  # S1: capped before the upgrade
                    options.host,
                    options.port,
                    options.ssl_context,
                    cap=config.server.max_unauthenticated,
                )
                websocket = WebSocketServer(
                    server.handle,
                    listeners,  # type: ignore[arg-type]  # any Listener serves (trio.serve_listeners)
                    handler_nursery=nursery,
                    max_message_size=4 * config.server.max_frame_bytes,
                    connect_timeout=config.server.hello_seconds,  # the upgrade request too
                )
                await nursery.start(websocket.run)
            server.port = listeners[0].port  # (one port: asked for, or the kernel's for 0)
            async with contextlib.AsyncExitStack() as metrics:
                if config.metrics.listen is not None:
                    host, port = metrics_address(config.metrics.listen)
                    with _listening("metrics.listen", config.metrics.listen):
                        bound = await metrics.enter_async_context(
                            open_metrics(
                                server,
                                host,
                                port,
                                nursery,
                                page=server if config.metrics.page else None,
                                ssl_context=options.ssl_context,
                            )
                        )
                    server.metrics_port = bound.port
                # O1: made once the start can no longer fail (the lock held, every listener
                # bound), so a token this start creates is always printed; a hello before it
                # exists is refused token_invalid
                token, created = await trio.to_thread.run_sync(ensure_token, state_dir)
                server.new_token = token if created else None
                try:
                    yield server
                finally:
                    nursery.cancel_scope.cancel()


def heap_policy(config: RoomWorkerConfig) -> HeapPolicy:
    """How ``serve`` keeps its heap (S7)."""
    return HeapPolicy(freeze_seconds=config.server.heap_freeze_seconds)


async def serve_until_signalled(config: RoomWorkerConfig, options: ServeOptions) -> None:
    """Serve until SIGINT or SIGTERM, then drain (S5) and stop."""
    import signal

    policy = watchdog_policy(config, timescale=options.unsafe_test_timescale)
    with (
        trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
        loud_logging(policy),
    ):
        async with (
            open_server(config, options) as server,
            keep_heap(heap_policy(config), lambda: server.frames_received),
        ):
            scheme = "wss" if options.ssl_context is not None else "ws"
            warning = server.tasks.warning
            if warning is not None:
                print(f"pi-runtime serve: !!! {warning} !!!", flush=True)
            if server.new_token is not None:
                print(
                    f"pi-runtime: a new access token (kept in {config.state_dir}/token): "
                    f"{server.new_token}",
                    flush=True,
                )
                server.new_token = None
            print(
                f"pi-runtime serve: listening on {scheme}://{options.host}:{server.port} "
                f"(state: {config.state_dir}, agent: {config.agent})"
                + (f" [{warning}]" if warning is not None else ""),
                flush=True,
            )
            if server.metrics_port is not None:
                host, _port = metrics_address(config.metrics.listen or "")
                web = "https" if options.ssl_context is not None else "http"
                print(
                    f"pi-runtime serve: metrics on {web}://{host}:{server.metrics_port}/metrics",
                    flush=True,
                )
                if config.metrics.page:
                    print(
                        f"pi-runtime serve: the operator page on {web}://{host}:"
                        f"{server.metrics_port}/ (log in with the access token)",
                        flush=True,
                    )
            async for signum in signals:
                name = signal.Signals(signum).name
                break
            server.worker.stop_admitting()
            print(
                f"pi-runtime serve: {name}: not admitting; draining for up to "
                f"{config.thresholds.drain_timeout_seconds:g} s"
                + (f" [{warning}]" if warning is not None else ""),
                flush=True,
            )
            await server.worker.drain()
            await server.flush(FLUSH_SECONDS)
            left = server.worker.pending()
            logger.info(
                "stopping; %d deliveries stay pending for the next start",
                len(left),
                extra=fields("stopping"),
            )
