"""What a scrape and the operator page cost on a host with many idle rooms (``GET /metrics``,
``/api/state``, the admin socket's ``status``; docs/design/operations.md M8).

Run it from the repository root::

    .venv/bin/python -m bench.scrape_rooms                       # 10, 1,000, 10,000, 50,000
    .venv/bin/python -m bench.scrape_rooms --rooms 10,1000       # a quick run

A real server (``open_server``, as ``bench.ingress``'s runtime role starts it: Fake-Pi, a
real file store, the metrics listener and its operator page on 127.0.0.1) runs in a
subprocess of this bench. Its turns are held back as ``bench.ingress`` holds them: one live
worker allowed, held by a *hold* room's turn whose model never answers; a *probe* room's
lane waits for that worker, so every delivery the bench sends it is admitted ``queued`` and
nothing else runs. The rooms are made as a chat's rooms are: each gets one delivery through
the worker's ``deliver`` (a durable admission, its lane and lane log), which is then
cancelled (``cancel``: its result ``cancelled`` published, no worker started) — a room that
had one delivery and is idle, as most of a long-running host's rooms are. The host grows to
each size of ``--rooms`` in turn, in the same server, and at each size, for each way a scrape
reads the host — **before** M8 (every room's status built and summed, and
``prometheus_client``'s own process collector, which lists ``/proc/self/fd``: one entry per
room lane's log) and **after** (``room_totals``: the lanes of a pending delivery or a live
worker only; ``ProcessMetrics``: the descriptors counted by the size Linux gives that
directory) — swapped in the running server:

* **on the server's Trio thread**, what answering costs, timed in the server process (median
  and largest of ``REPEATS``; wall and the thread's CPU): the scrape's encoding (what
  ``GET /metrics`` runs, the servers' collector included) and the largest allocation peak of
  one (``tracemalloc``); once per size, the operator page's state (what ``/api/state`` and each
  push of an open page's event stream build and encode), the admin socket's ``status`` (every
  room's status: its output is one row per room) and the process's resident memory and
  descriptors;
* **seen from outside**: a websocket client admits into the probe room, one delivery at a
  time, while the bench asks ``GET /metrics`` over HTTP ``SCRAPES`` times, one after another:
  each request's latency, the longest the server's loop was late waking a task sleeping 2 ms
  during it (the loop stall it caused; ``quiet``: the same over a window of the same length
  with no request), and each admission's latency (from its ``send`` to its ``accepted``),
  kept apart by whether a request was in flight meanwhile. The same with ``GET /api/state``.

Ratios are against the first size of the run (10 rooms by default). Nothing asserts; the
figures go into docs/design/performance.md ("What the metrics cost").
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import msgspec
import trio
from trio_websocket import WebSocketConnection, connect_websocket

from runtime._boundary._http import open_request

from .ingress import (
    REPO,
    TEXT,
    Server,
    _lines,
    _say,
    held_config,
    poll,
    server_process,
    text_delivery,
)

if TYPE_CHECKING:
    from runtime._rooms._census import RoomTotals
    from runtime._rooms._worker import RoomWorker

REPEATS: Final = 7
SCRAPES: Final = 12
HOLD_ROOM: Final = "dm:hold"
PROBE_ROOM: Final = "dm:probe"
TICK: Final = 0.002
GROW_AT_ONCE: Final = 256
GROW_STEP: Final = 5000
"""Rooms made per command (each answered well within the bench's 180 s a command)."""
WAYS: Final = ("before", "after")
ROOM_GAUGES: Final = (
    "pi_runtime_room_",
    "pi_runtime_deliveries_queued ",
    "pi_runtime_deliveries_pending ",
)


SERVER_LIMIT: Final = 3600.0
"""A server subprocess stops by itself after this long, whatever happens to the bench."""


def idle_room(i: int) -> str:
    return f"dm:idle-{i:06d}"


def by_statuses(worker: RoomWorker) -> RoomTotals:
    """The rooms summed as the collector summed them before M8: every room's status."""
    from runtime._rooms._census import RoomTotals

    rows = worker.status()
    return RoomTotals(
        lanes=len(rows),
        running=sum(row.state == "running" for row in rows),
        live_workers=sum(row.live_worker for row in rows),
        queued=sum(row.queued for row in rows),
        pending=len(worker.pending()),
    )


# -- the server (a subprocess: ``--role server``) ------------------------------------------


class Lag:
    """How late the loop wakes a task sleeping ``TICK``: the longest since the last read."""

    def __init__(self) -> None:
        self.worst = 0.0

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            await trio.sleep(TICK)
            self.worst = max(self.worst, time.perf_counter() - start - TICK)

    def take(self) -> float:
        worst, self.worst = self.worst, 0.0
        return worst


def timed(work: Callable[[], object]) -> dict[str, float]:
    """Median and largest wall and thread-CPU milliseconds of ``REPEATS`` runs of ``work``."""
    walls, cpus = [], []
    for _ in range(REPEATS):
        wall, cpu = time.perf_counter(), time.thread_time()
        work()
        walls.append((time.perf_counter() - wall) * 1e3)
        cpus.append((time.thread_time() - cpu) * 1e3)
    return {
        "wall_ms": statistics.median(walls),
        "wall_max_ms": max(walls),
        "cpu_ms": statistics.median(cpus),
    }


def peak_kib(work: Callable[[], object]) -> float:
    """The largest memory ``work`` held at once, allocated by it (``tracemalloc``)."""
    gc.collect()
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1] / 1024
    finally:
        tracemalloc.stop()


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def serve_commands(on_line: Callable[[str], Awaitable[None]]) -> None:
    """Answer the bench's commands on stdin until it closes stdin (or ``SERVER_LIMIT``)."""
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    with trio.move_on_after(SERVER_LIMIT):
        async for line in _lines(stdin):
            await on_line(line.strip())
    await stdin.aclose()


async def server_role(base: Path) -> None:
    from prometheus_client import ProcessCollector
    from prometheus_client.exposition import generate_latest

    from fake_pi.model_server import ScriptedModel, serve_model
    from fake_pi.scenario import Hang, Scenario
    from runtime._config import ServerConfig
    from runtime._metrics import PROCESS, REGISTRY
    from runtime._rooms._admission import Delivery
    from runtime._rooms._census import room_totals
    from runtime._server import _metrics
    from runtime._server._page import OperatorPage
    from runtime._server._serve import ServeOptions, open_server

    library = ProcessCollector(registry=None)

    def use(way: str) -> None:
        """Make the running server's scrapes read the host ``way`` (``WAYS``)."""
        before = way == "before"
        vars(_metrics)["room_totals"] = by_statuses if before else room_totals
        for collector in (library, PROCESS):
            with contextlib.suppress(KeyError):
                REGISTRY.unregister(collector)
        REGISTRY.register(library if before else PROCESS)

    hour = 3600.0
    model = ScriptedModel(scenario=Scenario(steps=[Hang(seconds=hour)]))
    lag = Lag()
    async with trio.open_nursery() as nursery:
        upstream = await nursery.start(serve_model, model)
        config = held_config(
            upstream.url,
            100_000,
            server=ServerConfig(max_in_flight=100_000),
            metrics_listen="127.0.0.1:0",
        )
        async with open_server(config, ServeOptions(port=0), base_dir=base) as server:
            worker = server.worker
            page = OperatorPage(server, secure=False, allowed_hosts=frozenset())

            def delivery(room: str, delivery_id: str) -> Delivery:
                return text_delivery(room, delivery_id, author_id="u1")

            with trio.fail_after(120):
                await worker.deliver(delivery(HOLD_ROOM, "hold"))
                await poll(lambda: model.request_count > 0)  # the hold turn asked the model
                await worker.deliver(delivery(PROBE_ROOM, "probe-warm"))
                await poll(lambda: worker.status(PROBE_ROOM)[0].state == "running")
            made = 0

            async def settle() -> None:
                """Cancel the probe room's queued deliveries: back to the two turns held."""
                for delivery_id in worker.pending():
                    if delivery_id.startswith("probe-") and delivery_id != "probe-warm":
                        await worker.cancel(delivery_id)
                await poll(lambda: len(worker.pending()) == 2)

            async def grow(rooms: int) -> None:
                nonlocal made
                limit = trio.CapacityLimiter(GROW_AT_ONCE)

                async def one(i: int) -> None:
                    async with limit:
                        delivery_id = f"idle-{i}"
                        await worker.deliver(delivery(idle_room(i), delivery_id))
                        await worker.cancel(delivery_id)

                async with trio.open_nursery() as growing:
                    for i in range(made, rooms):
                        growing.start_soon(one, i)
                made = max(made, rooms)
                await settle()

            def state() -> bytes:
                return msgspec.json.encode(page.state())

            def status() -> object:
                return msgspec.to_builtins(server._status(None))  # what ``status`` answers

            def status_frame() -> bytes:  # what the websocket ``status`` frame answers (P15)
                bound = config.server.max_frame_bytes
                return msgspec.json.encode(server._status(None, bound=bound))

            def scrape() -> bytes:
                return generate_latest(REGISTRY)

            async def on_line(line: str) -> None:
                await trio.lowlevel.checkpoint()
                word, _, arg = line.partition(" ")
                if word == "grow":
                    started = time.perf_counter()
                    await grow(int(arg) - 2)  # the hold and probe rooms count
                    _say("GROWN", {"seconds": time.perf_counter() - started})
                elif word == "measure":
                    gc.collect()
                    measured: dict[str, Any] = {
                        "rooms": worker.room_count,
                        "page": timed(state),
                        "page_bytes": len(state()),
                        "status": timed(status),
                        "status_frame": timed(status_frame),
                        "rss_mib": rss_mib(),
                        "fds": len(os.listdir("/proc/self/fd")),
                    }
                    for way in WAYS:
                        use(way)
                        measured[way] = {
                            "scrape": timed(scrape),
                            "peak_kib": peak_kib(scrape),
                            "gauges": [
                                line
                                for line in scrape().decode().splitlines()
                                if line.startswith(ROOM_GAUGES)
                            ],
                        }
                    use("after")
                    _say("MEASURED", measured)
                elif word == "collector":
                    use(arg)
                    _say("COLLECTOR", {"way": arg})
                elif word == "settle":
                    await settle()
                    _say("SETTLED", {})
                elif word == "lag":
                    _say("LAG", {"worst_ms": lag.take() * 1e3})

            nursery.start_soon(lag.run)
            _say("READY", {"port": server.port, "metrics_port": server.metrics_port})
            await serve_commands(on_line)
        nursery.cancel_scope.cancel()


# -- the bench ---------------------------------------------------------------------------


def start_server(base: Path) -> contextlib.AbstractAsyncContextManager[Server]:
    command = [sys.executable, "-m", "bench.scrape_rooms", "--role", "server", "--dir", str(base)]
    return server_process(command)


@contextlib.asynccontextmanager
async def admitting(port: int, token: str) -> AsyncIterator[WebSocketConnection]:
    async with trio.open_nursery() as nursery:
        ws = await connect_websocket(nursery, "127.0.0.1", port, "/", use_ssl=False)
        hello = {"type": "hello", "protocol": 1, "token": token, "client": "bench"}
        await ws.send_message(json.dumps(hello))
        welcome = json.loads(await ws.get_message())
        assert welcome.get("type") == "welcome", welcome
        try:
            yield ws
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await ws.aclose()
            nursery.cancel_scope.cancel()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


async def during(
    server: Server, ws: WebSocketConnection, url: str, headers: list[tuple[str, str]], tag: str
) -> dict[str, float]:
    """``SCRAPES`` requests of ``url``, one after another, while ``ws`` admits into the probe
    room one delivery at a time: the requests' latency and the loop stall each caused (and the
    same over a window as long with no request), the admissions' latency by whether a request
    was in flight meanwhile."""
    in_flight = [0]
    overlapped: list[float] = []
    quiet: list[float] = []
    asked: list[float] = []
    stalls: list[float] = []
    quiet_stalls: list[float] = []
    sequence = [0]
    done = trio.Event()

    async def admit() -> None:
        while not done.is_set():
            sequence[0] += 1
            delivery_id = f"probe-{tag}-{sequence[0]}"
            frame = {
                "type": "deliver",
                "delivery_id": delivery_id,
                "room": PROBE_ROOM,
                "author": {"id": "u1", "name": "Ann"},
                "message_id": f"m-{delivery_id}",
                "text": TEXT,
            }
            seen = in_flight[0]
            start = time.perf_counter()
            await ws.send_message(json.dumps(frame))
            while True:
                answer = json.loads(await ws.get_message())
                if answer.get("type") == "accepted" and answer["delivery_id"] == delivery_id:
                    break
            took = (time.perf_counter() - start) * 1e3
            (overlapped if seen or in_flight[0] else quiet).append(took)
            await trio.sleep(0.002)

    async def ask() -> None:
        for _ in range(SCRAPES):
            await server.command("lag", "LAG")
            in_flight[0] += 1
            start = time.perf_counter()
            async with open_request("GET", url, headers=headers) as response:
                await response.read()
                assert response.status == 200, response.status
            took = time.perf_counter() - start
            in_flight[0] -= 1
            stalls.append((await server.command("lag", "LAG"))["worst_ms"])
            asked.append(took * 1e3)
            await trio.sleep(0.05)
            await server.command("lag", "LAG")
            await trio.sleep(took)  # a window as long, no request
            quiet_stalls.append((await server.command("lag", "LAG"))["worst_ms"])
            await trio.sleep(0.05)
        done.set()

    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(admit)
            nursery.start_soon(ask)
    return {
        "request_ms": median(asked),
        "stall_ms": median(stalls),
        "stall_max_ms": max(stalls),
        "quiet_stall_ms": median(quiet_stalls),
        "admission_quiet_ms": median(quiet),
        "admission_during_ms": median(overlapped),
        "admission_during_max_ms": max(overlapped, default=0.0),
    }


async def run(sizes: list[int], base: Path) -> None:
    async with start_server(base) as server:
        token = (base / "state" / "token").read_text().strip()
        port = server.ready["metrics_port"]
        bearer = [("authorization", f"Bearer {token}")]
        first: dict[str, Any] | None = None
        made = 0
        async with admitting(server.port, token) as ws:
            for size in sizes:
                grown = 0.0
                for step in range(made + GROW_STEP, size + GROW_STEP, GROW_STEP):
                    answer = await server.command(f"grow {min(step, size)}", "GROWN")
                    grown += answer["seconds"]
                made = size
                row: dict[str, Any] = {"grown_s": grown}
                row |= await server.command("measure", "MEASURED")
                for way in WAYS:
                    await server.command(f"collector {way}", "COLLECTOR")
                    await server.command("settle", "SETTLED")
                    url = f"http://127.0.0.1:{port}/metrics"
                    row[way]["http"] = await during(server, ws, url, [], f"{way}{size}")
                url = f"http://127.0.0.1:{port}/api/state"
                await server.command("settle", "SETTLED")
                row["page_http"] = await during(server, ws, url, bearer, f"page{size}")
                first = first or row
                report(row, first)


def report(row: dict[str, Any], first: dict[str, Any]) -> None:
    def ratio(now: dict[str, Any], then: dict[str, Any]) -> str:
        return f"x{now['cpu_ms'] / max(then['cpu_ms'], 1e-6):.1f}"

    def http(figures: dict[str, float]) -> str:
        return (
            f"request {figures['request_ms']:.1f} ms, loop stall {figures['stall_ms']:.1f} ms "
            f"(max {figures['stall_max_ms']:.1f}; quiet {figures['quiet_stall_ms']:.1f}), "
            f"an admission meanwhile {figures['admission_during_ms']:.1f} ms "
            f"(max {figures['admission_during_max_ms']:.1f}; none in flight "
            f"{figures['admission_quiet_ms']:.1f})"
        )

    same = row["before"]["gauges"] == row["after"]["gauges"]
    lines = [
        f"{row['rooms']:>6} rooms (made in {row['grown_s']:.0f} s): RSS {row['rss_mib']:.0f} MiB, "
        f"{row['fds']} descriptors; the room gauges of both ways "
        f"{'the same' if same else 'DIFFER'}: {'; '.join(row['after']['gauges'])}"
    ]
    for way in WAYS:
        now, then = row[way], first[way]
        lines.append(
            f"  scrape, {way:>8}: Trio thread {now['scrape']['wall_ms']:.2f} ms "
            f"(CPU {now['scrape']['cpu_ms']:.2f}, {ratio(now['scrape'], then['scrape'])} "
            f"the first size's; max {now['scrape']['wall_max_ms']:.2f}), peak "
            f"{now['peak_kib']:.0f} KiB; over HTTP: {http(now['http'])}"
        )
    lines.append(
        f"  page state: Trio thread {row['page']['wall_ms']:.2f} ms (CPU "
        f"{row['page']['cpu_ms']:.2f}, {ratio(row['page'], first['page'])}), "
        f"{row['page_bytes'] / 1024:.0f} KiB; over HTTP: {http(row['page_http'])}"
    )
    lines.append(
        f"  admin status: Trio thread {row['status']['wall_ms']:.1f} ms (CPU "
        f"{row['status']['cpu_ms']:.1f}, {ratio(row['status'], first['status'])}); "
        f"a status frame: {row['status_frame']['wall_ms']:.2f} ms (CPU "
        f"{row['status_frame']['cpu_ms']:.2f}, {ratio(row['status_frame'], first['status_frame'])})"
    )
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scrape_rooms", description=__doc__)
    parser.add_argument("--rooms", default="10,1000,10000,50000", help="host sizes, in order")
    parser.add_argument("--dir", help="where to create the state directory (not tmpfs)")
    parser.add_argument("--role", choices=("server",), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "server":
        trio.run(server_role, Path(args.dir))
        return 0
    sizes = [int(size) for size in args.rooms.split(",")]
    root = Path(args.dir or REPO / ".cache")
    root.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="bench-scrape-rooms-", dir=root)).resolve()
    print(f"bench.scrape_rooms: sizes {sizes}", flush=True)
    try:
        trio.run(run, sizes, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
