"""``GET /metrics``: the runtime's Prometheus metrics on a listener of their own
(docs/design/operations.md "Metrics"; ``[metrics] listen``, ``serve --metrics ADDR``).

The events are counted where they happen (``runtime/_metrics.py``); what is a state — the
room lanes, their live workers and queues, the connections, the results not acknowledged, the
task lanes by classification — is read from the running server when scraped, by
:class:`ServerCollector`, registered for the server's life; the room lanes summed by
:func:`~runtime._rooms._census.room_totals`, which reads only the lanes with something under
way, so a scrape costs the same with 10 rooms known or 50,000 (M8). The exposition is
``prometheus_client``'s (``generate_latest``), in the text format a Prometheus scrape asks for;
scrapes that come together are answered from one build (:class:`Scrapes`, M10).
Nothing here carries a room id, a delivery or task id, message text or a secret: every label
comes from a closed set.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import ssl
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Final

import msgspec
import trio
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry

from .._boundary._h1 import MAX_HEAD
from .._boundary._http import HttpServer, Request, ResponseWriter, serve_http
from .._errors import ReasonCode
from .._logs import fields
from .._metrics import REGISTRY
from .._rooms._census import room_totals
from .._tasks._watchdog import Classification
from ._page import Observed, OperatorPage, Served, refuse, write_bound

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric


__all__ = [
    "COLLECTOR",
    "Scrapes",
    "ServerCollector",
    "allowed_hosts",
    "is_loopback",
    "open_metrics",
    "serve_metrics",
]

logger = logging.getLogger("runtime.metrics")

PATH: Final = "/metrics"
MAX_BODY: Final = 256 * 1024
"""The largest request body the listener reads (a control is at most 64 KiB): more is 413."""
REQUEST_SECONDS: Final = 10.0
"""A connection that has not sent a whole request this long after its last answer (or its
opening) is closed: an idle or slow client holds no file descriptor for longer (M6)."""
MAX_CONNECTIONS: Final = 64
"""Connections open at once; one more closes the one idle the longest, or with none idle is
answered ``503 too_many_connections`` (M6, M9)."""
SLOW_REQUEST_SECONDS: Final = 1.0
"""At the bound with no connection idle, a request still arriving this long after its first
byte is closed for a new connection (M11): half-sent requests cannot hold every connection."""
_TASK_STATES: Final = ("open", "waiting", "success_intent", "done", "failed", "aborted")
REUSE_SECONDS: Final = 1.0
"""The longest a scrape's answer is served again (M10), however long its build took."""


class ServerCollector(Collector):
    """The running servers' state, read at each scrape (never stored): every server of this
    process that serves its metrics (one, but for tests and embedders), summed."""

    def __init__(self) -> None:
        self.servers: list[Observed] = []

    def collect(self) -> Iterator[Metric]:
        # M8: summed without a status per room (most of a long-lived host's rooms are idle)
        rooms = [room_totals(server.worker) for server in self.servers]
        workers = [server.worker for server in self.servers]
        yield _gauge(
            "pi_runtime_room_lanes", "Room lanes this host has.", sum(r.lanes for r in rooms)
        )
        yield _gauge(
            "pi_runtime_room_lanes_running",
            "Room lanes with a turn running.",
            sum(r.running for r in rooms),
        )
        yield _gauge(
            "pi_runtime_room_workers_live",
            "Room lanes with a live worker process.",
            sum(r.live_workers for r in rooms),
        )
        yield _gauge(
            "pi_runtime_deliveries_queued",
            "Room deliveries admitted and waiting behind a running turn.",
            sum(r.queued for r in rooms),
        )
        yield _gauge(
            "pi_runtime_deliveries_pending",
            "Room deliveries admitted and not finished.",
            sum(r.pending for r in rooms),
        )
        yield _gauge(
            "pi_runtime_results_unacknowledged",
            "Published results no client has acknowledged.",
            sum(w.unacknowledged for w in workers),
        )
        yield _gauge(
            "pi_runtime_admitting",
            "1 while this host admits.",
            int(any(w.admitting for w in workers)),
        )
        yield _gauge(
            "pi_runtime_connections",
            "Authenticated websocket connections.",
            sum(len(server.connections) for server in self.servers),
        )
        # no views built: a thousand tasks are cheap
        census = [t for server in self.servers for t in server.tasks.runner.census()]
        live = [t for t in census if not t.ended]
        by_class = Counter(t.classification for t in live)
        family = GaugeMetricFamily(
            "pi_runtime_task_lanes",
            "Live task lanes by the watchdog's classification.",
            labels=["classification"],
        )
        for classification in Classification:
            family.add_metric([str(classification)], by_class.get(str(classification), 0))
        yield family
        by_state = Counter(t.state for t in census)
        tasks = GaugeMetricFamily(
            "pi_runtime_tasks", "Tasks this host knows, by state.", labels=["state"]
        )
        for state in _TASK_STATES:
            tasks.add_metric([state], by_state.get(state, 0))
        yield tasks
        yield _gauge(
            "pi_runtime_task_workers_live",
            "Task lanes with a live worker process.",
            sum(t.live_worker for t in live),
        )


class Scrapes:
    """One listener's latest scrape of each format, answered again to the scrapes that come
    less than its build's own duration after that build ended (and less than
    ``REUSE_SECONDS``), on Trio's clock (M10): many scrapes at once — before, each built in
    full, back to back, on the Trio thread, where admissions wait — cost one build, and no
    answer is older than the build that made it took."""

    def __init__(self) -> None:
        self._latest: dict[str, tuple[bytes, float, float]] = {}
        """By content type: the answer, when its build ended, how long it took."""

    def answer(self, encoder: Callable[[CollectorRegistry], bytes], content_type: str) -> bytes:
        """The scrape in ``content_type``: the latest one while it is fresh, else built now
        by ``encoder``; a build that raises keeps nothing (M5)."""
        started = trio.current_time()
        latest = self._latest.get(content_type)
        if latest is not None:
            body, ended, took = latest
            if started - ended < min(took, REUSE_SECONDS):
                return body
        body = encoder(REGISTRY)
        ended = trio.current_time()
        self._latest[content_type] = (body, ended, ended - started)
        return body


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost`` or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _refusal(status: int) -> bytes:
    """The body answering a request the HTTP layer refuses before any handler reads it (M7):
    a stable code, as every other refusal of this listener carries."""
    code, message = {
        413: (ReasonCode.HTTP_BODY_TOO_LARGE, f"a request body is at most {MAX_BODY} bytes"),
        431: (
            ReasonCode.HTTP_HEAD_TOO_LARGE,
            f"a request line and its headers are at most {MAX_HEAD} bytes",
        ),
        501: (ReasonCode.HTTP_UNSUPPORTED, "a body is sent whole or chunked, nothing else"),
    }.get(status, (ReasonCode.HTTP_MALFORMED, "the request is not HTTP/1.1 this listener reads"))
    return msgspec.json.encode({"ok": False, "code": code, "message": message})


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


COLLECTOR: Final = ServerCollector()
"""The one collector of the servers' state, registered once in the runtime's registry."""
REGISTRY.register(COLLECTOR)


async def _handle(
    page: OperatorPage | None,
    insecure: bool,
    request: Request,
    response: ResponseWriter,
    scrapes: Scrapes | None = None,
) -> None:
    path = request.target.split("?", 1)[0]
    if path != PATH and page is not None:
        if insecure:  # OP4: the page needs loopback or TLS; the metrics are served anyway
            where = "the operator page is served on loopback or over TLS only"
            await refuse(response, 403, ReasonCode.PAGE_INSECURE, where)
            return
        await page.handle(request, response)
        return
    if request.method not in ("GET", "HEAD"):  # M3, M7: the page's refusals, by its function
        await refuse(
            response, 405, ReasonCode.PAGE_METHOD, "only GET /metrics", [("allow", "GET, HEAD")]
        )
        return
    if path != PATH:
        where = f"nothing at {path}: the metrics are at {PATH}"
        await refuse(response, 404, ReasonCode.PAGE_NOT_FOUND, where)
        return
    # the format the scraper asks for (Prometheus text, or OpenMetrics), as the library
    # negotiates it; encoded on the Trio thread: the collector reads live state (once for
    # the scrapes that come while it is fresh, M10)
    try:
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    except (TypeError, ValueError):  # a malformed Accept (e.g. an OpenMetrics version): M6, M7
        await refuse(
            response, 406, ReasonCode.HTTP_NOT_ACCEPTABLE, "the Accept header cannot be read"
        )
        return
    # a collector's error, whatever its type, is a 500 (M5)
    body = encoder(REGISTRY) if scrapes is None else scrapes.answer(encoder, content_type)
    await trio.lowlevel.checkpoint()
    headers = [("content-type", content_type), ("content-length", str(len(body)))]
    with write_bound():  # a scraper that reads nothing holds no connection (M6)
        await response.start(200, headers)
        if request.method == "GET":
            await response.send(body)
        await response.end()


async def serve_metrics(
    host: str,
    port: int,
    *,
    page: Callable[[HttpServer], OperatorPage] | None = None,
    ssl_context: ssl.SSLContext | None = None,
    task_status: trio.TaskStatus[HttpServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``GET /metrics`` on ``host``:``port`` until cancelled, and the operator page
    ``page`` makes for the bound address at every other path; over TLS with ``ssl_context``.
    ``task_status`` gets the bound address once listening."""
    async with trio.open_nursery() as nursery:
        holder: list[OperatorPage] = []
        scrapes = Scrapes()

        async def handle(request: Request, response: ResponseWriter) -> None:
            shown = holder[0] if holder else None
            try:
                await _handle(
                    shown,
                    shown is not None and _insecure(host, ssl_context),
                    request,
                    response,
                    scrapes,
                )
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise  # the client went away: its connection ends
            except Exception:  # a fault stays in its request: the listener and server go on
                logger.exception(
                    "the metrics listener failed to answer", extra=fields("metrics_failed")
                )
                if not response.started:  # M5, M7: its code, as every refusal of the listener
                    await refuse(response, 500, ReasonCode.METRICS_FAILED, "see the server's log")

        bound: HttpServer = await nursery.start(
            functools.partial(
                serve_http,
                handle,
                host=host,
                port=port,
                ssl_context=ssl_context,
                max_request=MAX_BODY,
                request_seconds=REQUEST_SECONDS,
                max_connections=MAX_CONNECTIONS,
                slow_request_seconds=SLOW_REQUEST_SECONDS,
                refusal=_refusal,
            )
        )
        if page is not None:
            holder.append(made := page(bound))
            await nursery.start(made.follow)
        task_status.started(bound)


def _insecure(host: str, ssl_context: ssl.SSLContext | None) -> bool:
    return ssl_context is None and not is_loopback(host)


def allowed_hosts(host: str, port: int, ssl_context: ssl.SSLContext | None) -> frozenset[str]:
    """The ``Host`` values the page answers on a loopback listener (OP4): its own address and
    ``localhost``; any on a TLS listener elsewhere (its certificate names it)."""
    if not is_loopback(host):
        return frozenset()
    shown = f"[{host}]" if ":" in host else host
    return frozenset({f"{shown}:{port}", f"localhost:{port}"})


@contextlib.asynccontextmanager
async def open_metrics(
    server: Observed,
    host: str,
    port: int,
    nursery: trio.Nursery,
    *,
    page: Served | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> AsyncIterator[HttpServer]:
    """The server's state in the scrapes and the listener serving in ``nursery`` for the
    block (the operator page of ``page`` beside the metrics); the state is let go after it."""

    def make(bound: HttpServer) -> OperatorPage:
        assert page is not None
        return OperatorPage(
            page,
            secure=ssl_context is not None,
            allowed_hosts=allowed_hosts(bound.host, bound.port, ssl_context),
        )

    COLLECTOR.servers.append(server)
    try:
        bound = await nursery.start(
            functools.partial(
                serve_metrics,
                host,
                port,
                page=make if page is not None else None,
                ssl_context=ssl_context,
            )
        )
        yield bound
    finally:
        COLLECTOR.servers.remove(server)
