"""The model gateway: the worker's model endpoint, journaling every step
(docs/design/boundaries.md).

A worker (the real Pi or Fake-Pi) is pointed at the gateway instead of the
model: OpenAI-compatible streaming ``POST …/chat/completions`` on loopback. The
gateway answers each request either from the journal (replay: upstream is not
called) or by calling the upstream model and relaying its stream. The
invariants (G1…) are in ``docs/design/gateway.md``; in short:

* a step is identified by the sha256 of the canonical request body (G1);
* the intent is durable before upstream is called (G2); chunks pass through as
  they arrive (G3); the terminal part — the ``finish_reason`` chunk, the usage
  chunk and ``[DONE]`` — is held until the complete response is durable (G4);
  SSE keepalive comments flow whenever nothing else did for an interval (G5);
* a recorded step is answered from the journal, byte-identical framing, and
  never paid twice (G6); missing tool-call ids are minted from digest + index (G7);
* only requests carrying the current epoch's secret are served (G8); the
  upstream key is read from the environment per request and written nowhere (G9);
* upstream inactivity ends the stream with an error Pi retries in-process (G10);
  so does, when configured, an upstream that sends no data event, only comments (G15);
  an upstream error, before the stream or inside it, is relayed and never journaled (G10);
* with ``park_unavailable``, an unavailable provider — no response (a cut, or a clean end
  with no terminal part, before any of the answer too), 408, 429, 5xx, or an outage it
  reports inside a 200 stream — ends the worker's turn with :data:`PARKED_MESSAGE` for the
  runtime's backoff (PB1), by one rule: while nothing of the answer was passed on
  (:func:`carries_answer`);
* :attr:`Gateway.upstream_failure` is how the last call upstream ended, set afresh by each
  call: the failure the backoff judges a turn that ends on it by (PB1); an outage that ends
  the worker's turn is told at once too (:attr:`Gateway.on_unavailable`, PB4), as an
  answer is (:attr:`Gateway.on_answered`).

The pure reading of a stream (:func:`~runtime._boundary._stream.request_digest`,
:func:`~runtime._boundary._stream.is_terminal`, :func:`~runtime._boundary._stream.stream_failure`,
:func:`~runtime._boundary._stream.carries_answer`, …) is in :mod:`runtime._boundary._stream`
and carries the decisions; a body and its digest are read by difference from the last one
(:class:`~runtime._boundary._bodies.RequestBodies`, G1a); :class:`Gateway` and
:func:`serve_gateway` are the Trio shell.

Resource handling: :func:`serve_gateway` runs until cancelled. Upstream connections are
kept alive in the gateway's :class:`~runtime._boundary._http.ConnectionPool` (a lane's
requests are sequential: one connection serves them all); a request's connection goes back
to the pool only when its response was read to its end, and is closed otherwise however the
handler returns; :func:`serve_gateway` closes the idle ones when it ends.

Error handling: protocol problems are answered to the worker (401, 400, an SSE
``error`` event, or a cut connection — each with a ``gateway_*`` reason code in
the message). A failed journal append is not: the worker's stream is cut, and
:func:`serve_gateway` raises the :class:`~runtime._errors.PiRuntimeError` to its
owner (the lane), which fences the epoch.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import trio

from .._errors import PiRuntimeError, ReasonCode, StepRefused
from .._metrics import MODEL_REQUESTS, labelled
from .._pi._provider_errors import USAGE_LIMIT_PATTERN
from ._bodies import RequestBodies
from ._http import (
    ARRIVAL_SECONDS,
    PENDING_CONNECTIONS,
    ConnectionPool,
    HttpClientError,
    HttpServer,
    Request,
    ResponseWriter,
    SseEvent,
    SseParser,
    refusal_text,
    serve_http,
)
from ._steps import StepJournal
from ._stream import (
    DONE,
    ToolCallIds,
    UpstreamFailure,
    carries_answer,
    is_terminal,
    is_upstream_error,
    retry_after_seconds,
    sse_data,
    stream_cut,
    stream_failure,
)

__all__ = [
    "GATEWAY_SECRET_ENV",
    "KEEPALIVE",
    "PARKED_MESSAGE",
    "ROOM_UPSTREAM_INACTIVITY",
    "Gateway",
    "GatewayConfig",
    "GatewayStatistics",
    "data_inactivity_message",
    "inactivity_message",
    "serve_gateway",
]

GATEWAY_SECRET_ENV: Final = "PI_RUNTIME_GATEWAY_SECRET"
"""The worker's environment variable holding the epoch's gateway secret; the worker's model
route names it as its API key (``"$PI_RUNTIME_GATEWAY_SECRET"``), which Pi and Fake-Pi resolve
from the environment at request time, so it is never written to the agent directory. Tools
never see it: the extension's bash ``spawnHook`` and Fake-Pi drop it from their environment."""
PARKED_MESSAGE: Final = (
    "pi-runtime: the model provider cannot be reached for now; the runtime parks this turn "
    "and resumes it when the provider is back"
)
"""What a worker is told when the gateway ends its turn for an unavailable provider (PB1):
worded so that neither Pi's retry rules nor its account-limit rules match it."""
KEEPALIVE: Final = b": keepalive\n\n"
ROOM_UPSTREAM_INACTIVITY: Final = 270.0
"""Seconds of upstream silence after which a room lane's stream is aborted (below Pi's 300 s)."""
DEFAULT_KEEPALIVE_INTERVAL: Final = 15.0
"""Well below Pi's ``httpIdleTimeoutMs`` (300 s) between body chunks."""
_SSE_HEADERS: Final = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
_json = msgspec.json.Encoder()


# ---------------------------------------------------------------- the gateway's own words


def inactivity_message(seconds: float) -> str:
    """The error text for an aborted silent upstream; matches Pi's retryable ``timed out``."""
    return (
        f"{ReasonCode.GATEWAY_UPSTREAM_INACTIVE}: the upstream model stream timed out "
        f"(no data for {seconds:g} s); the request will be retried"
    )


def data_inactivity_message(seconds: float) -> str:
    """The error text for an upstream that sent no data event, only comments (G15)."""
    return (
        f"{ReasonCode.GATEWAY_UPSTREAM_INACTIVE}: the upstream model stream timed out "
        f"(no data event for {seconds:g} s, only comments); the request will be retried"
    )


def _error_body(code: ReasonCode, message: str) -> bytes:
    return _json.encode({"error": {"message": f"{code}: {message}", "type": str(code)}})


_UNAUTHORIZED: Final = "this request does not carry the current epoch's secret"


def _refused(status: int) -> bytes:
    """The body of a request refused before the gateway saw it whole (malformed, too large,
    not whole in time, without the secret: B8)."""
    if status == 401:
        return _error_body(ReasonCode.GATEWAY_UNAUTHORIZED, _UNAUTHORIZED)
    return _error_body(ReasonCode.GATEWAY_BAD_REQUEST, refusal_text(status))


def _ended_epoch() -> bytes:
    """The refusal of a request authorized with a secret rotated while it waited (G8): its
    epoch was fenced, and nothing of it is answered after its secret stopped working."""
    return _error_body(
        ReasonCode.GATEWAY_UNAUTHORIZED,
        "the epoch this request was asked in ended while it waited; it is not answered",
    )


def _without_key(data: bytes, key: str | None) -> bytes:
    """``data`` with the upstream key blotted out wherever it appears (G9): an upstream's
    error relayed to the worker may quote the key it refused."""
    return data.replace(key.encode(), b"[upstream key]") if key else data


def _ended_delivery() -> StepRefused:
    """The refusal of a request whose delivery the lane detached while it waited (G14):
    as a released journal refuses one, since nothing will replay what it is answered."""
    return StepRefused(
        ReasonCode.GATEWAY_BAD_REQUEST,
        "the delivery this request was asked in has ended while it waited; it is not answered",
    )


# ------------------------------------------------------------------------------ the shell


GateBarrier = Callable[[dict[str, Any]], Awaitable[None]]
AnswerHook = Callable[[dict[str, Any], str, bool], Awaitable[None]]
"""``(body, digest, replayed)``: awaited once a request's step is known, before its answer."""


async def _no_barrier(body: dict[str, Any]) -> None:
    await trio.lowlevel.checkpoint()


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayConfig:
    upstream_url: str
    """The upstream's base URL (``…/v1``); ``/chat/completions`` is appended."""
    upstream_key_env: str | None = None
    """The *name* of the environment variable holding the upstream key, read per request."""
    keepalive_interval: float = DEFAULT_KEEPALIVE_INTERVAL
    upstream_inactivity: float = ROOM_UPSTREAM_INACTIVITY
    """Per lane kind: rooms :data:`ROOM_UPSTREAM_INACTIVITY`; task lanes the phase's threshold."""
    upstream_data_inactivity: float | None = None
    """G15: the stream is cut when no SSE data event (comments do not count) arrived for this
    long after the headers. Rooms: ``None``, no such deadline; task lanes: the same value."""
    request_arrival: float = ARRIVAL_SECONDS
    """B8: how long a request may take to arrive whole from its first byte (and a new
    connection to send its first byte); longer, it is answered 408 and its connection closed.
    The wait between a worker's requests on its kept-alive connection is not bounded."""
    pending_connections: int = PENDING_CONNECTIONS
    """B9: how many connections on which no request has carried the secret yet are kept open
    at once; one more closes the oldest of them. A connection that has is not counted."""
    park_unavailable: bool = False
    """PB1: an upstream that is unavailable (:attr:`UpstreamFailure.unavailable`) ends the
    worker's turn at once with :data:`PARKED_MESSAGE`, which the worker does not retry: the
    runtime's durable backoff is then the one retry policy (room and task lanes with
    ``[backoff]``). So do an outage reported inside a 200 stream (:func:`stream_failure`), an
    upstream cut and a stream that ends with no terminal part (G16), while nothing of the
    answer was passed to the worker (:func:`carries_answer`); after that G10 relays the error
    and cuts (a cut, or such an end, is relayed as a cut), and
    :attr:`Gateway.upstream_failure` keeps the failure for the backoff (:func:`stream_cut`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayStatistics:
    requests: int
    refused: int
    replayed: int
    upstream_calls: int
    journaled: int
    inactivity_aborts: int
    data_inactivity_aborts: int
    """Streams cut because only comments arrived for ``upstream_data_inactivity`` (G15)."""
    detached: int
    """Upstream responses that finished after their delivery was detached (G14)."""
    incomplete_streams: int
    """Upstream streams that ended with no terminal part, cut instead of finished (G16)."""
    stream_errors: int
    """Upstream streams that reported an error inside a 200 response: relayed, cut, never
    journaled (G10)."""
    upstream_connections: int = 0
    """Connections opened upstream (G17: requests in turn share one kept-alive connection)."""


class _Downstream:
    """The worker's side of one response: serialised sends, lazy start, keepalives.

    A worker that goes away does not stop the step: sends become no-ops and the
    upstream response is still read to the end and journaled.
    """

    def __init__(self, response: ResponseWriter) -> None:
        self._response = response
        self._lock = trio.Lock()
        self.gone = False
        self.ended = False
        """The response is whole (ended, or answered at once): nothing more is sent; a
        keepalive that waited for the lock meanwhile sends nothing."""
        self.last_sent = trio.current_time()

    @property
    def started(self) -> bool:
        return self._response.started

    async def _write(self, data: bytes, *, end: bool = False) -> None:
        async with self._lock:
            if self.gone or self.ended:
                return
            try:  # each call one write, the head with the first (G3)
                if end:
                    self.ended = True
                if not self._response.started:
                    await self._response.start(200, _SSE_HEADERS, data, end=end)
                elif end:
                    await self._response.end(data)
                else:
                    await self._response.send(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.gone = True
            self.last_sent = trio.current_time()

    async def send(self, data: bytes) -> None:
        await self._write(data)

    async def finish(self, data: bytes) -> None:
        await self._write(data, end=True)

    async def respond(self, status: int, body: bytes) -> None:
        """A whole non-stream response, if the stream has not started."""
        async with self._lock:
            if self.gone or self.ended or self._response.started:
                return
            self.ended = True
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self._response.respond(status, body)

    async def refuse(self, status: int, error: bytes) -> None:
        """An answer the gateway will not give (``error``: one ``{"error": …}`` object): a
        whole ``status`` response — or, once a keepalive has started the stream (G5), the same
        object as an SSE error event, and the stream's end. Never a bare cut: the worker reads
        a cut as a network failure and retries, and a refusal is not to be retried."""
        async with self._lock:
            if self.gone or self.ended:
                return
            self.ended = True
            try:
                if not self._response.started:
                    await self._response.respond(status, error)
                    return
                await self._response.send(sse_data(error.decode()))
                await self._response.end()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.gone = True

    async def keepalive(self, interval: float) -> None:
        """Send a keepalive comment whenever nothing was sent for ``interval`` (G5), until
        the worker is gone (a send to a gone worker does not move ``last_sent``: looping on
        would spin) or the response has ended."""
        while not self.gone and not self.ended:
            await trio.sleep_until(self.last_sent + interval)
            if trio.current_time() >= self.last_sent + interval:
                await self.send(KEEPALIVE)


class _Keepalives:
    """G5a: one task per served gateway watches every response in flight, and starts a
    response's own keepalive loop (:meth:`_Downstream.keepalive`, in its request's nursery)
    only once it has been silent for ``interval`` — so a request answered in time starts
    no task of its own."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._watched: dict[_Downstream, trio.Nursery] = {}
        self._first = trio.Event()
        """Set when a response is watched while none was: the watcher waits for it then."""

    def watch(self, downstream: _Downstream, nursery: trio.Nursery) -> None:
        """Watch ``downstream``, whose request runs in ``nursery``; :meth:`forget` it before
        that nursery closes. Due no earlier than every response already watched (G5a)."""
        self._watched[downstream] = nursery
        self._first.set()

    def forget(self, downstream: _Downstream) -> None:
        self._watched.pop(downstream, None)

    async def run(self) -> None:
        """Until cancelled: wake when the first watched response is due, hand each due one
        its own loop, and sleep until the next is due (``last_sent`` moves on as data flows,
        so a response found not due yet is looked at again when it is)."""
        while True:
            if not self._watched:
                await self._first.wait()
                self._first = trio.Event()
                continue
            await trio.sleep_until(min(d.last_sent for d in self._watched) + self._interval)
            now = trio.current_time()
            for downstream, nursery in list(self._watched.items()):
                if now >= downstream.last_sent + self._interval:
                    del self._watched[downstream]
                    nursery.start_soon(downstream.keepalive, self._interval)


class Gateway:
    """The model endpoint of one worker epoch; serve it with :func:`serve_gateway`.

    ``journal`` is the delivery's :class:`StepJournal`; ``gate_barrier(body)`` is
    awaited before a request is answered (the tool gate holds requests whose
    tool results are not yet durable there; default: no wait). ``environ`` is
    where the upstream key is looked up on each request (default ``os.environ``).
    """

    def __init__(
        self,
        config: GatewayConfig,
        journal: StepJournal,
        *,
        gate_barrier: GateBarrier | None = None,
        environ: Mapping[str, str] | None = None,
        secret: str | None = None,
        on_answer: AnswerHook | None = None,
    ) -> None:
        self.config = config
        self.journal = journal
        self._barrier = gate_barrier or _no_barrier
        self.on_answer = on_answer
        """Awaited with ``(body, digest, replayed)`` once the request's step is recorded or
        found, before anything of the answer is sent (the lane watches for its steers)."""
        self._environ = os.environ if environ is None else environ
        self._secret = secret or secrets.token_urlsafe(32)
        self._locks: dict[str, trio.Lock] = {}
        self._failure: PiRuntimeError | None = None
        self._failed = trio.Event()
        self._bodies = RequestBodies()
        """The last request's body, which the next one repeats (G1a); forgotten with its
        delivery (:meth:`forget_bodies`)."""
        self._keepalives: _Keepalives | None = None
        """The watcher while :func:`serve_gateway` runs (G5a)."""
        self.on_answered: Callable[[], None] | None = None
        """Called once a call upstream was answered and its answer journaled: the provider
        is up (PB4: the route's breaker closes then, not when the turn ends)."""
        self.on_unavailable: Callable[[UpstreamFailure], object] | None = None
        """Called with the failure once a call upstream met an unavailable provider before
        any of the answer — the one that ends the worker's turn with :data:`PARKED_MESSAGE`
        (PB1): the provider is down (PB4: the route's breaker counts it then, whatever
        becomes of the turn — cancelled, its worker dead, its lane stopped — before the
        turn's end is read). The one set when the call went upstream is called, even if its
        delivery has ended since (G14): the word is the route's, not the turn's."""
        self.upstream_failure: UpstreamFailure | None = None
        """How the last call upstream failed (PB1): a status, no response, an error inside
        the stream, a stream cut short — what the backoff judges a turn that ends on it by.
        ``None`` while a call is under way, and after one that was answered or ended in a way
        that says nothing of the provider's availability (G10 and G15's silence, a journal
        failure): every call sets it afresh, so no earlier request's failure outlives it."""
        self._upstream = ConnectionPool()
        self._stats = dict.fromkeys(
            (
                "requests",
                "refused",
                "replayed",
                "upstream_calls",
                "journaled",
                "inactivity_aborts",
                "data_inactivity_aborts",
                "detached",
                "incomplete_streams",
                "stream_errors",
            ),
            0,
        )

    @property
    def secret(self) -> str:
        """The current epoch's secret; give it to the worker, never to disk or logs."""
        return self._secret

    def rotate_secret(self) -> str:
        """A fresh secret for a new epoch; the old one stops working at once."""
        self._secret = secrets.token_urlsafe(32)
        return self._secret

    def upstream_key(self) -> str | None:
        """The upstream key, as a request sent now would carry it (G9: read from the variable
        the configuration names, at each call); ``None`` when none is configured or set. For
        hiding it (``Boundaries.worker_secrets``), never for keeping it."""
        if self.config.upstream_key_env is None:
            return None
        return self._environ.get(self.config.upstream_key_env) or None

    def statistics(self) -> GatewayStatistics:
        return GatewayStatistics(**self._stats, upstream_connections=self._upstream.opened)

    def forget_bodies(self) -> None:
        """Keep nothing of the last request's body (its delivery ended or another is
        attached: nothing of a turn stays in memory, G1a)."""
        self._bodies.forget()

    async def aclose(self) -> None:
        """Close the kept-alive upstream connections (:func:`serve_gateway` does, at its end)."""
        await self._upstream.aclose()

    def _authorized(self, request: Request) -> bool:
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(
            token.strip().encode(), self._secret.encode()
        )

    def authorize(self, head: Request) -> bool:
        """Whether a request may go on, by its head alone (B8, G8): the HTTP shell asks as
        soon as the head has arrived and answers one refused 401 before reading its body (a
        client without the secret makes the gateway hold none of it). :meth:`handle` asks
        again once the request is whole: the secret may have rotated while the body came."""
        if self._authorized(head):
            return True
        self._stats["requests"] += 1
        self._stats["refused"] += 1
        return False

    async def handle(self, request: Request, response: ResponseWriter) -> None:
        """The HTTP handler (for :func:`~runtime._boundary._http.serve_http`)."""
        journal = self.journal  # G14: the delivery attached as the request arrives is its own
        self._stats["requests"] += 1
        if not self._authorized(request):  # G8: nothing reaches upstream
            self._stats["refused"] += 1
            # B8: no idle connection is kept for a client without the secret
            await response.respond(401, _refused(401), close=True)
            return
        secret = self._secret  # G8: the epoch it is served for, checked again when its turn comes
        target = request.target.split("?", 1)[0].rstrip("/")
        if request.method != "POST" or not target.endswith("/chat/completions"):
            await response.respond(
                404,
                _error_body(ReasonCode.GATEWAY_BAD_REQUEST, "only POST …/chat/completions"),
            )
            return
        problem = "the body is not a JSON object"
        try:  # G1: JSON as JavaScript writes it, lone surrogates (``\ud83d``) included;
            # G1a: by difference from the last body; G19: Pi nests arguments in strings only
            body, digest = self._bodies.read(request.body)
        except ValueError as error:  # not JSON (msgspec.DecodeError), a key no digest can hold
            body, problem = None, f"{problem}: {error}"
        except RecursionError:  # G19: the digest's encoder recurses, as deep as the decoder
            body, problem = None, f"{problem}: JSON nested too deeply"
        if not isinstance(body, dict):
            await response.respond(400, _error_body(ReasonCode.GATEWAY_BAD_REQUEST, problem))
            return
        downstream = _Downstream(response)
        keepalives = self._keepalives
        async with trio.open_nursery() as nursery:
            if keepalives is None:  # served outside serve_gateway: no watcher (G5a)
                nursery.start_soon(downstream.keepalive, self.config.keepalive_interval)
            else:
                keepalives.watch(downstream, nursery)
            try:
                await self._barrier(body)
                lock = self._locks.setdefault(digest, trio.Lock())
                try:
                    async with lock:  # an identical request in flight: wait, then replay
                        await self._answer(body, request.body, digest, downstream, journal, secret)
                finally:
                    if not lock.locked() and lock.statistics().tasks_waiting == 0:
                        self._locks.pop(digest, None)  # only requests in flight keep one
            finally:
                if keepalives is not None:
                    keepalives.forget(downstream)  # before the nursery closes (G5a)
                nursery.cancel_scope.cancel()

    async def _answer(
        self,
        body: dict[str, Any],
        raw: bytes,
        digest: str,
        downstream: _Downstream,
        journal: StepJournal,
        secret: str,
    ) -> None:
        """Answer the request from ``journal``, the one attached when it arrived (G14), if
        ``secret``, the one it was authorized with, is still the current one (G8)."""
        if secret != self._secret:  # G8: its epoch was fenced while it waited (barrier, lock)
            self._stats["refused"] += 1
            await downstream.refuse(401, _ended_epoch())
            return
        if journal is not self.journal:  # G14: its delivery ended while it waited (barrier, lock)
            await self._refuse(_ended_delivery(), downstream)
            return
        recorded = await journal.lookup(digest)
        if recorded is not None:  # G6: replay, upstream untouched
            self._stats["replayed"] += 1
            labelled(MODEL_REQUESTS, "journal").inc()
            if not await self._announce(body, digest, replayed=True):
                return
            await downstream.finish(b"".join(map(sse_data, recorded)))  # one write
            return
        key: str | None = None
        if self.config.upstream_key_env is not None:
            key = self.upstream_key()  # G9: per request, kept local
            if not key:
                await downstream.refuse(
                    500,
                    _error_body(
                        ReasonCode.GATEWAY_UPSTREAM_KEY_MISSING,
                        f"the upstream key variable {self.config.upstream_key_env} is not set; "
                        "set it in the runtime's environment",
                    ),
                )
                return
        try:
            await journal.record_request(digest)  # G2
        except StepRefused as exc:  # G13, G14: refused, not retried by the worker
            await self._refuse(exc, downstream)
            return
        except PiRuntimeError as exc:
            self._fail(exc)
            return
        if not await self._announce(body, digest, replayed=False):
            return
        self._stats["upstream_calls"] += 1
        labelled(MODEL_REQUESTS, "upstream").inc()
        await self._relay(raw, digest, key, downstream, journal)

    async def _refuse(self, refusal: StepRefused, downstream: _Downstream) -> None:
        """A request the gateway goes on serving after but does not answer (G13, G14): 409 —
        or its SSE error event once streaming — with the reason code; the worker does not
        retry it."""
        self._stats["refused"] += 1
        await downstream.refuse(409, _error_body(refusal.code, refusal.message))

    async def _announce(self, body: dict[str, Any], digest: str, *, replayed: bool) -> bool:
        """Tell the owner (``on_answer``) a request is about to be answered; False when
        what it journals there failed: the gateway fails as for its own append."""
        if self.on_answer is None:
            return True
        try:
            await self.on_answer(body, digest, replayed)
        except PiRuntimeError as exc:
            self._fail(exc)
            return False
        return True

    async def _relay(
        self,
        raw: bytes,
        digest: str,
        key: str | None,
        downstream: _Downstream,
        journal: StepJournal,
    ) -> None:
        ids = ToolCallIds(digest)
        chunks: list[str] = []
        held: list[str] = []
        failed: list[UpstreamFailure] = []  # the stream's error, once it reported one (G10)
        answering = False  # part of the answer was passed to the worker (PB1)
        parking = False  # the stream's error is an outage met before any of it: park (PB1)
        retry_after: float | None = None  # the 200 response's, for an error in its stream
        headers = [("content-type", "application/json"), ("accept", "text/event-stream")]
        if key is not None:
            headers.append(("authorization", f"Bearer {key}"))
        url = self.config.upstream_url.rstrip("/") + "/chat/completions"
        park = self.config.park_unavailable
        told = self.on_unavailable  # PB4: the route's, as it was when this call went up
        limit = self.config.upstream_inactivity
        data_limit = self.config.upstream_data_inactivity
        if journal is self.journal:  # G14: a request of an ended delivery judges no turn
            self.upstream_failure = None  # PB1, G18: this call's end says it, not an older one's

        def outage(failure: UpstreamFailure) -> bool:
            """How this call ended, an outage: kept for the backoff (G18) while the request's
            delivery is still the attached one (G14: an ended delivery's late end never judges
            the next delivery's turn), and whether it parks the turn — PB1, the one rule for
            every way an outage shows (a status, an error inside the stream, a cut): while
            nothing of the answer has been passed to the worker (keepalives, its role, empty
            deltas: :func:`carries_answer`) — told to ``on_unavailable`` then (PB4)."""
            if journal is self.journal:
                self.upstream_failure = failure
            parks = park and failure.unavailable and not answering
            if parks and told is not None:  # PB4: the route's word, whatever the turn becomes
                told(failure)
            return parks

        with (
            trio.CancelScope(deadline=trio.current_time() + limit) as silence,
            trio.CancelScope() as no_data,  # G15: only data events move it
        ):

            def data_arrived() -> None:
                if data_limit is not None:
                    no_data.deadline = trio.current_time() + data_limit

            def take(events: list[SseEvent]) -> bytes:
                """Journal-bound chunks of ``events``; the bytes to pass on at once (G3):
                every data payload before the terminal part, which is held (G4), and an
                error event — the last thing taken: the response failed (G10) — unless it is
                an outage met before any of the answer, which parks the turn instead (PB1)."""
                nonlocal answering, parking
                passed: list[bytes] = []
                for event in events:
                    if event.data is None:
                        continue  # upstream comments count as activity only (G10, G15)
                    data_arrived()
                    payload = ids.apply(event.data)  # G7
                    if is_upstream_error(payload):  # relayed as it came, never held
                        failure = stream_failure(payload, retry_after)
                        failed.append(failure)
                        parking = outage(failure)  # PB1, G18: kept before the worker hears
                        if not parking:  # relayed as it came, but never with the key (G9)
                            passed.append(_without_key(sse_data(payload), key))
                        break
                    chunks.append(payload)
                    if held or is_terminal(payload):
                        held.append(payload)
                    else:
                        passed.append(sse_data(payload))
                        answering = answering or carries_answer(payload)
                return b"".join(passed)

            try:
                async with self._upstream.request(
                    "POST",
                    url,
                    headers=headers,
                    body=raw,  # the worker's bytes, as they came
                ) as upstream:
                    silence.deadline = trio.current_time() + limit
                    if upstream.status != 200:
                        error = await upstream.read()
                        failure = UpstreamFailure(
                            upstream.status,
                            retry_after_seconds(upstream.headers.get("retry-after")),
                            USAGE_LIMIT_PATTERN.search(error.decode(errors="replace")) is not None,
                        )
                        if outage(failure):
                            await self._park(downstream)
                            return
                        error = _without_key(error, key)  # G9: a provider may quote it
                        await self._relay_status(upstream.status, error, downstream)
                        return
                    data_arrived()  # the data deadline runs from the headers
                    retry_after = retry_after_seconds(upstream.headers.get("retry-after"))
                    events = SseParser()
                    async for received in upstream.iter_bytes():
                        silence.deadline = trio.current_time() + limit  # any byte (G10)
                        if passed := take(events.feed(received)):
                            await downstream.send(passed)  # one read, one write (G3)
                        if failed:
                            break  # nothing after the error is read (its connection is closed)
                    else:  # the stream's end completes its last event
                        if passed := take(events.end()):
                            await downstream.send(passed)
            except HttpClientError:  # refused, unreachable, cut: no response, or cut short
                if not failed and any(p.strip() == DONE for p in held):  # G4: cut after its last
                    pass  # event, whole: finished and paid for, journaled like any other (G6)
                elif outage(stream_cut(answering=answering)):  # before the answer: park (PB1)
                    await self._park(downstream)
                    return
                else:  # the worker's stream is cut as the handler returns: it retries (G10)
                    return
        if silence.cancelled_caught:  # G10
            self._stats["inactivity_aborts"] += 1
            await self._relay_error(504, inactivity_message(limit), downstream)
            return  # a started stream is cut: Pi and Fake-Pi retry
        if no_data.cancelled_caught:  # G15: comments only, the same retryable end
            assert data_limit is not None
            self._stats["data_inactivity_aborts"] += 1
            await self._relay_error(504, data_inactivity_message(data_limit), downstream)
            return
        if failed:  # G10: an upstream error inside the stream is no answer: never journaled
            self._stats["stream_errors"] += 1  # upstream_failure has it (PB1: read as a status)
            if parking:  # an outage before any of the answer: the turn ends, as for a 5xx
                await self._park(downstream)
            return  # else the worker has the error; the stream is cut, as for an upstream cut
        if not held:  # G16: it ended with no terminal part: an incomplete response
            self._stats["incomplete_streams"] += 1  # never journaled, never finished:
            if outage(stream_cut(answering=answering)):  # as an upstream cut: parked before
                await self._park(downstream)  # the answer (PB1), else cut (retried)
            return
        if held[-1].strip() != DONE:
            chunks.append(DONE)
            held.append(DONE)
        if journal is not self.journal:  # G14: its delivery ended meanwhile (stalled, cancelled)
            self._stats["detached"] += 1
            return  # nobody replays it: not journaled, and the stream is cut without its end
        try:
            await journal.record_response(digest, chunks)  # keepalives flow meanwhile
        except StepRefused:  # G14: released while the response streamed
            self._stats["detached"] += 1
            return
        except PiRuntimeError as exc:
            self._fail(exc)
            return
        self._stats["journaled"] += 1
        if self.on_answered is not None:
            self.on_answered()
        await downstream.finish(b"".join(map(sse_data, held)))  # the terminal part, one write

    async def _park(self, downstream: _Downstream) -> None:
        """PB1: end the worker's turn for an unavailable provider with :data:`PARKED_MESSAGE`,
        which it does not retry — a whole 400, or, once its stream started (a keepalive, a
        chunk with nothing of the answer), that error as an SSE event and the stream's end:
        never a cut, which the worker would retry as a network failure (G5)."""
        await downstream.refuse(400, _json.encode({"error": {"message": PARKED_MESSAGE}}))

    async def _relay_status(self, status: int, body: bytes, downstream: _Downstream) -> None:
        """An upstream HTTP error: the same status, or an SSE error once streaming."""
        if not downstream.started:
            await downstream.respond(status, body)
            return
        await self._relay_error(
            status, f"{status}: {body[:2000].decode(errors='replace')}", downstream
        )

    async def _relay_error(self, status: int, message: str, downstream: _Downstream) -> None:
        if not downstream.started:
            await downstream.respond(status, _json.encode({"error": {"message": message}}))
            return
        # Pi's OpenAI client raises an event carrying ``error`` with this message
        await downstream.send(sse_data(_json.encode({"error": {"message": message}}).decode()))

    def _fail(self, error: PiRuntimeError) -> None:
        if self._failure is None:
            self._failure = error
        self._failed.set()

    @property
    def failure(self) -> PiRuntimeError | None:
        """The journal failure that stopped this gateway, set the moment it happened."""
        return self._failure

    async def wait_failed(self) -> PiRuntimeError:
        await self._failed.wait()
        assert self._failure is not None
        return self._failure


async def serve_gateway(
    gateway: Gateway,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    task_status: trio.TaskStatus[HttpServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``gateway`` on loopback until cancelled; ``started`` with the bound server.

    Point the worker at ``f"{server.url}/v1"`` with ``gateway.secret`` as its key.
    Raises the journal's error (e.g. ``journal_poisoned``) if an append failed.
    """
    failure: PiRuntimeError | None = None
    keepalives = _Keepalives(gateway.config.keepalive_interval)
    try:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(keepalives.run)
                gateway._keepalives = keepalives  # G5a
                server: HttpServer = await nursery.start(
                    lambda task_status: serve_http(
                        gateway.handle,
                        host=host,
                        port=port,
                        arrival_seconds=gateway.config.request_arrival,  # B8
                        authorize=gateway.authorize,  # B8: the secret before the body
                        max_pending=gateway.config.pending_connections,  # B9
                        refusal=_refused,
                        task_status=task_status,
                    )
                )
                task_status.started(server)
                failure = await gateway.wait_failed()
                scope.cancel()
    finally:
        if gateway._keepalives is keepalives:
            gateway._keepalives = None
        with trio.CancelScope(shield=True):
            await gateway.aclose()
    if failure is not None:
        raise failure
