"""The admin socket (``runtime/_server/_admin.py``); test names cite ``docs/design/operations.md``
(O5…). Real Unix sockets in ``tmp_path``, the real clock, every wait bounded by
``trio.fail_after``; the handler is a fake."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio
import trio.testing

from runtime._errors import AdminError, DeliveryError, ReasonCode, StateDirError
from runtime._server import _admin
from runtime._server._admin import ADMIN_SOCKET, MAX_REQUEST, admin_request, serve_admin

LIMIT: Final = 10.0


class FakeHandler:
    """Answers ``status``; ``cancel`` knows ``d1`` only; ``fail`` makes it misbehave."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []
        self.fail: str | None = None

    async def status(self) -> dict[str, Any]:
        self.calls.append(("status", None))
        if self.fail == "raise":
            raise RuntimeError("boom")
        if self.fail == "hang":
            await trio.sleep_forever()
        if self.fail == "not-json":
            return {"rooms": object()}
        return {"worker_id": "w1", "pending": 0, "rooms": []}

    async def cancel(self, delivery_id: str) -> dict[str, Any]:
        self.calls.append(("cancel", delivery_id))
        if delivery_id != "d1":
            raise DeliveryError(ReasonCode.DELIVERY_UNKNOWN, f"no delivery {delivery_id}")
        return {"delivery_id": delivery_id, "state": "cancelling"}


def state_dir(tmp_path: Path, name: str = "state") -> Path:
    path = tmp_path / name
    path.mkdir(mode=0o700)
    return path


@contextlib.asynccontextmanager
async def serving(state: Path, handler: FakeHandler) -> AsyncIterator[Path]:
    async with trio.open_nursery() as nursery:
        path = await nursery.start(serve_admin, state, handler)
        yield path
        nursery.cancel_scope.cancel()


async def raw(path: Path, data: bytes, *, close_write: bool = False) -> dict[str, Any] | None:
    """Send ``data`` as is; the decoded answer (``None``: the server closed silently)."""
    stream = await trio.open_unix_socket(str(path))
    async with stream:
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(data)
            if close_write:
                await stream.send_eof()
        received = b""
        while chunk := await stream.receive_some():
            received += chunk
    if not received:
        return None
    answer: dict[str, Any] = msgspec.json.decode(received)
    return answer


# ---------------------------------------------------------------------------- the socket


async def test_o5_socket_is_private_before_it_listens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = state_dir(tmp_path)
    seen: list[tuple[int, bool]] = []
    rename = os.rename

    def checking_rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(os.fspath(src))
            listening = True
        except ConnectionRefusedError:
            listening = False
        finally:
            probe.close()
        seen.append((stat.S_IMODE(os.lstat(src).st_mode), listening))
        rename(src, dst)

    monkeypatch.setattr(os, "rename", checking_rename)
    with trio.fail_after(LIMIT):
        async with serving(state, FakeHandler()) as path:
            assert seen == [(0o600, False)]  # made private, not yet listening
            assert path == state.absolute() / ADMIN_SOCKET
            info = os.lstat(path)
            assert stat.S_ISSOCK(info.st_mode)
            assert stat.S_IMODE(info.st_mode) == 0o600
            assert await admin_request(state, {"command": "status"}) is not None
        assert not path.exists()  # removed on the way out
        assert sorted(os.listdir(state)) == []


async def test_o5_a_state_directory_others_can_read_is_refused(tmp_path: Path) -> None:
    state = state_dir(tmp_path)
    state.chmod(0o755)
    with trio.fail_after(LIMIT), pytest.raises(StateDirError) as refused:
        await serve_admin(state, FakeHandler())
    assert refused.value.code is ReasonCode.STATE_DIR_INSECURE


async def test_o5_a_state_directory_path_longer_than_a_socket_address(tmp_path: Path) -> None:
    state = tmp_path / ("long-" * 30)
    state.mkdir(mode=0o700)
    assert len(os.fsencode(state / ADMIN_SOCKET)) > 107
    handler = FakeHandler()
    with trio.fail_after(LIMIT):
        async with serving(state, handler) as path:
            assert path.parent == state.absolute()
            response = await admin_request(state, {"command": "status"})
            assert response == {"ok": True, "worker_id": "w1", "pending": 0, "rooms": []}
        assert not path.exists()
        assert await admin_request(state, {"command": "status"}) is None


@pytest.mark.parametrize("length", [95, 100, 104, 107])
async def test_o5_an_admin_socket_path_just_under_the_limit_is_served(
    tmp_path: Path, length: int
) -> None:
    """O5: a path to ``admin.sock`` that fits a socket address while the temporary name it is
    bound under first does not (13 bytes longer) is served too. Before, the temporary name
    went to ``bind`` as it was: ``AF_UNIX path too long``, and ``serve`` did not start (a
    test's temporary directory under xdist was of such a length)."""
    base = len(os.fsencode(tmp_path / "s" / ADMIN_SOCKET)) - 1
    assert base < length, "the test's temporary directory is already too long"
    state = tmp_path / ("s" * (length - base))
    state.mkdir(mode=0o700)
    assert len(os.fsencode(state / ADMIN_SOCKET)) == length
    with trio.fail_after(LIMIT):
        async with serving(state, FakeHandler()):
            response = await admin_request(state, {"command": "status"})
    assert response is not None
    assert response["ok"] is True


async def test_o6_a_live_server_is_refused(tmp_path: Path) -> None:
    state = state_dir(tmp_path)
    with trio.fail_after(LIMIT):
        async with serving(state, FakeHandler()) as path:
            with pytest.raises(StateDirError) as refused:
                await serve_admin(state, FakeHandler())
            assert refused.value.code is ReasonCode.ADMIN_ALREADY_SERVING
            assert path.exists()  # the refused one did not touch it
            assert await admin_request(state, {"command": "status"}) is not None


async def test_o6_a_stale_socket_is_replaced(tmp_path: Path) -> None:
    state = state_dir(tmp_path)
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(state / ADMIN_SOCKET))  # a server that died without cleaning up
    dead.close()
    with trio.fail_after(LIMIT):
        assert await admin_request(state, {"command": "status"}) is None
        async with serving(state, FakeHandler()):
            response = await admin_request(state, {"command": "status"})
            assert response is not None
            assert response["ok"] is True


async def test_o6_something_else_at_the_socket_path_is_refused(tmp_path: Path) -> None:
    state = state_dir(tmp_path)
    (state / ADMIN_SOCKET).write_text("not a socket")
    with trio.fail_after(LIMIT), pytest.raises(StateDirError) as refused:
        await serve_admin(state, FakeHandler())
    assert refused.value.code is ReasonCode.STATE_DIR_INVALID
    assert (state / ADMIN_SOCKET).read_text() == "not a socket"


async def test_o6_a_socket_replaced_by_another_server_is_left_alone(tmp_path: Path) -> None:
    state = state_dir(tmp_path)
    with trio.fail_after(LIMIT):
        async with serving(state, FakeHandler()) as path:
            path.unlink()
            other = socket.socket(socket.AF_UNIX)
            other.bind(str(path))
        assert stat.S_ISSOCK(os.lstat(path).st_mode)  # not ours any more: not removed
        other.close()


# -------------------------------------------------------------------------- the exchange


async def test_o7_status_and_cancel(tmp_path: Path) -> None:
    state = state_dir(tmp_path)
    handler = FakeHandler()
    with trio.fail_after(LIMIT):
        async with serving(state, handler):
            assert await admin_request(state, {"command": "status"}) == {
                "ok": True,
                "worker_id": "w1",
                "pending": 0,
                "rooms": [],
            }
            assert await admin_request(state, {"command": "cancel", "delivery_id": "d1"}) == {
                "ok": True,
                "delivery_id": "d1",
                "state": "cancelling",
            }
            assert await admin_request(state, {"command": "cancel", "delivery_id": "zz"}) == {
                "ok": False,
                "code": "delivery_unknown",
                "message": "no delivery zz",
            }
    assert handler.calls == [("status", None), ("cancel", "d1"), ("cancel", "zz")]


BAD: Final = [
    (b"not json\n", ReasonCode.ADMIN_BAD_REQUEST),
    (b"[1, 2]\n", ReasonCode.ADMIN_BAD_REQUEST),
    (b'"status"\n', ReasonCode.ADMIN_BAD_REQUEST),
    (b"{}\n", ReasonCode.ADMIN_UNKNOWN_COMMAND),
    (b'{"command": "reboot"}\n', ReasonCode.ADMIN_UNKNOWN_COMMAND),
    (b'{"command": ["status"]}\n', ReasonCode.ADMIN_UNKNOWN_COMMAND),
    (b'{"command": "cancel"}\n', ReasonCode.ADMIN_BAD_REQUEST),
    (b'{"command": "cancel", "delivery_id": 7}\n', ReasonCode.ADMIN_BAD_REQUEST),
    (b'{"command": "cancel", "delivery_id": ""}\n', ReasonCode.ADMIN_BAD_REQUEST),
    (b'{"command": "cancel", "delivery_id": "a\\nb"}\n', ReasonCode.ADMIN_BAD_REQUEST),
    (b'{"command": "status", "extra": 1}\n', ReasonCode.ADMIN_BAD_REQUEST),
    (b"\xff\xfe\n", ReasonCode.ADMIN_BAD_REQUEST),
    (b"[" * 5000 + b"]" * 5000 + b"\n", ReasonCode.ADMIN_BAD_REQUEST),  # deeper than decoders go
    (b'{"command": "cancel", "delivery_id": ' + b"[" * 5000 + b"\n", ReasonCode.ADMIN_BAD_REQUEST),
    (b"{" + b" " * (MAX_REQUEST + 10), ReasonCode.ADMIN_REQUEST_TOO_LARGE),
    (b'{"command": "status"}' + b" " * MAX_REQUEST + b"\n", ReasonCode.ADMIN_REQUEST_TOO_LARGE),
]


async def test_o7_bad_requests_get_stable_codes_and_never_reach_the_handler(
    tmp_path: Path,
) -> None:
    state = state_dir(tmp_path)
    handler = FakeHandler()
    with trio.fail_after(LIMIT):
        async with serving(state, handler) as path:
            for data, code in BAD:
                answer = await raw(path, data)
                assert answer is not None, data[:40]
                assert (answer["ok"], answer["code"]) == (False, code), data[:40]
                assert answer["message"]
            assert handler.calls == []
            # a client that sends nothing, or closes at once, gets nothing and harms nothing
            assert await raw(path, b"", close_write=True) is None
            assert await raw(path, b"\n") is None
            # a request without its newline, ended by closing the write side, is answered
            answer = await raw(path, b'{"command": "status"}', close_write=True)
            assert answer is not None
            assert answer["ok"] is True
            assert (await admin_request(state, {"command": "status"}) or {})["ok"] is True


@pytest.mark.parametrize("fail", ["raise", "not-json"])
async def test_o7_a_failing_handler_is_answered_admin_failed(
    tmp_path: Path, fail: str, caplog: pytest.LogCaptureFixture
) -> None:
    state = state_dir(tmp_path)
    handler = FakeHandler()
    handler.fail = fail
    with trio.fail_after(LIMIT):
        async with serving(state, handler):
            answer = await admin_request(state, {"command": "status"})
            assert answer is not None
            assert (answer["ok"], answer["code"]) == (False, "admin_failed")
            handler.fail = None
            assert (await admin_request(state, {"command": "status"}) or {})["ok"] is True
    assert "admin handler" in caplog.text


@pytest.mark.parametrize("answered", [None, ["rooms"], "status"])
async def test_o7_a_handler_answering_no_json_object_is_admin_failed_not_a_timeout(
    tmp_path: Path, answered: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """O7: a handler that answers at once with something that is no JSON object — nothing, a
    list, a string — is ``admin_failed`` (logged), and the next request is answered. Before,
    nothing (``None``) was taken for the handler's deadline passing: a handler that answered
    in no time was told ``admin_timeout`` "no answer within 30 s"; and a list or a string
    failed outside the handler's guard, so the client got no answer at all."""

    class Odd(FakeHandler):
        async def status(self) -> dict[str, Any]:
            if self.fail == "odd":
                result: dict[str, Any] = answered
                return result
            return await super().status()

    state = state_dir(tmp_path)
    handler = Odd()
    handler.fail = "odd"
    with trio.fail_after(LIMIT):
        async with serving(state, handler):
            answer = await admin_request(state, {"command": "status"})
            assert answer is not None
            assert (answer["ok"], answer["code"]) == (False, "admin_failed"), answer
            handler.fail = None
            assert (await admin_request(state, {"command": "status"}) or {})["ok"] is True
    assert "admin handler" in caplog.text


async def test_o7_slow_clients_and_slow_handlers_are_answered_admin_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_admin, "REQUEST_TIMEOUT", 0.2)
    monkeypatch.setattr(_admin, "HANDLER_TIMEOUT", 0.2)
    state = state_dir(tmp_path)
    handler = FakeHandler()
    handler.fail = "hang"
    with trio.fail_after(LIMIT):
        async with serving(state, handler) as path:
            stream = await trio.open_unix_socket(str(path))
            async with stream:  # connects, sends half a request, waits
                await stream.send_all(b'{"command": ')
                answer = msgspec.json.decode(await stream.receive_some())
            assert (answer["ok"], answer["code"]) == (False, "admin_timeout")
            answer = await admin_request(state, {"command": "status"})
            assert answer is not None
            assert (answer["ok"], answer["code"]) == (False, "admin_timeout")
            handler.fail = None
            assert (await admin_request(state, {"command": "status"}) or {})["ok"] is True


async def test_o7_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_admin, "_peer_uid", lambda stream: os.geteuid() + 1)
    state = state_dir(tmp_path)
    handler = FakeHandler()
    with trio.fail_after(LIMIT):
        async with serving(state, handler):
            answer = await admin_request(state, {"command": "cancel", "delivery_id": "d1"})
    assert answer is not None
    assert (answer["ok"], answer["code"]) == (False, "admin_unauthorized")
    assert handler.calls == []


async def test_o7_many_clients_at_once(tmp_path: Path) -> None:
    state = state_dir(tmp_path)
    answers: list[dict[str, Any] | None] = []

    async def ask() -> None:
        answers.append(await admin_request(state, {"command": "status"}))

    with trio.fail_after(LIMIT):
        async with serving(state, FakeHandler()), trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(ask)
    assert len(answers) == 20
    assert all(a is not None and a["ok"] for a in answers)


class SlowAbort(FakeHandler):
    """``cancel`` of a running delivery whose abort is answered only when the abort grace
    runs out (the lane's shielded wait, lanes.md L13): the cancel happened; its answer comes
    ``grace`` seconds later. ``fail = "hang"``: it never answers."""

    def __init__(self, grace: float) -> None:
        super().__init__()
        self.grace = grace

    async def cancel(self, delivery_id: str) -> dict[str, Any]:
        self.calls.append(("cancel", delivery_id))
        if self.fail == "hang":
            await trio.sleep_forever()
        await trio.sleep(self.grace)
        return {"delivery_id": delivery_id, "cancelled": True}


@pytest.mark.parametrize("grace", [None, 120.0])
async def test_o7_o8_a_cancel_whose_abort_takes_the_whole_grace_gets_its_answer(
    grace: float | None, tmp_path: Path, io_autojump_clock: trio.testing.MockClock
) -> None:
    """O7, O8, in virtual time: a ``cancel`` whose abort takes the whole configured
    ``abort_grace_seconds`` (the default 30 s, or 120 s) is answered with the handler's
    answer — through the socket and through :func:`answer` (the operator page's way) — not
    ``admin_timeout``: the cancel's deadline is the grace plus the handlers' own 30 s, and
    the client waits while the server sends its keepalives."""
    serve = serve_admin if grace is None else functools.partial(serve_admin, abort_grace=grace)
    handler = SlowAbort(30.0 if grace is None else grace)
    state = state_dir(tmp_path)
    line = b'{"command": "cancel", "delivery_id": "d1"}'
    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, state, handler)
            began = trio.current_time()
            through_socket = await admin_request(state, {"command": "cancel", "delivery_id": "d1"})
            took = trio.current_time() - began
            if grace is None:
                directly = await _admin.answer(handler, None, line)
            else:
                directly = await _admin.answer(handler, None, line, abort_grace=grace)
            nursery.cancel_scope.cancel()
    expected = {"ok": True, "delivery_id": "d1", "cancelled": True}
    assert (through_socket, directly) == (expected, expected)
    assert took == pytest.approx(handler.grace, abs=1.0)


async def test_o7_o8_a_cancel_that_never_answers_is_admin_timeout_after_grace_and_margin(
    tmp_path: Path, io_autojump_clock: trio.testing.MockClock
) -> None:
    """O7, O8, in virtual time: a ``cancel`` handler that never answers is given up at the
    grace plus the handlers' 30 s, and the client — kept waiting by keepalives past its own
    40 s of silence — gets that ``admin_timeout`` answer from the server; a ``status`` is
    still given up at 30 s."""
    handler = SlowAbort(120.0)
    handler.fail = "hang"
    state = state_dir(tmp_path)
    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(serve_admin, abort_grace=120.0), state, handler)
            began = trio.current_time()
            cancel = await admin_request(state, {"command": "cancel", "delivery_id": "d1"})
            cancel_took = trio.current_time() - began
            began = trio.current_time()
            status = await admin_request(state, {"command": "status"})
            status_took = trio.current_time() - began
            nursery.cancel_scope.cancel()
    assert cancel is not None
    assert status is not None
    assert (cancel["ok"], cancel["code"]) == (False, "admin_timeout")
    assert cancel_took == pytest.approx(150.0, abs=1.0)
    assert (status["ok"], status["code"]) == (False, "admin_timeout")
    assert status_took == pytest.approx(30.0, abs=1.0)


# ---------------------------------------------------------------------------- the client


async def test_o8_no_server_is_none(tmp_path: Path) -> None:
    state = state_dir(tmp_path)
    with trio.fail_after(LIMIT):
        assert await admin_request(state, {"command": "status"}) is None  # no socket
        assert await admin_request(tmp_path / "missing", {"command": "status"}) is None
        (state / ADMIN_SOCKET).write_text("")
        assert await admin_request(state, {"command": "status"}) is None  # not a socket


@contextlib.asynccontextmanager
async def impostor(state: Path, answer: bytes | None) -> AsyncIterator[None]:
    """A listener at the admin socket that answers ``answer`` (or never answers)."""
    listener = trio.socket.socket(socket.AF_UNIX)
    await listener.bind(str(state / ADMIN_SOCKET))
    listener.listen()

    async def serve() -> None:
        while True:
            conn, _ = await listener.accept()
            if answer is None:
                continue  # keeps the connection, says nothing
            with conn:
                await conn.recv(65536)
                await conn.send(answer)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        yield
        nursery.cancel_scope.cancel()
    listener.close()


@pytest.mark.parametrize("answer", [b"garbage\n", b"[]\n", b'{"no": "ok"}\n', b""])
async def test_o8_an_answer_that_is_not_a_response(tmp_path: Path, answer: bytes) -> None:
    state = state_dir(tmp_path)
    with trio.fail_after(LIMIT):
        async with impostor(state, answer):
            with pytest.raises(AdminError) as bad:
                await admin_request(state, {"command": "status"})
    assert bad.value.code is ReasonCode.ADMIN_BAD_RESPONSE


async def test_o8_a_server_that_never_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_admin, "CLIENT_TIMEOUT", 0.2)
    state = state_dir(tmp_path)
    with trio.fail_after(LIMIT):
        async with impostor(state, None):
            with pytest.raises(AdminError) as slow:
                await admin_request(state, {"command": "status"})
    assert slow.value.code is ReasonCode.ADMIN_TIMEOUT
