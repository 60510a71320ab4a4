"""One client cannot lock the others out of the metrics and page listener
(docs/design/operations.md M9): a real server on 127.0.0.1 with ``[metrics] listen`` (the
operator page beside the metrics), real connections on real sockets. At the connection bound,
a new connection closes the connection idle the longest — one that has sent nothing since it
was opened or since its last answer — and is served; a connection in the middle of a request
is never closed for it, and when every connection is, the new one is answered ``503``.

Each wait is for a real condition (an answer, a close), bounded by ``trio.fail_after`` well
under ``REQUEST_SECONDS``: what serves the second client is the rule, not the idle timeout."""

from __future__ import annotations

import select
from pathlib import Path
from typing import Any, Final

import pytest
import trio
import trio.testing

from runtime._server import _metrics

from .test_serve import Rig, rig

LIMIT: Final = 60.0
SERVED_WITHIN: Final = 5.0
"""How soon the second client must be answered: half of ``REQUEST_SECONDS`` (10 s), so that
no connection of the first client has been closed for being idle too long."""
LISTEN: Final = {"metrics": {"listen": "127.0.0.1:0"}}


def _port(r: Rig) -> int:
    port = r.server.metrics_port
    assert port is not None
    return port


def _request(port: int, path: str = "/metrics") -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n".encode()


async def _answer(stream: trio.SocketStream) -> bytes:
    """One whole response (head and its ``content-length`` body) read from ``stream``; the
    connection stays open."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = await stream.receive_some(65536)
        assert chunk, f"closed before an answer: {got!r}"
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        assert chunk, "closed in the middle of an answer"
        body += chunk
    assert len(body) == length, "more than one answer"
    return head


async def _closed(stream: trio.SocketStream) -> None:
    """Wait until the server closes ``stream`` (a reset counts as a close)."""
    try:
        while await stream.receive_some(65536):
            pass
    except trio.BrokenResourceError:
        pass


def _still_open(stream: trio.SocketStream) -> bool:
    """Whether nothing, not even the server's close, is waiting to be read on ``stream``."""
    poller = select.poll()
    poller.register(stream.socket.fileno(), select.POLLIN)
    return not poller.poll(0)


async def _ask(stream: trio.SocketStream, port: int, path: str = "/metrics") -> bytes:
    """A request on ``stream``, as a scraper or a browser makes it: its answer's head. The
    connection stays open, kept alive as theirs are."""
    await stream.send_all(_request(port, path))
    return await _answer(stream)


async def test_m9_one_client_holding_every_connection_idle_does_not_lock_out_the_others(
    tmp_path: Path,
) -> None:
    """M9: one local client opens ``MAX_CONNECTIONS`` connections and keeps them idle — half
    never send a byte, half scraped once and keep their connection alive. A scraper and the
    operator's browser, each on a new connection, are still served at once (before, both were
    answered ``503 too_many_connections`` until the first client let go). Each new connection
    closed the first client's connection idle the longest (the oldest silent one), and no
    other."""
    bound = _metrics.MAX_CONNECTIONS
    silent: list[trio.SocketStream] = []
    kept: list[trio.SocketStream] = []
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, LISTEN) as r:
            port = _port(r)
            others: list[trio.SocketStream] = []
            try:
                for _ in range(bound // 2):
                    silent.append(await trio.open_tcp_stream("127.0.0.1", port))
                for _ in range(bound - bound // 2):
                    stream = await trio.open_tcp_stream("127.0.0.1", port)
                    kept.append(stream)
                    await stream.send_all(_request(port))
                    assert (await _answer(stream)).startswith(b"HTTP/1.1 200")
                with trio.fail_after(SERVED_WITHIN):
                    others.append(await trio.open_tcp_stream("127.0.0.1", port))
                    scraped = await _ask(others[0], port)
                    assert scraped.startswith(b"HTTP/1.1 200"), scraped
                    others.append(await trio.open_tcp_stream("127.0.0.1", port))
                    page = await _ask(others[1], port, "/")
                    assert not page.startswith(b"HTTP/1.1 503"), page  # the login page
                    await _closed(silent[0])  # the two oldest idle: the first silent ones
                    await _closed(silent[1])
                assert all(_still_open(s) for s in [*silent[2:], *kept])
            finally:
                for stream in [*silent, *kept, *others]:
                    await stream.aclose()


async def test_m9_the_connection_idle_the_longest_goes_first_and_a_request_is_never_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """M9: with the bound at 3 — ``begun`` half-way through its request line, the oldest;
    ``served`` answered and kept alive; then ``silent``, opened after that answer, that sends
    nothing — a new connection closes ``served`` (idle the longest), the next ``silent`` (idle
    longer than the first new one, kept alive after its answer); ``begun`` is never closed for
    a newer connection: it finishes its request and is answered."""
    monkeypatch.setattr(_metrics, "MAX_CONNECTIONS", 3)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, LISTEN) as r:
            port = _port(r)
            request = _request(port)
            begun = await trio.open_tcp_stream("127.0.0.1", port)
            await begun.send_all(request[:9])  # "GET /metr", then nothing for now
            served = await trio.open_tcp_stream("127.0.0.1", port)
            await served.send_all(request)
            assert (await _answer(served)).startswith(b"HTTP/1.1 200")
            silent = await trio.open_tcp_stream("127.0.0.1", port)  # idle since now
            async with begun, served, silent:
                with trio.fail_after(SERVED_WITHIN):
                    one = await trio.open_tcp_stream("127.0.0.1", port)
                    first = await _ask(one, port)
                    assert first.startswith(b"HTTP/1.1 200"), first
                    await _closed(served)
                    assert _still_open(silent)
                    two = await trio.open_tcp_stream("127.0.0.1", port)
                    second = await _ask(two, port)  # ``one`` is idle, but newer than ``silent``
                    assert second.startswith(b"HTTP/1.1 200"), second
                    await _closed(silent)
                    assert _still_open(begun)
                    assert _still_open(one)
                    await begun.send_all(request[9:])
                    finished = await _answer(begun)
                await one.aclose()
                await two.aclose()
    assert finished.startswith(b"HTTP/1.1 200"), finished


async def test_m9_when_every_connection_is_in_a_request_one_more_is_refused_503(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """M6, M9: at the bound with no idle connection to close — every one half-way through a
    request — one more connection is answered ``503 too_many_connections`` at once and
    closed; the connections in their requests are not touched and are answered."""
    monkeypatch.setattr(_metrics, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(_metrics, "SLOW_REQUEST_SECONDS", LIMIT)  # neither is slow (M11)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, LISTEN) as r:
            port = _port(r)
            request = _request(port)
            one = await trio.open_tcp_stream("127.0.0.1", port)
            two = await trio.open_tcp_stream("127.0.0.1", port)
            async with one, two:
                for stream in (one, two):
                    await stream.send_all(request[:9])
                with trio.fail_after(SERVED_WITHIN):
                    refused = b""
                    async with await trio.open_tcp_stream("127.0.0.1", port) as extra:
                        await extra.send_all(request)
                        while chunk := await extra.receive_some(65536):
                            refused += chunk
                    answers = []
                    for stream in (one, two):
                        await stream.send_all(request[9:])
                        answers.append(await _answer(stream))
    assert refused.startswith(b"HTTP/1.1 503"), refused
    assert b'"code":"too_many_connections"' in refused
    assert all(answer.startswith(b"HTTP/1.1 200") for answer in answers), answers


async def test_m9_a_crowd_of_silent_connections_still_holds_at_most_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """M6, M9: forty silent connections opened one after another to a listener bounded at
    eight: each one past the eighth closes the oldest silent one at once (long before
    ``REQUEST_SECONDS``), so the thirty-two oldest are closed and the eight newest are open —
    never more than the bound — and a scrape after them is served."""
    monkeypatch.setattr(_metrics, "MAX_CONNECTIONS", 8)
    crowd: list[trio.SocketStream] = []
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, LISTEN) as r:
            port = _port(r)
            try:
                with trio.fail_after(SERVED_WITHIN):
                    for _ in range(40):
                        crowd.append(await trio.open_tcp_stream("127.0.0.1", port))
                    for stream in crowd[:32]:
                        await _closed(stream)
                    assert all(_still_open(stream) for stream in crowd[32:])
                    crowd.append(await trio.open_tcp_stream("127.0.0.1", port))
                    scraped = await _ask(crowd[-1], port)
                    await _closed(crowd[32])
            finally:
                for stream in crowd:
                    await stream.aclose()
    assert scraped.startswith(b"HTTP/1.1 200"), scraped


@pytest.mark.parametrize(
    ("holders", "closed"),
    [
        pytest.param(("half", "half"), 0, id="the-request-arriving-the-longest-goes"),
        pytest.param(("half", "silent"), 1, id="an-idle-connection-goes-before-a-request"),
        pytest.param(("answering", "half"), 1, id="a-request-arrived-whole-is-never-closed"),
    ],
)
async def test_m11_requests_left_half_sent_do_not_lock_the_others_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, holders: tuple[str, str], closed: int
) -> None:
    """M11: the bound at 2, the grace 0, both connections held, one after the other, each
    ``half`` (half its request line sent: a request arriving), ``silent`` (idle) or
    ``answering`` (its scrape arrived whole, its answer held in the build). A scraper's new
    connection is served at once, and closes the ``closed`` one unanswered: the request
    arriving the longest, but an idle connection before any request, and never a request that
    arrived whole. The other is untouched and, its request finished (its build let go), is
    answered. Before M11, two half-sent requests got the scraper ``503 too_many_connections``
    until ``REQUEST_SECONDS`` closed them."""
    monkeypatch.setattr(_metrics, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(_metrics, "SLOW_REQUEST_SECONDS", 0.0)
    building, release = trio.Event(), trio.Event()
    handle = _metrics._handle

    async def held(*args: Any) -> None:
        if not building.is_set():
            building.set()
            await release.wait()
        await handle(*args)

    monkeypatch.setattr(_metrics, "_handle", held)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, LISTEN) as r:
            port = _port(r)
            request = _request(port)
            streams: list[trio.SocketStream] = []
            for how in holders:
                streams.append(stream := await trio.open_tcp_stream("127.0.0.1", port))
                if how == "answering":
                    await stream.send_all(request)
                    await building.wait()
                elif how == "half":
                    await stream.send_all(request[:9])
                # the listener (in this Trio run) has read what came, and blocks again
                await trio.testing.wait_all_tasks_blocked(0.01)
            kept = streams[1 - closed]
            async with streams[0], streams[1]:
                with trio.fail_after(SERVED_WITHIN):
                    building.set()  # (unless the answering one holds it) no build is held
                    async with await trio.open_tcp_stream("127.0.0.1", port) as scraper:
                        scraped = await _ask(scraper, port)
                    await _closed(streams[closed])
                    assert _still_open(kept)
                    release.set()
                    if holders[1 - closed] == "half":
                        await kept.send_all(request[9:])
                    finished = await _answer(kept)
    assert scraped.startswith(b"HTTP/1.1 200"), scraped
    assert finished.startswith(b"HTTP/1.1 200"), finished
