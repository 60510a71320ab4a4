"""Room-lane benchmarks of issue #5 with subprocess Fake-Pi workers: runtime CPU per tool
round, replay of pending deliveries to their results, and memory per idle lane.

Run it from the repository root::

    .venv/bin/python -m bench.lane_rounds                  # all three, 3-5 minutes
    .venv/bin/python -m bench.lane_rounds rounds replay    # some of them
    .venv/bin/python -m bench.lane_rounds --quick          # a smoke run, about a minute

Everything runs through :func:`~runtime._rooms._worker.open_room_worker` with ``agent =
"fake"``: every lane's worker is a Fake-Pi subprocess behind the lane's own gateway and gate,
on a real state directory. The scripted model is a subprocess too (``python -m
fake_pi.model_server``), so this process's CPU and memory are the runtime's alone.

* **rounds** — runtime CPU per tool round; target ≤ 1 ms, fsync excluded. A tool round is
  what the runtime does for one gated tool call (gate ``/before`` and ``/after``, the tool's
  intent and outcome made durable) plus the model request carrying its result (the gateway's
  barrier, its relay of request and response, the step's intent and response made durable,
  the worker's events read). Each measured delivery is a turn of ``R`` rounds (each a model
  response with one ``read`` call of a small file) and a final text; its baseline is a
  delivery whose turn is the final text alone. Both run in a fresh room (a fresh session and
  worker), so CPU per round = (CPU of the ``R``-round delivery - CPU of the baseline) / ``R``:
  admission, worker launch, prompt, result and publication cancel out. CPU is this process's
  (``getrusage``, every thread) from ``deliver`` to the published result. The deliveries run
  with real syncs and with ``os.fsync``/``os.fdatasync`` replaced by no-ops in this process,
  alternating, the order rotated each repetition. The idle worker is stopped between
  deliveries, outside the measurement. A profiled pair at the end (main thread only,
  ``cProfile`` timed by thread CPU, no-op syncs) says where the time goes.
* **replay** — replay to result of ``N`` pending deliveries (default 100 over 10 rooms, the
  default live-worker cap of 4): a state directory where ``N`` deliveries were admitted and
  the host stopped before any lane ran is reopened, and the time from ``open_room_worker`` to
  the ``N``-th published result is taken; the baseline is the same ``N`` deliveries admitted
  and run on a fresh state directory, from ``open_room_worker`` to the ``N``-th result, in
  the same run, alternating. The workers' CPU (reaped children) and epochs are shown too.
* **memory** — runtime memory per idle lane; target ≤ 64 KiB, the worker process excluded.
  In a child process of its own: ``W`` warm-up rooms, then ``N`` more, each with one
  delivery; once every result is in, every worker is stopped (idle stop and the live-worker
  cap), and only what the runtime keeps for an idle lane remains. One child measures RSS
  (``VmRSS`` after ``W + N`` lanes - after ``W``, divided by ``N``; default ``N`` = 100),
  without tracing; another traces with ``tracemalloc`` (16 frames, from the warm-up on; slow,
  so fewer lanes, default 40): what was allocated and is still held per lane, grouped by
  the innermost ``runtime/`` function and by line, and gc-tracked objects by type.

Nothing asserts a time or a size: targets print as met or missed for information. Every
server binds 127.0.0.1 or a private Unix socket; every process started is stopped (the
workers by the room worker, the model servers and children here). Each phase is bounded by
``LIMIT``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import cProfile
import functools
import gc
import json
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec
import trio

from bench.journal import background_load
from fake_pi.scenario import Call, Scenario, Step, Text, ToolCalls
from runtime._config import Caps, ModelConfig, RoomWorkerConfig, Thresholds
from runtime._records import (
    ModelRequestIntent,
    ModelResponse,
    Outcome,
    ToolIntent,
    ToolOutcome,
)
from runtime._rooms._admission import Author, Delivery
from runtime._rooms._worker import RoomWorker, open_room_worker
from runtime._wire import DeliveryResult

REPO: Final = Path(__file__).resolve().parents[1]
TARGET_ROUND_MS: Final = 1.0
TARGET_LANE_KIB: Final = 64.0
GRANTS: Final = frozenset({"send_text_update", "read"})
FILE_TEXT: Final = "lane-rounds-marker\n" + "".join(f"line {i}: a small file\n" for i in range(8))
LIMIT: Final = 600.0
"""Seconds any one phase may take before the bench gives up (a bound, not a measurement)."""
KINDS: Final = ("rounds", "replay", "memory")


# ------------------------------------------------------------------------------ common


def process_cpu() -> float:
    """User + system CPU seconds of this process (the runtime), every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def children_cpu() -> float:
    """User + system CPU seconds of this process's children that ended and were reaped."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def rss_bytes() -> int:
    """This process's resident set size (``VmRSS``)."""
    for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def count_tasks() -> int:
    """Every Trio task of this run."""
    count = 0
    root = trio.lowlevel.current_root_task()
    pending = [root] if root is not None else []
    while pending:
        task = pending.pop()
        count += 1
        for nursery in task.child_nurseries:
            pending.extend(nursery.child_tasks)
    return count


@contextlib.contextmanager
def no_sync(active: bool = True) -> Iterator[None]:
    """``os.fsync`` and ``os.fdatasync`` as no-ops in this process while active (bench only):
    the store's ``OsFileSystem``, the session fsyncs and directory syncs all go through them;
    every other step (encode, hand-off, ``write``, acknowledge) still runs."""
    if not active:
        yield
        return
    saved = os.fsync, os.fdatasync

    def skip(fd: Any) -> None:
        return None

    os.fsync = os.fdatasync = skip
    try:
        yield
    finally:
        os.fsync, os.fdatasync = saved


@contextlib.asynccontextmanager
async def open_upstream(steps: Sequence[Step], directory: Path) -> AsyncIterator[str]:
    """The scripted model as a subprocess on loopback, answering ``steps`` in order (then
    plainly): its base URL (``…/v1``). Stopped when the block ends."""
    scenario = directory / "scenario.json"
    scenario.write_bytes(Scenario(steps=list(steps)).dump_json())
    command = [
        sys.executable,
        "-m",
        "fake_pi.model_server",
        "--host",
        "127.0.0.1",
        "--scenario",
        str(scenario),
        "--max-seconds",
        str(LIMIT * 2),
    ]
    process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, cwd=REPO)
    try:
        assert process.stdout is not None
        line = b""
        with trio.fail_after(30):
            while not line.endswith(b"\n"):
                data = await process.stdout.receive_some()
                if not data:
                    raise SystemExit("the model server ended before listening")
                line += data
        url = line.decode().strip().rsplit(" ", 1)[1]
        yield url
    finally:
        with trio.CancelScope(shield=True):
            process.terminate()
            with trio.move_on_after(5):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()


def make_config(
    url: str, *, caps: Caps | None = None, idle_stop: float = 600.0
) -> RoomWorkerConfig:
    return RoomWorkerConfig(
        agent="fake",
        model=ModelConfig(base_url=url),
        default_grants=GRANTS,
        caps=caps or Caps(),
        thresholds=Thresholds(idle_stop_seconds=idle_stop),
    )


def make_delivery(delivery_id: str, room: str, text: str) -> Delivery:
    return Delivery(
        delivery_id=delivery_id,
        room=room,
        author=Author(id="u1", name="Ann"),
        message_id=f"m-{delivery_id}",
        text=text,
    )


@contextlib.asynccontextmanager
async def open_bench_worker(config: RoomWorkerConfig, base: Path) -> AsyncIterator[RoomWorker]:
    """:func:`open_room_worker`, its events read and dropped as a client would (unread, up
    to ``EVENT_BUFFER`` of them would stay in this process's memory)."""
    async with open_room_worker(config, base_dir=base) as worker, trio.open_nursery() as nursery:

        async def drain() -> None:
            async for _event in worker.events():
                pass

        nursery.start_soon(drain)
        yield worker
        nursery.cancel_scope.cancel()


async def collect(results: AsyncIterator[DeliveryResult], count: int) -> list[DeliveryResult]:
    found: list[DeliveryResult] = []
    async for result in results:
        found.append(result)
        if len(found) == count:
            break
    return found


async def all_workers_stopped(worker: RoomWorker) -> None:
    """Wait until no lane has a live worker (the live-worker set is the host's own)."""
    while worker._live:
        await worker._live_changed.wait()


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


def verdict(value: float, target: float) -> str:
    return "met" if value <= target else "MISSED"


# ---------------------------------------------------------------------- rounds: CPU


@dataclass(frozen=True)
class RoundsSettings:
    rounds: int
    reps: int


@dataclass(frozen=True)
class Planned:
    index: int
    synced: bool
    rounds: int

    @property
    def delivery_id(self) -> str:
        return f"d{self.index}"

    @property
    def room(self) -> str:
        return f"dm:round{self.index}"

    @property
    def final(self) -> str:
        return f"done {self.index}"


@dataclass(frozen=True)
class Measured:
    planned: Planned
    cpu: float
    wall: float
    records: dict[str, int]


def plan_rounds(settings: RoundsSettings) -> list[Planned]:
    """Per repetition: baseline and ``R`` rounds, with real and no-op syncs; the order of
    the four rotates every repetition."""
    kinds = [(True, 0), (True, settings.rounds), (False, 0), (False, settings.rounds)]
    plan: list[Planned] = []
    for rep in range(settings.reps):
        turn = kinds[rep % 4 :] + kinds[: rep % 4]
        for synced, rounds in turn:
            plan.append(Planned(len(plan), synced, rounds))
    return plan


def steps_for(plan: Sequence[Planned], read_path: Path) -> list[Step]:
    steps: list[Step] = []
    for planned in plan:
        call = ToolCalls(calls=[Call(name="read", arguments={"path": str(read_path)})])
        steps.extend([call] * planned.rounds)
        steps.append(Text(text=planned.final))
    return steps


async def count_records(worker: RoomWorker, delivery_id: str) -> dict[str, int]:
    records = (await worker.store.read_delivery_log(delivery_id)).records
    kinds = (ModelRequestIntent, ModelResponse, ToolIntent, ToolOutcome)
    counts = {kind.__name__: sum(isinstance(r, kind) for r in records) for kind in kinds}
    counts["all"] = len(records)
    return counts


async def run_planned(
    worker: RoomWorker,
    results: AsyncIterator[DeliveryResult],
    planned: Planned,
    profiler: cProfile.Profile | None = None,
) -> Measured:
    gc.collect()
    with no_sync(not planned.synced):
        if profiler is not None:
            profiler.enable()
        cpu = process_cpu()
        start = time.perf_counter()
        await worker.deliver(make_delivery(planned.delivery_id, planned.room, "go"))
        (result,) = await collect(results, 1)
        wall = time.perf_counter() - start
        cpu = process_cpu() - cpu
        if profiler is not None:
            profiler.disable()
    if (result.delivery_id, result.outcome, result.text) != (
        planned.delivery_id,
        Outcome.REPLY,
        planned.final,
    ):
        raise SystemExit(f"unexpected result {result} for {planned}")
    records = await count_records(worker, planned.delivery_id)
    if records["ToolOutcome"] != planned.rounds:
        raise SystemExit(f"{planned}: {records}")
    worker._lanes[planned.room].stop_worker()  # outside the measurement
    await all_workers_stopped(worker)
    return Measured(planned, cpu, wall, records)


@dataclass(frozen=True)
class Profile:
    own: Counter[str]
    """Own time (tottime) by where the code lives."""
    runtime: Counter[str]
    """Cumulative time of each function in ``runtime/`` (nested: they do not add up)."""


def read_profile(profiler: cProfile.Profile) -> Profile:
    """Own time by where the code lives (a file of this repository, a package, the standard
    library, or a C function by name), and cumulative time of the runtime's functions."""
    purelib = sysconfig.get_paths()["purelib"]
    stdlib = sysconfig.get_paths()["stdlib"]
    own: Counter[str] = Counter()
    runtime: Counter[str] = Counter()
    table: dict[tuple[str, int, str], tuple[Any, ...]] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    for (filename, _line, name), (_cc, _nc, tottime, cumtime, _callers) in table.items():
        if filename == "~":
            key = f"C: {name}"
        elif filename.startswith(purelib):
            key = Path(filename).relative_to(purelib).parts[0]
        elif filename.startswith(str(REPO)):
            key = str(Path(filename).relative_to(REPO))
            if key.startswith("runtime/"):
                runtime[f"{key}:{name}"] += cumtime
        elif filename.startswith(stdlib):
            key = f"stdlib: {Path(filename).relative_to(stdlib)}"
        else:
            key = filename
        own[key] += tottime
    return Profile(own, runtime)


async def profile_pair(
    worker: RoomWorker, results: AsyncIterator[DeliveryResult], pair: Sequence[Planned]
) -> dict[str, list[tuple[str, float]]]:
    """Per round: (profile of the ``R``-round delivery - profile of its baseline) / ``R``,
    largest first; own time by group, and cumulative time of runtime functions."""
    by_rounds: dict[int, Profile] = {}
    for planned in pair:
        profiler = cProfile.Profile(time.thread_time)  # this thread's CPU, not wall time
        await run_planned(worker, results, planned, profiler)
        by_rounds[planned.rounds] = read_profile(profiler)
    rounds = max(by_rounds)
    measured, baseline = by_rounds[rounds], by_rounds[0]
    out: dict[str, list[tuple[str, float]]] = {}
    for name in ("own", "runtime"):
        full, base = getattr(measured, name), getattr(baseline, name)
        per_round = {k: (full[k] - base.get(k, 0.0)) / rounds for k in full}
        out[name] = sorted(per_round.items(), key=lambda item: -item[1])
    return out


async def rounds_bench(settings: RoundsSettings, log: Callable[[str], None]) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="bench-lane-rounds-"))
    try:
        read_path = base / "notes.txt"
        read_path.write_text(FILE_TEXT, encoding="utf-8")
        plan = plan_rounds(settings)
        # unmeasured warm-up (imports, first-use caches), then the plan, then a profiled pair
        warm = [Planned(len(plan), True, 0), Planned(len(plan) + 1, True, settings.rounds)]
        profiled = [
            Planned(len(plan) + 2, False, 0),
            Planned(len(plan) + 3, False, settings.rounds),
        ]
        steps = steps_for([*warm, *plan, *profiled], read_path)
        with trio.fail_after(LIMIT):
            async with (
                open_upstream(steps, base) as url,
                open_bench_worker(make_config(url), base) as worker,
            ):
                results = worker.results()
                for planned in warm:
                    await run_planned(worker, results, planned)
                measured: list[Measured] = []
                for planned in plan:
                    measured.append(await run_planned(worker, results, planned))
                    log(
                        f"  rounds: {planned.index + 1}/{len(plan)} "
                        f"({'sync' if planned.synced else 'no sync'}, {planned.rounds} rounds) "
                        f"{measured[-1].cpu * 1e3:.0f} ms CPU"
                    )
                profile = await profile_pair(worker, results, profiled)
        return analyse_rounds(settings, measured, profile)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def analyse_rounds(
    settings: RoundsSettings, measured: list[Measured], profile: dict[str, list[tuple[str, float]]]
) -> dict[str, Any]:
    by: dict[tuple[bool, int, int], Measured] = {}
    for m in measured:
        rep = m.planned.index // 4
        by[(m.planned.synced, m.planned.rounds, rep)] = m
    out: dict[str, Any] = {"rounds": settings.rounds, "reps": settings.reps}
    for synced in (True, False):
        label = "sync" if synced else "no_sync"
        cpu_per, wall_per, base_cpu, base_wall, full_cpu = [], [], [], [], []
        for rep in range(settings.reps):
            base, full = by[(synced, 0, rep)], by[(synced, settings.rounds, rep)]
            cpu_per.append((full.cpu - base.cpu) / settings.rounds * 1e3)
            wall_per.append((full.wall - base.wall) / settings.rounds * 1e3)
            base_cpu.append(base.cpu * 1e3)
            base_wall.append(base.wall * 1e3)
            full_cpu.append(full.cpu * 1e3)
        out[label] = {
            "cpu_ms_per_round": Spread.of(cpu_per),
            "wall_ms_per_round": Spread.of(wall_per),
            "baseline_cpu_ms": Spread.of(base_cpu),
            "baseline_wall_ms": Spread.of(base_wall),
            "turn_cpu_ms": Spread.of(full_cpu),
        }
    sample = next(m for m in measured if m.planned.rounds == settings.rounds)
    base_sample = next(m for m in measured if m.planned.rounds == 0)
    out["records_per_round"] = {
        k: (sample.records[k] - base_sample.records[k]) / settings.rounds for k in sample.records
    }
    out["profile"] = profile
    return out


def report_rounds(result: dict[str, Any]) -> list[str]:
    rounds = result["rounds"]
    lines = [
        f"## rounds: runtime CPU per tool round ({rounds} rounds per measured turn, "
        f"{result['reps']} repetitions; median [min, max])",
        "",
        "| syncs | CPU ms / round | wall ms / round | baseline turn CPU ms | "
        f"{rounds}-round turn CPU ms | baseline turn wall ms | ≤ {TARGET_ROUND_MS:g} ms? |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for label, name in (("sync", "real"), ("no_sync", "no-op")):
        r = result[label]
        cpu: Spread = r["cpu_ms_per_round"]
        lines.append(
            f"| {name} | {cpu.text()} | {r['wall_ms_per_round'].text()} | "
            f"{r['baseline_cpu_ms'].text('.1f')} | {r['turn_cpu_ms'].text('.1f')} | "
            f"{r['baseline_wall_ms'].text('.0f')} | {verdict(cpu.median, TARGET_ROUND_MS)} |"
        )
    per = result["records_per_round"]
    lines += [
        "",
        "Durable records per round (delivery log): "
        + ", ".join(f"{k} {v:g}" for k, v in per.items()),
        "",
        "Where a round's main-thread CPU goes (cProfile timed by thread CPU, no-op syncs;",
        "the profiler inflates the times, the shares are what counts). Own time per round:",
        "",
        "| where | ms / round | share |",
        "|---|---:|---:|",
    ]
    own: list[tuple[str, float]] = result["profile"]["own"]
    total = sum(v for _, v in own if v > 0)
    for key, value in own[:16]:
        lines.append(f"| {key} | {value * 1e3:.3f} | {value / total * 100:.0f}% |")
    lines += [
        f"| (all, positive groups) | {total * 1e3:.3f} | 100% |",
        "",
        "Cumulative time per round of runtime functions (nested: they do not add up):",
        "",
        "| function | ms / round | share of all |",
        "|---|---:|---:|",
    ]
    for key, value in result["profile"]["runtime"][:24]:
        lines.append(f"| {key} | {value * 1e3:.3f} | {value / total * 100:.0f}% |")
    return lines


# ---------------------------------------------------------------------- replay


@dataclass(frozen=True)
class ReplaySettings:
    deliveries: int
    rooms: int
    reps: int
    live_workers: int
    """``caps.max_live_workers``; by default one per room (see the note on the cap below)."""
    idle_stop: float


def replay_deliveries(settings: ReplaySettings) -> list[Delivery]:
    return [
        make_delivery(f"d{n}", f"dm:replay{n % settings.rooms}", f"message {n}")
        for n in range(settings.deliveries)
    ]


class _Idle:
    """Stands in for the room worker's nursery while admitting: no lane ever runs."""

    def start_soon(self, *args: Any, **kwargs: Any) -> None:
        return None


async def admit_only(config: RoomWorkerConfig, base: Path, deliveries: list[Delivery]) -> None:
    """Admit every delivery, then stop the host before any lane ran (bench only)."""
    async with open_room_worker(config, base_dir=base) as worker:
        nursery = worker._nursery
        worker._nursery = _Idle()  # type: ignore[assignment]
        try:
            for delivery in deliveries:
                await worker.deliver(delivery)
        finally:
            worker._nursery = nursery
    leftovers = list((base / "state" / "deliveries").iterdir())
    if leftovers:
        raise SystemExit(f"a lane ran while admitting: {leftovers[:3]}")


async def run_to_results(
    config: RoomWorkerConfig, base: Path, deliveries: list[Delivery] | None, count: int
) -> dict[str, float]:
    """From ``open_room_worker`` to the ``count``-th result: admitting ``deliveries`` first
    (fresh) or none (replay)."""
    gc.collect()
    workers_cpu = children_cpu()
    cpu = process_cpu()
    start = time.perf_counter()
    async with open_bench_worker(config, base) as worker:
        opened = time.perf_counter() - start
        if deliveries is not None:
            for delivery in deliveries:
                await worker.deliver(delivery)
        admitted = time.perf_counter() - start
        found = await collect(worker.results(), count)
        wall = time.perf_counter() - start
        cpu = process_cpu() - cpu
        epochs = sum(lane.epochs for lane in worker._lanes.values())
    workers_cpu = children_cpu() - workers_cpu  # every worker is reaped once the block ends
    bad = [r for r in found if r.outcome is not Outcome.REPLY]
    if len({r.delivery_id for r in found}) != count or bad:
        raise SystemExit(f"expected {count} replies, got {len(found)}; not replies: {bad[:3]}")
    return {
        "wall": wall,
        "cpu": cpu,
        "workers_cpu": workers_cpu,
        "epochs": epochs,
        "opened": opened,
        "admitted": admitted,
    }


async def replay_bench(settings: ReplaySettings, log: Callable[[str], None]) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="bench-lane-replay-"))
    deliveries = replay_deliveries(settings)
    runs: dict[str, list[dict[str, float]]] = {"fresh": [], "replay": []}
    try:
        with trio.fail_after(LIMIT):
            async with open_upstream([], root) as url:
                caps = Caps(
                    queue_limit=settings.deliveries + 1, max_live_workers=settings.live_workers
                )
                config = make_config(url, caps=caps, idle_stop=settings.idle_stop)
                # warm-up: a few deliveries, unmeasured
                await run_to_results(config, root / "warm", deliveries[:4], 4)
                for rep in range(settings.reps):
                    order = ("fresh", "replay") if rep % 2 == 0 else ("replay", "fresh")
                    for kind in order:
                        base = root / f"{kind}-{rep}"
                        if kind == "replay":
                            await admit_only(config, base, deliveries)
                            run = await run_to_results(config, base, None, settings.deliveries)
                        else:
                            run = await run_to_results(
                                config, base, deliveries, settings.deliveries
                            )
                        runs[kind].append(run)
                        shutil.rmtree(base, ignore_errors=True)
                        log(f"  replay: rep {rep + 1}, {kind}: {run['wall']:.2f} s")
        return {"settings": settings, "runs": runs}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report_replay(result: dict[str, Any]) -> list[str]:
    settings: ReplaySettings = result["settings"]
    runs: dict[str, list[dict[str, float]]] = result["runs"]
    n = settings.deliveries
    lines = [
        f"## replay: {n} pending deliveries over {settings.rooms} rooms to their results "
        f"({settings.reps} repetitions, live-worker cap {settings.live_workers}, idle stop "
        f"{settings.idle_stop:g} s; median [min, max])",
        "",
        "| run | open → last result, s | ms / delivery | runtime CPU ms / delivery "
        "| workers' CPU s | worker epochs | open (recovery) ms | deliver() calls done, ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def spread(kind: str, key: str, scale: float = 1.0) -> Spread:
        return Spread.of([x[key] * scale for x in runs[kind]])

    for kind in ("fresh", "replay"):
        lines.append(
            f"| {kind} | {spread(kind, 'wall').text()} "
            f"| {spread(kind, 'wall', 1e3 / n).text('.1f')} "
            f"| {spread(kind, 'cpu', 1e3 / n).text('.1f')} "
            f"| {spread(kind, 'workers_cpu').text('.1f')} | {spread(kind, 'epochs').text('.0f')} "
            f"| {spread(kind, 'opened', 1e3).text('.1f')} "
            f"| {spread(kind, 'admitted', 1e3).text('.0f')} |"
        )
    ratios = [b["wall"] / a["wall"] for a, b in zip(runs["fresh"], runs["replay"], strict=True)]
    lines += ["", f"replay / fresh, per repetition: {Spread.of(ratios).text()}"]
    return lines


# ---------------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemorySettings:
    lanes: int
    """Idle lanes measured by RSS (after the warm-up ones)."""
    warm: int
    traced_lanes: int
    """Idle lanes measured by ``tracemalloc`` (deep tracebacks cost ~0.5 s of CPU a lane)."""
    rounds: int = 0
    """Tool rounds in each lane's one turn (0: a plain reply). With rounds, one worker runs
    at a time, so that each lane's turn takes the scripted steps in order."""


TRACE_FRAMES: Final = 16
COMPONENTS: Final = (
    (
        "the lane's gateway: its server, tasks and Gateway",
        ("_gateway.py:serve_gateway", "_http.py:serve_http", "_gateway.py:Gateway."),
    ),
    ("the lane's gate: its server, tasks and Gate", ("_gate.py:serve_gate", "_gate.py:Gate.")),
    ("open_boundaries: the nursery holding both", ("_boundary.py:open_boundaries",)),
    (
        "the last delivery's journals, kept attached",
        (
            "_boundary.py:_journals",
            "_gate.py:RecordingGateJournal",
            "_gate.py:_parse",
            "_gate.py:canonical_args",
            "_gateway.py:DeliveryStepJournal",
            "_stream.py:request_digest",
            "_http.py:iter_sse",
        ),
    ),
    ("the room's slot (_Slot)", ("_lanes.py:_Slot",)),
    ("the lane: object, task, idle wait", ("_lanes.py:Lane", "_room_worker.py:RoomWorker._lane")),
)
"""Parts of an idle lane, by the innermost ``runtime/`` function that allocated (prefixes
below ``runtime/``)."""


def component_of(function: str) -> str:
    for label, prefixes in COMPONENTS:
        if function.removeprefix("runtime/").startswith(prefixes):
            return label
    return "elsewhere in runtime/" if function.startswith("runtime/") else "not under runtime/"


@functools.cache
def _functions(filename: str) -> list[tuple[int, int, str]]:
    """``(first line, last line, qualified name)`` of every function in a source file."""
    found: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    found.append((child.lineno, child.end_lineno or child.lineno, name))
                visit(child, f"{name}.")

    visit(ast.parse(Path(filename).read_text(encoding="utf-8")), "")
    return found


def function_at(filename: str, line: int) -> str:
    """The innermost function of ``filename`` holding ``line``."""
    spans = [f for f in _functions(filename) if f[0] <= line <= f[1]]
    return min(spans, key=lambda f: f[1] - f[0])[2] if spans else "<module>"


def first_runtime_frame(trace: tracemalloc.Traceback) -> tuple[str, str]:
    """The innermost frame in ``runtime/`` of an allocation (where the runtime asked for
    it) as ``(file:function, file:line)``, else its innermost frame twice."""
    for frame in reversed(trace):  # a Traceback lists the oldest frame first
        if frame.filename.startswith(f"{REPO}/runtime/"):
            rel = Path(frame.filename).relative_to(REPO)
            where = f"{rel}:{function_at(frame.filename, frame.lineno)}"
            return where, f"{rel}:{frame.lineno}"
    return str(trace[-1]), str(trace[-1])


def object_counts() -> Counter[str]:
    return Counter(type(o).__qualname__ for o in gc.get_objects())


async def idle_lanes(
    worker: RoomWorker, results: AsyncIterator[DeliveryResult], first: int, count: int
) -> None:
    """``count`` new rooms, one delivery each; returns once every result is in and every
    worker is stopped (idle stop and the live-worker cap), so the lanes are idle."""
    for n in range(first, first + count):
        await worker.deliver(make_delivery(f"d{n}", f"dm:m{n}", "hello"))
    await collect(results, count)
    await all_workers_stopped(worker)
    if any(lane._room is None or lane._room.live is not None for lane in worker._lanes.values()):
        raise SystemExit("a lane is not idle with its worker stopped")
    gc.collect()


def memory_point(lanes: int) -> dict[str, Any]:
    return {
        "lanes": lanes,
        "rss": rss_bytes(),
        "fds": open_fds(),
        "tasks": count_tasks(),
    }


async def memory_child(settings: MemorySettings, mode: str) -> dict[str, Any]:
    """Measured in a process of its own (see :func:`memory_bench`)."""
    tracing = mode == "trace"
    lanes = settings.traced_lanes if tracing else settings.lanes
    root = Path(tempfile.mkdtemp(prefix="bench-lane-memory-"))
    first = root / "first.snapshot"
    points: list[dict[str, Any]] = []
    counts: list[Counter[str]] = []
    steps: list[Step] = []
    if settings.rounds:
        read_path = root / "notes.txt"
        read_path.write_text(FILE_TEXT, encoding="utf-8")
        call = ToolCalls(calls=[Call(name="read", arguments={"path": str(read_path)})])
        turn: list[Step] = [*[call] * settings.rounds, Text(text="done")]
        steps = turn * (settings.warm + lanes)
    caps = Caps(max_live_workers=1 if settings.rounds else 4)
    try:
        with trio.fail_after(LIMIT):
            async with open_upstream(steps, root) as url:
                config = make_config(url, caps=caps, idle_stop=0.2)
                async with open_bench_worker(config, root) as worker:
                    results = worker.results()
                    await idle_lanes(worker, results, 0, settings.warm)
                    if tracing:
                        tracemalloc.start(TRACE_FRAMES)
                    points.append(memory_point(settings.warm))
                    if tracing:  # counted before, and kept on disk: not in what follows
                        counts.append(object_counts())
                        tracemalloc.take_snapshot().dump(str(first))
                    await idle_lanes(worker, results, settings.warm, lanes)
                    points.append(memory_point(settings.warm + lanes))
                    if tracing:
                        counts.append(object_counts())
                        last = tracemalloc.take_snapshot()
                        tracemalloc.stop()
        out: dict[str, Any] = {"lanes": lanes, "points": points}
        if tracing:
            out |= analyse_traces(tracemalloc.Snapshot.load(str(first)), last)
            out["objects"] = (counts[1] - counts[0]).most_common(30)
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def analyse_traces(first: tracemalloc.Snapshot, last: tracemalloc.Snapshot) -> dict[str, Any]:
    """What was allocated between the snapshots and is still held (the snapshots' own
    allocations left out): in all, by runtime function, by line."""
    keep = [tracemalloc.Filter(False, tracemalloc.__file__)]
    before, after = first.filter_traces(keep), last.filter_traces(keep)
    sizes: Counter[str] = Counter()
    blocks: Counter[str] = Counter()
    lines: dict[str, Counter[str]] = {}
    held = 0
    for stat in after.compare_to(before, "traceback"):
        function, line = first_runtime_frame(stat.traceback)
        sizes[function] += stat.size_diff
        blocks[function] += stat.count_diff
        lines.setdefault(function, Counter())[line] += stat.size_diff
        held += stat.size_diff
    return {
        "held": held,
        "by_runtime_function": [
            (k, v, blocks[k], [line for line, _ in lines[k].most_common(3)])
            for k, v in sizes.most_common()
        ],
        "by_line": [
            (str(stat.traceback[-1]), stat.size_diff, stat.count_diff)
            for stat in after.compare_to(before, "lineno")[:20]
        ],
    }


async def memory_bench(settings: MemorySettings, log: Callable[[str], None]) -> dict[str, Any]:
    """Two children: one without ``tracemalloc`` (RSS undisturbed by tracing), one tracing
    with deep tracebacks on fewer lanes (bytes, and which runtime code allocated them)."""
    out: dict[str, Any] = {"settings": settings}
    for mode in ("rss", "trace"):
        command = [
            sys.executable,
            "-m",
            "bench.lane_rounds",
            "--memory-child",
            mode,
            "--lanes",
            str(settings.lanes),
            "--warm",
            str(settings.warm),
            "--traced-lanes",
            str(settings.traced_lanes),
            "--memory-rounds",
            str(settings.rounds),
        ]
        start = time.perf_counter()
        with trio.fail_after(LIMIT):
            done = await trio.run_process(command, capture_stdout=True, cwd=REPO)
        out[mode] = json.loads(done.stdout)
        log(f"  memory: {mode} child done in {time.perf_counter() - start:.0f} s")
    return out


def report_memory(result: dict[str, Any]) -> list[str]:
    settings: MemorySettings = result["settings"]
    rss, trace = result["rss"], result["trace"]
    lines = [
        f"## memory: runtime memory per idle lane ({settings.warm} warm-up lanes, then "
        f"{settings.lanes} measured by RSS and {settings.traced_lanes} by tracemalloc, "
        f"{TRACE_FRAMES} frames; every worker stopped; each lane's one turn had "
        f"{settings.rounds} tool rounds)",
        "",
        "| view | lanes | after warm-up | after all | per idle lane | ≤ 64 KiB? |",
        "|---|---:|---:|---:|---:|---|",
    ]
    n, m = rss["lanes"], trace["lanes"]
    a, b = rss["points"]
    per = (b["rss"] - a["rss"]) / n / 1024
    lines.append(
        f"| RSS, not tracing | {n} | {a['rss'] / 2**20:.2f} MiB | {b['rss'] / 2**20:.2f} MiB "
        f"| {per:.1f} KiB | {verdict(per, TARGET_LANE_KIB)} |"
    )
    per = trace["held"] / m / 1024
    lines.append(
        f"| tracemalloc: allocated after the warm-up and still held | {m} | | "
        f"{trace['held'] / 2**20:.2f} MiB | {per:.1f} KiB | {verdict(per, TARGET_LANE_KIB)} |"
    )
    lines += [
        "",
        f"Per idle lane: {(b['fds'] - a['fds']) / n:.2f} open file descriptors, "
        f"{(b['tasks'] - a['tasks']) / n:.2f} Trio tasks.",
        "",
        "Where the held memory was allocated, by the innermost runtime/ frame (per idle lane):",
        "",
        "| allocated in | bytes / lane | blocks / lane | mostly at |",
        "|---|---:|---:|---|",
    ]
    for key, size, count, at in trace["by_runtime_function"][:24]:
        lines.append(f"| {key} | {size / m:,.0f} | {count / m:.1f} | {', '.join(at)} |")
    parts: Counter[str] = Counter()
    for key, size, _count, _at in trace["by_runtime_function"]:
        parts[component_of(key)] += size
    lines += ["", "The same by part of the lane:", "", "| part | bytes / lane |", "|---|---:|"]
    for label, size in parts.most_common():
        lines.append(f"| {label} | {size / m:,.0f} |")
    lines.append(f"| (all) | {trace['held'] / m:,.0f} |")
    lines += ["", "By line (innermost frame, per idle lane):", "", "| line | bytes / lane |"]
    lines.append("|---|---:|")
    for key, size, _count in trace["by_line"][:12]:
        lines.append(f"| {key} | {size / m:,.0f} |")
    lines += ["", "Objects per idle lane, by type (gc-tracked, ≥ 0.5 per lane):", ""]
    lines.append(
        ", ".join(f"{name} {count / m:.1f}" for name, count in trace["objects"] if count >= m / 2)
    )
    return lines


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("kinds", nargs="*", help=f"any of {', '.join(KINDS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--rounds", type=int, default=None, help="tool rounds per turn (20)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (rounds 6, replay 3)")
    parser.add_argument("--deliveries", type=int, default=100)
    parser.add_argument("--rooms", type=int, default=10, help="rooms of the replay (10)")
    parser.add_argument(
        "--live-workers", type=int, default=None, help="replay live-worker cap (the default, 4)"
    )
    parser.add_argument(
        "--idle-stop", type=float, default=600.0, help="replay's idle stop, seconds (600)"
    )
    parser.add_argument("--lanes", type=int, default=None, help="idle lanes for RSS (100)")
    parser.add_argument("--warm", type=int, default=None, help="warm-up lanes (10)")
    parser.add_argument(
        "--traced-lanes", type=int, default=None, help="idle lanes for tracemalloc (40)"
    )
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument(
        "--memory-rounds", type=int, default=0, help="tool rounds in each idle lane's turn (0)"
    )
    parser.add_argument("--memory-child", choices=["rss", "trace"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    lanes = args.lanes or (20 if quick else 100)
    warm = args.warm or (5 if quick else 10)
    traced = args.traced_lanes or (10 if quick else 40)
    memory = MemorySettings(lanes=lanes, warm=warm, traced_lanes=traced, rounds=args.memory_rounds)
    if args.memory_child:
        result = trio.run(memory_child, memory, args.memory_child)
        print(json.dumps(result))
        return 0
    kinds = args.kinds or list(KINDS)
    if not set(kinds) <= set(KINDS):
        parser.error(f"unknown benchmark in {kinds}; choose from {', '.join(KINDS)}")

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    report: list[str] = [
        f"# bench.lane_rounds, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"machine: {os.cpu_count()} CPUs; {background_load()}",
        "",
    ]
    figures: dict[str, Any] = {}
    if "rounds" in kinds:
        settings = RoundsSettings(
            rounds=args.rounds or (5 if quick else 20), reps=args.reps or (1 if quick else 6)
        )
        log(f"rounds: {settings}")
        figures["rounds"] = trio.run(rounds_bench, settings, log)
        print("\n".join([*report, *report_rounds(figures["rounds"]), ""]), flush=True)
        report = []
    if "replay" in kinds:
        rooms = args.rooms if not quick else 4
        replay = ReplaySettings(
            deliveries=args.deliveries if not quick else 20,
            rooms=rooms,
            reps=args.reps or (1 if quick else 3),
            live_workers=args.live_workers or Caps().max_live_workers,
            idle_stop=args.idle_stop,
        )
        log(f"replay: {replay}")
        figures["replay"] = trio.run(replay_bench, replay, log)
        print("\n".join([*report, *report_replay(figures["replay"]), ""]), flush=True)
        report = []
    if "memory" in kinds:
        log(f"memory: {memory}")
        figures["memory"] = trio.run(memory_bench, memory, log)
        print("\n".join([*report, *report_memory(figures["memory"]), ""]), flush=True)
    print(f"after: {background_load()}")
    if args.json:

        def plain(value: Any) -> Any:
            if isinstance(value, Spread | RoundsSettings | ReplaySettings | MemorySettings):
                return msgspec.to_builtins(value.__dict__)
            raise TypeError(type(value))

        args.json.write_text(json.dumps(figures, default=plain, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
