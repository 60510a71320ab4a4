"""Ingress benchmark (issue #6 item 9): durable admissions over 50 websocket connections.

Run it from the repository root::

    .venv/bin/python -m bench.ingress            # full run: 3 rounds, under two minutes
    .venv/bin/python -m bench.ingress --quick    # smoke run: 1 short round
    .venv/bin/python -m bench.ingress --heap-freeze 0   # the server's collector left as it is
    .venv/bin/python -m bench.ingress --profile .cache/ingress.prof   # instead: a cProfile pass
    .venv/bin/python -m bench.ingress --profile .cache/ingress.txt --py-spy PATH/py-spy
    .venv/bin/python -m bench.ingress --pipeline 1 --admission append   # bisect: append only

What is measured, over 50 websocket connections on 127.0.0.1:

* **runtime**: ``deliver`` frames to ``pi-runtime serve`` (``runtime._server._serve.open_server``),
  each timed from just before its ``send`` to the ``accepted`` frame, which the server sends
  only once the admission is durable (group-committed ``fdatasync`` of the admissions log);
* **echo**: the same 50 clients sending the same frames to a plain trio-websocket echo
  server, which sends every message straight back: the baseline.

Both are driven closed-loop, each connection keeping ``k`` frames outstanding (``k`` in
``--pipeline``, default 1 and 4), in slices that alternate runtime and echo (4 slices of 40
frames per connection per case and round): admissions/s against echoes/s. Then both are
driven paced (open loop: each connection sends on a fixed schedule, up to 256 outstanding) at
50 % of the round's best echo throughput (the latency target's rate) and at 25 %, 3 s each:
p50/p99 latency at a given rate, the runtime's beside the echo server's.

Turns are held back, so the measurement is admission only, with the runtime unmodified: the
configuration allows one live worker (``caps.max_live_workers = 1``), and before measuring
the server admits one delivery to a *hold* room whose model request never gets an answer
(a scripted model that hangs; every threshold that could end that turn is set to an hour or
half of one). That turn holds the only worker slot. Each of the 50 measured rooms (one per
connection) then gets one warm-up delivery, whose lane prepares its turn and parks waiting
for a slot (``RoomWorker._reserve_worker``). Every measured delivery after that is admitted
``queued`` behind it: nothing steers, no worker starts, no result is published. The bench
checks this after every slice (dispositions, and the server's own report of the hold turn,
the parked lanes and the results) and discards a round where it does not hold.
``caps.queue_limit`` and ``server.max_in_flight`` are raised to what a round sends.

Both servers run in subprocesses of this bench (``--role``), the clients in this process: the
client load would otherwise compete with the server for one interpreter, and the two vCPUs
give one to each side. The runtime server is fresh (a new state directory) every round, so no
round admits on top of another round's pending deliveries; the echo server lives for the whole
run. Each set of 50 connections is opened once per round and warmed with 5 unmeasured frames
per connection. Every ratio is taken per round and its median over rounds is reported. CPU
time is read per case: the server process and its main (Trio) thread from ``/proc``, this
process from ``getrusage``, so the report says which side was the bottleneck; so is the
share of time some task of the machine stalled waiting for a CPU or for I/O.

The runtime server keeps its heap as ``serve`` does (``keep_heap``, docs/design/serve.md S7;
``--heap-freeze 0`` for Python's collector as it is). ``--admission`` bisects the server's
cost per frame: ``append`` replaces the worker's admission with one durable append of an
admission record (the writer hand-off, the ``fdatasync``, the acknowledgement), ``none`` with
a single yield; the websocket side and the ``accepted`` frame stay as they are.

Each phase reports the server's collection pauses: their total, the full ones, the longest of
any generation by wall time and by the collecting thread's CPU time (``max``, ``cpu``), and the
keeper's sweeps; after a round, what the collector tracks, a forced full collection's time and
a sweep's.

Bounded: a fixed number of frames per case, the paced cases a fixed number of seconds, every
case under a time limit. Everything binds 127.0.0.1, state directories go under the
repository's ``.cache/`` (not tmpfs), and every process the bench starts is stopped (closing
its stdin, then SIGTERM, then SIGKILL; the runtime server stops its Fake-Pi worker on the way
out). The targets print met/missed for information only; nothing asserts on time.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import os
import pstats
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import trio
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    WebSocketRequest,
    connect_websocket,
    serve_websocket,
)

if TYPE_CHECKING:
    from runtime._config import RoomWorkerConfig, ServerConfig
    from runtime._journal._interface import Log
    from runtime._rooms._admission import Delivery
    from runtime._server._heap import HeapKeeper
    from runtime._wire import Accepted

from bench.journal import (
    HEX64,
    background_load,
    choose_base,
    describe_machine,
    percentile,
    pressure_since,
    pressure_totals,
)

CONNECTIONS: Final = 50
HOLD_ROOM: Final = "dm:bench-hold"
TEXT: Final = (
    "can you check why the nightly build failed? the last green run was yesterday at 18:00 "
    "and since then three commits touched runtime/_server/_serve.py and tests/server/test_serve.py"
)
PHASE_LIMIT: Final = 120.0
"""Seconds any one phase may take before the run is abandoned."""
SERVER_LIMIT: Final = 900.0
"""A server subprocess stops by itself after this long, whatever happens to the bench."""
PACED_OUTSTANDING: Final = 256
"""Paced phase: frames one connection may have outstanding before its sender waits."""
CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
REPO: Final = Path(__file__).resolve().parents[1]


def room_of(connection: int) -> str:
    return f"dm:bench-{connection}"


def deliver_frame(delivery_id: str, connection: int) -> str:
    """The ``deliver`` frame as a chat bridge would send it (JSON text, as tests/_wire.py)."""
    return json.dumps(
        {
            "type": "deliver",
            "delivery_id": delivery_id,
            "room": room_of(connection),
            "author": {"id": f"u{connection}", "name": "Ann"},
            "message_id": f"m-{delivery_id}",
            "text": TEXT,
        }
    )


# -- the servers (subprocesses: ``--role echo`` / ``--role runtime``) -----------------------


async def _lines(stream: trio.abc.ReceiveStream) -> AsyncIterator[str]:
    """Lines of ``stream`` until EOF."""
    buffer = b""
    while True:
        chunk = await stream.receive_some(4096)
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield line.decode()


class GcWatch:
    """This process's garbage-collection pauses (``gc.callbacks``), taken per case."""

    def __init__(self) -> None:
        self.started = 0.0
        self.started_cpu = 0.0
        self.pauses: list[tuple[int, float]] = []
        self.cpu: list[float] = []
        """Each pause's CPU time on the collecting thread (less than its wall time when the
        machine took the CPU away meanwhile)."""
        self.keeper: HeapKeeper | None = None
        """The runtime's heap keeper, whose sweeps are counted apart (``generation`` 3)."""
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            self.started_cpu = time.thread_time()
        else:
            sweeping = self.keeper is not None and self.keeper.sweeping
            generation = 3 if sweeping else info["generation"]
            self.pauses.append((generation, time.perf_counter() - self.started))
            self.cpu.append(0.0 if sweeping else time.thread_time() - self.started_cpu)

    def take(self) -> dict[str, Any]:
        """Pauses since the last call: all of them, and full (generation 2) collections."""
        pauses, self.pauses = self.pauses, []
        cpu, self.cpu = self.cpu, []
        full = [seconds for generation, seconds in pauses if generation == 2]
        sweeps = [seconds for generation, seconds in pauses if generation == 3]
        return {
            "collections": len(pauses),
            "all_ms": sum(seconds for _, seconds in pauses) * 1e3,
            "full": len(full),
            "full_ms": sum(full) * 1e3,
            "full_max_ms": max(full, default=0.0) * 1e3,
            "max_ms": max((t for g, t in pauses if g != 3), default=0.0) * 1e3,
            "max_cpu_ms": max(cpu, default=0.0) * 1e3,
            "sweeps": len(sweeps),
            "sweep_max_ms": max(sweeps, default=0.0) * 1e3,
        }


def _say(kind: str, data: dict[str, Any]) -> None:
    print(f"{kind} {json.dumps(data)}", flush=True)


async def _until_stdin_closes(on_line: Callable[[str], Awaitable[None]]) -> None:
    """Answer the bench's commands on stdin until it closes stdin (or signals)."""
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    with (
        trio.move_on_after(SERVER_LIMIT),
        trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals,
    ):
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_signal)
            async for line in _lines(stdin):
                await on_line(line.strip())
            nursery.cancel_scope.cancel()
    await stdin.aclose()


async def echo_server() -> None:
    """A plain trio-websocket echo server: every message straight back."""

    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        with contextlib.suppress(ConnectionClosed):
            while True:
                await ws.send_message(await ws.get_message())

    collections = GcWatch()

    async def on_line(line: str) -> None:
        await trio.lowlevel.checkpoint()
        if line == "gc":
            _say("GC", collections.take())

    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            lambda task_status: serve_websocket(
                handler, "127.0.0.1", 0, None, handler_nursery=nursery, task_status=task_status
            )
        )
        _say("READY", {"port": server.port})
        await _until_stdin_closes(on_line)
        nursery.cancel_scope.cancel()


def instruments_off() -> None:
    """Make every ``prometheus_client`` counter, gauge and histogram a no-op in this process:
    the runtime with its metrics off (``bench.ingress_metrics``'s baseline)."""
    import prometheus_client

    def nothing(*_args: Any, **_kwargs: Any) -> None:
        return None

    prometheus_client.Counter.inc = nothing  # type: ignore[method-assign]
    prometheus_client.Histogram.observe = nothing  # type: ignore[method-assign]
    prometheus_client.Gauge.set = nothing  # type: ignore[method-assign]
    prometheus_client.Gauge.inc = nothing  # type: ignore[method-assign]
    prometheus_client.Gauge.dec = nothing  # type: ignore[method-assign]


async def runtime_server(
    base: Path,
    rooms: int,
    capacity: int,
    profile: str | None,
    metrics: str = "default",
    heap_freeze: float | None = None,
    admission: str = "worker",
) -> None:
    """``open_server`` on a fresh state directory, its turns held back (module docstring).
    ``metrics``: ``off`` every instrument a no-op, ``on`` the metrics listener and its page
    served too (its port in ``READY``), ``default`` as ``serve`` runs by default.
    ``heap_freeze``: ``[server] heap_freeze_seconds`` (``None``: its default); the heap is
    kept as ``serve`` keeps it (``keep_heap``). ``admission``: what a ``deliver`` frame costs
    besides the websocket (:func:`bisected_deliver`)."""
    from fake_pi.model_server import ScriptedModel, serve_model
    from fake_pi.scenario import Hang, Scenario
    from runtime._config import ServerConfig
    from runtime._server._heap import keep_heap
    from runtime._server._serve import ServeOptions, heap_policy, open_server

    hour = 3600.0
    model = ScriptedModel(scenario=Scenario(steps=[Hang(seconds=hour)]))
    profiler = cProfile.Profile() if profile else None
    collections = GcWatch()
    async with trio.open_nursery() as nursery:
        upstream = await nursery.start(serve_model, model)
        config = held_config(
            upstream.url,
            capacity,
            server=ServerConfig(max_in_flight=capacity)
            if heap_freeze is None
            else ServerConfig(max_in_flight=capacity, heap_freeze_seconds=heap_freeze),
            metrics_listen="127.0.0.1:0" if metrics == "on" else None,
        )
        if metrics == "off":
            instruments_off()
        async with (
            open_server(config, ServeOptions(port=0), base_dir=base) as server,
            keep_heap(heap_policy(config), lambda: server.frames_received) as keeper,
        ):  # as serve keeps its heap once started
            collections.keeper = keeper
            worker = server.worker

            def delivery(room: str, delivery_id: str) -> Delivery:
                return text_delivery(room, delivery_id, author_id="u-warm")

            started = time.perf_counter()
            with trio.fail_after(120):
                await worker.deliver(delivery(HOLD_ROOM, "hold"))
                await poll(lambda: model.request_count > 0)  # the hold turn asked the model
                for i in range(rooms):
                    await worker.deliver(delivery(room_of(i), f"warm-{i}"))
                await poll(lambda: parked(worker, rooms) == rooms)  # each lane waits for a slot
            await trio.sleep(0.5)
            if admission != "worker":  # every measured frame from here on
                worker.deliver = bisected_deliver(admission, worker.store.admissions)  # type: ignore[method-assign,assignment]

            def report() -> dict[str, Any]:
                hold = worker._lanes[HOLD_ROOM]
                return {
                    "hold_busy": hold.busy,
                    "hold_live": hold.live_worker,
                    "live_workers": len(worker._live),
                    "parked": parked(worker, rooms),
                    "pending": len(worker.pending()),
                    "results": worker.last_seq,
                    "model_requests": model.request_count,
                    "gc_tracked": len(gc.get_objects()),
                    "gc_types": Counter(type(o).__name__ for o in gc.get_objects()).most_common(8),
                    "gc_frozen": gc.get_freeze_count(),
                    "gc_full_now_ms": timed_full_collection(),
                    "gc_sweep_now": timed_sweep(keeper),
                }

            async def on_line(line: str) -> None:
                await trio.lowlevel.checkpoint()
                if line == "check":
                    _say("CHECK", report())
                elif line == "gc":
                    _say("GC", collections.take())
                elif line == "profile-start" and profiler is not None:
                    profiler.enable()
                elif line == "profile-stop" and profiler is not None:
                    profiler.disable()
                    if profile:
                        profiler.dump_stats(profile)
                    _say("PROFILED", {"file": profile})

            _say(
                "READY",
                {
                    "port": server.port,
                    "metrics_port": server.metrics_port,
                    "warmup_s": time.perf_counter() - started,
                }
                | report(),
            )
            await _until_stdin_closes(on_line)
        nursery.cancel_scope.cancel()


def held_config(
    upstream_url: str,
    capacity: int,
    *,
    server: ServerConfig,
    metrics_listen: str | None,
) -> RoomWorkerConfig:
    """A room worker on Fake-Pi whose turns the scripted model at ``upstream_url`` holds back
    for an hour (nothing times out meanwhile), one live worker, ``capacity`` deliveries
    queued per room: the bench servers' configuration (this one's and bench.scrape_rooms')."""
    from runtime._config import Caps, MetricsConfig, ModelConfig, RoomWorkerConfig, Thresholds

    hour = 3600.0
    return RoomWorkerConfig(
        agent="fake",
        model=ModelConfig(base_url=f"{upstream_url}/v1"),
        thresholds=Thresholds(
            stall_seconds=hour,
            upstream_inactivity_seconds=hour / 2,
            idle_stop_seconds=hour,
            drain_timeout_seconds=1.0,
        ),
        caps=Caps(max_live_workers=1, queue_limit=capacity),
        server=server,
        metrics=MetricsConfig(listen=metrics_listen),
    )


def text_delivery(room: str, delivery_id: str, *, author_id: str) -> Delivery:
    """A delivery of :data:`TEXT` into ``room`` by Ann."""
    from runtime._rooms._admission import Author, Delivery

    return Delivery(
        delivery_id=delivery_id,
        room=room,
        author=Author(id=author_id, name="Ann"),
        message_id=f"m-{delivery_id}",
        text=TEXT,
    )


async def poll(condition: Callable[[], bool]) -> None:
    """Until ``condition`` holds (runtime state the bench has no event for)."""
    while True:
        if condition():
            return
        await trio.sleep(0.05)


def timed_full_collection() -> float:
    """A full collection now, in ms: what the collector's walk costs in this state."""
    started = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - started) * 1e3


def timed_sweep(keeper: HeapKeeper | None) -> tuple[float, int] | None:
    """The heap keeper's sweep now (a full collection of the frozen heap too): its ms, and
    the unreachable objects it found (cycles frozen since the last sweep)."""
    if keeper is None:
        return None
    keeper.sweep()
    seconds, found = keeper.sweeps[-1]
    return seconds * 1e3, found


def parked(worker: Any, rooms: int) -> int:
    """How many measured rooms' lanes hold a delivery and wait for a worker slot."""
    count = 0
    for i in range(rooms):
        lane = worker._lanes.get(room_of(i))
        slot = lane._room if lane is not None else None
        if (
            lane is not None
            and lane.busy
            and slot is not None
            and slot.boundaries is not None
            and slot.live is None
            and lane not in worker._live
        ):
            count += 1
    return count


ADMISSIONS: Final = ("worker", "append", "none")
"""``--admission``: what the runtime server does with a ``deliver`` frame."""


def bisected_deliver(
    admission: str, log: Log
) -> Callable[[Mapping[str, Any]], Awaitable[Accepted]]:
    """``RoomWorker.deliver`` with the admission cut away, to bisect the server's cost per
    frame: ``append`` makes one admission record durable in the admissions log (the
    group-committed hand-off to the writer thread, the ``fdatasync``, the acknowledgement) and
    nothing else — no checks, fingerprints, prompt or lane; ``none`` only yields once. Both
    answer ``accepted`` (``queued``) as the worker would, through the same server code."""
    from runtime._records import Admission, Fingerprints
    from runtime._wire import Accepted

    prints = Fingerprints(request=HEX64, authority=HEX64, settings=HEX64)

    async def deliver(request: Mapping[str, Any]) -> Accepted:
        delivery_id, room = request["delivery_id"], request["room"]
        if admission == "append":
            record = Admission(
                delivery_id=delivery_id,
                lane=room,
                request=dict(request),
                fingerprints=prints,
                rendered_prompt=request["text"],
                admitted_ms=time.time_ns() // 1_000_000,
            )
            await log.append(record)
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return Accepted(delivery_id=delivery_id, room=room, disposition="queued")

    return deliver


def server_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The options of the bench that its runtime servers take."""
    heap = () if args.heap_freeze is None else ("--heap-freeze", str(args.heap_freeze))
    return (*heap, "--admission", args.admission)


def server_main(args: argparse.Namespace) -> int:
    if args.role == "echo":
        trio.run(echo_server)
    else:
        trio.run(
            runtime_server,
            Path(args.base),
            args.rooms,
            args.capacity,
            args.profile,
            args.metrics,
            args.heap_freeze,
            args.admission,
        )
    return 0


# -- driving a server ------------------------------------------------------------------


class Server:
    """A server subprocess: its port, its commands, its CPU time."""

    def __init__(self, process: trio.Process, lines: AsyncIterator[str]) -> None:
        self.process = process
        self._lines = lines
        self.ready: dict[str, Any] = {}

    async def expect(self, kind: str) -> dict[str, Any]:
        with trio.fail_after(180):
            async for line in self._lines:
                word, _, rest = line.partition(" ")
                if word == kind:
                    data: dict[str, Any] = json.loads(rest)
                    return data
                print(f"  [server] {line}", file=sys.stderr)
        raise RuntimeError(f"the server ended before saying {kind}")

    async def command(self, line: str, answer: str | None = None) -> dict[str, Any]:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(f"{line}\n".encode())
        return await self.expect(answer) if answer else {}

    @property
    def port(self) -> int:
        return int(self.ready["port"])

    def cpu(self) -> tuple[float, float]:
        """User + system CPU seconds of the server process so far: all its threads, and its
        main thread alone (the Trio thread; the others are the journal's writer threads)."""
        pid = self.process.pid
        return _ticks(f"/proc/{pid}/stat"), _ticks(f"/proc/{pid}/task/{pid}/stat")


def _ticks(stat: str) -> float:
    fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def start_server(role: str, *extra: str) -> contextlib.AbstractAsyncContextManager[Server]:
    return server_process([sys.executable, "-m", "bench.ingress", "--role", role, *extra])


@contextlib.asynccontextmanager
async def server_process(command: list[str]) -> AsyncIterator[Server]:
    """A bench server subprocess (``command``), once it has said ``READY``; stopped after."""
    process = await trio.lowlevel.open_process(command, stdin=-1, stdout=-1, cwd=str(REPO))
    try:
        assert process.stdout is not None
        server = Server(process, _lines(process.stdout))
        server.ready = await server.expect("READY")
        yield server
    finally:
        with trio.CancelScope(shield=True):
            await stop(process)


async def stop(process: trio.Process) -> None:
    """Close its stdin (it leaves its blocks and stops its workers), then TERM, then KILL."""
    if process.stdin is not None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await process.stdin.aclose()
    for escalate in (None, process.terminate, process.kill):
        if escalate is not None:
            escalate()
        with trio.move_on_after(30 if escalate is None else 10):
            await process.wait()
            return


# -- the clients -----------------------------------------------------------------------


@dataclass
class Phase:
    """Frames answered over every connection: ``ops`` of them in ``seconds`` (summed over
    slices), with each one's latency from its ``send`` to its answer."""

    kind: str
    pipeline: int
    ops: int = 0
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    server_cpu: float = 0.0
    trio_cpu: float = 0.0
    """The server's Trio thread alone."""
    client_cpu: float = 0.0
    dispositions: Counter[str] = field(default_factory=Counter)
    gc_ms: float = 0.0
    """The server's garbage-collection pauses meanwhile, in total."""
    gc_full: int = 0
    gc_full_max_ms: float = 0.0
    """Full (generation 2) collections of the server meanwhile, and the longest."""
    gc_max_ms: float = 0.0
    """The longest collection of any generation meanwhile (not counting sweeps)."""
    gc_max_cpu_ms: float = 0.0
    """The most CPU one collection took meanwhile (its wall time less any preemption)."""
    sweeps: int = 0
    sweep_max_ms: float = 0.0
    """The heap keeper's sweeps meanwhile (docs/design/serve.md S7), and the longest."""
    target_rate: float | None = None
    max_lag_ms: float = 0.0
    """Paced only: how late a frame went out against its schedule, at most."""
    stall_cpu_s: float = 0.0
    stall_io_s: float = 0.0
    """Seconds in which some task of the machine waited for a CPU / for I/O meanwhile."""

    @property
    def rate(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else 0.0

    def p(self, fraction: float) -> float:
        return percentile(self.latencies_ms, fraction)

    def add(self, part: Phase) -> None:
        self.ops += part.ops
        self.seconds += part.seconds
        self.latencies_ms += part.latencies_ms
        self.server_cpu += part.server_cpu
        self.trio_cpu += part.trio_cpu
        self.client_cpu += part.client_cpu
        self.dispositions.update(part.dispositions)
        self.gc_ms += part.gc_ms
        self.gc_full += part.gc_full
        self.gc_full_max_ms = max(self.gc_full_max_ms, part.gc_full_max_ms)
        self.gc_max_ms = max(self.gc_max_ms, part.gc_max_ms)
        self.gc_max_cpu_ms = max(self.gc_max_cpu_ms, part.gc_max_cpu_ms)
        self.sweeps += part.sweeps
        self.sweep_max_ms = max(self.sweep_max_ms, part.sweep_max_ms)
        self.max_lag_ms = max(self.max_lag_ms, part.max_lag_ms)
        self.stall_cpu_s += part.stall_cpu_s
        self.stall_io_s += part.stall_io_s


class Invalid(Exception):
    """A phase saw something that means it did not measure admission only."""


def client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Clients:
    """``CONNECTIONS`` open websockets to one server (kept for a whole round)."""

    server: Server
    kind: str
    connections: list[WebSocketConnection]


@contextlib.asynccontextmanager
async def open_clients(server: Server, kind: str, token: str | None) -> AsyncIterator[Clients]:
    """Connect ``CONNECTIONS`` clients (and say hello with ``token``); close them after."""
    connections: list[WebSocketConnection] = []
    problems: list[str] = []
    async with trio.open_nursery() as nursery:

        async def connect() -> None:
            ws = await connect_websocket(nursery, "127.0.0.1", server.port, "/", use_ssl=False)
            connections.append(ws)
            if token is not None:
                hello = {"type": "hello", "protocol": 1, "token": token, "client": "bench"}
                await ws.send_message(json.dumps(hello))
                welcome = json.loads(await ws.get_message())
                if welcome.get("type") != "welcome":
                    problems.append(f"hello refused: {welcome}")

        try:
            with trio.fail_after(PHASE_LIMIT):
                async with trio.open_nursery() as connecting:
                    for _ in range(CONNECTIONS):
                        connecting.start_soon(connect)
            if problems:
                raise Invalid(problems[0])
            yield Clients(server, kind, connections)
        finally:
            with trio.move_on_after(10) as closing:
                closing.shield = True
                for ws in connections:
                    await ws.aclose()
            nursery.cancel_scope.cancel()


async def drive(
    clients: Clients,
    frames: list[list[tuple[str, str]]],
    pipeline: int,
    *,
    rate: float | None = None,
) -> Phase:
    """Send every connection's frames (``(delivery_id, text)``) with ``pipeline`` outstanding
    per connection; with ``rate``, on a fixed schedule instead (frames/s over all)."""
    kind = clients.kind
    phase = Phase(kind, pipeline, target_rate=rate)
    go = trio.Event()
    ends: list[float] = []
    problems: list[str] = []
    t0 = 0.0

    async def one(c: int, nursery: trio.Nursery) -> None:
        ws = clients.connections[c]
        mine = frames[c]
        slots = trio.Semaphore(pipeline)
        sent: dict[str, float] = {}
        interval = len(frames) / rate if rate else 0.0

        async def sender() -> None:
            await go.wait()
            for n, (delivery_id, text) in enumerate(mine):
                if rate:
                    due = t0 + (n + c / len(frames)) * interval
                    await trio.sleep(max(0.0, due - time.perf_counter()))
                    phase.max_lag_ms = max(phase.max_lag_ms, (time.perf_counter() - due) * 1e3)
                await slots.acquire()
                sent[delivery_id] = time.perf_counter()
                await ws.send_message(text)

        nursery.start_soon(sender)
        for _ in mine:
            frame = json.loads(await ws.get_message())
            now = time.perf_counter()
            if frame.get("type") not in ("accepted", "deliver"):  # a result, an error, a signal
                problems.append(f"{kind}: unexpected frame {frame}")
                nursery.cancel_scope.cancel()
                return
            phase.latencies_ms.append((now - sent.pop(frame["delivery_id"])) * 1e3)
            if frame["type"] == "accepted":
                phase.dispositions[frame["disposition"]] += 1
            slots.release()
        ends.append(time.perf_counter())

    await clients.server.command("gc", "GC")  # from here on
    with trio.fail_after(PHASE_LIMIT):
        async with trio.open_nursery() as nursery:
            for c in range(len(frames)):
                nursery.start_soon(one, c, nursery)
            await trio.sleep(0.05)  # every task waits at the barrier
            load = pressure_totals()
            cpu0, server0 = client_cpu(), clients.server.cpu()
            t0 = time.perf_counter()
            go.set()
    if clients.kind == "runtime" and set(phase.dispositions) != {"queued"}:
        problems.append(f"dispositions other than queued: {dict(phase.dispositions)}")
    if problems:
        raise Invalid(problems[0])
    phase.seconds = max(ends) - t0
    phase.client_cpu = client_cpu() - cpu0
    server1 = clients.server.cpu()
    phase.server_cpu, phase.trio_cpu = server1[0] - server0[0], server1[1] - server0[1]
    stalls = pressure_since(load)
    phase.stall_cpu_s = stalls.get("cpu", 0.0) / 100 * phase.seconds
    phase.stall_io_s = stalls.get("io", 0.0) / 100 * phase.seconds
    phase.ops = len(phase.latencies_ms)
    collected = await clients.server.command("gc", "GC")
    phase.gc_ms, phase.gc_full = collected["all_ms"], collected["full"]
    phase.gc_full_max_ms, phase.gc_max_ms = collected["full_max_ms"], collected["max_ms"]
    phase.gc_max_cpu_ms = collected["max_cpu_ms"]
    phase.sweeps, phase.sweep_max_ms = collected["sweeps"], collected["sweep_max_ms"]
    return phase


# -- one run ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    rounds: int
    slices: int
    per_slice: int
    """Frames per connection per slice."""
    paced_seconds: float
    """Length of each paced case."""


PACED_FRACTIONS: Final = (0.5, 0.25)
"""Paced cases: these fractions of the round's best echo throughput."""
RATIO_TARGETS: Final = {1: 0.70}
"""Durable admissions / echo throughput per pipeline depth k (issue #23 item 4: k = 1);
any other k: issue #6's 0.50."""
P99_TARGETS_MS: Final = {0.5: 10.0, 0.25: 5.0}
"""p99 admission latency paced at a fraction of echo (issue #23's table)."""
FULL: Final = Settings(rounds=3, slices=4, per_slice=40, paced_seconds=3.0)
QUICK: Final = Settings(rounds=1, slices=1, per_slice=20, paced_seconds=1.0)
WARMUP_FRAMES: Final = 5
"""Frames per connection sent unmeasured on every set of connections first."""
MAX_PACED_RATE: Final = 60_000.0


class Frames:
    """Unique delivery ids for every phase of the run."""

    def __init__(self) -> None:
        self.phase = 0

    def make(self, per_connection: int) -> list[list[tuple[str, str]]]:
        self.phase += 1
        out: list[list[tuple[str, str]]] = []
        for c in range(CONNECTIONS):
            ids = [f"p{self.phase}-c{c}-{n}" for n in range(per_connection)]
            out.append([(d, deliver_frame(d, c)) for d in ids])
        return out


async def check_held(runtime: Server, rooms: int) -> dict[str, Any]:
    state = await runtime.command("check", "CHECK")
    held = (
        state["hold_busy"]
        and state["hold_live"]
        and state["live_workers"] == 1
        and state["parked"] == rooms
        and state["results"] == 0
        and state["model_requests"] == 1
    )
    if not held:
        raise Invalid(f"turns were not held back: {state}")
    return state


@dataclass
class Round:
    closed: dict[tuple[str, int], Phase]
    """(``echo`` | ``runtime``, k): the slices of that case, summed."""
    paced: dict[tuple[str, float], Phase]
    """(``echo`` | ``runtime``, fraction of the best echo rate): the paced cases (each rate
    the same schedule for both)."""
    facts: dict[str, Any]
    slice_ratios: dict[int, list[float]]
    """k: runtime rate / echo rate of each slice."""


async def run_round(
    base: Path,
    echo: Server,
    settings: Settings,
    pipelines: list[int],
    round_no: int,
    frames: Frames,
    log: Callable[[str], None],
    profile: str | None = None,
    py_spy: str | None = None,
    server_args: tuple[str, ...] = (),
) -> Round:
    state_base = base / f"round-{round_no}"
    state_base.mkdir()
    paced_max = int(settings.paced_seconds * MAX_PACED_RATE / CONNECTIONS) + 1
    per_room = settings.slices * len(pipelines) * settings.per_slice
    per_room += len(PACED_FRACTIONS) * paced_max
    capacity = per_room + 2 * WARMUP_FRAMES + 8
    extra = ["--base", str(state_base), "--rooms", str(CONNECTIONS), "--capacity", str(capacity)]
    extra += server_args
    if profile and not py_spy:
        extra += ["--profile", profile]
    closed: dict[tuple[str, int], Phase] = {}
    slice_ratios: dict[int, list[float]] = {k: [] for k in pipelines}
    try:
        async with (
            start_server("runtime", *extra) as runtime,
            open_clients(echo, "echo", None) as to_echo,
            open_clients(
                runtime, "runtime", (state_base / "state" / "token").read_text().strip()
            ) as to_runtime,
        ):
            facts = dict(runtime.ready)
            log(f"round {round_no}: runtime server ready in {facts['warmup_s']:.1f}s")
            for clients in (to_echo, to_runtime):
                await drive(clients, frames.make(WARMUP_FRAMES), 1)
            if profile:  # one profiled runtime case (and with py-spy, echo), nothing else
                k = max(pipelines)
                count = settings.slices * settings.per_slice
                cases: dict[tuple[str, int], Phase] = {}
                if py_spy:
                    async with sampling(py_spy, runtime.process.pid, profile):
                        cases["runtime", k] = await drive(to_runtime, frames.make(count), k)
                    async with sampling(py_spy, echo.process.pid, f"{profile}.echo"):
                        cases["echo", k] = await drive(to_echo, frames.make(count), k)
                else:
                    await runtime.command("profile-start")
                    cases["runtime", k] = await drive(to_runtime, frames.make(count), k)
                    await runtime.command("profile-stop", "PROFILED")
                await check_held(runtime, CONNECTIONS)
                return Round(cases, {}, facts, {})
            for s in range(settings.slices):
                for k in pipelines:
                    flip = (s + round_no) % 2
                    rates: dict[str, float] = {}
                    for clients in (to_runtime, to_echo) if flip else (to_echo, to_runtime):
                        p = await drive(clients, frames.make(settings.per_slice), k)
                        closed.setdefault((clients.kind, k), Phase(clients.kind, k)).add(p)
                        rates[clients.kind] = p.rate
                    slice_ratios[k].append(rates["runtime"] / rates["echo"])
                await check_held(runtime, CONNECTIONS)
            for (kind, k), p in sorted(closed.items()):
                log(f"  {kind:<8} k={k}: {p.rate:,.0f}/s, p50 {p.p(0.5):.1f} ms")
            best_echo = max(p.rate for (kind, _), p in closed.items() if kind == "echo")
            paced: dict[tuple[str, float], Phase] = {}
            for fraction in PACED_FRACTIONS:
                target = min(fraction * best_echo, MAX_PACED_RATE)
                count = max(5, round(target * settings.paced_seconds / CONNECTIONS))
                for clients in (to_echo, to_runtime) if round_no % 2 else (to_runtime, to_echo):
                    p = await drive(clients, frames.make(count), PACED_OUTSTANDING, rate=target)
                    paced[clients.kind, fraction] = p
                    log(f"  {clients.kind} paced at {target:,.0f}/s: p99 {p.p(0.99):.1f} ms")
                await check_held(runtime, CONNECTIONS)
            facts["after"] = await check_held(runtime, CONNECTIONS)
            return Round(closed, paced, facts, slice_ratios)
    finally:
        shutil.rmtree(state_base, ignore_errors=True)


# -- the report ------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _row(p: Phase) -> dict[str, Any]:
    return {
        "kind": p.kind,
        "pipeline": p.pipeline,
        "ops": p.ops,
        "seconds": p.seconds,
        "rate": p.rate,
        "p50_ms": p.p(0.5),
        "p99_ms": p.p(0.99),
        "max_ms": max(p.latencies_ms),
        "server_cpu_us_per_op": p.server_cpu / p.ops * 1e6,
        "trio_cpu_us_per_op": p.trio_cpu / p.ops * 1e6,
        "server_cores": p.server_cpu / p.seconds,
        "client_cores": p.client_cpu / p.seconds,
        "cpu_stall_pct": 100 * p.stall_cpu_s / p.seconds,
        "io_stall_pct": 100 * p.stall_io_s / p.seconds,
        "dispositions": dict(p.dispositions),
        "gc_ms": p.gc_ms,
        "gc_full": p.gc_full,
        "gc_full_max_ms": p.gc_full_max_ms,
        "gc_max_ms": p.gc_max_ms,
        "gc_max_cpu_ms": p.gc_max_cpu_ms,
        "sweeps": p.sweeps,
        "sweep_max_ms": p.sweep_max_ms,
        "target_rate": p.target_rate,
        "max_lag_ms": p.max_lag_ms,
    }


def report(rounds: list[Round], pipelines: list[int]) -> tuple[list[str], dict[str, Any]]:
    lines: list[str] = []
    data: dict[str, Any] = {"rounds": [], "targets": {}}
    header = (
        f"{'round':>5}  {'case':<17} {'frames':>7} {'frames/s':>9} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'max ms':>7} {'srv us/op':>9} {'trio us/op':>10} {'srv cores':>9} {'cli cores':>9} "
        f"{'cpu stall':>9} {'io stall':>8} {'gc ms':>6} {'full gc':>7} {'max':>5} {'cpu':>4} "
        f"{'sweeps':>6}  dispositions"
    )
    lines += [header, "-" * len(header)]
    for i, one in enumerate(rounds, 1):
        rows = [one.closed[key] for key in sorted(one.closed, key=lambda key: (key[1], key[0]))]
        rows += [one.paced[key] for key in sorted(one.paced, key=lambda key: (-key[1], key[0]))]
        data["rounds"].append([_row(p) for p in rows])
        for p, row in zip(rows, data["rounds"][-1], strict=True):
            label = f"{p.kind} k={p.pipeline}" if p.target_rate is None else f"{p.kind} paced"
            share = [f for (_, f), q in one.paced.items() if q is p]
            label += f" {share[0]:.0%}" if share else ""
            lines.append(
                f"{i:>5}  {label:<17} {p.ops:>7} {p.rate:>9,.0f} {row['p50_ms']:>7.2f} "
                f"{row['p99_ms']:>7.2f} {row['max_ms']:>7.1f} "
                f"{row['server_cpu_us_per_op']:>9.0f} {row['trio_cpu_us_per_op']:>10.0f} "
                f"{row['server_cores']:>9.2f} "
                f"{row['client_cores']:>9.2f} {row['cpu_stall_pct']:>8.0f}% "
                f"{row['io_stall_pct']:>7.0f}% {p.gc_ms:>6.0f} {p.gc_full:>7} "
                f"{p.gc_max_ms:>5.1f} {p.gc_max_cpu_ms:>4.1f} {p.sweeps:>6}  "
                + ", ".join(f"{k} {v}" for k, v in sorted(p.dispositions.items()))
                + (
                    f"  (target {p.target_rate:,.0f}/s, latest send {p.max_lag_ms:.1f} ms late)"
                    if p.target_rate is not None
                    else ""
                )
            )
    lines.append("")
    lines.append("targets (per round, median over rounds; informational only):")
    for k in pipelines:
        ratios = [
            r.closed[("runtime", k)].rate / r.closed[("echo", k)].rate
            for r in rounds
            if ("runtime", k) in r.closed and ("echo", k) in r.closed
        ]
        slices = [v for r in rounds for v in r.slice_ratios.get(k, [])]
        value = _median(ratios)
        goal = RATIO_TARGETS.get(k, 0.50)
        met = value >= goal
        spread = f"; slices {min(slices):.2f}-{max(slices):.2f}" if slices else ""
        lines.append(
            f"  k={k}: durable admissions / echo throughput = {value:.2f}   target >= {goal:.2f}   "
            f"{'MET' if met else 'MISSED'}   (rounds: {', '.join(f'{r:.2f}' for r in ratios)}"
            f"{spread})"
        )
        data["targets"][f"ratio_k{k}"] = {
            "value": value,
            "rounds": ratios,
            "slices": slices,
            "met": met,
        }
    for fraction in PACED_FRACTIONS:
        paced_target(lines, data, rounds, fraction)
    lines.append("")
    lines.append(
        "CPU per frame (less sensitive to the neighbours than frames/s; median over rounds):"
    )
    for k in pipelines:
        cpu: dict[str, list[float]] = {"runtime": [], "trio": [], "echo": [], "client": []}
        for r in rounds:
            rt, echo = r.closed.get(("runtime", k)), r.closed.get(("echo", k))
            if rt is None or echo is None:
                continue
            cpu["runtime"].append(rt.server_cpu / rt.ops * 1e6)
            cpu["trio"].append(rt.trio_cpu / rt.ops * 1e6)
            cpu["echo"].append(echo.server_cpu / echo.ops * 1e6)
            cpu["client"].append(echo.client_cpu / echo.ops * 1e6)
        runtime_us, trio_us, echo_us, client_us = (_median(v) for v in cpu.values())
        lines.append(
            f"  k={k}: runtime server {runtime_us:.0f} us per admission ({trio_us:.0f} on its "
            f"Trio thread), echo server "
            f"{echo_us:.0f} us per echo, client {client_us:.0f} us per echo; "
            f"echo / runtime server CPU = {echo_us / runtime_us:.2f}"
        )
        data["targets"][f"cpu_k{k}"] = {
            "runtime_server_us": runtime_us,
            "runtime_trio_us": trio_us,
            "echo_server_us": echo_us,
            "echo_client_us": client_us,
        }
    return lines, data


def paced_target(
    lines: list[str], data: dict[str, Any], rounds: list[Round], fraction: float
) -> None:
    """p99 admission latency when paced at ``fraction`` of the echo throughput, against its
    target (:data:`P99_TARGETS_MS`), beside the echo server's at the same rate."""
    paced = [r.paced["runtime", fraction] for r in rounds if ("runtime", fraction) in r.paced]
    if not paced:
        return
    p99s = [p.p(0.99) for p in paced]
    echo_p99s = [r.paced["echo", fraction].p(0.99) for r in rounds if ("echo", fraction) in r.paced]
    reached = [p.rate / p.target_rate for p in paced if p.target_rate]
    value = _median(p99s)
    goal = P99_TARGETS_MS.get(fraction)
    met = goal is not None and value <= goal and _median(reached) >= 0.95
    verdict = ("MET" if met else "MISSED") if goal is not None else "(information)"
    wanted = f"target <= {goal:g} ms" if goal is not None else "no target"
    lines.append(
        f"  paced at {fraction:.0%} of echo ({_median([p.rate for p in paced]):,.0f}/s): p99 "
        f"admission latency = {value:.2f} ms   {wanted}   {verdict}   "
        f"(rounds: {', '.join(f'{v:.2f}' for v in p99s)}; rate reached / target: "
        f"{', '.join(f'{v:.2f}' for v in reached)}; echo p99 at the same rate: "
        f"{', '.join(f'{v:.2f}' for v in echo_p99s)} ms)"
    )
    data["targets"][f"paced_{fraction:g}_p99_ms"] = {
        "value": value,
        "rounds": p99s,
        "reached": reached,
        "echo_p99_ms": echo_p99s,
        "met": met,
    }


@contextlib.asynccontextmanager
async def sampling(py_spy: str, pid: int, out: str) -> AsyncIterator[None]:
    """py-spy sampling ``pid`` while the block runs, without pausing it (pausing it 250 times
    a second slows it and spoils py-spy's idle detection); raw stacks to ``out``. Leaves are
    right; a stack read while the process runs may lack its outer frames, so time including
    callees is a lower bound."""
    command = [py_spy, "record", "--pid", str(pid), "--nonblocking", "--threads", "--rate", "250"]
    command += ["--format", "raw", "--output", out, "--duration", "300"]
    process = await trio.lowlevel.open_process(command, stdout=-1)
    try:
        assert process.stdout is not None
        with trio.fail_after(30):  # until it says it samples
            seen = b""
            while b"Sampling process" not in seen:
                chunk = await process.stdout.receive_some(4096)
                if not chunk:
                    raise RuntimeError(f"py-spy did not start: {seen.decode(errors='replace')}")
                seen += chunk
        yield
    finally:
        with trio.CancelScope(shield=True):
            process.send_signal(signal.SIGINT)  # py-spy writes its output and exits
            with trio.move_on_after(30):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()


def _short(frame: str) -> str:
    """``func (path:line)`` with the path relative to the repository or site-packages."""
    for marker in (f"{REPO}/", "site-packages/", "lib/python3.11/"):
        if marker in frame:
            head, _, tail = frame.partition("(")
            return f"{head}({tail.split(marker, 1)[1]}"
    return frame


def print_samples(path: str, limit: int = 25) -> None:
    """The sampled case: where the server's threads were (py-spy raw format, one stack a
    line: ``thread (tid): name;frame;frame;... count``), split into the Trio thread and the
    journal's writer threads; by own time per frame and per file, and by time including
    callees per function. A thread counts while it runs or waits for a CPU or a disk."""
    groups: dict[str, tuple[Counter[str], Counter[str], Counter[str]]] = {}
    totals: Counter[str] = Counter()
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        thread, *frames = stack.split(";")
        name = thread.partition(": ")[2]
        group = (
            "Trio thread"
            if name == "MainThread"
            else ("writer threads" if name.startswith("pi-runtime-writer") else "other threads")
        )
        frames = [_short(f) for f in frames] or ["(no Python frame)"]
        own, files, inclusive = groups.setdefault(group, (Counter(), Counter(), Counter()))
        totals[group] += n
        own[frames[-1]] += n
        files[frames[-1].rpartition("(")[2].rpartition(":")[0]] += n
        for function in {f.rpartition(":")[0] + ")" for f in frames}:
            inclusive[function] += n
    total = sum(totals.values())
    print(f"\nserver samples (py-spy, {total} samples of threads running or waiting to run):")
    for group, n in totals.most_common():
        print(f"  {group}: {100 * n / total:.1f}%")
    for group, (own, files, inclusive) in sorted(groups.items(), key=lambda g: -totals[g[0]]):
        for title, counter, top in (
            ("own time by frame (function, file:line)", own, limit),
            ("own time by file", files, 15),
            ("time including callees, by function", inclusive, limit),
        ):
            print(f"\n  {group}, {title} (% of its samples):")
            for name, k in counter.most_common(top):
                print(f"  {100 * k / totals[group]:6.1f}%  {name}")


def print_profile(path: str, limit: int = 30) -> None:
    """The profiled phase's top functions by own time and by cumulative time."""
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        stats = pstats.Stats(path, stream=out)
        stats.sort_stats(order).print_stats(limit)
        text = out.getvalue()
        start = text.find("   ncalls")
        print(f"\nserver profile, by {order} (top {limit}):")
        print(text[start:].rstrip())


# -- entry point -----------------------------------------------------------------------


async def run(
    args: argparse.Namespace, settings: Settings, pipelines: list[int]
) -> dict[str, Any] | None:
    base_parent = choose_base(args.dir)
    base = Path(tempfile.mkdtemp(prefix="bench-ingress-", dir=base_parent))
    os.chmod(base, 0o700)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    print("pi-runtime ingress benchmark" + (" (quick)" if args.quick else ""))
    for key, value in describe_machine(base).items():
        print(f"  {key}: {value}")
    sample = deliver_frame("p1-c0-0", 0)
    print(
        f"  {CONNECTIONS} connections, deliver frame {len(sample)} B, "
        f"pipelines k={pipelines}; {settings.rounds} round(s) of {settings.slices} slice(s) "
        f"of {settings.per_slice} frames per connection per case; paced phase "
        f"{settings.paced_seconds:g}s"
    )
    print(f"  background load before: {background_load()}")
    frames = Frames()
    rounds: list[Round] = []
    started = time.perf_counter()
    try:
        async with start_server("echo") as echo:
            if args.profile:
                profiled = await run_round(
                    base,
                    echo,
                    settings,
                    pipelines,
                    1,
                    frames,
                    log,
                    profile=args.profile,
                    py_spy=args.py_spy,
                    server_args=server_args(args),
                )
                how = "py-spy sampling" if args.py_spy else "cProfile on, so slower"
                for (kind, k), p in profiled.closed.items():
                    print(
                        f"  profiled {kind} case ({how}): k={k}, {p.ops} frames, "
                        f"{p.rate:,.0f}/s, p50 {p.p(0.5):.1f} ms, "
                        f"{p.server_cpu / p.ops * 1e6:.0f} us server CPU per frame "
                        f"({p.trio_cpu / p.ops * 1e6:.0f} us on its Trio thread), "
                        f"{p.server_cpu / p.seconds:.2f} server cores, "
                        f"{p.client_cpu / p.seconds:.2f} client cores"
                    )
                if args.py_spy:
                    print("\nTHE RUNTIME SERVER")
                    print_samples(args.profile)
                    print("\nTHE ECHO SERVER")
                    print_samples(f"{args.profile}.echo")
                else:
                    print_profile(args.profile)
                return {}
            for round_no in range(1, settings.rounds + 1):
                try:
                    one = await run_round(
                        base, echo, settings, pipelines, round_no, frames, log,
                        server_args=server_args(args),
                    )  # fmt: skip
                except Invalid as error:
                    log(f"round {round_no} discarded: {error}")
                    continue
                rounds.append(one)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"  background load after: {background_load()}")
    print(f"  measured in {time.perf_counter() - started:.0f}s")
    for i, fact in enumerate((r.facts for r in rounds), 1):
        print(
            f"  round {i}: runtime warm-up {fact['warmup_s']:.1f}s; after the last phase: "
            f"{fact['after']['pending']} pending, {fact['after']['results']} results, "
            f"hold turn running={fact['after']['hold_busy']}, "
            f"model requests {fact['after']['model_requests']}; objects the collector tracks "
            f"{fact['gc_tracked']:,} at start, {fact['after']['gc_tracked']:,} at the end "
            f"({fact['after']['gc_frozen']:,} frozen; most: {fact['after']['gc_types']}); "
            f"a full collection then took {fact['after']['gc_full_now_ms']:.1f} ms"
            + (
                f", a sweep {sweep[0]:.1f} ms ({sweep[1]:,} unreachable found)"
                if (sweep := fact["after"].get("gc_sweep_now")) is not None
                else ""
            )
        )
    print()
    if not rounds:
        print("no valid round")
        return None
    lines, data = report(rounds, pipelines)
    if args.admission != "worker":
        print(
            f"--admission {args.admission}: the runtime server did not admit anything (a "
            "bisection of its cost); the figures below are not the runtime's.\n"
        )
        data["admission"] = args.admission
    print("\n".join(lines))
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ingress", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="a few-second smoke run")
    parser.add_argument("--rounds", type=int, help="rounds (default 3, quick 1)")
    parser.add_argument("--slices", type=int, help="slices per round (default 4, quick 1)")
    parser.add_argument("--per-slice", type=int, help="frames per connection per slice and case")
    parser.add_argument("--pipeline", default="1,4", help="outstanding frames per connection")
    parser.add_argument("--dir", help="where to create the state directories (not tmpfs)")
    parser.add_argument("--json", help="also write every figure to this JSON file")
    parser.add_argument("--profile", help="instead: one runtime case under cProfile, to FILE")
    parser.add_argument("--py-spy", help="with --profile: sample with this py-spy instead")
    parser.add_argument(
        "--heap-freeze",
        type=float,
        help="the runtime's [server] heap_freeze_seconds (default: its default; 0: Python's "
        "collector as it is)",
    )
    parser.add_argument(
        "--admission",
        choices=ADMISSIONS,
        default="worker",
        help="to bisect the server's cost: the worker's admission (default), only a durable "
        "append of the record (append), or nothing (none)",
    )
    parser.add_argument("--role", choices=("echo", "runtime"), help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    parser.add_argument("--rooms", type=int, default=CONNECTIONS, help=argparse.SUPPRESS)
    parser.add_argument("--capacity", type=int, default=10_000, help=argparse.SUPPRESS)
    parser.add_argument(
        "--metrics", choices=("default", "off", "on"), default="default", help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.role:
        return server_main(args)
    settings = QUICK if args.quick else FULL
    settings = Settings(
        args.rounds or settings.rounds,
        args.slices or settings.slices,
        args.per_slice or settings.per_slice,
        settings.paced_seconds,
    )
    pipelines = [int(k) for k in args.pipeline.split(",")]
    data = trio.run(run, args, settings, pipelines)
    if data is None:
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
