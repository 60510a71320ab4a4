"""The operator page: ``/`` of the metrics listener (docs/design/operations.md "The operator
page", OP1-OP9).

What it serves, all of it behind a session (OP2) but the login form and the two static files:

* ``GET /`` the page (``page/index.html``, its script and style are package data: no build
  step, no external resource, OP1), or the login form when there is no session;
* ``POST /login`` (a form with the state directory's access token, compared in constant time;
  a session cookie back, ``HttpOnly; SameSite=Strict``) and ``POST /logout``;
* ``GET /api/state`` the state the page shows, ``GET /api/events`` the same as server-sent
  events, pushed when a task changes and otherwise when it differs, once a second (OP6);
* ``GET /api/tasks/<id>`` what ``task show`` shows and the task's timeline of
  classifications since this server started; ``GET /api/journal/<delivery id>`` the records
  ``journal show`` prints;
* ``POST /api/command`` one control (task resume / abort / fail / grant / reply, delivery
  cancel) through the admin socket's own parser and handlers (:func:`~._admin.answer`), so its
  answers and stable codes are the command line's (OP5), behind the session's CSRF token and an
  ``Origin`` check (OP3).

``Authorization: Bearer <token>`` works in place of a session for scripts (no CSRF check: a
browser never sends that header across sites). A fault in one request is its 500 (OP8).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import html
import logging
import secrets
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol
from urllib.parse import parse_qs, unquote

import msgspec
import trio

from .._boundary._http import Request, ResponseWriter
from .._errors import PiRuntimeError, ReasonCode
from .._journal._inspect import delivery_records, delivery_records_in_database
from .._logs import fields
from ._admin import MAX_REQUEST, answer, id_problem
from ._throttle import LOGIN_FAILURES, LOGIN_WINDOW, LoginThrottle, client_of
from ._token import read_token, token_matches

if TYPE_CHECKING:
    from .._rooms._worker import RoomWorker
    from .._tasks._service import TaskService
    from .._wire import DeliveryResult, RoomStatus

__all__ = ["CONTROLS", "Observed", "OperatorPage", "Served", "write_bound"]

logger = logging.getLogger("runtime.page")

COOKIE: Final = "pi_runtime_page"
_COOKIE_MAX: Final = 128
"""Longer than any session key this page makes (``token_urlsafe(32)``: 43 characters)."""
CONTROLS: Final = frozenset(
    {"cancel", "task_resume", "task_abort", "task_fail", "task_grant", "task_reply"}
)
"""The admin commands the page's controls may send (OP5)."""
SESSION_SECONDS: Final = 12 * 3600.0
MAX_SESSIONS: Final = 32
MAX_STREAMS: Final = 16
"""Open event streams at once (OP6); one more is ``page_busy``."""
PUSH_SECONDS: Final = 1.0
KEEPALIVE_SECONDS: Final = 5.0
"""A comment on a quiet stream this often: a closed page's stream is noticed (its send fails)
and its slot given back within this long."""
SEND_SECONDS: Final = 10.0
"""How long one write of an answer may wait for the client to read it (OP6): past it the
connection is closed, so a page that stops reading its event stream gives its slot back."""
TIMELINE: Final = 256
"""Classification changes kept per task (the oldest go first)."""
TIMELINES: Final = 4096
"""Tasks whose timeline is kept (the one that changed least recently goes first)."""
ROOMS_SHOWN: Final = 500
PENDING_SHOWN: Final = 200
TASKS_SHOWN: Final = 500
"""Tasks one state lists (OP6): the live ones first, the most recently changed first."""
_FILES: Final = {
    "/static/page.js": ("page.js", "text/javascript; charset=utf-8"),
    "/static/page.css": ("page.css", "text/css; charset=utf-8"),
}
_SECURITY: Final = [
    (
        "content-security-policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "same-origin"),  # "no-referrer" makes a form's Origin "null"
    ("cache-control", "no-store"),
]
_JSON: Final = msgspec.json.Encoder()


class Observed(Protocol):
    """What the metrics collector reads of the running server (``RoomServer``)."""

    @property
    def worker(self) -> RoomWorker: ...
    @property
    def tasks(self) -> TaskService: ...
    @property
    def connections(self) -> Sized: ...


class Served(Observed, Protocol):
    """What the page reads of the running server besides, and asks of it: its ``status``
    and ``cancel`` answer the admin socket too."""

    @property
    def state_dir(self) -> Path: ...
    @property
    def worker_id(self) -> str: ...

    async def status(self) -> dict[str, Any]: ...

    async def cancel(self, delivery_id: str) -> dict[str, Any]: ...


@dataclass(slots=True)
class _Session:
    csrf: str
    token_digest: bytes
    """The token it logged in with: a rotated token ends the session (OP2)."""
    expires: float
    """When it ends, on the host's clock that counts a suspend (:meth:`OperatorPage._now`)."""


class _Refused(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


@functools.cache
def _file(name: str) -> bytes:
    return resources.files("runtime._server").joinpath("page", name).read_bytes()


class OperatorPage:
    """The page's handler on the metrics listener; :meth:`follow` keeps the timelines."""

    def __init__(self, server: Served, *, secure: bool, allowed_hosts: frozenset[str]) -> None:
        self.server = server
        self.secure = secure
        """Whether the listener speaks TLS (the cookie is then ``Secure``)."""
        self.allowed_hosts = allowed_hosts
        """``Host`` values answered (the listener's own names); empty: any (OP4)."""
        self._sessions: dict[str, _Session] = {}
        self._throttle = LoginThrottle()
        self._streams = 0
        self._timelines: dict[str, collections.deque[tuple[int, str, str]]] = {}
        self._changed = trio.Event()

    # -- the timelines -----------------------------------------------------------------

    async def follow(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Record every task's classification changes (with the wall-clock time they were
        seen) and wake the event streams; until cancelled. Each timeline starts from the
        task's classification and state (``TaskService.classifications``, no row built: OP6),
        only the ``TIMELINES`` that are kept."""
        wall = self.server.worker.store.clocks.wall
        async with self.server.tasks.events(buffer=4096) as events:
            task_status.started()
            try:
                now_ms = wall.time_ms()
                start = self.server.tasks.classifications()
                for task_id in list(start)[-TIMELINES:]:  # by id: the last ones are kept
                    self._mark(task_id, now_ms, *start[task_id])
                async for event in events:
                    self._mark(event.task_id, wall.time_ms(), event.classification, event.state)
                    self._changed.set()
                    self._changed = trio.Event()
            except Exception:  # OP8: the page's fault stays the page's; the server goes on
                logger.exception(
                    "the operator page stopped following the tasks; the timelines stop here",
                    extra=fields("page_failed", code=ReasonCode.PAGE_FAILED),
                )

    def _mark(self, task_id: str, at_ms: int, classification: str, state: str) -> None:
        timeline = self._timelines.pop(task_id, None) or collections.deque(maxlen=TIMELINE)
        self._timelines[task_id] = timeline  # the most recently changed last
        if len(self._timelines) > TIMELINES:
            del self._timelines[next(iter(self._timelines))]
        if not timeline or timeline[-1][1:] != (classification, state):
            timeline.append((at_ms, classification, state))

    # -- requests ----------------------------------------------------------------------

    async def handle(self, request: Request, response: ResponseWriter) -> None:
        """Answer one request; every refusal is a JSON body with its stable code, and a
        failure stays in its request (OP8)."""
        try:
            self._check_host(request)
            await self._route(request, response)
        except _Refused as refused:
            if not response.started:
                await self._error(response, refused.status, refused.code, refused.message)
        except PiRuntimeError as error:
            if not response.started:
                await self._error(
                    response, 404 if error.code in _UNKNOWN else 409, error.code, error.message
                )
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise
        except Exception:
            logger.exception(
                "the operator page failed to answer %s", request.method, extra=fields("page_failed")
            )
            if not response.started:
                await self._error(response, 500, ReasonCode.PAGE_FAILED, "see the server's log")

    async def _route(self, request: Request, response: ResponseWriter) -> None:
        path = request.target.split("?", 1)[0]
        method = request.method
        if path in _FILES:
            self._only(method, "GET")
            name, content_type = _FILES[path]
            await self._send(response, 200, _file(name), content_type)
        elif path == "/":
            self._only(method, "GET")
            session = await self._session_of(request)
            if session is None:
                await self._login_form(response, 200, "")
            else:
                page = _file("index.html").replace(
                    b"{{csrf}}", html.escape(session.csrf).encode("ascii")
                )
                await self._send(response, 200, page, "text/html; charset=utf-8")
        elif path == "/login":
            self._only(method, "POST")
            await self._login(request, response)
        elif path == "/logout":
            self._only(method, "POST")
            await self._authorized(request, state_changing=True)
            key = self._cookie(request)
            if key is not None:
                self._sessions.pop(key, None)
            await self._send(response, 200, b'{"ok":true}', "application/json", clear=True)
        elif path.startswith("/api/"):
            await self._api(request, response, path[len("/api/") :], method)
        else:
            raise _Refused(404, ReasonCode.PAGE_NOT_FOUND, f"nothing at {path}")

    async def _api(
        self, request: Request, response: ResponseWriter, path: str, method: str
    ) -> None:
        if path == "command":
            self._only(method, "POST")
            await self._authorized(request, state_changing=True)
            await self._command(request, response)
            return
        self._only(method, "GET")
        await self._authorized(request, state_changing=False)
        if path == "state":
            await self._json(response, 200, await self.snapshot())
        elif path == "events":
            await self._events(request, response)
        elif path.startswith("tasks/"):
            task_id = _checked_id("task_show", "task_id", unquote(path[len("tasks/") :]))
            shown = await self.server.tasks.task_show(task_id)
            timeline = [
                {"at_ms": at, "classification": c, "state": s}
                for at, c, s in self._timelines.get(task_id, ())
            ]
            await self._json(response, 200, {**shown, "timeline": timeline})
        elif path.startswith("journal/"):
            delivery_id = _checked_id(
                "journal_show", "delivery_id", unquote(path[len("journal/") :])
            )
            await self._json(response, 200, await self._journal(delivery_id))
        else:
            raise _Refused(404, ReasonCode.PAGE_NOT_FOUND, f"nothing at /api/{path}")

    # -- what the page shows -----------------------------------------------------------

    async def snapshot(self) -> dict[str, Any]:
        """:meth:`state`, after a checkpoint."""
        await trio.lowlevel.checkpoint()
        return self.state()

    def state(self) -> dict[str, Any]:
        """The state the page shows: the server's, its rooms, the pending deliveries and every
        task with its silence, thresholds, budget, hold and next safe action — at most
        ``ROOMS_SHOWN`` rooms and ``TASKS_SHOWN`` tasks, and no status or row of any other is
        built (OP6)."""
        worker, tasks = self.server.worker, self.server.tasks
        rooms = worker.status(limit=ROOMS_SHOWN)  # only the statuses it shows are built
        pending = sorted(worker.pending())
        ends = tasks.ends()
        scale = tasks.policy.timescale
        return {
            "worker_id": self.server.worker_id,
            "admitting": worker.admitting,
            "connections": len(self.server.connections),
            "unacknowledged": worker.unacknowledged,
            "rooms": [_room_row(room, worker.last_result(room.room)) for room in rooms],
            "rooms_total": worker.room_count,
            "pending": pending[:PENDING_SHOWN],
            "pending_total": len(pending),
            "tasks": [  # only the rows it shows are built
                _silence_shown(row) for row in tasks.rows(self._shown(ends))
            ],
            "tasks_total": len(ends),
            "unsafe_test_timescale": scale,
            "warning": tasks.warning,
        }

    def _shown(self, ends: dict[str, bool]) -> list[str]:
        """The ids of at most ``TASKS_SHOWN`` tasks (OP6), by id, of every task's id and
        whether it has ended (``TaskService.ends``): the live ones first (they are what the
        operator acts on), then the ended ones, each the most recently changed first as the
        timelines saw them. Only these tasks' rows are built."""
        if len(ends) <= TASKS_SHOWN:
            return list(ends)
        recency = {task_id: at for at, task_id in enumerate(self._timelines)}
        chosen = sorted(ends, key=lambda task_id: (ends[task_id], -recency.get(task_id, -1)))
        return sorted(chosen[:TASKS_SHOWN])

    async def _journal(self, delivery_id: str) -> dict[str, Any]:
        url = self.server.worker.config.store.url
        if url is not None:
            records, note = await delivery_records_in_database(url, delivery_id)
        else:
            records, note = await trio.to_thread.run_sync(
                delivery_records, self.server.state_dir, delivery_id
            )
        return {"delivery_id": delivery_id, "records": msgspec.to_builtins(records), "note": note}

    async def _events(self, request: Request, response: ResponseWriter) -> None:
        """The state as server-sent events (OP6): an ``event: state`` whenever it differs from
        the last one sent, checked when a task changes and at least once a second; a comment
        every ``KEEPALIVE_SECONDS`` of no change; an ``event: logout`` (its data: the code and
        message of :meth:`_stream_end`) and the end once the session is gone or the token file
        cannot be used. A write the client has not taken within ``SEND_SECONDS`` ends it and
        closes its connection."""
        if self._streams >= MAX_STREAMS:
            raise _Refused(503, ReasonCode.PAGE_BUSY, f"at most {MAX_STREAMS} open pages")
        self._streams += 1
        try:
            headers = [("content-type", "text/event-stream"), *_SECURITY]
            with write_bound():
                await response.start(200, headers)
            last = b""
            quiet = 0.0
            while True:
                ended = await self._stream_end(request)
                if ended is not None:
                    with write_bound():
                        await response.send(
                            b"event: logout\ndata: " + _JSON.encode(ended) + b"\n\n"
                        )
                    break
                body = _JSON.encode(await self.snapshot())
                if body != last:
                    with write_bound():
                        await response.send(b"event: state\ndata: " + body + b"\n\n")
                    last, quiet = body, 0.0
                elif quiet >= KEEPALIVE_SECONDS:
                    with write_bound():
                        await response.send(b": still here\n\n")
                    quiet = 0.0
                changed = self._changed
                started = trio.current_time()
                with trio.move_on_after(PUSH_SECONDS):
                    await changed.wait()
                quiet += trio.current_time() - started
            with write_bound():
                await response.end()
        finally:
            self._streams -= 1

    async def _command(self, request: Request, response: ResponseWriter) -> None:
        if len(request.body) > MAX_REQUEST:
            raise _Refused(
                413, ReasonCode.ADMIN_REQUEST_TOO_LARGE, f"a request is at most {MAX_REQUEST} bytes"
            )
        if b"\n" in request.body.strip():
            raise _Refused(400, ReasonCode.ADMIN_BAD_REQUEST, "a request is one JSON object")
        server = self.server
        grace = server.worker.config.thresholds.abort_grace_seconds  # a cancel's deadline (O7)
        body = request.body.strip()
        answered = await answer(server, server.tasks, body, commands=CONTROLS, abort_grace=grace)
        code = answered.get("code")
        if answered.get("ok"):
            status = 200
        elif code in (ReasonCode.ADMIN_BAD_REQUEST, ReasonCode.ADMIN_UNKNOWN_COMMAND):
            status = 400
        else:
            status = 404 if code in _UNKNOWN else 409
        logger.info(
            "operator page: %s %s",
            _loose_command(request.body),
            "done" if answered.get("ok") else f"refused {answered.get('code')}",
            extra=fields("page_command", code=None if answered.get("ok") else answered.get("code")),
        )
        await self._json(response, status, answered)

    # -- who may ask (OP2-OP4) -----------------------------------------------------------

    def _check_host(self, request: Request) -> None:
        """OP4: on a loopback listener only its own names are answered (a page reached by
        another name, as a rebinding attack reaches it, is refused)."""
        if self.allowed_hosts and request.headers.get("host", "") not in self.allowed_hosts:
            raise _Refused(421, ReasonCode.PAGE_HOST_REFUSED, "this listener is not that host")

    def _origin(self, request: Request) -> str:
        scheme = "https" if self.secure else "http"
        return f"{scheme}://{request.headers.get('host', '')}"

    def _check_origin(self, request: Request) -> None:
        origin = request.headers.get("origin")
        if origin is not None and origin != self._origin(request):
            raise _Refused(403, ReasonCode.CSRF_REFUSED, "a request from another site is refused")

    @staticmethod
    def _only(method: str, allowed: str) -> None:
        if method != allowed:
            raise _Refused(405, ReasonCode.PAGE_METHOD, f"only {allowed} here")

    def _cookie(self, request: Request) -> str | None:
        """The session key in the ``Cookie`` header, picked out by hand: the standard
        library's cookie parser is quadratic in backslashes on Python < 3.11.10, and this runs
        on the loop before any authentication (a 16 KiB header would block it for a second)."""
        raw = request.headers.get("cookie")
        if raw is None:
            return None
        for part in raw.split(";"):
            name, sep, value = part.strip().partition("=")
            if sep and name == COOKIE and 0 < len(value) <= _COOKIE_MAX:
                return value
        return None

    def _now(self) -> float:
        """The host's time, the time it spent suspended included (``CLOCK_BOOTTIME``,
        clocks.md): a session's 12 hours count a suspend (OP2); Trio's clock stands still
        through one."""
        return self.server.worker.store.clocks.silence.read().boottime

    async def _current_token(self) -> str | None:
        return await trio.to_thread.run_sync(read_token, self.server.state_dir)

    async def _session_of(self, request: Request) -> _Session | None:
        """The request's live session: its cookie names one that has not expired and was
        opened with the token the state directory holds now."""
        key = self._cookie(request)
        session = self._sessions.get(key) if key is not None else None
        if session is None or key is None:
            return None
        token = await self._current_token()
        if self._sessions.get(key) is not session:  # logged out while the token was read
            return None
        if (
            session.expires <= self._now()
            or token is None
            or not secrets.compare_digest(session.token_digest, _digest(token))
        ):
            self._sessions.pop(key, None)
            return None
        return session

    async def _bearer(self, request: Request) -> bool | None:
        """``None``: no ``Authorization`` header; else whether it carries the token. The token
        is compared first: the right one is never throttled (OP2); a wrong one from a client
        throttled is ``login_throttled``."""
        value = request.headers.get("authorization")
        if value is None:
            return None
        scheme, _, presented = value.partition(" ")
        token = await self._current_token()
        if scheme.lower() == "bearer" and token is not None and token_matches(token, presented):
            return True
        client = client_of(request.peer)
        self._throttled(client)
        self._count_failure(client)
        return False

    async def _authorized(self, request: Request, *, state_changing: bool) -> None:
        """OP2/OP3: a bearer token, or a live session whose CSRF token a state-changing
        request carries, from the page's own origin."""
        bearer = await self._bearer(request)
        if bearer is not None:
            if not bearer:
                raise _Refused(401, ReasonCode.TOKEN_INVALID, "the token is missing or wrong")
            return
        session = await self._session_of(request)
        if session is None:
            raise _Refused(401, ReasonCode.LOGIN_REQUIRED, "log in with the access token first")
        if not state_changing:
            return
        self._check_origin(request)
        presented = request.headers.get("x-csrf-token", "")
        if not secrets.compare_digest(presented.encode(), session.csrf.encode()):
            raise _Refused(403, ReasonCode.CSRF_REFUSED, "this request is not from the page")

    async def _stream_end(self, request: Request) -> dict[str, str] | None:
        """Why the event stream of ``request`` ends now — its ``logout``'s data, the code and
        the message the same request would be refused with — or ``None`` while its session
        or bearer token holds (OP2): ``login_required`` for a session gone (a rotated token,
        its 12 hours, a log out), ``token_insecure`` or ``token_invalid`` for a token file
        that cannot be used any more (O2), so the page can tell the operator why. A failed
        read of the token file ends the stream with no ``logout``: the page's next stream
        may find it readable again."""
        try:
            await self._authorized(request, state_changing=False)
        except _Refused as refused:
            return {"code": str(refused.code), "message": refused.message}
        except PiRuntimeError as error:
            return {"code": str(error.code), "message": error.message}
        return None

    def _throttled(self, client: str) -> None:
        """OP2: ``login_throttled`` for a client with ``LOGIN_FAILURES`` refused tokens in the
        last ``LOGIN_WINDOW`` seconds."""
        if self._throttle.throttled(client, trio.current_time()):
            raise _Refused(
                429,
                ReasonCode.LOGIN_THROTTLED,
                f"{LOGIN_FAILURES} wrong tokens in {LOGIN_WINDOW:g} s; wait before trying again",
            )

    def _count_failure(self, client: str) -> None:
        self._throttle.failed(client, trio.current_time())
        logger.warning("operator page: a wrong token", extra=fields("page_login_refused"))

    async def _login(self, request: Request, response: ResponseWriter) -> None:
        self._check_origin(request)
        client = client_of(request.peer)
        if await self._login_throttled(response, client):  # (then no file is read)
            return
        try:
            form = parse_qs(request.body.decode("utf-8", "replace"), max_num_fields=4)
        except ValueError:
            await self._login_form(response, 400, "admin_bad_request: send the token field alone")
            return
        presented = (form.get("token") or [""])[0].strip()
        token = await self._current_token()
        # OP2: asked again once the token is read, and nothing awaited from here to the
        # failure's count: the logins one client has in flight at once are not all let
        # through by checks made before any of them was counted
        if await self._login_throttled(response, client):
            return
        if token is None or not token_matches(token, presented):
            self._count_failure(client)
            await self._login_form(response, 401, "token_invalid: the token is missing or wrong")
            return
        if len(self._sessions) >= MAX_SESSIONS:  # the oldest goes
            del self._sessions[next(iter(self._sessions))]
        key = secrets.token_urlsafe(32)
        self._sessions[key] = _Session(
            csrf=secrets.token_urlsafe(32),
            token_digest=_digest(token),
            expires=self._now() + SESSION_SECONDS,
        )
        logger.info("operator page: a login", extra=fields("page_login"))
        cookie = self._set_cookie(key)
        with write_bound():
            await response.start(
                303, [("location", "/"), ("content-length", "0"), ("set-cookie", cookie)]
            )
            await response.end()

    async def _login_throttled(self, response: ResponseWriter, client: str) -> bool:
        """Whether ``client`` is throttled (OP2); if so its login is answered so, the form
        with ``login_throttled``."""
        try:
            self._throttled(client)
        except _Refused as refused:
            await self._login_form(response, refused.status, f"{refused.code}: {refused.message}")
            return True
        return False

    def _set_cookie(self, value: str, max_age: int | None = None) -> str:
        parts = [f"{COOKIE}={value}", "Path=/", "HttpOnly", "SameSite=Strict"]
        if max_age is not None:
            parts.append(f"Max-Age={max_age}")
        if self.secure:
            parts.append("Secure")
        return "; ".join(parts)

    # -- responses ----------------------------------------------------------------------

    async def _login_form(self, response: ResponseWriter, status: int, message: str) -> None:
        page = _file("login.html").replace(b"{{error}}", html.escape(message).encode("utf-8"))
        await self._send(response, status, page, "text/html; charset=utf-8")

    async def _send(
        self,
        response: ResponseWriter,
        status: int,
        body: bytes,
        content_type: str,
        *,
        clear: bool = False,
    ) -> None:
        headers = [("content-type", content_type), ("content-length", str(len(body))), *_SECURITY]
        if clear:
            headers.append(("set-cookie", self._set_cookie("", max_age=0)))
        with write_bound():
            await response.start(status, headers)
            await response.send(body)
            await response.end()

    async def _json(self, response: ResponseWriter, status: int, body: dict[str, Any]) -> None:
        await self._send(response, status, _JSON.encode(body), "application/json")

    async def _error(self, response: ResponseWriter, status: int, code: str, message: str) -> None:
        await refuse(response, status, code, message)


_UNKNOWN: Final = frozenset(
    {
        ReasonCode.TASK_UNKNOWN,
        ReasonCode.DELIVERY_UNKNOWN,
        ReasonCode.DELIVERY_EXPIRED,
        ReasonCode.TASK_EXPIRED,
    }
)
"""Codes answered 404: nothing of that id is here (any more)."""


async def refuse(
    response: ResponseWriter,
    status: int,
    code: str,
    message: str,
    extra: list[tuple[str, str]] | None = None,
) -> None:
    """Answer a refusal of the listener — the page's and the metrics' alike (OP8, M7): a JSON
    body ``{"ok": false, "code": …, "message": …}`` with its stable code, the page's headers and
    ``extra`` (a 405's ``allow``); a client gone meanwhile is let go."""
    body = _JSON.encode({"ok": False, "code": str(code), "message": message})
    headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError), write_bound():
        await response.start(status, [*headers, *_SECURITY, *(extra or [])])
        await response.send(body)
        await response.end()


@contextlib.contextmanager
def write_bound() -> Iterator[None]:
    """Bound the writes of the block by ``SEND_SECONDS`` (OP6): past it they are given up and
    ``trio.BrokenResourceError`` closes the connection (the listener's answer to a client gone),
    so a client that stops reading holds no event stream, task or descriptor."""
    with trio.move_on_after(SEND_SECONDS) as bound:
        yield
    if bound.cancelled_caught:
        raise trio.BrokenResourceError(f"the client read nothing for {SEND_SECONDS:g} s")


def _checked_id(view: str, name: str, value: str) -> str:
    """``value``, the id the path of ``view`` names, if the admin socket would take it as
    ``name`` (:func:`~._admin.id_problem`: 1 to 200 printable characters); else it is refused
    400 ``admin_bad_request`` with the admin socket's message, before anything looks it up
    (OP7)."""
    problem = id_problem(name, value)
    if problem is not None:
        raise _Refused(400, ReasonCode.ADMIN_BAD_REQUEST, f"{view}: {problem}")
    return value


def _room_row(room: RoomStatus, last: DeliveryResult | None) -> dict[str, Any]:
    """A room as ``status`` reports it, and how its latest result ended (its outcome, code
    and delivery — never its text: OP7)."""
    row: dict[str, Any] = {
        "room": room.room,
        "state": room.state,
        "queued": room.queued,
        "live_worker": room.live_worker,
        "last_result_seq": room.last_result_seq,
        "last_outcome": None,
        "last_code": None,
        "last_delivery": None,
    }
    if last is not None:
        row |= {
            "last_outcome": str(last.outcome),
            "last_code": last.code,
            "last_delivery": last.delivery_id,
        }
    return row


def _silence_shown(row: dict[str, Any]) -> dict[str, Any]:
    """A task's row as the page shows it (OP11): ``silence_watched`` (the view's) says whether
    its silence is measured now, and an unmeasured one is ``null``, never the ``0.0`` the row
    carries (a lane waiting for its user, settled, ended or failed is not silent for 0 s: its
    silence is not watched)."""
    row["silence_watched"] = watched = bool(row.get("silence_watched"))
    if not watched:
        row["silence_seconds"] = None
    return row


def _loose_command(body: bytes) -> str:
    """The command a control named, for the log (never its text or reason)."""
    try:
        data = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return "?"
    command = data.get("command") if isinstance(data, dict) else None
    return command if isinstance(command, str) and command in CONTROLS else "?"
