"""Adversarial tests of the operator surfaces (docs/design/operations.md "Metrics", "The
operator page", "The admin socket"): each tries to break one rule — no secret in an answer, a
stable code for bad input, no client stalling the others, no text of a client's in the
exposition or as HTML on the page. Real servers, real sockets on 127.0.0.1 and a real admin
socket."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from fake_pi.scenario import Hang
from runtime._boundary._http import open_request
from runtime._config import config_from_dict
from runtime._errors import ConfigError
from runtime._server import _metrics
from runtime._server._admin import ADMIN_SOCKET, admin_request

from .._wire import message
from .test_admin import FakeHandler, serving, state_dir
from .test_metrics import _exchange, scrape
from .test_operator_page import PAGE, ask, login, port_of
from .test_serve import rig

LIMIT: Final = 60.0
ROOM: Final = 'room:"}evil_metric{x="1"}<img/src=x/onerror=alert(1)>'
"""A valid opaque room id (printable, no space) made of the exposition's and HTML's syntax."""
DELIVERY: Final = '</script><script>alert("d")</script>"} injected 1'
"""A valid delivery id (printable, spaces allowed) likewise."""


def _families(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


# -- M2, M3, M7: hostile scrapes -------------------------------------------------------------


async def test_m3_m7_a_scrape_with_a_huge_or_malformed_query_is_answered_with_a_code(
    tmp_path: Path,
) -> None:
    """M3, M7: the query of ``/metrics`` is no part of the path — junk, percent signs that
    decode to nothing, a query of 15,000 bytes — the scrape is answered; a request line over
    the head's 16 KiB is ``431 http_head_too_large`` with its code, and the listener goes on."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, {"metrics": {"listen": "127.0.0.1:0"}}) as r:
            port = port_of(r)
            for query in ("?%zz&&==;%00", "?" + "a=b&" * 3_750, '?name[]=}{"\\'):
                status, _kind, text = await scrape(port, "/metrics" + query)
                assert status == 200, query[:40]
                assert "pi_runtime_room_lanes" in _families(text)
            head = f"GET /metrics?{'x' * 20_000} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n"
            refused = await _exchange(port, head.encode())
            assert refused.startswith(b"HTTP/1.1 431"), refused[:60]
            assert b'"code":"http_head_too_large"' in refused
            assert b"x" * 100 not in refused  # the request is not echoed back
            status, _, _ = await scrape(port)
            assert status == 200


async def test_m2_room_and_delivery_ids_made_of_the_exposition_syntax_reach_no_scrape(
    tmp_path: Path,
) -> None:
    """M2: a room id and a delivery id a client chose, carrying ``"``, ``}``, ``{`` and a
    would-be sample, are admitted (they are valid ids) and appear nowhere in the exposition,
    in either format: it parses, and holds no family but the runtime's own."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE, steps=[Hang(seconds=3600)]) as r, r.connect() as client:
            await client.send(message(DELIVERY, room=ROOM))
            accepted = await client.until(lambda f: f["type"] in ("accepted", "error"))
            assert accepted["type"] == "accepted", accepted
            port = port_of(r)
            _, _, text = await scrape(port)
            _, kind, open_text = await scrape(port, accept="application/openmetrics-text")
    assert kind.startswith("application/openmetrics-text")
    for body in (text, open_text):
        for part in ("evil_metric", "injected", "alert", "<img", ROOM, DELIVERY):
            assert part not in body
    names = _families(text)
    assert "evil_metric" not in names
    assert all(name.startswith(("pi_runtime_", "process_")) for name in names), names
    assert {n for n in names if n.startswith("pi_runtime_deliveries_pending")}


# -- M6: clients that never finish, or come all at once --------------------------------------


async def test_m6_a_head_sent_a_byte_at_a_time_is_closed_at_the_request_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """M6: ``REQUEST_SECONDS`` bounds the whole request, not the silence between two bytes: a
    client that keeps sending header bytes but never ends its head is closed once the bound
    has passed, unanswered but for the close; the next scrape is served."""
    monkeypatch.setattr(_metrics, "REQUEST_SECONDS", 0.5)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, {"metrics": {"listen": "127.0.0.1:0"}}) as r:
            port = port_of(r)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"GET /metrics HTTP/1.1\r\nx-slow: ")
            closed_at: list[float] = []
            started = trio.current_time()

            async def trickle() -> None:  # the attacker's pace, not a wait for the server
                try:
                    while True:
                        await stream.send_all(b"a")
                        await trio.sleep(0.05)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return

            async def read() -> None:
                try:
                    while await stream.receive_some(65536):
                        pass
                except trio.BrokenResourceError:
                    pass
                closed_at.append(trio.current_time() - started)

            with trio.fail_after(5.0):  # ten times the bound: the server closed it
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(trickle)
                    await read()
                    nursery.cancel_scope.cancel()
            await stream.aclose()
            status, _, _ = await scrape(port)
    assert status == 200
    assert closed_at
    assert closed_at[0] < 5.0


async def test_m6_a_crowd_of_connections_is_capped_and_the_websocket_clients_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """M6, M9: forty silent connections opened at once to a listener capped at eight: each
    one over the cap closes the one idle the longest (M9), the last eight are closed at the
    request bound — every one ends closed with no answer, at most eight open at a time;
    meanwhile a websocket client is served as before, and once the crowd has gone a scrape
    is answered."""
    monkeypatch.setattr(_metrics, "REQUEST_SECONDS", 0.5)
    monkeypatch.setattr(_metrics, "MAX_CONNECTIONS", 8)
    answers: list[bytes] = []
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, {"metrics": {"listen": "127.0.0.1:0"}}) as r:
            port = port_of(r)

            async def silent() -> None:
                answers.append(await _exchange(port, b""))

            async with trio.open_nursery() as nursery:
                for _ in range(40):
                    nursery.start_soon(silent)
                async with r.connect() as client:
                    await client.send({"type": "status"})
                    status = await client.until(lambda f: f["type"] == "status")
                    assert status["pending"] == 0
            code, _, _ = await scrape(port)
    assert code == 200
    assert len(answers) == 40
    assert all(a == b"" for a in answers)  # silent, idle: closed (M9, or at the bound)


# -- OP1: text of a client's on the page -----------------------------------------------------


_SINKS: Final = re.compile(
    r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function|"
    r"setTimeout\(\s*[\"'`]|srcdoc|javascript:"
)


def test_op1_the_script_has_no_html_sink() -> None:
    """OP1: the page's script puts every value in the page as text: it has no sink that
    parses a string as HTML or script."""
    script = (Path(_metrics.__file__).parent / "page" / "page.js").read_text()
    assert _SINKS.search(script) is None, _SINKS.search(script)


async def test_op1_op7_ids_made_of_html_reach_the_page_as_json_data_only(tmp_path: Path) -> None:
    """OP1, OP7: a room id and a delivery id made of HTML and script reach the page only as
    JSON strings — in ``/api/state`` (``application/json``, ``nosniff``, the page's CSP) and
    as one ``data:`` line of an event (an id cannot end the event or start another) — never
    in the HTML the server writes; a 404 naming such a path is JSON too."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE, steps=[Hang(seconds=3600)]) as r, r.connect() as client:
            await client.send(message(DELIVERY, room=ROOM))
            await client.until(lambda f: f["type"] == "accepted")
            port = port_of(r)
            cookie, _ = await login(port, r.token)
            page = await ask(port, "/", headers=[("cookie", cookie)])
            state = await ask(port, "/api/state", headers=[("cookie", cookie)])
            missing = await ask(port, "/%3Cscript%3Ealert(1)%3C/script%3E")
            url = f"http://127.0.0.1:{port}/api/events"
            async with open_request("GET", url, headers=[("cookie", cookie)]) as events:
                raw = b""
                async for chunk in events.iter_bytes():
                    raw += chunk
                    if b"\n\n" in raw:
                        break
    for text in ("<script>alert", "<img", "alert(", "evil_metric"):
        assert text.encode() not in page.body
    assert state.status == 200
    assert state.headers["content-type"] == "application/json"
    assert state.headers["x-content-type-options"] == "nosniff"
    assert "script-src 'self'" in state.headers["content-security-policy"]
    data = state.json()
    assert [room["room"] for room in data["rooms"]] == [ROOM]
    assert data["pending"] == [DELIVERY]
    assert (missing.status, missing.code) == (404, "page_not_found")
    assert missing.headers["content-type"] == "application/json"
    event = raw.split(b"\n\n", 1)[0].split(b"\n")
    assert event[0] == b"event: state"
    assert len(event) == 2
    assert event[1].startswith(b"data: ")
    assert msgspec.json.decode(event[1][len(b"data: ") :])["pending"] == [DELIVERY]


# -- O5, O7: the admin socket -----------------------------------------------------------------


async def _raw_admin(state: Path, line: bytes) -> dict[str, Any]:
    stream = await trio.open_unix_socket(str(state / ADMIN_SOCKET))
    async with stream:
        await stream.send_all(line + b"\n")
        got = b""
        while chunk := await stream.receive_some(65536):
            got += chunk
    answer = msgspec.json.decode(got.strip())
    assert isinstance(answer, dict)
    return answer


@pytest.mark.parametrize(
    ("line", "code"),
    [
        (b'{"command": 5}', "admin_unknown_command"),
        (b'{"command": {"command": "status"}}', "admin_unknown_command"),
        (b'{"command": "cancel", "delivery_id": 5}', "admin_bad_request"),
        (b'{"command": "cancel", "delivery_id": ["d1"]}', "admin_bad_request"),
        (b'{"command": "cancel", "delivery_id": null}', "admin_bad_request"),
        (b'{"command": "cancel", "delivery_id": "d1\\u2028"}', "admin_bad_request"),
        (b'{"command": "cancel", "delivery_id": "\\u00ad"}', "admin_bad_request"),
        (
            b'{"command": "cancel", "delivery_id": "d1", "delivery_id": "x\\u0000"}',
            "admin_bad_request",
        ),
        (b'{"command": "status", "command": "cancel", "delivery_id": "d1"}', "admin_bad_request"),
        (b'{"command": "cancel", "delivery_id": "d1", "extra": true}', "admin_bad_request"),
        (b'{"command": "cancel", "delivery_id": "\\ud800"}', "admin_bad_request"),
        (b'{"command": "status", "x": 1e400}', "admin_bad_request"),
        (b"\xff\xfe{}", "admin_bad_request"),
        (b"[" * 100_000, "admin_request_too_large"),
    ],
)
async def test_o7_a_request_of_the_wrong_types_is_refused_with_its_code(
    tmp_path: Path, line: bytes, code: str
) -> None:
    """O7: an id of the wrong type, one that is not printable (a line separator, a soft
    hyphen, a lone surrogate), duplicated keys whose last is bad, a number JSON's doubles
    cannot hold, bytes that are not UTF-8: each is refused with its code and never reaches
    the handler, and the server answers the next request."""
    state = state_dir(tmp_path)
    handler = FakeHandler()
    with trio.fail_after(LIMIT):
        async with serving(state, handler):
            answer = await _raw_admin(state, line)
            after = await _raw_admin(state, b'{"command": "status"}')
    assert (answer["ok"], answer["code"]) == (False, code), answer
    assert handler.calls == [("status", None)]
    assert after["ok"] is True


_OTHER_USER: Final = """
import os, socket, sys
fd = os.open(sys.argv[1], os.O_PATH | os.O_DIRECTORY)
os.setegid(65534)
os.seteuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
s.connect(f"/proc/self/fd/{fd}/admin.sock")
try:
    s.sendall(b'{"command": "cancel", "delivery_id": "d1"}\\n')
except BrokenPipeError:  # refused at once: the answer is still there to read
    pass
got = b""
while chunk := s.recv(65536):
    got += chunk
sys.stdout.write(got.decode())
"""


async def test_o5_a_peer_of_another_uid_is_refused_even_when_the_modes_let_it_in(
    tmp_path: Path,
) -> None:
    """O5: the uid check is the socket's own, not only the modes': a real process of another
    user (uid 65534; the tests run as root, as CI does) that reaches the socket — its
    directory and file opened up after the bind — is answered ``admin_unauthorized``
    (``SO_PEERCRED``) and nothing is cancelled."""
    state = state_dir(tmp_path)
    handler = FakeHandler()
    with trio.fail_after(LIMIT):
        async with serving(state, handler):
            state.chmod(0o711)
            (state / ADMIN_SOCKET).chmod(0o666)
            done = await trio.to_thread.run_sync(
                lambda: subprocess.run(
                    [sys.executable, "-c", _OTHER_USER, str(state)],
                    capture_output=True,
                    timeout=30,
                    check=False,
                )
            )
            state.chmod(0o700)
    assert done.returncode == 0, done.stderr
    answer = msgspec.json.decode(done.stdout.strip())
    assert (answer["ok"], answer["code"]) == (False, "admin_unauthorized")
    assert handler.calls == []


# -- C4, O4: a password in the configuration ---------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://pi:hunter2-secret@127.0.0.1:1/pi",
        "host=127.0.0.1 port=1 dbname=pi password=hunter2-secret",
        "postgresql://pi@127.0.0.1:1/pi?password=hunter2-secret",
    ],
)
def test_o4_a_database_password_in_the_configuration_is_refused_without_being_shown(
    url: str,
) -> None:
    """C4 (O4): a store URL carrying a password is refused at load, naming ``store.url``; the
    password is in neither the message nor anything the error carries."""
    with pytest.raises(ConfigError) as refused:
        config_from_dict({"store": {"url": url}}, base=Path("/nonexistent"))
    assert "store.url" in str(refused.value)
    assert "hunter2" not in repr(refused.value)
    assert "hunter2" not in str(refused.value)


async def test_o4_the_token_is_in_no_answer_of_the_page_metrics_or_admin_socket(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """O4, M2, OP2: after a login, a control, a refused one, a scrape and an admin ``status``,
    the token is in no answer and no log record; a control carrying the token as its text
    is not logged with it either."""
    caplog.set_level("DEBUG")
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, PAGE) as r:
            port = port_of(r)
            token = r.token
            cookie, csrf = await login(port, token)
            headers = [("cookie", cookie), ("x-csrf-token", csrf)]
            bodies = [(await ask(port, "/api/state", headers=headers)).body]
            for command in (
                {"command": "task_reply", "task_id": "t1", "text": token},
                {"command": "status", "token": token},
                {"command": token},
            ):
                answered = await ask(
                    port, "/api/command", "POST", headers=headers, body=msgspec.json.encode(command)
                )
                assert answered.status in (400, 404), answered
                if command["command"] != token:  # (an unknown command is named back)
                    bodies.append(answered.body)
            _, _, text = await scrape(port)
            status = await admin_request(r.root / "state", {"command": "status"})
    assert token not in text
    assert token not in repr(status)
    for body in bodies:
        assert token.encode() not in body
    for record in caplog.records:
        assert token not in record.getMessage()
        assert token not in repr(record.__dict__)
