"""The operator page over real HTTP (docs/design/operations.md "The operator page", OP1-OP9):
a real server on 127.0.0.1 with ``[metrics] listen``, real requests on real sockets, a real
Fake-Pi worker behind a scripted model. What a browser does with it is
``test_operator_browser.py``; here each test tries to break one rule of who may see and do
what."""

from __future__ import annotations

import contextlib
import functools
import http.cookies
import re
import ssl
import threading
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Final, cast

import h11
import msgspec
import pytest
import trio
import trustme

from fake_pi.scenario import Hang, Step, Text
from runtime._boundary._http import Request, ResponseWriter, open_request, serve_http
from runtime._clock import Clocks, MockSilenceClock
from runtime._config import config_from_dict
from runtime._errors import ReasonCode
from runtime._journal._inspect import delivery_records
from runtime._rooms import _worker
from runtime._server import _page, _throttle
from runtime._server._admin import admin_request
from runtime._server._metrics import _handle, allowed_hosts
from runtime._server._page import OperatorPage
from runtime._server._serve import ServeOptions, open_server
from runtime._server._token import ensure_token, read_token, rotate_token
from runtime._tasks._service import TaskService
from runtime._wire import RoomStatus

from .._failing import fails_once
from .._wire import message
from .test_serve import Rig, rig

LIMIT: Final = 60.0
PAGE: Final = {"metrics": {"listen": "127.0.0.1:0"}}
SECRET_WORDS: Final = "the quartermaster's parrot"


class Answer(msgspec.Struct):
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return msgspec.json.decode(self.body)

    @property
    def code(self) -> str | None:
        data = self.json()
        return data.get("code") if isinstance(data, dict) else None


async def ask(
    port: int,
    path: str,
    method: str = "GET",
    *,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
    scheme: str = "http",
    ssl_context: Any = None,
) -> Answer:
    url = f"{scheme}://127.0.0.1:{port}{path}"
    async with open_request(
        method, url, headers=headers, body=body, ssl_context=ssl_context
    ) as response:
        return Answer(response.status, dict(response.headers), await response.read())


def port_of(r: Rig) -> int:
    assert r.server.metrics_port is not None
    return r.server.metrics_port


async def login(port: int, token: str) -> tuple[str, str]:
    """Log in: the session cookie (``name=value``) and the page's CSRF token."""
    answer = await ask(
        port,
        "/login",
        "POST",
        headers=[("content-type", "application/x-www-form-urlencoded")],
        body=f"token={token}".encode(),
    )
    assert answer.status == 303, answer
    cookie = answer.headers["set-cookie"].split(";", 1)[0]
    page = await ask(port, "/", headers=[("cookie", cookie)])
    found = re.search(rb'<meta name="csrf-token" content="([^"]+)">', page.body)
    assert found is not None, page.body
    return cookie, found[1].decode()


def control(cookie: str, csrf: str | None, origin: str | None = None) -> list[tuple[str, str]]:
    headers = [("cookie", cookie), ("content-type", "application/json")]
    if csrf is not None:
        headers.append(("x-csrf-token", csrf))
    if origin is not None:
        headers.append(("origin", origin))
    return headers


# -- OP1: package data, nothing from elsewhere ---------------------------------------------


async def test_op1_the_page_and_its_script_are_package_data_with_no_outside_resource(
    tmp_path: Path,
) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE) as r:
            port = port_of(r)
            form = await ask(port, "/")
            assert form.status == 200
            assert b'action="/login"' in form.body
            policy = form.headers["content-security-policy"]
            assert "default-src 'none'" in policy
            assert "script-src 'self'" in policy
            assert "frame-ancestors 'none'" in policy
            for path in ("/static/page.js", "/static/page.css"):
                file = await ask(port, path)
                assert file.status == 200, path
                # no address of another site: everything the page loads is its own
                assert re.findall(rb"https?://(?!www\.w3\.org/2000/svg)", file.body) == []
            assert (await ask(port, "/static/other.js")).code == "page_not_found"


# -- OP2: the access token, sessions, throttling ----------------------------------------------


async def test_op2_only_the_token_opens_a_session_and_a_rotated_token_ends_it(
    tmp_path: Path,
) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE) as r:
            port = port_of(r)
            assert (await ask(port, "/api/state")).code == "login_required"
            wrong = await ask(port, "/login", "POST", body=b"token=not-it")
            assert wrong.status == 401
            assert "set-cookie" not in wrong.headers
            assert b"token_invalid" in wrong.body
            cookie, _csrf = await login(port, r.token)
            answer = await ask(port, "/login", "POST", body=f"token={r.token}".encode())
            flags = answer.headers["set-cookie"]
            assert "HttpOnly" in flags
            assert "SameSite=Strict" in flags
            assert "Secure" not in flags  # plain http on loopback
            state = await ask(port, "/api/state", headers=[("cookie", cookie)])
            assert state.status == 200
            assert state.json()["worker_id"] == r.server.worker_id
            assert r.token.encode() not in state.body
            bearer = await ask(port, "/api/state", headers=[("authorization", f"Bearer {r.token}")])
            assert bearer.status == 200
            forged = await ask(port, "/api/state", headers=[("cookie", "pi_runtime_page=forged")])
            assert forged.code == "login_required"
            await trio.to_thread.run_sync(rotate_token, tmp_path / "state")
            ended = await ask(port, "/api/state", headers=[("cookie", cookie)])
            assert (ended.status, ended.code) == (401, "login_required")
            old = await ask(port, "/api/state", headers=[("authorization", f"Bearer {cookie}")])
            assert old.code == "token_invalid"


async def test_op2_the_session_cookie_is_read_without_the_standard_cookie_parser(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OP2: the page reads its session key out of the ``Cookie`` header by hand. The standard
    parser is quadratic in backslashes on Python < 3.11.10, and the header comes from anyone
    before any authentication, on the loop the room worker shares (a 16 KiB cookie blocked it
    for 0.65 s per request): it is never called with that header. A session cookie among
    others, and after a hostile one, still opens the session."""
    parsed: list[str] = []
    unquote = http.cookies._unquote

    def recorded(value: str) -> str:
        parsed.append(value)
        return unquote(value)

    monkeypatch.setattr(http.cookies, "_unquote", recorded)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE) as r:
            port = port_of(r)
            cookie, _csrf = await login(port, r.token)
            hostile = 'pi_runtime_page="' + "\\" * 4000 + '"'
            refused = await ask(port, "/api/state", headers=[("cookie", hostile)])
            assert refused.code == "login_required"
            among = f'a=b; theme="x\\y"; {cookie}; z=1'
            assert (await ask(port, "/api/state", headers=[("cookie", among)])).status == 200
    assert parsed == []


async def test_op2_wrong_tokens_are_throttled_even_before_the_right_one(tmp_path: Path) -> None:
    """OP2: after five wrong tokens one client's logins are ``login_throttled``, the right
    token's too, and so is its next wrong bearer token; a session opened before goes on."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE) as r:
            port = port_of(r)
            cookie, _csrf = await login(port, r.token)
            for _ in range(_throttle.LOGIN_FAILURES):
                assert (await ask(port, "/login", "POST", body=b"token=guess")).status == 401
            throttled = await ask(port, "/login", "POST", body=f"token={r.token}".encode())
            assert throttled.status == 429
            assert b"login_throttled" in throttled.body
            guess = await ask(port, "/api/state", headers=[("authorization", "Bearer guess")])
            assert (guess.status, guess.code) == (429, "login_throttled")
            # a session opened before is not locked out by someone guessing
            assert (await ask(port, "/api/state", headers=[("cookie", cookie)])).status == 200


async def ask_from(
    source: str,
    port: int,
    path: str,
    method: str = "GET",
    *,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
) -> Answer:
    """``ask``, from the client address ``source``: every 127.x.y.z is this machine's, so a
    test has as many clients as it likes, each on a real socket."""
    stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=source)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        head = [("host", f"127.0.0.1:{port}"), ("content-length", str(len(body)))]
        request = h11.Request(method=method, target=path, headers=head + (headers or []))
        await stream.send_all(
            conn.send(request) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
        )
        status, got, data = 0, {}, b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
                got = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                data += event.data
            elif isinstance(event, h11.EndOfMessage):
                return Answer(status, got, data)


def test_op2_the_throttle_is_per_client_an_ipv6_one_by_its_64_every_loopback_address_one() -> None:
    """OP2 (the pure core): five wrong tokens throttle their client alone — an address, an
    IPv6 one by its /64, an IPv4-mapped one as its IPv4 address — and every loopback address
    (``127.0.0.0/8``, ``::1``) is one client: this host."""
    throttle, now = _throttle.LoginThrottle(), 100.0
    for peer in ("192.0.2.7", "2001:db8:0:1::a", "127.0.0.2"):
        for _ in range(_throttle.LOGIN_FAILURES):
            throttle.failed(_throttle.client_of(peer), now)
    throttled = {
        "192.0.2.7": True,
        "::ffff:192.0.2.7": True,
        "192.0.2.8": False,
        "2001:db8:0:1::b": True,  # the same /64
        "2001:db8:0:2::a": False,
        "127.0.0.2": True,
        "127.0.0.1": True,
        "127.255.0.9": True,
        "::1": True,
        "::ffff:127.0.0.3": True,
    }
    for peer, expected in throttled.items():
        assert throttle.throttled(_throttle.client_of(peer), now) is expected, peer
    assert not throttle.throttled(_throttle.client_of("127.0.0.1"), now + _throttle.LOGIN_WINDOW)


def test_op2_the_throttle_remembers_a_bounded_number_of_clients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OP2: the throttle keeps at most ``MAX_CLIENTS`` clients — guesses from many addresses
    cannot grow it — and the one that failed least recently is the one let go."""
    monkeypatch.setattr(_throttle, "MAX_CLIENTS", 2)
    throttle, now = _throttle.LoginThrottle(), 100.0
    for _ in range(_throttle.LOGIN_FAILURES):
        throttle.failed("192.0.2.2", now)
    assert throttle.throttled("192.0.2.2", now)
    for source in ("192.0.2.3", "192.0.2.4"):  # two more: the first one goes
        throttle.failed(source, now + 1)
    assert not throttle.throttled("192.0.2.2", now + 1)


async def test_op2_a_guesser_on_many_loopback_addresses_is_one_client_and_flushes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OP2: a local guesser sends each wrong token from a new loopback address (127.0.0.0/8 is
    16 million of them, all this host), with the throttle's table small enough to flush
    (``MAX_CLIENTS`` 2). Five wrong tokens in all, then every address's logins are
    ``login_throttled`` — the one already throttled too, whatever new addresses come after,
    and the operator's ``127.0.0.1`` (the same host). Before, each address was a client of its
    own: five tries a minute each, and new addresses pushed the throttled one out of the
    table."""
    monkeypatch.setattr(_throttle, "MAX_CLIENTS", 2)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE) as r:
            port = port_of(r)
            for n in range(_throttle.LOGIN_FAILURES):
                wrong = await ask_from(f"127.0.0.{2 + n}", port, "/login", "POST", body=b"token=g")
                assert wrong.status == 401, n
            for source in ("127.0.1.1", "127.0.1.2", "127.0.1.3", "127.0.0.2", "127.0.0.1"):
                held = await ask_from(source, port, "/login", "POST", body=b"token=guess")
                assert held.status == 429, source
                assert b"login_throttled" in held.body


async def test_op2_the_throttle_never_refuses_the_right_bearer(tmp_path: Path) -> None:
    """OP2: five wrong tokens from a client throttle its wrong tokens and logins (the right
    token's login too: every loopback address is that client), but the right bearer token is
    answered from every address, the guessing one's too, and a session opened before goes
    on."""
    guesser, operator = "127.0.0.2", "127.0.0.1"
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE) as r:
            port = port_of(r)
            form = f"token={r.token}".encode()
            opened = await ask_from(operator, port, "/login", "POST", body=form)
            assert opened.status == 303, opened
            cookie = opened.headers["set-cookie"].split(";", 1)[0]
            for _ in range(_throttle.LOGIN_FAILURES):
                wrong = await ask_from(guesser, port, "/login", "POST", body=b"token=guess")
                assert wrong.status == 401
            assert (await ask_from(operator, port, "/login", "POST", body=form)).status == 429
            bearer = [("authorization", f"Bearer {r.token}")]
            for source in (operator, guesser):
                state = await ask_from(source, port, "/api/state", headers=bearer)
                assert state.status == 200, (source, state.body)
                wrong_bearer = [("authorization", "Bearer guess")]
                still = await ask_from(source, port, "/api/state", headers=wrong_bearer)
                assert (still.status, still.code) == (429, "login_throttled")
            session = await ask_from(operator, port, "/api/state", headers=[("cookie", cookie)])
            assert session.status == 200


async def test_op2_wrong_logins_sent_at_once_are_throttled_after_five(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """OP2: one client sends many wrong logins at once, each on its own connection, so that
    every one of them has been let in while the first one's read of the token file is still
    under way (the reads are held until all have begun: the order of events a guesser with
    many connections gets for free). Still only five of them are compared and answered
    ``token_invalid`` (five ``page_login_refused`` lines); the others are ``login_throttled``.
    Before, the throttle was asked before that read and the failure counted after it: every
    login in flight was compared, and a guesser had as many tries a minute as connections."""
    tries = 4 * _throttle.LOGIN_FAILURES
    gathered = threading.Barrier(tries, timeout=LIMIT / 4)

    def held(state_dir: Path) -> str | None:
        gathered.wait()  # every login's read has begun
        return read_token(state_dir)

    monkeypatch.setattr(_page, "read_token", held)
    statuses: list[int] = []

    async def guess(port: int) -> None:
        answer = await ask_from("127.0.0.2", port, "/login", "POST", body=b"token=guess")
        statuses.append(answer.status)

    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE) as r:
            caplog.clear()
            async with trio.open_nursery() as nursery:
                for _ in range(tries):
                    nursery.start_soon(guess, port_of(r))
            logged = [getattr(one, "event", None) for one in caplog.records]
    assert sorted(statuses) == [401] * _throttle.LOGIN_FAILURES + [429] * (
        tries - _throttle.LOGIN_FAILURES
    ), statuses
    assert logged.count("page_login_refused") == _throttle.LOGIN_FAILURES


async def test_op2_a_session_ends_after_12_hours_a_host_suspend_included(tmp_path: Path) -> None:
    """OP2: a session lasts at most ``SESSION_SECONDS`` of the host's time, the time it spent
    suspended included (the suspend-aware clock, clocks.md): an operator's laptop that slept
    through a weekend with the page open wakes to the login form, not to a session of three
    days. Before, the session's end was on Trio's clock, which stands still while the host is
    suspended, so a session outlived its 12 hours by every suspend. The page here is served
    alone on 127.0.0.1, its server a stub that has the state directory and the clocks."""
    clock = MockSilenceClock()
    state = tmp_path / "state"
    token, _ = await trio.to_thread.run_sync(ensure_token, state)
    served = SimpleNamespace(
        state_dir=state, worker=SimpleNamespace(store=SimpleNamespace(clocks=Clocks(silence=clock)))
    )
    page = OperatorPage(cast("Any", served), secure=False, allowed_hosts=frozenset())
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_http, page.handle)
            port = server.port
            cookie, _csrf = await login(port, token)
            clock.suspend(_page.SESSION_SECONDS / 2)  # a night: the session goes on
            opened = await ask(port, "/", headers=[("cookie", cookie)])
            assert b"csrf-token" in opened.body
            clock.suspend(_page.SESSION_SECONDS / 2)  # and another: it has lasted 12 h
            ended = await ask(port, "/api/state", headers=[("cookie", cookie)])
            assert (ended.status, ended.code) == (401, "login_required")
            form = await ask(port, "/", headers=[("cookie", cookie)])
            assert b"csrf-token" not in form.body
            assert b'action="/login"' in form.body
            nursery.cancel_scope.cancel()


async def test_op6_the_event_stream_of_the_right_bearer_token_outlasts_a_guesser(
    tmp_path: Path,
) -> None:
    """OP2, OP6: an event stream opened with the right bearer token is checked again at
    every push; wrong tokens from the same address do not end it with a ``logout``."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE, steps=[Hang(seconds=3600)]) as r:
            port = port_of(r)
            url = f"http://127.0.0.1:{port}/api/events"
            bearer = [("authorization", f"Bearer {r.token}")]
            async with open_request("GET", url, headers=bearer) as events:
                assert events.status == 200
                states = _states(events.iter_bytes())
                assert (await anext(states))["pending_total"] == 0
                for _ in range(_throttle.LOGIN_FAILURES + 1):
                    await ask(port, "/login", "POST", body=b"token=guess")
                async with r.connect() as client:
                    await client.send(message("d1", SECRET_WORDS))
                    await client.until(lambda f: f["type"] == "accepted")
                    async for state in states:  # a logout would end it first
                        if state["pending"] == ["d1"]:
                            break
                    else:
                        raise AssertionError("the stream ended with a logout")


# -- OP3: cross-site requests ------------------------------------------------------------------


async def test_op3_a_control_without_the_csrf_token_or_from_another_origin_does_nothing(
    tmp_path: Path,
) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE, steps=[Hang(seconds=3600)]) as r:
            port = port_of(r)
            own = f"http://127.0.0.1:{port}"
            async with r.connect() as client:
                await client.send(message("d1", SECRET_WORDS))
                await client.until(lambda f: f["type"] == "accepted")
                cookie, csrf = await login(port, r.token)
                cancel = b'{"command": "cancel", "delivery_id": "d1"}'
                for headers in (
                    control(cookie, None),  # a form from anywhere: no header
                    control(cookie, "not-the-csrf-token"),
                    control(cookie, csrf, origin="http://127.0.0.1:1"),  # another origin
                    control(cookie, csrf, origin="null"),
                ):
                    refused = await ask(port, "/api/command", "POST", headers=headers, body=cancel)
                    assert (refused.status, refused.code) == (403, "csrf_refused"), headers
                assert r.server.worker.pending() == ["d1"]  # nothing acted
                # a cross-site login is refused too (login CSRF)
                forced = await ask(
                    port, "/login", "POST", headers=[("origin", "http://evil.example")],
                    body=f"token={r.token}".encode(),
                )  # fmt: skip
                assert forced.code == "csrf_refused"
                done = await ask(
                    port, "/api/command", "POST", headers=control(cookie, csrf, own), body=cancel
                )
                assert done.status == 200, done
                assert done.json() == {"delivery_id": "d1", "cancelled": True, "ok": True}
                result = await client.until(lambda f: f["type"] == "result")
                assert result["outcome"] == "cancelled"
                state = await ask(port, "/api/state", headers=[("cookie", cookie)])
                assert SECRET_WORDS.encode() not in state.body  # OP7


# -- OP4: loopback or TLS, and only its own names ---------------------------------------------


async def test_op4_a_request_for_another_host_name_is_refused(tmp_path: Path) -> None:
    """A page reached by another name (a DNS-rebinding page's ``Host``) answers nothing."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE) as r:
            port = port_of(r)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(
                    b"GET /api/state HTTP/1.1\r\nhost: evil.example:%d\r\n" % port
                    + f"authorization: Bearer {r.token}\r\n\r\n".encode()
                )
                data = b""
                while b"}" not in data:
                    data += await stream.receive_some(4096)
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 421")
            assert msgspec.json.decode(body)["code"] == "page_host_refused"
            assert allowed_hosts("127.0.0.1", port, None) == {
                f"127.0.0.1:{port}",
                f"localhost:{port}",
            }


async def test_op4_a_page_on_a_network_address_without_tls_is_not_served_but_metrics_are() -> None:
    """The listener's own decision, over a real HTTP exchange in memory (no test binds a
    network address): ``insecure`` answers ``page_insecure`` for the page, ``/metrics`` still."""

    class Never(OperatorPage):
        def __init__(self) -> None:
            pass

        async def handle(self, request: Request, response: ResponseWriter) -> None:
            raise AssertionError("an insecure listener never reaches the page")

    async def handler(request: Request, response: ResponseWriter) -> None:
        await _handle(Never(), True, request, response)

    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve_http, handler)
        for path, status in (("/", 403), ("/api/state", 403), ("/metrics", 200)):
            async with open_request("GET", f"{server.url}{path}") as response:
                body = await response.read()
            assert response.status == status, path
            if status == 403:
                assert msgspec.json.decode(body)["code"] == "page_insecure"
        nursery.cancel_scope.cancel()


async def test_op4_over_tls_the_page_answers_https_with_a_secure_cookie(tmp_path: Path) -> None:
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    config = config_from_dict(PAGE, base=tmp_path)
    with trio.fail_after(LIMIT):
        async with open_server(
            config, ServeOptions(port=0, ssl_context=server_context), base_dir=tmp_path
        ) as server:
            port = server.metrics_port
            assert port is not None
            token = (tmp_path / "state" / "token").read_text()
            answer = await ask(
                port, "/login", "POST", body=f"token={token}".encode(), scheme="https",
                ssl_context=client_context,
            )  # fmt: skip
            assert answer.status == 303
            assert "Secure" in answer.headers["set-cookie"]
            scrape = await ask(port, "/metrics", scheme="https", ssl_context=client_context)
            assert scrape.status == 200


# -- OP5: the controls are the command line's -------------------------------------------------


async def test_op5_a_control_gets_the_admin_sockets_answer_and_only_controls_are_allowed(
    tmp_path: Path,
) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE) as r:
            port = port_of(r)
            cookie, csrf = await login(port, r.token)
            own = f"http://127.0.0.1:{port}"
            for request in (
                {"command": "task_resume", "task_id": "nope", "reason": "r"},
                {"command": "task_grant", "task_id": "nope", "reason": "r", "epochs": -1},
                {"command": "task_reply", "task_id": "nope", "text": "yes"},
                {"command": "cancel", "delivery_id": "nope"},
            ):
                body = msgspec.json.encode(request)
                page = await ask(
                    port, "/api/command", "POST", headers=control(cookie, csrf, own), body=body
                )
                cli = await admin_request(tmp_path / "state", request)
                assert page.json() == cli, request
                assert page.status in (400, 404, 409)
            for command in ("status", "task_submit", "task_forget", "tasks"):
                body = msgspec.json.encode({"command": command, "task_id": "x"})
                page = await ask(
                    port, "/api/command", "POST", headers=control(cookie, csrf, own), body=body
                )
                assert (page.status, page.code) == (400, "admin_unknown_command"), command
            junk = await ask(
                port, "/api/command", "POST", headers=control(cookie, csrf, own), body=b"{not"
            )
            assert junk.code == "admin_bad_request"
            deep = b'{"command": "cancel", "delivery_id": ' + b"[" * 5000 + b"]" * 5000 + b"}"
            nested = await ask(
                port, "/api/command", "POST", headers=control(cookie, csrf, own), body=deep
            )
            assert (nested.status, nested.code) == (400, "admin_bad_request")  # not a fault


# -- OP6: live, bounded ----------------------------------------------------------------------


async def test_op6_the_event_stream_pushes_a_new_state_when_something_changes(
    tmp_path: Path,
) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE, steps=[Hang(seconds=3600)]) as r:
            port = port_of(r)
            cookie, _csrf = await login(port, r.token)
            url = f"http://127.0.0.1:{port}/api/events"
            async with open_request("GET", url, headers=[("cookie", cookie)]) as events:
                assert events.status == 200
                assert events.headers["content-type"] == "text/event-stream"
                states = _states(events.iter_bytes())
                first = await anext(states)
                assert first["pending_total"] == 0
                async with r.connect() as client:
                    await client.send(message("d1", SECRET_WORDS))
                    await client.until(lambda f: f["type"] == "accepted")
                    while True:
                        state = await anext(states)
                        if state["pending"] == ["d1"]:
                            break
                    assert state["rooms"][0]["room"] == "dm:1"
                    await trio.to_thread.run_sync(rotate_token, tmp_path / "state")
                    # a rotated token ends the stream with a logout
                    left = [state async for state in states]  # ends at the logout
                    assert all(s["pending"] == ["d1"] for s in left)


async def test_op2_a_token_file_turned_insecure_ends_an_open_stream_with_a_logout_saying_so(
    tmp_path: Path,
) -> None:
    """OP2, O2: while a page's event stream (a session's) and a script's (a bearer token's)
    are open, the token file's mode turns group-readable. Each stream ends with an
    ``event: logout`` whose data names ``token_insecure`` and says what to do (never the
    token), as a rotated token's end names ``login_required``. Before, the token's read
    raised out of the stream: it was cut with no ``logout``, and the page could not tell the
    operator why (its browser reconnected into a refusal, "reconnecting" for ever)."""
    token_file = tmp_path / "state" / "token"
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE) as r:
            port = port_of(r)
            cookie, _csrf = await login(port, r.token)
            url = f"http://127.0.0.1:{port}/api/events"
            bearer = [("authorization", f"Bearer {r.token}")]
            async with (
                open_request("GET", url, headers=[("cookie", cookie)]) as page,
                open_request("GET", url, headers=bearer) as script,
            ):
                streams = [_events_of(page.iter_bytes()), _events_of(script.iter_bytes())]
                for events in streams:
                    assert (await anext(events))[0] == "state"
                await trio.to_thread.run_sync(token_file.chmod, 0o640)
                for events in streams:
                    left = [event async for event in events]  # to the stream's end
                    kind, data = left[-1]
                    assert kind == "logout", left
                    assert data["code"] == "token_insecure"
                    assert "pi-runtime token rotate" in data["message"]
                    assert r.token not in data["message"]
                    assert all(kind == "state" for kind, _ in left[:-1])
            # the file private again, the session is usable again; a rotated token ends its
            # stream with a logout that says so (the login form says what to do then)
            await trio.to_thread.run_sync(token_file.chmod, 0o600)
            async with open_request("GET", url, headers=[("cookie", cookie)]) as page:
                events = _events_of(page.iter_bytes())
                assert (await anext(events))[0] == "state"
                await trio.to_thread.run_sync(rotate_token, tmp_path / "state")
                left = [event async for event in events]
                assert left[-1] == (
                    "logout",
                    {"code": "login_required", "message": "log in with the access token first"},
                )


async def _events_of(chunks: Any) -> Any:
    """Each server-sent event of a stream as ``(event, data)``, to the stream's end."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if event.startswith(b"event: "):
                head, _, data = event.partition(b"\ndata: ")
                yield head[len(b"event: ") :].decode(), msgspec.json.decode(data)


async def _states(chunks: Any) -> Any:
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if event.startswith(b"event: logout"):
                return
            if event.startswith(b"event: state\ndata: "):
                yield msgspec.json.decode(event[len(b"event: state\ndata: ") :])


async def test_op6_open_streams_are_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_page, "MAX_STREAMS", 2)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE) as r:
            port = port_of(r)
            cookie, _csrf = await login(port, r.token)
            url = f"http://127.0.0.1:{port}/api/events"
            async with (
                open_request("GET", url, headers=[("cookie", cookie)]) as one,
                open_request("GET", url, headers=[("cookie", cookie)]) as two,
            ):
                assert (one.status, two.status) == (200, 200)
                busy = await ask(port, "/api/events", headers=[("cookie", cookie)])
                assert (busy.status, busy.code) == (503, "page_busy")


async def test_op6_a_page_that_stops_reading_its_event_stream_gives_its_slot_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OP6: a client that opens the event stream and then reads nothing (a small receive
    buffer, so the pipe fills) has its connection closed once a write has waited
    ``SEND_SECONDS``, and its stream slot is free again; the stream's every push is a big,
    new state here, so the pipe fills fast."""
    monkeypatch.setattr(_page, "SEND_SECONDS", 0.2)
    monkeypatch.setattr(_page, "PUSH_SECONDS", 0.01)
    monkeypatch.setattr(_page, "MAX_STREAMS", 1)
    pushes = 0
    snapshot = OperatorPage.snapshot

    async def big(self: OperatorPage) -> dict[str, Any]:
        nonlocal pushes
        pushes += 1
        return {**await snapshot(self), "padding": f"{pushes:08d}" * 32_768}  # 256 KiB

    ended = trio.Event()
    events = OperatorPage._events

    async def watched(self: OperatorPage, request: Request, response: ResponseWriter) -> None:
        try:
            await events(self, request, response)
        finally:
            ended.set()

    monkeypatch.setattr(OperatorPage, "snapshot", big)
    monkeypatch.setattr(OperatorPage, "_events", watched)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE) as r:
            port = port_of(r)
            sock = trio.socket.socket()
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)
            await sock.connect(("127.0.0.1", port))
            async with trio.SocketStream(sock) as stuck:
                await stuck.send_all(
                    f"GET /api/events HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
                    f"authorization: Bearer {r.token}\r\n\r\n".encode()
                )
                with trio.fail_after(20):  # the slot is given back (never, before OP6's bound)
                    await ended.wait()
                bearer = [("authorization", f"Bearer {r.token}")]
                url = f"http://127.0.0.1:{port}/api/events"
                async with open_request("GET", url, headers=bearer) as again:
                    assert again.status == 200  # the one slot is free
                got = 0
                with contextlib.suppress(trio.BrokenResourceError):  # a reset is a close
                    while chunk := await stuck.receive_some(65536):  # what was sent, then the close
                        got += len(chunk)
                assert got > 0


def task_row(i: int) -> dict[str, Any]:
    """Task ``t<i>``'s row: the even ones ended."""
    return {
        "task_id": f"t{i}",
        "state": "done" if i % 2 == 0 else "open",
        "classification": "Active",
        "ended": "done" if i % 2 == 0 else None,
    }


def many_tasks(monkeypatch: pytest.MonkeyPatch, n: int) -> list[int]:
    """The task service knows ``n`` tasks (:func:`task_row`); the list counts the rows built."""
    built = [0]
    ids = [f"t{i}" for i in range(1, n + 1)]
    rows_of = {task_id: functools.partial(task_row, i) for i, task_id in enumerate(ids, 1)}

    def ends(self: TaskService) -> dict[str, bool]:
        return {task_id: int(task_id[1:]) % 2 == 0 for task_id in sorted(ids)}

    def rows(self: TaskService, task_ids: Iterable[str] | None = None) -> list[dict[str, Any]]:
        chosen = sorted(ids) if task_ids is None else list(task_ids)
        built[0] += len(chosen)
        return [rows_of[task_id]() for task_id in chosen]

    def classifications(self: TaskService) -> dict[str, tuple[str, str]]:
        return {
            task_id: ((row := rows_of[task_id]())["classification"], row["state"])
            for task_id in sorted(ids)
        }

    monkeypatch.setattr(TaskService, "ends", ends)
    monkeypatch.setattr(TaskService, "rows", rows)
    monkeypatch.setattr(TaskService, "classifications", classifications)
    return built


async def test_op6_a_state_lists_at_most_tasks_shown_tasks_and_says_how_many(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OP6: one state lists at most ``TASKS_SHOWN`` tasks — the live ones first, the most
    recently changed first — and ``tasks_total`` says how many there are."""
    monkeypatch.setattr(_page, "TASKS_SHOWN", 2)
    many_tasks(monkeypatch, 7)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE) as r:
            port = port_of(r)
            bearer = [("authorization", f"Bearer {r.token}")]
            state = (await ask(port, "/api/state", headers=bearer)).json()
    assert state["tasks_total"] == 7
    # t1, t3, t5, t7 are live; the follower saw t7 change last, then t5
    assert [task["task_id"] for task in state["tasks"]] == ["t5", "t7"]


async def test_op6_the_timelines_start_without_building_a_task_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OP6: the follower that keeps the timelines starts each one from the task's
    classification and state (``TaskService.classifications()``) without building its row,
    and a state builds the rows of the tasks it lists and no other: two thousand tasks cost
    the page's start no row, and its first state ``TASKS_SHOWN``; ``tasks_total`` still says
    how many there are. The
    timelines did start (the state lists the tasks the follower saw last, by id order: the
    live ones whose ids sort last)."""
    monkeypatch.setattr(_page, "TASKS_SHOWN", 5)
    built = many_tasks(monkeypatch, 2000)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE) as r:
            port = port_of(r)
            bearer = [("authorization", f"Bearer {r.token}")]
            state = (await ask(port, "/api/state", headers=bearer)).json()
            assert built[0] == 5
    assert state["tasks_total"] == 2000
    live = [task_id for task_id in sorted(f"t{i}" for i in range(1, 2001)) if int(task_id[1:]) % 2]
    assert [task["task_id"] for task in state["tasks"]] == sorted(live[-5:])  # live ones first


async def test_op6_a_state_builds_no_room_status_past_what_it_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OP6: a state builds the statuses of the rooms it lists (``ROOMS_SHOWN``, the first by
    room) and no other — ``RoomWorker.status(limit=…)`` picks them by name first — and
    ``rooms_total`` (``RoomWorker.room_count``) still says how many rooms there are."""
    monkeypatch.setattr(_page, "ROOMS_SHOWN", 2)
    built = [0]

    def counted(**fields: Any) -> RoomStatus:
        built[0] += 1
        return RoomStatus(**fields)

    monkeypatch.setattr(_worker, "RoomStatus", counted)
    steps: list[Step] = [Text(text="one"), Text(text="two"), Text(text="three")]
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE, steps=steps) as r:
            port = port_of(r)
            bearer = [("authorization", f"Bearer {r.token}")]
            async with r.connect() as client:
                for room in ("dm:3", "dm:1", "dm:2"):
                    await client.send(message(f"d-{room}", "hello", room=room))
                    await client.until(lambda f: f["type"] == "result")
            built[0] = 0
            state = (await ask(port, "/api/state", headers=bearer)).json()
            assert built[0] == 2
    assert state["rooms_total"] == 3
    assert [room["room"] for room in state["rooms"]] == ["dm:1", "dm:2"]


# -- OP7, OP8: what a view shows; a fault stays in its request ---------------------------------


async def test_op7_a_deliverys_journal_is_what_journal_show_prints(tmp_path: Path) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE, steps=[Text(text="hello")]) as r:
            port = port_of(r)
            cookie, _csrf = await login(port, r.token)
            async with r.connect() as client:
                await client.send(message("d/1 x", SECRET_WORDS))
                await client.until(lambda f: f["type"] == "result")
            state = await ask(port, "/api/state", headers=[("cookie", cookie)])
            room = state.json()["rooms"][0]
            assert (room["last_outcome"], room["last_delivery"]) == ("reply", "d/1 x")
            assert room["last_result_seq"] == 1
            assert b"hello" not in state.body  # the reply's text is not on the page (OP7)
            shown = await ask(port, "/api/journal/d%2F1%20x", headers=[("cookie", cookie)])
            assert shown.status == 200
            records, _note = delivery_records(tmp_path / "state", "d/1 x")
            assert shown.json()["records"] == msgspec.to_builtins(records)
            assert r.token.encode() not in shown.body
            unknown = await ask(port, "/api/journal/nope", headers=[("cookie", cookie)])
            assert (unknown.status, unknown.code) == (404, "delivery_unknown")
            task = await ask(port, "/api/tasks/nope", headers=[("cookie", cookie)])
            assert (task.status, task.code) == (404, "task_unknown")


async def test_op7_a_task_id_not_of_the_admin_sockets_form_is_refused_before_any_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OP7: ``GET /api/tasks/<id>`` checks the id as the admin socket's ``task_show`` does
    (``pi-runtime task show``, O7): an id with a NUL or another control character (sent
    percent-encoded, as a URL carries it), an empty one or one over 200 characters is 400
    ``admin_bad_request`` — the command line's very answer — and never reaches the task
    service. Ids that try to climb out of a directory (``..``, ``%2e%2e``, encoded slashes)
    are ids like any other: looked up by id (a dictionary key, a hash on disk, never a path)
    and ``task_unknown``. Before, every id reached the task service as it was: a NUL or a
    kilobyte of id was ``task_unknown``, not the bad request the command line answers."""
    reached: list[str] = []
    task_show = TaskService.task_show

    async def spied(self: TaskService, task_id: str) -> dict[str, Any]:
        reached.append(task_id)
        return await task_show(self, task_id)

    monkeypatch.setattr(TaskService, "task_show", spied)
    bad = {
        "%00": "\x00",
        "t%001": "t\x001",
        "t%0A1": "t\n1",
        "%1B%5B2J": "\x1b[2J",
        "": "",
        "t" * 201: "t" * 201,
        "%C2%85": "\x85",  # a C1 control (NEL), UTF-8 encoded
    }
    climbing = {
        "..": "..",
        "%2e%2e": "..",
        "..%2F..%2Fetc%2Fpasswd": "../../etc/passwd",
        "%2F": "/",
        "a%5C..%5Cb": "a\\..\\b",
    }
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE) as r:
            port = port_of(r)
            bearer = [("authorization", f"Bearer {r.token}")]
            for raw, task_id in bad.items():
                answer = await ask(port, f"/api/tasks/{raw}", headers=bearer)
                cli = await admin_request(
                    tmp_path / "state", {"command": "task_show", "task_id": task_id}
                )
                assert cli is not None
                assert (answer.status, answer.code) == (400, cli["code"]), raw
                assert cli["code"] == "admin_bad_request"
                assert answer.json()["message"] == cli["message"], raw
            assert reached == []  # none of them reached the task service
            for raw in climbing:
                answer = await ask(port, f"/api/tasks/{raw}", headers=bearer)
                assert (answer.status, answer.code) == (404, "task_unknown"), raw
            assert reached == list(climbing.values())
            assert (await ask(port, "/api/state", headers=bearer)).status == 200


async def test_op8_a_failing_view_is_its_own_500_and_the_page_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0
    original = OperatorPage.snapshot

    async def broken(self: OperatorPage) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug in the view")
        return await original(self)

    monkeypatch.setattr(OperatorPage, "snapshot", broken)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE) as r:
            port = port_of(r)
            bearer = [("authorization", f"Bearer {r.token}")]
            failed = await ask(port, "/api/state", headers=bearer)
            assert (failed.status, failed.code) == (500, str(ReasonCode.PAGE_FAILED))
            assert (await ask(port, "/api/state", headers=bearer)).status == 200
            assert (await ask(port, "/metrics")).status == 200
            assert r.server.worker.admitting


async def test_op9_page_false_serves_the_metrics_alone(tmp_path: Path) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, {"metrics": {"listen": "127.0.0.1:0", "page": False}}) as r:
            port = port_of(r)
            assert (await ask(port, "/")).status == 404
            assert (await ask(port, "/login", "POST", body=b"token=x")).status == 405
            assert (await ask(port, "/metrics")).status == 200


async def test_op6_a_body_over_the_bound_is_413_before_anything_reads_it(tmp_path: Path) -> None:
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE) as r:
            port = port_of(r)
            big = await ask(port, "/login", "POST", body=b"token=" + b"x" * 300_000)
            assert big.status == 413
            assert (await ask(port, "/")).status == 200  # the listener goes on


async def test_op8_a_fault_in_following_the_tasks_stays_in_the_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timelines' follower fails (its first read of the tasks raises): it is logged, the
    server goes on serving its websocket, the metrics and the page."""
    calls = fails_once(monkeypatch, TaskService, "classifications")
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE, steps=[Text(text="still here")]) as r:
            port = port_of(r)
            bearer = [("authorization", f"Bearer {r.token}")]
            assert (await ask(port, "/api/state", headers=bearer)).status == 200
            assert (await ask(port, "/metrics")).status == 200
            async with r.connect() as client:
                await client.send(message("d1", "hello"))
                result = await client.until(lambda f: f["type"] == "result")
            assert result["outcome"] == "reply"
            assert calls[0] == 1  # the follower's, which failed
