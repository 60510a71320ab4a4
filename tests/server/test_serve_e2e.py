"""``pi-runtime serve`` end to end: a real server process (Fake-Pi workers) and real websocket
clients (``docs/design/serve.md``, issue #6 item 8).

The server is started as operators start it (``python -m runtime._cli serve``), with a TOML
configuration pointing the model at a scripted model server in the test, and stopped by
SIGKILL (a crash) or SIGTERM (a drain).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import trio
from trio_websocket import open_websocket_url

from fake_pi.scenario import Step, Text
from runtime._boundary._http import open_request
from runtime._journal._store import delivery_key

from .._procs import hosts_run_under
from .._wire import Client, Frame, message
from .._workers import scripted_upstream, waiting_bash

REPO: Final = Path(__file__).resolve().parents[2]
LIMIT: Final = 120.0
LISTENING: Final = re.compile(rb"listening on ws://([0-9.]+):(\d+)")


class Server:
    """One run of ``pi-runtime serve``."""

    def __init__(self, process: trio.Process, root: Path, output: bytes) -> None:
        self.process = process
        self.root = root
        self.output = output
        """What the server printed so far (its stdout)."""
        found = LISTENING.search(output)
        assert found is not None
        self.port = int(found.group(2))

    async def printed(self, pattern: bytes) -> None:
        """Wait until the server prints something matching ``pattern``."""
        assert self.process.stdout is not None
        while re.search(pattern, self.output) is None:
            data = await self.process.stdout.receive_some(4096)
            assert data, f"serve ended without printing {pattern!r}: {self.output!r}"
            self.output += data

    @property
    def token(self) -> str:
        return (self.root / "state" / "token").read_text()

    @contextlib.asynccontextmanager
    async def connect(self, **hello: Any) -> AsyncIterator[Client]:
        async with open_websocket_url(f"ws://127.0.0.1:{self.port}/") as ws:
            client = Client(ws)
            welcome = await client.hello(self.token, **hello)
            assert welcome["type"] == "welcome", welcome
            yield client

    async def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        await self.process.wait()


def write_config(root: Path, url: str, extra: str = "") -> Path:
    path = root / "config.toml"
    path.write_text(
        f'state_dir = "state"\nwork_root = "work"\n\n[model]\nbase_url = "{url}"\n{extra}'
    )
    return path


@contextlib.asynccontextmanager
async def serve(root: Path, config: Path, *args: str) -> AsyncIterator[Server]:
    hosts_run_under(root)  # none of its workers may outlive the test (tests/server/conftest.py)
    command = [sys.executable, "-m", "runtime._cli", "serve", "--port", "0"]
    command += ["--config", str(config), *args]
    with (root / "serve.stderr").open("ab") as stderr:
        process = await trio.lowlevel.open_process(
            command,
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=str(root),
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        try:
            assert process.stdout is not None
            seen = b""
            while LISTENING.search(seen) is None:
                data = await process.stdout.receive_some(4096)
                assert data, f"serve ended before listening: {seen!r}"
                seen += data
            yield Server(process, root, seen)
        finally:
            if process.returncode is None:
                process.kill()
                with trio.CancelScope(shield=True):
                    await process.wait()


def results(frames: list[Frame]) -> list[Frame]:
    return [f for f in frames if f["type"] == "result"]


async def test_a_burst_of_three_gets_one_reply_and_two_absorbed(tmp_path: Path) -> None:
    """The first message starts a turn (a tool that waits); the next two arrive mid-turn,
    are steered into it and end ``absorbed`` into its one reply."""
    started, release, waiting = waiting_bash(tmp_path)
    steps: list[Step] = [waiting, Text(text="one answer for all three")]
    grants = '\n[rooms."dm:1"]\ngrants = ["bash", "send_text_update"]\n'
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps) as (model, url):
            config = write_config(tmp_path, url, grants)
            async with serve(tmp_path, config) as server, server.connect() as client:
                await client.send(message("d1", "first"))
                await trio.to_thread.run_sync(started.read_bytes)
                await client.send(message("d2", "second"))
                await client.send(message("d3", "third"))
                accepted = [await client.until(lambda f: f["type"] == "accepted") for _ in range(3)]
                await trio.to_thread.run_sync(release.write_text, "done\n")
                found: dict[str, Frame] = {}
                while len(found) < 3:
                    frame = await client.until(lambda f: f["type"] == "result")
                    found[frame["delivery_id"]] = frame
    assert [a["disposition"] for a in accepted] == ["started", "steered", "steered"]
    assert (found["d1"]["outcome"], found["d1"]["text"]) == ("reply", "one answer for all three")
    for steered in ("d2", "d3"):
        assert (found[steered]["outcome"], found[steered]["absorbed_into"]) == ("absorbed", "d1")
    assert model.request_count == 2
    carried = str(model.requests[1].body["messages"])
    assert "second" in carried
    assert "third" in carried


async def test_sigkill_mid_turn_then_one_result_per_delivery_and_none_acknowledged_again(
    tmp_path: Path,
) -> None:
    """d1 is answered and acknowledged; the server is SIGKILLed while d2's model request is
    open. After a restart the reconnecting client gets d2's result once and never d1's."""
    arrived = trio.Event()
    killed = trio.Event()

    async def on_request(n: int) -> None:
        if n == 2:
            arrived.set()
            await killed.wait()  # d2's first request never answers: the server dies

    steps: list[Step] = [Text(text="one"), Text(text="never sent"), Text(text="two")]
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps, on_request=on_request) as (model, url):
            config = write_config(tmp_path, url)
            async with serve(tmp_path, config) as server, server.connect() as client:
                await client.send(message("d1"))
                first = await client.result("d1")
                await client.send({"type": "ack", "seq": first["seq"]})
                await client.send(message("d2"))
                await client.until(lambda f: f["type"] == "accepted")
                await arrived.wait()
                await server.kill()
                killed.set()
            async with serve(tmp_path, config) as server, server.connect() as client:
                second = await client.until(lambda f: f["type"] == "result")
                await client.send({"type": "status"})
                rest = await client.until(lambda f: f["type"] in ("status", "result"))
    assert (first["delivery_id"], first["seq"]) == ("d1", 1)
    assert (second["delivery_id"], second["outcome"], second["text"]) == ("d2", "reply", "two")
    assert second["seq"] == 2
    assert rest["type"] == "status"  # no other result came: d1 was acknowledged
    assert model.request_count == 3


async def test_fifty_rooms_at_once(tmp_path: Path) -> None:
    """Five connections each send to ten rooms; every delivery gets its own reply."""
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="ok")] * 50) as (model, url):
            config = write_config(tmp_path, url, "\n[caps]\nmax_live_workers = 8\n")
            async with serve(tmp_path, config) as server:
                found: dict[str, Frame] = {}

                async def client_of(n: int) -> None:
                    async with server.connect() as client:
                        mine = [f"c{n}-r{r}" for r in range(10)]
                        for delivery in mine:
                            await client.send(message(delivery, room=f"dm:{delivery}"))
                        while not all(d in found for d in mine):
                            frame = await client.until(lambda f: f["type"] == "result")
                            found[frame["delivery_id"]] = frame

                async with trio.open_nursery() as nursery:
                    for n in range(5):
                        nursery.start_soon(client_of, n)
    assert len(found) == 50
    assert {f["outcome"] for f in found.values()} == {"reply"}
    assert sorted(f["seq"] for f in found.values()) == list(range(1, 51))
    assert model.request_count == 50


async def test_cancel_of_a_running_delivery(tmp_path: Path) -> None:
    arrived = trio.Event()

    async def on_request(n: int) -> None:
        arrived.set()
        await trio.sleep_forever()  # the model never answers; only the cancel ends the turn

    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="never")], on_request=on_request) as (_, url):
            config = write_config(tmp_path, url)
            async with serve(tmp_path, config) as server, server.connect() as client:
                await client.send(message("d1"))
                await client.until(lambda f: f["type"] == "accepted")
                await arrived.wait()
                await client.send({"type": "cancel", "delivery_id": "d1"})
                result = await client.result("d1")
    assert result["outcome"] == "cancelled"


async def test_sigterm_drains_running_turns_and_refuses_new_ones(tmp_path: Path) -> None:
    """SIGTERM while d1's model request is open: new deliveries are refused
    ``not_admitting``; d1 finishes within the drain timeout; the server exits 0."""
    arrived, release = trio.Event(), trio.Event()

    async def on_request(n: int) -> None:
        arrived.set()
        await release.wait()

    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="drained")], on_request=on_request) as (_, url):
            config = write_config(tmp_path, url)
            async with serve(tmp_path, config, "--drain-timeout", "60") as server:
                async with server.connect() as client:
                    await client.send(message("d1"))
                    await client.until(lambda f: f["type"] == "accepted")
                    await arrived.wait()
                    server.process.send_signal(signal.SIGTERM)
                    await server.printed(rb"SIGTERM: not admitting")
                    await client.send(message("late", room="dm:2"))
                    refused = await client.until(lambda f: f["type"] in ("error", "accepted"))
                    assert (refused["code"], refused["ref"]) == ("not_admitting", "late")
                    release.set()
                    result = await client.result("d1")
                assert await server.process.wait() == 0
    assert (result["outcome"], result["text"]) == ("reply", "drained")


async def test_sigterm_past_the_drain_timeout_leaves_the_turn_pending_for_the_next_start(
    tmp_path: Path,
) -> None:
    arrived = trio.Event()

    async def on_request(n: int) -> None:
        if n == 1:
            arrived.set()
            await trio.sleep_forever()

    steps: list[Step] = [Text(text="after the restart")]  # the first request never gets one
    with trio.fail_after(LIMIT):
        async with scripted_upstream(steps, on_request=on_request) as (_, url):
            config = write_config(tmp_path, url)
            async with (
                serve(tmp_path, config, "--drain-timeout", "0") as server,
                server.connect() as client,
            ):
                await client.send(message("d1"))
                await client.until(lambda f: f["type"] == "accepted")
                await arrived.wait()
                server.process.send_signal(signal.SIGTERM)
                assert await server.process.wait() == 0
            status = await trio.run_process(
                [sys.executable, "-m", "runtime._cli", "status", "--json", "--state-dir", "state"],
                cwd=tmp_path,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                capture_stdout=True,
            )
            async with serve(tmp_path, config) as server, server.connect() as client:
                result = await client.result("d1")
    pending = json.loads(status.stdout)["pending_deliveries"]
    assert [p["delivery_id"] for p in pending] == ["d1"]
    assert (result["outcome"], result["text"]) == ("reply", "after the restart")


async def test_log_json_lines_are_events_and_the_metrics_listener_answers(tmp_path: Path) -> None:
    """``serve --log-json --metrics 127.0.0.1:0`` (docs/design/operations.md "Logs" L1, M1):
    every line on standard error is one JSON object with a stable ``event``; the published
    result's line names the delivery by its journal key (never the client's id), its room,
    outcome and seq; no line holds the message's text, the reply or the token. The metrics
    listener the process prints answers a scrape counting the delivery."""
    words = "the quartermaster's parrot"
    with trio.fail_after(LIMIT):
        async with scripted_upstream([Text(text="aye aye")]) as (_, url):
            config = write_config(tmp_path, url)
            args = ("--log-json", "--metrics", "127.0.0.1:0")
            async with serve(tmp_path, config, *args) as server:
                await server.printed(rb"metrics on http://127\.0\.0\.1:\d+/metrics")
                found = re.search(rb"metrics on http://127\.0\.0\.1:(\d+)/metrics", server.output)
                assert found is not None
                async with server.connect() as client:
                    await client.send(message("d-logs", text=words))
                    result = await client.result("d-logs")
                url = f"http://127.0.0.1:{int(found.group(1))}/metrics"
                async with open_request("GET", url) as response:
                    scraped = (await response.read()).decode()
                server.process.send_signal(signal.SIGTERM)
                assert await server.process.wait() == 0
    assert result["outcome"] == "reply"
    assert 'pi_runtime_deliveries_finished_total{outcome="reply"} 1.0' in scraped
    token = (tmp_path / "state" / "token").read_text().strip()
    lines = (tmp_path / "serve.stderr").read_text().splitlines()
    assert lines
    entries = [json.loads(line) for line in lines]  # every line one JSON object
    for entry in entries:
        assert {"time", "level", "logger", "message", "event"} <= set(entry), entry
    published = [e for e in entries if e["event"] == "result_published"]
    assert len(published) == 1
    (line,) = published
    assert line["delivery"] == delivery_key("d-logs")
    assert (line["room"], line["outcome"], line["seq"]) == ("dm:1", "reply", result["seq"])
    text = "\n".join(lines)
    for secretish in (words, "aye aye", token, '"d-logs"'):
        assert secretish not in text
