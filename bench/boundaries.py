"""Boundary benchmark: latency the model gateway and the tool gate add, for Pi and Fake-Pi.

Run it from the repository root::

    .venv/bin/python -m bench.boundaries                 # both workers, about a minute
    .venv/bin/python -m bench.boundaries --quick         # a smoke run, a few seconds
    .venv/bin/python -m bench.boundaries --kind fake     # only Fake-Pi (or: pi, both)

Issue #4, item 7: the latency added per model request by the gateway and per tool call by
the gate, against the same scenario without them, measured in the same run, for the real
Pi 1.6.0 and for Fake-Pi. Target: at most 0.8 ms per crossing (issue #23 item 5; issue #4
asked 2 ms), not counting the durable appends themselves.

How. For each worker kind, warm worker processes run side by side, one per configuration
(three; four for Pi), a fresh set every ``block`` repetitions, so the conversation, and with
it the request body, stays between about 5 and 80 KiB instead of growing all run long:

* ``direct``: worker -> scripted model (Pi without the gate extension; Fake-Pi without the
  gate environment): the baseline;
* ``gateway``: worker -> :class:`~runtime._boundary._gateway.Gateway`
  (``MemoryStepJournal``) -> model;
* ``gate``: as ``gateway``, plus the tool gate (``RecordingGateJournal`` on a ``MemoryLog``,
  ``read`` granted): Pi loads ``runtime/_boundary/pi_extension/gate.ts``, Fake-Pi gets the gate
  environment; the gateway holds each request until the outcomes of the tool results it
  carries are recorded, as ``runtime/_boundary/_boundaries.py`` wires a lane (B4);
* ``gate-local`` (Pi only; bench code): as ``gateway``, with Pi loading a copy of the gate
  extension whose two round trips are answered inside Pi (``/before`` "run", ``/after``
  nothing, no socket): the same tools registered the same way, so what Pi's own side of the
  gate costs — its extension machinery — apart from the runtime's.

The journals are in memory, so the durable appends are excluded, as the target says. Every
turn is the same scenario: ``R`` rounds, each a model response with one ``read`` call of a
small file in the worker's cwd, then a final text; so a turn is ``R + 1`` model requests and
``R`` tool calls. A turn is timed from ``prompt`` to ``agent_settled``. After one warm-up turn
per configuration, the configurations take turns (``direct, gateway, [gate-local,] gate``, the order
rotated every repetition) so drift hits them all alike. Each repetition ``k`` is the ``k``-th
turn of every worker, so the conversations have the same length when compared. Garbage
is collected between turns, outside the timed window, and the model keeps no old bodies.

From each repetition: gateway cost per model request = (gateway - direct) / (R + 1); gate cost
per tool call = (gate - gateway) / R (a tool call is two gate round trips, ``/before`` and
``/after``); for Pi, split into Pi's side = (gate-local - gateway) / R and the runtime's
round trips = (gate - gate-local) / R. The table shows medians over repetitions with min and
max, and ratios to ``direct`` computed per repetition. CPU is measured too: this process's
(the model, gateway, gate and RPC all live here, as in the runtime) with ``getrusage``, and
the worker's from ``/proc/<pid>/stat`` (10 ms ticks, so it is summed over all repetitions
before dividing).

Where the time goes: an in-process breakdown without any worker. A Python client (a fresh
connection per request, as Fake-Pi) sends real request bodies of the run straight to the
model, through a bare byte relay on the same HTTP stack (bench code: what a second hop costs
before the gateway does anything), and through the gateway; the gateway's JSON work on the
body is timed alone; and gate ``/before`` + ``/after`` pairs are timed with Fake-Pi's client.

The target is printed as met/missed for information only; nothing asserts. Every server binds
127.0.0.1 (the gate a private Unix socket); every worker is stopped by ``open_worker``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import trio

from bench.journal import background_load, pressure_since, pressure_totals
from fake_pi._gate_client import post_json
from fake_pi.model_server import ScriptedModel, serve_model
from fake_pi.scenario import Call, Scenario, Step, Text, ToolCalls
from runtime._boundary._bodies import RequestBodies
from runtime._boundary._boundaries import carried_tool_results
from runtime._boundary._gate import (
    EXTENSION_PATH,
    GATE_SECRET_ENV,
    GATE_SOCKET_ENV,
    Gate,
    GateServer,
    MemoryLog,
    RecordingGateJournal,
    gate_environment,
    serve_gate,
)
from runtime._boundary._gateway import GATEWAY_SECRET_ENV, Gateway, GatewayConfig, serve_gateway
from runtime._boundary._http import (
    ConnectionPool,
    Handler,
    HttpServer,
    Request,
    ResponseWriter,
    iter_sse,
    open_request,
    serve_http,
)
from runtime._boundary._steps import MemoryStepJournal
from runtime._boundary._stream import request_digest
from runtime._pi._pi_install import PiInstall, default_pi_home, find_pi
from runtime._pi._rpc import RpcChannel, open_rpc_channel
from runtime._pi._worker import (
    Epoch,
    ModelRoute,
    RetrySettings,
    WorkerLaunch,
    WorkerProgram,
    open_worker,
)

REPO: Final = Path(__file__).resolve().parents[1]
CONFIGS: Final = ("direct", "gateway", "gate")
PI_CONFIGS: Final = ("direct", "gateway", "gate-local", "gate")
"""Pi's: with ``gate-local``, its extension answering the gate itself (the module docstring)."""
KINDS: Final = ("fake", "pi")
KIND_LABEL: Final = {"fake": "Fake-Pi", "pi": "Pi 1.6.0"}
TARGET_MS: Final = 0.8
"""Issue #23 item 5 (issue #4 had 2 ms)."""
FILE_NAME: Final = "notes.txt"
FILE_MARK: Final = "boundary-bench-marker"
FILE_TEXT: Final = FILE_MARK + "\n" + "".join(f"line {i}: a small file\n" for i in range(8))
TURN_LIMIT: Final = 120.0
"""Seconds one turn may take before the bench gives up (a bound, not a measurement)."""
CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
BLOCK: Final = 10
"""Back-to-back requests per timed block in the in-process breakdown."""


@dataclass(frozen=True)
class Settings:
    rounds: int
    """Tool rounds per turn (R): R + 1 model requests and R tool calls."""
    reps: int
    """Measured turns per configuration."""
    block: int = 5
    """Repetitions per set of workers: fresh workers after that many, so a conversation (and
    its request bodies) stays within a realistic size instead of growing for the whole run."""
    breakdown: int = 100
    """Requests per target and body in the in-process breakdown (in blocks of BLOCK)."""
    warmup: int = 1
    """Unmeasured turns of every fresh worker before its measured ones."""


FULL: Final = Settings(rounds=30, reps=15, breakdown=200)
QUICK: Final = Settings(rounds=5, reps=2, breakdown=10)


# ------------------------------------------------------------------------------ measuring


def process_cpu() -> float:
    """User + system CPU seconds of this process (model, gateway, gate, RPC), all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def worker_cpu(pid: int) -> float:
    """User + system CPU seconds of the worker process, all its threads (10 ms ticks)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    except OSError:
        return float("nan")
    fields = stat.rsplit(")", 1)[1].split()
    # after the command: state is field 3, utime field 14, stime field 15 (1-based)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass(frozen=True)
class Turn:
    wall: float
    """Seconds from ``prompt`` to ``agent_settled``."""
    runtime_cpu: float
    worker_cpu: float
    body_bytes: int
    """Size of the turn's last model request body (the conversation grows turn by turn)."""


@dataclass
class Rig:
    """One warm worker in one configuration, with its model (and gateway, gate)."""

    kind: str
    config: str
    model: ScriptedModel
    epoch: Epoch
    rpc: RpcChannel
    gateway: Gateway | None = None
    gate_log: MemoryLog | None = None
    bodies: list[dict[str, Any]] = field(default_factory=list)
    """The first and the latest last request body (samples for the in-process breakdown)."""


def scenario(settings: Settings) -> Scenario:
    """Every turn's steps, once per turn a worker will run (the model takes them in order)."""
    turn: list[Step] = [
        ToolCalls(calls=[Call(name="read", arguments={"path": FILE_NAME})])
        for _ in range(settings.rounds)
    ]
    turn.append(Text(text="done"))
    return Scenario(steps=turn * (settings.warmup + settings.block))


def find_real_pi(explicit: str | None) -> PiInstall | None:
    """The installed Pi (never installs): ``--pi-home``, the default home, or the repo cache."""
    homes = [Path(explicit)] if explicit else [default_pi_home(), REPO / ".cache" / "pi"]
    for home in homes:
        found = find_pi(home)
        if found is not None:
            return found
    return None


def configs_of(kind: str) -> tuple[str, ...]:
    return PI_CONFIGS if kind == "pi" else CONFIGS


def local_gate_extension(base: Path) -> Path:
    """A copy of Pi's gate extension whose ``post`` answers in Pi itself — ``/before`` "run",
    ``/after`` nothing — with everything else as it is (bench code, never the runtime's): what
    Pi's side of a gated tool call costs without a round trip to the runtime."""
    text = EXTENSION_PATH.read_text(encoding="utf-8")
    start = text.index("function post(")
    end = text.index("\n}\n", start) + len("\n}\n")
    local = (
        "function post(path: string, body: unknown, signal?: AbortSignal): Promise<any> {\n"
        '\treturn Promise.resolve(path === "/before" ? { decision: "run" } : {});\n'
        "}\n"
    )
    path = base / "gate-local.ts"
    path.write_text(text[:start] + local + text[end:], encoding="utf-8")
    return path


def make_launch(
    kind: str,
    root: Path,
    base_url: str,
    pi: PiInstall | None,
    *,
    gateway: Gateway | None,
    gate_env: dict[str, str] | None,
    extension: Path | None = None,
) -> WorkerLaunch:
    for sub in ("work", "home", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "work" / FILE_NAME).write_text(FILE_TEXT, encoding="utf-8")
    if kind == "pi":
        assert pi is not None
        program = WorkerProgram.pi(pi)
    else:
        program = WorkerProgram.fake_pi()
    extra_env: dict[str, str] = {}
    api_key = "pi-runtime"
    if gateway is not None:  # the secret travels in the environment; both workers expand "$NAME"
        api_key = f"${GATEWAY_SECRET_ENV}"
        extra_env[GATEWAY_SECRET_ENV] = gateway.secret
    if gate_env is not None:
        extra_env.update(gate_env)
    return WorkerLaunch(
        program=program,
        cwd=root / "work",
        home=root / "home",
        agent_dir=root / "home" / "agent",
        tmp_dir=root / "tmp",
        session=None,
        route=ModelRoute(provider="fake", model="fake-model", base_url=base_url, api_key=api_key),
        retry=RetrySettings(max_retries=0),
        settings={"compaction": {"enabled": False}},
        extensions=(extension,) if kind == "pi" and extension is not None else (),
        extra_env=extra_env,
    )


@contextlib.asynccontextmanager
async def open_rig(
    kind: str,
    config: str,
    base: Path,
    settings: Settings,
    pi: PiInstall | None,
) -> AsyncIterator[Rig]:
    """Serve the model (and gateway, gate) on loopback and start one warm worker."""
    model = ScriptedModel(scenario=scenario(settings))
    root = base / f"{kind}-{config}"
    async with trio.open_nursery() as nursery:
        up: HttpServer = await nursery.start(serve_model, model)
        base_url = f"{up.url}/v1"
        gateway: Gateway | None = None
        gate_log: MemoryLog | None = None
        gate_env: dict[str, str] | None = None
        journal: RecordingGateJournal | None = None
        extension: Path | None = EXTENSION_PATH if config == "gate" else None
        if config == "gate-local":  # the extension needs its variables; nothing listens
            gate_env = {GATE_SOCKET_ENV: str(base / "none.sock"), GATE_SECRET_ENV: "bench-local"}
            extension = local_gate_extension(base)
        if config == "gate":
            gate_log = MemoryLog()
            journal = RecordingGateJournal(gate_log, key="bench", epoch=1, granted=("read",))
            gate = Gate(journal)
            server: GateServer = await nursery.start(serve_gate, gate, base / f"{kind}.sock")
            gate_env = gate_environment(server, gate)
        if config in ("gateway", "gate-local", "gate"):
            barrier = None
            if journal is not None:
                tools = journal

                async def hold_until_outcomes_durable(body: dict[str, Any]) -> None:
                    # as runtime/_boundary/_boundaries.py wires a lane (B4)
                    await tools.wait_outcomes(carried_tool_results(body))

                barrier = hold_until_outcomes_durable
            gateway = Gateway(
                GatewayConfig(upstream_url=base_url), MemoryStepJournal(), gate_barrier=barrier
            )
            served: HttpServer = await nursery.start(functools.partial(serve_gateway, gateway))
            base_url = f"{served.url}/v1"
        launch = make_launch(
            kind, root, base_url, pi, gateway=gateway, gate_env=gate_env, extension=extension
        )
        async with (
            open_worker(launch) as epoch,
            open_rpc_channel(epoch.stdin, epoch.stdout, stderr=epoch.stderr_tail) as rpc,
        ):
            yield Rig(kind, config, model, epoch, rpc, gateway=gateway, gate_log=gate_log)
        nursery.cancel_scope.cancel()


def _tool_texts(body: dict[str, Any]) -> list[str]:
    texts = []
    for message in body.get("messages", []):
        if message.get("role") == "tool":
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            texts.append(str(content))
    return texts


async def run_turn(rig: Rig, settings: Settings) -> Turn:
    """One timed turn; then checks that it really made R+1 requests and R tool calls."""
    gc.collect()  # outside the timed window: no old garbage is collected inside a turn
    rig.model.requests.clear()  # the model keeps every body; keep only this turn's
    gate_before = len(rig.gate_log.records) if rig.gate_log is not None else 0
    stats_before = rig.gateway.statistics() if rig.gateway is not None else None
    with trio.fail_after(TURN_LIMIT):
        cpu0, wcpu0 = process_cpu(), worker_cpu(rig.epoch.pid)
        t0 = time.perf_counter()
        prompted = await rig.rpc.prompt("go")
        settled = await rig.rpc.wait_settled(prompted.settled_before)
        t1 = time.perf_counter()
        cpu1, wcpu1 = process_cpu(), worker_cpu(rig.epoch.pid)
        while rig.rpc.statistics().events_buffered:  # R4: keep the buffer from growing
            await rig.rpc.next_event()
    problems: list[str] = []
    if settled.record.get("aborted") is not False:
        problems.append(f"the turn was aborted: {settled.record}")
    made = rig.model.request_count
    if made != settings.rounds + 1:
        problems.append(f"{made} model requests, expected {settings.rounds + 1}")
    last = rig.model.requests[-1].body if rig.model.requests else {}
    tools = _tool_texts(last)
    if not tools or FILE_MARK not in tools[-1]:
        problems.append(f"the last tool result is not the file: {tools[-1:]!r}")
    if rig.gate_log is not None:
        appended = len(rig.gate_log.records) - gate_before
        if appended != 2 * settings.rounds:
            problems.append(f"the gate recorded {appended} records, expected {2 * settings.rounds}")
    if rig.gateway is not None and stats_before is not None:
        stats = rig.gateway.statistics()
        calls = stats.upstream_calls - stats_before.upstream_calls
        journaled = stats.journaled - stats_before.journaled
        if calls != settings.rounds + 1 or journaled != calls or stats.replayed:
            problems.append(f"gateway: {calls} upstream calls, {journaled} journaled, {stats}")
    if problems:
        raise RuntimeError(f"{rig.kind}/{rig.config}: " + "; ".join(problems))
    size = len(msgspec.json.encode(last))
    if not rig.bodies:
        rig.bodies.append(rig.model.requests[0].body)
    rig.bodies[1:] = [last]
    rig.model.requests.clear()
    return Turn(wall=t1 - t0, runtime_cpu=cpu1 - cpu0, worker_cpu=wcpu1 - wcpu0, body_bytes=size)


async def measure_kind(
    kind: str,
    base: Path,
    settings: Settings,
    pi: PiInstall | None,
    log: Callable[[str], None],
) -> tuple[dict[str, list[Turn]], list[dict[str, Any]]]:
    """Per block: a fresh worker per configuration, warm-up, then the configurations take
    turns. Every worker is stopped when its block ends."""
    configs = configs_of(kind)
    turns: dict[str, list[Turn]] = {config: [] for config in configs}
    bodies: list[dict[str, Any]] = []
    rep = 0
    while rep < settings.reps:
        block = min(settings.block, settings.reps - rep)
        async with contextlib.AsyncExitStack() as stack:
            rigs: dict[str, Rig] = {}
            for config in configs:  # a launch proves itself or fails; turns are bounded
                rigs[config] = await stack.enter_async_context(
                    open_rig(kind, config, base, settings, pi)
                )
            for _ in range(settings.warmup):
                for config in configs:
                    await run_turn(rigs[config], settings)
            for _ in range(block):
                shift = rep % len(configs)
                for config in configs[shift:] + configs[:shift]:
                    turns[config].append(await run_turn(rigs[config], settings))
                rep += 1
                walls = ", ".join(f"{c} {turns[c][-1].wall * 1e3:.0f}" for c in configs)
                log(f"  {kind} rep {rep}/{settings.reps}: turn ms {walls}")
            bodies = rigs["gateway"].bodies
    return turns, bodies


# ------------------------------------------------------------------ in-process breakdown


def body_cpu(previous: bytes, data: bytes, repeat: int = 20) -> tuple[float, float]:
    """Seconds the gateway spends on a body beyond relaying it (the bytes go upstream as
    they came, G1): read whole — decoded and digested — and read by difference from the
    request before it, as the gateway reads every request of a turn after its first (G1a)."""
    started = time.perf_counter()
    for _ in range(repeat):
        body = msgspec.json.decode(data)
        request_digest(body)
    whole = (time.perf_counter() - started) / repeat
    spent = 0.0
    for _ in range(repeat):
        bodies = RequestBodies()
        bodies.read(previous)
        started = time.perf_counter()
        bodies.read(data)
        spent += time.perf_counter() - started
    return whole, spent / repeat


async def stream_request(base_url: str, data: bytes, headers: list[tuple[str, str]]) -> None:
    """One streamed ``chat/completions`` request on a fresh connection, read to the end."""
    url = f"{base_url}/chat/completions"
    async with open_request("POST", url, headers=headers, body=data) as response:
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {await response.read()!r}")
        async for _ in iter_sse(response.iter_bytes()):
            pass


def relay_proxy(upstream: str) -> Handler:
    """A bare HTTP relay on the runtime's HTTP stack (bench code, not the runtime): the
    request body forwarded as is and the response bytes relayed as they arrive, nothing
    parsed, checked or held, its upstream connection kept alive as the gateway's is (G17).
    What a second hop costs before the gateway does anything."""
    pool = ConnectionPool()

    async def handle(request: Request, response: ResponseWriter) -> None:
        headers = [("content-type", "application/json"), ("accept", "text/event-stream")]
        url = f"{upstream}/chat/completions"
        async with pool.request("POST", url, headers=headers, body=request.body) as up:
            await response.start(up.status, [("content-type", "text/event-stream")])
            async for data in up.iter_bytes():
                await response.send(data)
            await response.end()

    return handle


async def breakdown(
    bodies: Sequence[dict[str, Any]], settings: Settings, base: Path
) -> dict[str, Any]:
    """The runtime side alone, no worker, a Python client making a fresh connection per
    request (as Fake-Pi does): straight to the model, through a bare relay, through the
    gateway, on real request bodies of the run; and gate ``/before`` + ``/after`` pairs.

    Timed in blocks of :data:`BLOCK` back-to-back requests (so each block also pays the
    previous request's connection teardown), the targets taking turns block by block."""
    blocks = max(1, settings.breakdown // BLOCK)
    step = ToolCalls(calls=[Call(name="read", arguments={"path": FILE_NAME})])
    model = ScriptedModel(scenario=Scenario(steps=[step] * (3 * blocks * BLOCK * len(bodies))))
    rows: list[dict[str, Any]] = []
    async with trio.open_nursery() as nursery:
        up: HttpServer = await nursery.start(serve_model, model)
        upstream = f"{up.url}/v1"
        gateway = Gateway(GatewayConfig(upstream_url=upstream), MemoryStepJournal())
        served: HttpServer = await nursery.start(functools.partial(serve_gateway, gateway))
        relay: HttpServer = await nursery.start(
            functools.partial(serve_http, relay_proxy(upstream))
        )
        plain = [("content-type", "application/json")]
        targets = {
            "direct": (upstream, plain),
            "relay": (f"{relay.url}/v1", plain),
            "gateway": (
                f"{served.url}/v1",
                [*plain, ("authorization", f"Bearer {gateway.secret}")],
            ),
        }
        sent = 0
        for body in bodies:
            per: dict[str, list[float]] = {name: [] for name in targets}
            # each target's conversation grows by a message a request, as a worker's does (so
            # the gateway reads each body by difference from the last, G1a) and no body is
            # sent twice (the gateway would answer it from its journal)
            grown = {name: list(body.get("messages") or []) for name in targets}
            for block in range(blocks):
                names = list(targets)[block % 3 :] + list(targets)[: block % 3]
                for name in names:
                    url, headers = targets[name]
                    datas = []
                    for _ in range(BLOCK):
                        sent += 1
                        grown[name].append({"role": "user", "content": f"bench-{sent}"})
                        datas.append(msgspec.json.encode({**body, "messages": grown[name]}))
                    gc.collect()
                    with trio.fail_after(TURN_LIMIT):
                        started = time.perf_counter()
                        for data in datas:
                            await stream_request(url, data, headers)
                        per[name].append((time.perf_counter() - started) / BLOCK * 1e3)
                    model.requests.clear()
            direct = per["direct"]
            rows.append(
                {
                    "body_kib": len(datas[-1]) / 1024,
                    "direct_ms": Spread.of(direct),
                    "relay_ms": Spread.of(
                        [r - d for r, d in zip(per["relay"], direct, strict=True)]
                    ),
                    "gateway_ms": Spread.of(
                        [g - d for g, d in zip(per["gateway"], direct, strict=True)]
                    ),
                    "body_cpu_ms": [t * 1e3 for t in body_cpu(datas[-2], datas[-1])],
                }
            )
        log = MemoryLog()
        gate = Gate(RecordingGateJournal(log, key="bench", epoch=1, granted=("read",)))
        server: GateServer = await nursery.start(serve_gate, gate, base / "breakdown.sock")
        pairs: list[float] = []
        result = {"content": [{"type": "text", "text": FILE_TEXT}], "isError": False}
        for block in range(blocks):
            gc.collect()
            with trio.fail_after(TURN_LIMIT):
                started = time.perf_counter()
                for i in range(BLOCK):
                    call = {"tool_call_id": f"call_b{block}_{i}", "name": "read"}
                    before = await post_json(
                        str(server.path),
                        "/before",
                        {**call, "args": {"path": FILE_NAME}},
                        secret=gate.secret,
                    )
                    after = await post_json(
                        str(server.path), "/after", {**call, "result": result}, secret=gate.secret
                    )
                    if before[0] != 200 or before[1].get("decision") != "run" or after[0] != 200:
                        raise RuntimeError(f"gate breakdown: {before} {after}")
                pairs.append((time.perf_counter() - started) / BLOCK * 1e3)
        nursery.cancel_scope.cancel()
    return {"gateway": rows, "gate_pair_ms": Spread.of(pairs)}


def breakdown_report(result: dict[str, Any], settings: Settings) -> list[str]:
    blocks = max(1, settings.breakdown // BLOCK)
    lines = [
        "In-process breakdown (no worker; Python client, fresh connection per request; "
        f"{blocks} blocks of {BLOCK} back-to-back requests per target, targets taking turns; "
        "ms per request, median over blocks [min, max]):",
        "",
        "| body KiB | direct to the model | added by a bare relay proxy | added by the gateway "
        "| the body read whole (decode + digest) | read by difference from the last (G1a) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["gateway"]:
        whole, by_difference = row["body_cpu_ms"]
        lines.append(
            f"| {row['body_kib']:.0f} | {row['direct_ms'].text()} | {row['relay_ms'].text()} "
            f"| {row['gateway_ms'].text()} | {whole:.3f} | {by_difference:.3f} |"
        )
    lines += [
        "",
        f"Gate /before + /after pair, Python client (Fake-Pi's), fresh connection each: "
        f"{result['gate_pair_ms'].text()} ms per tool call.",
    ]
    return lines


# -------------------------------------------------------------------------------- report


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def text(self, spec: str = ".2f") -> str:
        return f"{self.median:{spec}} [{self.low:{spec}}, {self.high:{spec}}]"


def analyse(turns: dict[str, list[Turn]], settings: Settings) -> dict[str, Any]:
    """Per-repetition differences and ratios, then medians; CPU from totals over reps."""
    configs = tuple(turns)
    direct, gateway, gate = (turns[c] for c in CONFIGS)
    requests, calls = settings.rounds + 1, settings.rounds
    reps = len(direct)

    def cpu_per(config: str, attr: str, per: int) -> float:
        total: float = sum(getattr(t, attr) for t in turns[config])
        return total / (reps * per) * 1e3

    gateway_added = [
        (g.wall - d.wall) / requests * 1e3 for d, g in zip(direct, gateway, strict=True)
    ]
    gate_added = [(c.wall - g.wall) / calls * 1e3 for g, c in zip(gateway, gate, strict=True)]
    split: dict[str, Any] = {}
    if "gate-local" in turns:  # Pi: its side of the gate, and the runtime's round trips
        local = turns["gate-local"]
        split = {
            "pi_side_ms_per_call": Spread.of(
                [(x.wall - g.wall) / calls * 1e3 for g, x in zip(gateway, local, strict=True)]
            ),
            "round_trips_ms_per_call": Spread.of(
                [(c.wall - x.wall) / calls * 1e3 for x, c in zip(local, gate, strict=True)]
            ),
            "pi_side_worker_cpu": cpu_per("gate-local", "worker_cpu", calls)
            - cpu_per("gateway", "worker_cpu", calls),
            "round_trips_runtime_cpu": cpu_per("gate", "runtime_cpu", calls)
            - cpu_per("gate-local", "runtime_cpu", calls),
            "round_trips_worker_cpu": cpu_per("gate", "worker_cpu", calls)
            - cpu_per("gate-local", "worker_cpu", calls),
        }
    return {
        **split,
        "body_kib": Spread.of([t.body_bytes / 1024 for t in gateway]),
        "turn_ms": {c: Spread.of([t.wall * 1e3 for t in turns[c]]) for c in configs},
        "round_ms": {c: Spread.of([t.wall * 1e3 / requests for t in turns[c]]) for c in configs},
        "ratio": {
            c: Spread.of([t.wall / d.wall for t, d in zip(turns[c], direct, strict=True)])
            for c in configs
        },
        "runtime_cpu_ms_per_request": {c: cpu_per(c, "runtime_cpu", requests) for c in configs},
        "worker_cpu_ms_per_request": {c: cpu_per(c, "worker_cpu", requests) for c in configs},
        "gateway_ms_per_request": Spread.of(gateway_added),
        "gate_ms_per_call": Spread.of(gate_added),
        "gateway_runtime_cpu": cpu_per("gateway", "runtime_cpu", requests)
        - cpu_per("direct", "runtime_cpu", requests),
        "gateway_worker_cpu": cpu_per("gateway", "worker_cpu", requests)
        - cpu_per("direct", "worker_cpu", requests),
        "gate_runtime_cpu": cpu_per("gate", "runtime_cpu", calls)
        - cpu_per("gateway", "runtime_cpu", calls),
        "gate_worker_cpu": cpu_per("gate", "worker_cpu", calls)
        - cpu_per("gateway", "worker_cpu", calls),
    }


def verdict(spread: Spread) -> str:
    if spread.median <= TARGET_MS:
        return "met" if spread.high <= TARGET_MS else "met (median)"
    return "missed"


def report(kind: str, result: dict[str, Any], settings: Settings) -> list[str]:
    label = KIND_LABEL[kind]
    lines = [
        f"{label}: {settings.rounds} rounds per turn ({settings.rounds + 1} model requests, "
        f"{settings.rounds} read calls), {settings.reps} measured turns per configuration; "
        f"the last request body of a turn grew from {result['body_kib'].low:.0f} to "
        f"{result['body_kib'].high:.0f} KiB",
        "",
        "| configuration | turn ms, median [min, max] | ms per request | ratio to direct "
        "| runtime CPU ms/request | worker CPU ms/request |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for config in result["turn_ms"]:
        lines.append(
            f"| {config} | {result['turn_ms'][config].text('.0f')} "
            f"| {result['round_ms'][config].median:.2f} "
            f"| {result['ratio'][config].text('.3f')} "
            f"| {result['runtime_cpu_ms_per_request'][config]:.2f} "
            f"| {result['worker_cpu_ms_per_request'][config]:.2f} |"
        )
    gateway, gate = result["gateway_ms_per_request"], result["gate_ms_per_call"]
    lines += [
        "",
        "| crossing | added ms, median [min, max] | runtime CPU ms | worker CPU ms "
        f"| target ≤ {TARGET_MS:g} ms |",
        "|---|---:|---:|---:|---|",
        f"| gateway, per model request | {gateway.text()} | {result['gateway_runtime_cpu']:.2f} "
        f"| {result['gateway_worker_cpu']:.2f} | {verdict(gateway)} |",
        f"| gate, per tool call (/before + /after) | {gate.text()} "
        f"| {result['gate_runtime_cpu']:.2f} | {result['gate_worker_cpu']:.2f} "
        f"| {verdict(gate)} |",
    ]
    if "pi_side_ms_per_call" in result:
        lines += [
            f"| … of it Pi's side: its extension answering itself (gate-local - gateway) "
            f"| {result['pi_side_ms_per_call'].text()} | — "
            f"| {result['pi_side_worker_cpu']:.2f} | |",
            f"| … of it the round trips to the runtime (gate - gate-local) "
            f"| {result['round_trips_ms_per_call'].text()} "
            f"| {result['round_trips_runtime_cpu']:.2f} "
            f"| {result['round_trips_worker_cpu']:.2f} | |",
        ]
    return lines


def to_json(result: dict[str, Any]) -> dict[str, Any]:
    def plain(value: Any) -> Any:
        if isinstance(value, Spread):
            return value.__dict__
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    return {k: plain(v) for k, v in result.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.boundaries", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--kind", choices=("pi", "fake", "both"), default="both")
    parser.add_argument("--rounds", type=int, help="tool rounds per turn (default 30, quick 5)")
    parser.add_argument("--reps", type=int, help="measured turns per configuration (default 7)")
    parser.add_argument("--pi-home", help="where Pi is installed (default: the runtime's cache)")
    parser.add_argument("--json", help="also write every figure to this JSON file")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    settings = dataclasses.replace(
        settings, rounds=args.rounds or settings.rounds, reps=args.reps or settings.reps
    )
    kinds = KINDS if args.kind == "both" else (args.kind,)
    pi = find_real_pi(args.pi_home) if "pi" in kinds else None
    if "pi" in kinds and pi is None:
        raise SystemExit(
            "Pi is not installed; run `.venv/bin/pi-runtime pi install` or pass --pi-home"
        )

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    print("pi-runtime boundary benchmark: gateway and gate" + (" (quick)" if args.quick else ""))
    print(f"  date: {time.strftime('%Y-%m-%d %H:%M:%S %z')}")
    print(f"  cpus: {os.cpu_count()}, python {platform.python_version()}, trio {trio.__version__}")
    if pi is not None:
        print(f"  pi: {pi.version} at {pi.home}")
    print(f"  background load before: {background_load()}")
    base = Path(tempfile.mkdtemp(prefix="bench-bnd-"))  # short: a socket path is ≤ 107 bytes
    os.chmod(base, 0o700)
    results: dict[str, dict[str, Any]] = {}
    raw: dict[str, Any] = {}
    bodies: list[dict[str, Any]] = []
    stalls: dict[str, dict[str, float]] = {}
    started = time.perf_counter()
    try:
        for kind in kinds:
            pressure = pressure_totals()
            turns, samples = trio.run(measure_kind, kind, base, settings, pi, log)
            stalls[kind] = pressure_since(pressure)
            results[kind] = analyse(turns, settings)
            raw[kind] = {c: [t.__dict__ for t in turns[c]] for c in turns}
            bodies = samples  # the last kind's (Pi's, when it ran): real bodies
        log("  in-process breakdown")
        tiny = {
            "model": "fake-model",
            "stream": True,
            "messages": [{"role": "user", "content": "go"}],
        }
        split = trio.run(breakdown, [tiny, *bodies], settings, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"  background load after: {background_load()}")
    for kind, load in stalls.items():
        text = ", ".join(f"{k} {v:.0f}%" for k, v in load.items())
        print(f"  {KIND_LABEL[kind]}: time some task stalled waiting ({text})")
    print(f"  measured in {time.perf_counter() - started:.0f}s")
    for kind in kinds:
        print()
        print("\n".join(report(kind, results[kind], settings)))
    print()
    print("\n".join(breakdown_report(split, settings)))
    print()
    print(
        "Added ms per crossing = (turn with the boundary - turn without) / crossings per turn, "
        "per repetition; CPU columns = CPU summed over all repetitions / crossings. "
        "Informational only: nothing asserts."
    )
    if args.json:
        data = {kind: to_json(result) for kind, result in results.items()}
        data["turns"] = raw
        data["breakdown"] = to_json(split)
        data["settings"] = settings.__dict__
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
