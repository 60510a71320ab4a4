"""``GET /metrics`` (docs/design/operations.md "Metrics", M1-M4): a real server on 127.0.0.1
with ``[metrics] listen``, a real websocket client and a real Fake-Pi worker; the scrape is a
real HTTP request, parsed with ``prometheus_client``'s own parser of the text format. The
runtime's registry is the process's, so the tests compare a scrape before with one after."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio
from prometheus_client import ProcessCollector
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from fake_pi.scenario import Step, Text
from runtime._boundary._http import open_request
from runtime._cli._serve import _config
from runtime._config import config_from_dict
from runtime._errors import ConfigError
from runtime._metrics import REGISTRY
from runtime._records import Outcome, ReplayClass
from runtime._rooms import _worker
from runtime._rooms._census import RoomTotals, room_totals
from runtime._rooms._worker import RoomWorker
from runtime._server import _metrics, _page
from runtime._server._metrics import ServerCollector
from runtime._server._serve import ServeOptions, check_bind
from runtime._tasks._watchdog import Classification
from runtime._wire import RoomStatus

from .._failing import fails_once
from .._wire import message
from .._workers import waiting_bash
from .test_serve import Rig, rig

LIMIT: Final = 60.0
SECRET_WORDS: Final = "the quartermaster's parrot"


@pytest.fixture(autouse=True)
def _every_scrape_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each scrape here is built afresh, so it shows what happened before it: the listener
    answers a scrape arriving within the last build's own duration with that build (M10,
    tested on its own in test_operator_page_2.py) — on a loaded machine a build takes long
    enough that the scrape after an ``ack`` got the one from before it."""
    monkeypatch.setattr(_metrics, "REUSE_SECONDS", 0.0)


"""The message's text: never in a scrape."""


async def scrape(
    port: int, path: str = "/metrics", method: str = "GET", accept: str | None = None
) -> tuple[int, str, str]:
    headers = [("accept", accept)] if accept is not None else None
    url = f"http://127.0.0.1:{port}{path}"
    async with open_request(method, url, headers=headers) as response:
        body = await response.read()
        return response.status, response.headers.get("content-type", ""), body.decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[_key(sample)] = sample.value
    return found


def _key(sample: Sample) -> tuple[str, tuple[tuple[str, str], ...]]:
    return sample.name, tuple(sorted(sample.labels.items()))


def value(
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


BOUNDED: Final[dict[str, set[str] | None]] = {
    "outcome": {str(o) for o in Outcome},
    "source": {"upstream", "journal"},
    "replay_class": {str(c) for c in ReplayClass},
    "classification": {str(c) for c in Classification},
    "state": {"open", "waiting", "success_intent", "done", "failed", "aborted"},
    "purpose": {"soft", "fence"},
    "kind": {"young", "full", "sweep"},  # a collector pause (serve.md S7)
    "tool": None,  # a tool of the configuration: checked against the grants below
    "code": None,  # a reason code: checked against the stable list below
    "le": None,  # a histogram bucket
}


def label_values(text: str) -> Iterable[tuple[str, str, str]]:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for name, label in sample.labels.items():
                yield sample.name, name, label


async def test_m1_m2_a_scrape_counts_a_delivery_and_shows_the_live_state(tmp_path: Path) -> None:
    """M1: one delivery answered moves the counters by exactly what happened — one admission,
    one result of outcome ``reply``, one upstream model request, one turn, journal appends
    and fdatasyncs — and the gauges read the live server: one room lane, one connection, one
    result unacknowledged until the client acknowledges it, every task classification
    present (zero). M2: every label value is from a closed set, and neither the message's
    text nor its room, delivery id or the access token appears in the scrape."""
    settings = {"metrics": {"listen": "127.0.0.1:0"}}
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, settings, steps=[Text(text="aye")]) as r, r.connect() as client:
            port = r.server.metrics_port
            assert port is not None
            status, kind, before_text = await scrape(port)
            assert status == 200
            assert kind.startswith("text/plain; version=")  # the Prometheus text format
            before = samples(before_text)
            await client.send(message("d-metrics", text=SECRET_WORDS, room="guild:7:42"))
            result = await client.until(lambda f: f["type"] == "result")
            assert result["outcome"] == "reply"
            _, _, during_text = await scrape(port)
            await client.send({"type": "ack", "seq": result["seq"]})
            await client.send({"type": "status"})  # answered after the ack (frames in order)
            await client.until(lambda f: f["type"] == "status")
            _, _, after_text = await scrape(port)
    during, after = samples(during_text), samples(after_text)

    def moved(name: str, **labels: str) -> float:
        return value(during, name, **labels) - value(before, name, **labels)

    assert moved("pi_runtime_deliveries_admitted_total") == 1
    assert moved("pi_runtime_deliveries_finished_total", outcome="reply") == 1
    assert moved("pi_runtime_model_requests_total", source="upstream") == 1
    assert moved("pi_runtime_model_requests_total", source="journal") == 0
    assert moved("pi_runtime_turn_seconds_count") == 1
    assert moved("pi_runtime_first_token_seconds_count") == 1
    assert moved("pi_runtime_journal_append_seconds_count") >= 3  # admission, steps, result
    assert moved("pi_runtime_journal_fdatasync_seconds_count") >= 1
    assert moved("pi_runtime_journal_batch_records_count") >= 1
    assert value(during, "pi_runtime_room_lanes") == 1
    assert value(during, "pi_runtime_connections") == 1
    assert value(during, "pi_runtime_results_unacknowledged") == 1
    assert value(after, "pi_runtime_results_unacknowledged") == 0
    assert value(during, "pi_runtime_admitting") == 1
    for classification in Classification:
        assert ("pi_runtime_task_lanes", (("classification", str(classification)),)) in during
    assert value(during, "process_resident_memory_bytes") > 0

    codes = set((Path(__file__).parents[1] / "data" / "reason_codes.txt").read_text().split())
    token = (tmp_path / "state" / "token").read_text().strip()
    for text in (during_text, after_text):
        for secretish in (SECRET_WORDS, "guild:7:42", "d-metrics", "m-d-metrics", token):
            assert secretish not in text
        for sample_name, label, label_value in label_values(text):
            allowed = BOUNDED.get(label, set())
            assert label in BOUNDED, (sample_name, label)
            if label == "code":
                assert label_value.split(":")[0] in codes, (sample_name, label_value)
            elif allowed is not None:
                assert label_value in allowed, (sample_name, label, label_value)


async def test_m3_the_metrics_listener_answers_only_get_metrics(tmp_path: Path) -> None:
    """M3: another path is 404, another method 405; the websocket server is not on it."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, {"metrics": {"listen": "127.0.0.1:0", "page": False}}) as r:
            port = r.server.metrics_port
            assert port is not None
            assert (await scrape(port, "/"))[0] == 404
            assert (await scrape(port, "/metrics", method="POST"))[0] == 405
            assert (await scrape(port, "/metrics?name[]=x"))[0] == 200
            openmetrics = "application/openmetrics-text; version=1.0.0"
            status, kind, text = await scrape(port, accept=openmetrics)
            assert (status, kind.split(";")[0]) == (200, "application/openmetrics-text")
            assert text.rstrip().endswith("# EOF")
            assert port != r.server.port


@pytest.mark.parametrize("page", [False, True])
async def test_m3_m7_another_path_or_method_is_refused_with_the_pages_codes(
    tmp_path: Path, page: bool
) -> None:
    """M3, M7: the listener's 404 and 405 are refusals like every other of it — a JSON body
    with a stable code, the page's own (``page_not_found``, ``page_method``), answered by the
    function the page answers with — with the page served or not; a 405 says what is allowed."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, {"metrics": {"listen": "127.0.0.1:0", "page": page}}) as r:
            port = r.server.metrics_port
            assert port is not None
            answers = []
            for method, path in (("GET", "/nothing-here"), ("POST", "/metrics")):
                url = f"http://127.0.0.1:{port}{path}"
                async with open_request(method, url) as response:
                    body = msgspec.json.decode(await response.read())
                    answers.append((response.status, dict(response.headers), body))
    (missing, _, nothing), (method_status, headers, wrong) = answers
    assert (missing, nothing["ok"], nothing["code"]) == (404, False, "page_not_found")
    assert (method_status, wrong["ok"], wrong["code"]) == (405, False, "page_method")
    assert headers["content-type"] == "application/json"
    assert headers["allow"] == "GET, HEAD"
    assert nothing["message"].startswith("nothing at /nothing-here")
    assert wrong["message"] == "only GET /metrics"


@pytest.mark.parametrize(
    ("listen", "setting"),
    [("0.0.0.0:9464", "metrics.listen"), ("9464", "metrics.listen"), ("h:port", "metrics.listen")],
)
def test_m4_a_network_or_malformed_metrics_address_is_refused(
    tmp_path: Path, listen: str, setting: str
) -> None:
    """M4: the listener has no TLS and no token: a non-loopback address is refused unless
    ``--insecure-bind``; an address that is not HOST:PORT is refused naming the setting."""

    def build_and_check() -> None:
        config = config_from_dict({"metrics": {"listen": listen}}, base=tmp_path)
        check_bind(ServeOptions(), config)

    with pytest.raises(ConfigError) as refused:
        build_and_check()
    assert refused.value.setting == setting
    if listen.startswith("0.0.0.0"):
        config = config_from_dict({"metrics": {"listen": listen}}, base=tmp_path)
        check_bind(ServeOptions(insecure_bind=True), config)  # said so: allowed


def test_m4_serve_metrics_sets_the_listener(tmp_path: Path) -> None:
    """``serve --metrics HOST:PORT`` is ``[metrics] listen`` (the flag wins)."""
    args = argparse.Namespace(
        config=None,
        state_dir=tmp_path / "state",
        agent=None,
        store=None,
        metrics="127.0.0.1:9464",
        drain_timeout=None,
    )
    assert _config(args).metrics.listen == "127.0.0.1:9464"


async def test_m1_two_servers_in_one_process_both_answer(tmp_path: Path) -> None:
    """M1 for embedders (and tests): two servers of one process serve their metrics at once —
    one collector of the servers' state, summed — and the second going away leaves the
    first's scrape working."""
    with trio.fail_after(LIMIT):
        settings = {"metrics": {"listen": "127.0.0.1:0"}}
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        async with rig(tmp_path / "a", settings) as a, a.connect():
            async with rig(tmp_path / "b", settings) as b, b.connect():
                assert a.server.metrics_port is not None
                assert b.server.metrics_port is not None
                status, _, text = await scrape(b.server.metrics_port)
                assert status == 200
                assert value(samples(text), "pi_runtime_connections") == 2
            status, _, text = await scrape(a.server.metrics_port)
            assert status == 200
            assert value(samples(text), "pi_runtime_connections") == 1


def refusal_code(kind: str, text: str) -> str:
    """The code of a refusal of the listener (M7): a JSON body ``{"ok": false, "code": …,
    "message": …}``, its code one of the pinned stable ones."""
    assert kind == "application/json"
    answer = msgspec.json.decode(text)
    assert (answer["ok"], bool(answer["message"])) == (False, True)
    code = answer["code"]
    assert isinstance(code, str)
    codes = set((Path(__file__).parents[1] / "data" / "reason_codes.txt").read_text().split())
    assert code in codes  # a stable code, pinned
    return code


@pytest.mark.parametrize("error", [RuntimeError, ValueError, TypeError])
async def test_m5_m7_a_failing_scrape_is_its_own_500_with_its_code_and_the_server_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: type[Exception]
) -> None:
    """M5, M7: a bug in the collector (its first read of the server raises) answers that
    scrape 500 ``metrics_failed`` — a refusal like every other of the listener, a JSON body
    with the code (before: a line of plain text); the next scrape, the websocket and the
    server go on. Whatever it raises: a ``ValueError`` or ``TypeError`` is not taken for an
    ``Accept`` that cannot be read (before, it was answered ``406`` and not logged)."""
    if error is RuntimeError:
        fails_once(monkeypatch, ServerCollector, "collect")
    else:
        original = ServerCollector.collect
        calls = [0]

        def collect(self: ServerCollector) -> Iterator[Any]:
            calls[0] += 1
            if calls[0] == 1:
                raise error("a planted bug in ServerCollector.collect")
            return original(self)

        monkeypatch.setattr(ServerCollector, "collect", collect)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, {"metrics": {"listen": "127.0.0.1:0"}}) as r:
            port = r.server.metrics_port
            assert port is not None
            status, kind, text = await scrape(port)
            assert (status, refusal_code(kind, text)) == (500, "metrics_failed")
            assert (await scrape(port))[0] == 200
            async with r.connect() as client:
                await client.send({"type": "status"})
                assert (await client.until(lambda f: f["type"] == "status"))["pending"] == 0


# -- M6: a listener anyone may reach holds nothing for long ----------------------------------


def _port(r: Rig) -> int:
    port = r.server.metrics_port
    assert port is not None
    return port


async def _exchange(port: int, head: bytes) -> bytes:
    """Send ``head`` on a new connection and read until the server closes it."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(head)
        got = b""
        while chunk := await stream.receive_some(65536):
            got += chunk
    return got


@pytest.mark.parametrize("page", [True, False])
async def test_m6_a_head_gets_headers_and_no_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, page: bool
) -> None:
    """M6: a ``HEAD`` to any path is answered with headers alone; before, the listener wrote
    a body h11 refuses for a HEAD and logged the refusal as ``metrics_failed`` with a
    traceback — a log anyone could fill."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, {"metrics": {"listen": "127.0.0.1:0", "page": page}}) as r:
            port = _port(r)
            head = f"HEAD /x HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nconnection: close\r\n\r\n"
            got = await _exchange(port, head.encode())
            metrics = (
                f"HEAD /metrics HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nconnection: close\r\n\r\n"
            )
            scraped = await _exchange(port, metrics.encode())
    assert got.split(b" ", 2)[1] in (b"401", b"404"), got[:80]
    assert got.endswith(b"\r\n\r\n"), "headers only"
    assert scraped.startswith(b"HTTP/1.1 200")
    assert scraped.endswith(b"\r\n\r\n")
    assert "metrics_failed" not in caplog.text


async def test_m6_m7_a_malformed_accept_is_406_with_its_code_not_a_server_fault(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """M6, M7: an ``Accept`` naming an OpenMetrics version that cannot be read is the client's
    fault: ``406 http_not_acceptable`` — a refusal like every other of the listener, a JSON
    body with the code (before: a line of plain text) — not ``500 metrics_failed`` with a
    traceback."""
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, {"metrics": {"listen": "127.0.0.1:0"}}) as r:
            accept = "application/openmetrics-text; version=abc"
            status, kind, text = await scrape(_port(r), accept=accept)
    assert (status, refusal_code(kind, text)) == (406, "http_not_acceptable")
    assert "metrics_failed" not in caplog.text


async def test_m6_an_idle_or_slow_client_is_closed_and_connections_are_capped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """M6, M9: a connection that has not sent a whole request within ``REQUEST_SECONDS`` —
    half a request line, or nothing after an answer — is closed; at ``MAX_CONNECTIONS`` one
    more closes the connection idle the longest and is served (M9), and with every
    connection in a request it is answered ``503 too_many_connections`` at once and closed:
    idle clients cannot take the file descriptors the room worker needs."""
    monkeypatch.setattr(_metrics, "REQUEST_SECONDS", 0.5)
    monkeypatch.setattr(_metrics, "MAX_CONNECTIONS", 2)
    scrape_head = b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, {"metrics": {"listen": "127.0.0.1:0"}}) as r:
            port = _port(r)
            slow = await trio.open_tcp_stream("127.0.0.1", port)
            await slow.send_all(b"GET /metr")  # half a request line, then nothing
            idle = await trio.open_tcp_stream("127.0.0.1", port)
            await idle.send_all(f"GET /metrics HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n".encode())
            answered = await idle.receive_some(65536)  # then it stays open and says nothing
            served = await _exchange(port, scrape_head)  # closes the idle one (M9)
            slower = await trio.open_tcp_stream("127.0.0.1", port)
            await slower.send_all(b"GET /metr")  # now both connections are in a request
            refused = await _exchange(port, scrape_head)
            for stream in (slow, idle, slower):  # the server closes them (the wait is for it)
                while await stream.receive_some(65536):
                    pass
                await stream.aclose()
    assert answered.startswith(b"HTTP/1.1 200")
    assert served.startswith(b"HTTP/1.1 200")
    assert refused.startswith(b"HTTP/1.1 503")
    assert b'"code":"too_many_connections"' in refused


# -- M7: every refusal says its code, the protocol's too --------------------------------------


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        (b"NOT A REQUEST\r\n\r\n", 400, "http_malformed"),
        (
            b"POST /login HTTP/1.1\r\nhost: x\r\ncontent-length: 2048\r\n\r\n" + b"t" * 2048,
            413,
            "http_body_too_large",
        ),
        (
            b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"x" * 20_000 + b"\r\n",  # no end of head
            431,
            "http_head_too_large",
        ),
        (
            b"POST /login HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\n",
            501,
            "http_unsupported",
        ),
    ],
)
async def test_m7_a_request_the_protocol_refuses_is_answered_with_its_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request_bytes: bytes, status: int, code: str
) -> None:
    """M7: a request refused by the HTTP layer before any handler reads it — not HTTP, a body
    over ``MAX_BODY``, a head over 16 KiB, a transfer coding it cannot read — is answered like
    every other refusal of the listener: a JSON body with its stable code (and a message), and
    the connection is closed."""
    monkeypatch.setattr(_metrics, "MAX_BODY", 1024)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, {"metrics": {"listen": "127.0.0.1:0"}}) as r:
            got = await _exchange(_port(r), request_bytes)
            assert (await scrape(_port(r)))[0] == 200  # the listener goes on
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), got[:80]
    assert b"content-type: application/json" in head.lower()
    answer = msgspec.json.decode(body)
    assert answer["ok"] is False
    assert answer["code"] == code
    assert answer["message"]
    codes = set((Path(__file__).parents[1] / "data" / "reason_codes.txt").read_text().split())
    assert code in codes  # a stable code, pinned


async def test_m6_a_scraper_that_reads_nothing_is_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """M6: a client that sends scrapes and reads none of the answers (a small receive buffer;
    the requests pipelined, so the answers fill the pipe) has its connection closed once a
    write has waited ``SEND_SECONDS``: it holds none of the ``MAX_CONNECTIONS`` for long."""
    monkeypatch.setattr(_page, "SEND_SECONDS", 0.2)
    given_up = trio.Event()
    handle = _metrics._handle

    async def watched(*args: Any) -> None:
        try:
            await handle(*args)
        except trio.BrokenResourceError:
            given_up.set()
            raise

    monkeypatch.setattr(_metrics, "_handle", watched)
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, {"metrics": {"listen": "127.0.0.1:0"}}) as r:
            port = _port(r)
            sock = trio.socket.socket()
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)
            await sock.connect(("127.0.0.1", port))
            async with trio.SocketStream(sock) as stuck:
                scrape_request = f"GET /metrics HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n"
                await stuck.send_all(scrape_request.encode() * 400)
                with trio.fail_after(20):  # never, before the bound
                    await given_up.wait()
                got = 0
                with contextlib.suppress(trio.BrokenResourceError):  # a reset is a close
                    while chunk := await stuck.receive_some(65536):  # the answers sent, the close
                        got += len(chunk)
            assert got > 0
            assert (await scrape(port))[0] == 200


# -- M8: a scrape costs what is under way, not the rooms known --------------------------------


async def test_m8_a_scrape_builds_no_room_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """M8: a scrape sums the room lanes without building a status per room. Three rooms that
    had a delivery each and are idle: a scrape builds none of their statuses (before: one per
    room the host knows, at every scrape, on the Trio thread while admissions waited — 30 ms
    at 10,000 rooms) and still says three lanes, none running, three live workers."""
    built = [0]

    def counted(**fields: Any) -> RoomStatus:
        built[0] += 1
        return RoomStatus(**fields)

    monkeypatch.setattr(_worker, "RoomStatus", counted)
    steps: list[Step] = [Text(text="one"), Text(text="two"), Text(text="three")]
    settings = {"metrics": {"listen": "127.0.0.1:0"}}
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, settings, steps=steps) as r, r.connect() as client:
            for room in ("dm:1", "dm:2", "dm:3"):
                await client.send(message(f"d-{room}", "hello", room=room))
                await client.result(f"d-{room}")
            built[0] = 0
            status, _, text = await scrape(_port(r))
            assert (status, built[0]) == (200, 0)
    found = samples(text)
    assert value(found, "pi_runtime_room_lanes") == 3
    assert value(found, "pi_runtime_room_lanes_running") == 0
    assert value(found, "pi_runtime_room_workers_live") == 3
    assert value(found, "pi_runtime_deliveries_pending") == 0


class _SameAsStatuses(trio.abc.Instrument):
    """After every task step — every state a scrape can see, since a scrape runs within one
    step — compares :func:`room_totals` with ``status()`` summed, and keeps the largest of
    each figure seen (so the test knows the work it watched was not all idle)."""

    def __init__(self, worker: RoomWorker) -> None:
        self.worker = worker
        self.differences: list[tuple[RoomTotals, RoomTotals]] = []
        self.largest: dict[str, int] = {}

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        rows, pending = self.worker.status(), len(self.worker.pending())
        expected = RoomTotals(
            lanes=len(rows),
            running=sum(row.state == "running" for row in rows),
            live_workers=sum(row.live_worker for row in rows),
            queued=sum(row.queued for row in rows),
            pending=pending,
        )
        got = room_totals(self.worker)
        if got != expected and len(self.differences) < 5:
            self.differences.append((got, expected))
        for name in ("running", "live_workers", "queued", "pending"):
            self.largest[name] = max(self.largest.get(name, 0), getattr(expected, name))


async def test_m8_the_room_totals_are_the_statuses_summed_at_every_step(tmp_path: Path) -> None:
    """M8: what the scrape reads in place of every room's status — only the lanes of a pending
    delivery or a live worker — equals ``status()`` summed after every task step of a real
    server's work that goes through each way a lane's state changes: a turn that runs a tool
    with two deliveries steered into it (their results written after the owner's: ``absorbed``),
    a second room's lane waiting for the one live worker allowed (running, no worker) with a
    delivery queued behind it and one cancelled out of its queue, the first room's idle worker
    stopped for the second's, and both rooms' turns ending with their workers kept live."""
    started, release, waiting = waiting_bash(tmp_path)
    steps: list[Step] = [waiting, Text(text="for all three"), Text(text="e1"), Text(text="e2")]
    settings = {
        "metrics": {"listen": "127.0.0.1:0"},
        "caps": {"max_live_workers": 1},
        "rooms": {"dm:1": {"grants": ["bash", "send_text_update"]}, "dm:2": {}},
    }
    with trio.fail_after(LIMIT):
        async with rig(tmp_path, settings, steps=steps) as r, r.connect() as client:
            watch = _SameAsStatuses(r.server.worker)
            trio.lowlevel.add_instrument(watch)
            try:
                await client.send(message("d1", "first"))
                await trio.to_thread.run_sync(started.read_bytes)
                for frame in (
                    message("d2", "second"),
                    message("d3", "third"),
                    message("e1", "one", room="dm:2"),
                    message("e2", "two", room="dm:2"),
                    message("e3", "three", room="dm:2"),
                ):
                    await client.send(frame)
                    await client.until(lambda f: f["type"] == "accepted")
                await client.send({"type": "cancel", "delivery_id": "e3"})
                assert (await client.result("e3"))["outcome"] == "cancelled"
                await trio.to_thread.run_sync(release.write_text, "done\n")
                outcomes: dict[str, str] = {}
                while len(outcomes) < 5:
                    frame = await client.until(lambda f: f["type"] == "result")
                    outcomes[frame["delivery_id"]] = frame["outcome"]
            finally:
                trio.lowlevel.remove_instrument(watch)
    assert outcomes == {
        "d1": "reply",
        "d2": "absorbed",
        "d3": "absorbed",
        "e1": "reply",
        "e2": "reply",
    }
    assert watch.differences == []
    assert watch.largest["running"] == 2  # dm:1's turn, and dm:2's waiting for the worker
    assert watch.largest["queued"] >= 1
    assert watch.largest["live_workers"] == 1
    assert watch.largest["pending"] >= 5


def test_m8_a_scrape_counts_the_open_descriptors_without_listing_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """M8: the serve process keeps a descriptor open per room lane's log, and
    ``prometheus_client``'s process collector listed ``/proc/self/fd`` at every scrape — one
    entry per room, on the Trio thread. With 300 more descriptors open, a scrape of the
    runtime's registry lists no descriptor directory where Linux gives the directory's size
    (the count it keeps, since 6.2), and says that count; the process metrics are the
    library's otherwise: the same names, types and help."""
    listed: list[str] = []
    listdir = os.listdir

    def listing(path: Any = ".") -> list[str]:
        listed.append(str(path))
        return listdir(path)

    with contextlib.ExitStack() as files:
        for _ in range(300):
            files.enter_context(open(os.devnull, "rb"))
        monkeypatch.setattr(os, "listdir", listing)
        text = generate_latest(REGISTRY).decode()
        monkeypatch.undo()
        size = os.stat("/proc/self/fd").st_size
        counted = size or len(os.listdir("/proc/self/fd"))
    assert [path for path in listed if path.endswith("/fd")] == ([] if size else ["/proc/self/fd"])
    found = samples(text)
    assert value(found, "process_open_fds") == counted >= 300
    library = ProcessCollector(registry=None).collect()
    ours = {
        family.name: (family.type, family.documentation)
        for family in text_string_to_metric_families(text)
        if family.name.startswith("process_")
    }
    assert ours == {family.name: (family.type, family.documentation) for family in library}
