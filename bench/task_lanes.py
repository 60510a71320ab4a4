"""Task-lane benchmarks of issue #8: what a parked task lane costs, and the virtual-time matrix.

Run it from the repository root::

    .venv/bin/python -m bench.task_lanes                 # 1,000 and 10,000 lanes, 6-9 minutes
    .venv/bin/python -m bench.task_lanes --lanes 3000 --also 1000,300   # other sizes
    .venv/bin/python -m bench.task_lanes --rounds 20 --lanes 500 --also ''   # a longer turn
    .venv/bin/python -m bench.task_lanes --quick         # a smoke run, under a minute

Targets (issue #8): 10,000 supervised task lanes whose workers are parked (waiting) cost
**≤ 5 % of one core** and **≤ 16 KiB of runtime memory each**, workers excluded (a shared
timer wheel; parked lanes hold **no file descriptors**); the whole virtual-time matrix
**< 60 s** wall.

**A parked lane.** Each lane is a task submitted to the in-process runner
(:func:`~runtime._tasks._runner.open_task_runner` with
:class:`~runtime._tasks._workers.InProcessWorkers`, set up as in ``tests/task_harness.py``) on a
real state directory in a temporary directory and the real clock (Trio's default clock,
``Clocks.system()``). The model's first answer to every task is a ``task_wait`` tool call: the
gate records it and the lifecycle kernel accepts the wait. Its next answer (after the tool
result) is a short text; the agent settles, and the lane stops its epoch's Fake-Pi and waits
for a reply. A lane counts as parked once its kernel is ``waiting``, it has no worker and its
task is blocked on its wake-up event. So "workers excluded" holds by construction.

**Per size N, in a child process of its own** (so its RSS and descriptors are the lanes'):

1. warm-up: ``--warm`` lanes parked on a throw-away store and runner, then closed (imports,
   the thread cache, first-use caches);
2. the measured store and runner are opened. With zero lanes the bench takes RSS (``VmRSS``),
   the entries of ``/proc/self/fd`` (and what they point at), Trio tasks and threads. Then a
   **zero-lane CPU window**: ``--window`` seconds of real time in which the process does
   nothing of its own, with its CPU time (``getrusage(RUSAGE_SELF)``, every thread, user +
   system) taken around it;
3. N lanes are admitted and parked, at most ``--concurrency`` of them unparked at a time (the
   runner serializes submits anyway). Per lane: the time from ``submit`` to parked; overall:
   wall and CPU time per lane;
4. every lane is checked to be parked, ``gc.collect()``, the same figures again, then the
   **parked CPU window**, as long as the first. Every lane is checked again after it.

Memory per parked lane = (RSS with N parked - RSS with zero lanes) / N. Two more children run
the same with ``tracemalloc`` started after the warm-up: ``--traced-lanes`` lanes with 1 frame
(the total, cheaply), and ``--grouped-lanes`` lanes with ``--frames`` frames (slow: 0.3-0.4 s
of CPU per lane at 8 frames), which say where it goes. Each reports what was allocated
since the zero-lane point and is still held, per lane, grouped by the innermost frame in
``runtime/`` or ``fake_pi/``, and the gc-tracked objects per lane by type.

**The virtual-time matrix**: ``pytest -q tests/tasks/test_tasks.py tests/tasks/test_watchdog.py
tests/tasks/test_lifecycle.py -p no:randomly`` in a subprocess, its wall time.

Nothing asserts a time or a size: targets print as met or missed for information. Every child
is bounded by ``LIMIT``; the temporary directories are removed. Progress goes to stderr, the
report to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import trio

from bench.journal import background_load
from bench.lane_rounds import count_tasks, function_at, open_fds, process_cpu, rss_bytes
from fake_pi.model_server import ScriptedModel
from fake_pi.scenario import Call, Step, Text, ToolCalls
from runtime._clock import Clocks
from runtime._journal._store import open_store
from runtime._pi._launch import ModelRoute
from runtime._tasks._lane import TaskLane
from runtime._tasks._lifecycle import TaskState
from runtime._tasks._runner import TaskRunner, open_task_runner
from runtime._wire import TaskSpec
from runtime.testing._in_process import InProcessWorkers

REPO: Final = Path(__file__).resolve().parents[1]
ROUTE: Final = ModelRoute(provider="fake", model="fake-model")
TARGET_CORE_PERCENT: Final = 5.0
TARGET_LANE_KIB: Final = 16.0
TARGET_FDS_PER_LANE: Final = 0.0
TARGET_MATRIX_SECONDS: Final = 60.0
MATRIX: Final = (
    "tests/tasks/test_tasks.py",
    "tests/tasks/test_watchdog.py",
    "tests/tasks/test_lifecycle.py",
)
LIMIT: Final = 900.0
"""Seconds any one child or phase may take before the bench gives up (a bound)."""
RESULT_MARK: Final = "RESULT "
WAIT_CALL: Final = ToolCalls(
    calls=[Call(name="task_wait", arguments={"question": "which one, blue or green?"})]
)
ASKED: Final = Text(text="I asked which one.")
FILE_TEXT: Final = "a task's worktree\n" + "".join(f"line {i}: a small file\n" for i in range(8))


# ------------------------------------------------------------------------------ the model


@dataclass
class ParkingModel(ScriptedModel):
    """Per task: ``rounds`` ``read`` calls of ``read_path`` (one per model request), then a
    ``task_wait`` call, then a short text. Which is due is told by the tool results in the
    request, so concurrent tasks never share a script. Unlike :class:`ScriptedModel` it keeps
    no request: its memory must not grow with the lanes."""

    rounds: int = 0
    read_path: str = ""

    def next_step(self, body: dict[str, Any]) -> Step:
        messages = body.get("messages") or []
        results = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "tool")
        if results < self.rounds:
            return ToolCalls(calls=[Call(name="read", arguments={"path": self.read_path})])
        return WAIT_CALL if results == self.rounds else ASKED


# --------------------------------------------------------------------------- parked lanes


def is_parked(lane: TaskLane) -> bool:
    """Waiting for a reply, no worker, the lane's task blocked on its wake-up event."""
    return (
        lane.kernel.state is TaskState.WAITING
        and lane.worker is None
        and lane.ended is None
        and lane._wake.statistics().tasks_waiting == 1
    )


@dataclass
class Parker:
    """Submits tasks and tells when each is parked (on the runner's change events)."""

    runner: TaskRunner
    worktree: Path
    waiting: dict[str, trio.Event] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)

    async def watch(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with self.runner.events(buffer=1_000_000) as events:
            task_status.started()
            async for event in events:
                parked = self.waiting.get(event.task_id)
                if parked is None:
                    continue
                lane = self.runner.lanes.get(event.task_id)
                ended = event.task_id in self.runner.ended
                if ended or (lane is not None and (is_parked(lane) or lane.finished.is_set())):
                    del self.waiting[event.task_id]
                    parked.set()

    async def park(self, task_id: str) -> None:
        parked = self.waiting[task_id] = trio.Event()
        start = time.perf_counter()
        spec = TaskSpec(
            task_id=task_id,
            prompt=f"Task {task_id}: paint the shed.",
            worktree=str(self.worktree),
            grants=frozenset({"read"}),
        )
        await self.runner.submit(spec)
        await parked.wait()
        lane = self.runner.lanes.get(task_id)
        if lane is None or not is_parked(lane):  # it ended or failed: the bench is wrong
            view = self.runner.show(task_id)
            raise SystemExit(
                f"task {task_id} did not park: state {view.state}, {view.classification}, "
                f"ended {view.ended}, failure {lane.failure if lane else None!r}"
            )
        self.latencies.append(time.perf_counter() - start)

    async def park_many(self, prefix: str, count: int, concurrency: int) -> None:
        limiter = trio.Semaphore(concurrency)

        async def one(task_id: str) -> None:
            try:
                await self.park(task_id)
            finally:
                limiter.release()

        async with trio.open_nursery() as nursery:
            for n in range(count):
                await limiter.acquire()
                nursery.start_soon(one, f"{prefix}{n}")


@contextlib.asynccontextmanager
async def open_bench_runner(base: Path, rounds: int = 0) -> AsyncIterator[Parker]:
    """A store in ``base/state`` and an in-process runner on the real clock; its events are
    watched to know when a lane is parked. Each task reads a small file ``rounds`` times
    before its ``task_wait``."""
    worktree = base / "worktree"
    worktree.mkdir(parents=True, exist_ok=True)
    readme = worktree / "README.md"
    readme.write_text(FILE_TEXT, encoding="utf-8")
    clocks = Clocks.system()
    workers = InProcessWorkers(model=ParkingModel(rounds=rounds, read_path=str(readme)))
    async with (
        open_store(base / "state", clocks=clocks) as store,
        open_task_runner(
            store, workers=workers, route=ROUTE, clocks=clocks, work_root=base / "work"
        ) as runner,
        trio.open_nursery() as nursery,
    ):
        parker = Parker(runner, worktree)
        await nursery.start(parker.watch)
        yield parker
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------------------- children


@dataclass(frozen=True)
class ChildSettings:
    lanes: int
    warm: int
    window: float
    concurrency: int
    rounds: int = 0
    """``read`` calls each task makes before its ``task_wait``."""
    frames: int = 0
    """``tracemalloc`` frames per allocation; 0: no tracing (RSS, descriptors, CPU)."""

    @property
    def trace(self) -> bool:
        return self.frames > 0


def snapshot_point() -> dict[str, Any]:
    gc.collect()
    return {
        "rss": rss_bytes(),
        "fds": open_fds(),
        "fd_kinds": fd_kinds(),
        "tasks": count_tasks(),
        "threads": threading.active_count(),
        "gc_objects": len(gc.get_objects()),
    }


def fd_kinds() -> dict[str, int]:
    """Open descriptors by what they point at (lane logs, other files, sockets, ...)."""
    kinds: Counter[str] = Counter()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.endswith("/lane.log"):
            kinds["lane.log"] += 1
        elif target.endswith(".jsonl"):
            kinds["session"] += 1
        elif target.startswith("/"):
            kinds["other file"] += 1
        else:
            kinds[target.split(":", 1)[0]] += 1
    return dict(kinds)


async def cpu_window(seconds: float) -> dict[str, float]:
    """This process's CPU over ``seconds`` of real time in which it does nothing itself."""
    gc.collect()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu, wall = process_cpu(), time.perf_counter()
    await trio.sleep(seconds)
    wall = time.perf_counter() - wall
    cpu = process_cpu() - cpu
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "wall": wall,
        "cpu": cpu,
        "percent": 100.0 * cpu / wall,
        "voluntary_switches": float(after.ru_nvcsw - usage.ru_nvcsw),
        "involuntary_switches": float(after.ru_nivcsw - usage.ru_nivcsw),
    }


@dataclass
class GcPauses:
    """Time spent in the cyclic garbage collector, by generation, while installed."""

    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    counts: list[int] = field(default_factory=lambda: [0, 0, 0])
    _started: float = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            generation = info["generation"]
            self.seconds[generation] += time.perf_counter() - self._started
            self.counts[generation] += 1

    @contextlib.contextmanager
    def installed(self) -> Iterator[GcPauses]:
        gc.callbacks.append(self)
        try:
            yield self
        finally:
            gc.callbacks.remove(self)

    def as_dict(self) -> dict[str, list[float] | list[int]]:
        return {"seconds": list(self.seconds), "counts": list(self.counts)}


def remember_sources() -> None:
    """Parse every source file of ``runtime/`` and ``fake_pi/`` now, as imported: the tree may
    be edited while the bench runs, and a traceback's line must map to the function that
    was loaded."""
    for package in ("runtime", "fake_pi"):
        for path in sorted((REPO / package).rglob("*.py")):
            with contextlib.suppress(SyntaxError, OSError, UnicodeDecodeError):
                function_at(str(path), 0)


def where(trace: tracemalloc.Traceback) -> tuple[str, str]:
    """The innermost frame of an allocation in ``runtime/`` or ``fake_pi/`` (where the
    repository's code asked for it) as ``(file:function, file:line)``; else its innermost
    frame, marked as under no repository frame."""
    for frame in reversed(trace):  # a Traceback lists the oldest frame first
        for package in ("runtime", "fake_pi"):
            if frame.filename.startswith(f"{REPO}/{package}/"):
                rel = Path(frame.filename).relative_to(REPO)
                function = function_at(frame.filename, frame.lineno)
                return f"{rel}:{function}", f"{rel}:{frame.lineno}"
    frame = trace[-1]
    short = frame.filename.split("site-packages/", 1)[-1].rsplit("/lib/python3.11/", 1)[-1]
    short = short.removeprefix(f"{REPO}/")
    return f"(no repository frame) {short}", f"{short}:{frame.lineno}"


async def child(settings: ChildSettings) -> dict[str, Any]:
    """One size, measured in this process (see the module's docstring)."""
    if settings.trace:
        remember_sources()
    root = Path(tempfile.mkdtemp(prefix="bench-task-lanes-"))
    result: dict[str, Any] = {
        "lanes": settings.lanes,
        "frames": settings.frames,
        "rounds": settings.rounds,
    }
    try:
        with trio.fail_after(LIMIT):
            async with open_bench_runner(root / "warm", settings.rounds) as parker:
                await parker.park_many("warm-", settings.warm, settings.concurrency)
            if settings.trace:
                tracemalloc.start(settings.frames)
            async with open_bench_runner(root / "measured", settings.rounds) as parker:
                result["zero"] = snapshot_point()  # collects the warm-up's garbage first
                types_before = Counter(type(o).__name__ for o in gc.get_objects())
                first = tracemalloc.take_snapshot() if settings.trace else None
                if not settings.trace:
                    result["zero_window"] = await cpu_window(settings.window)
                cpu, wall = process_cpu(), time.perf_counter()
                with GcPauses().installed() as pauses:
                    await parker.park_many("task-", settings.lanes, settings.concurrency)
                result["admit_wall"] = time.perf_counter() - wall
                result["admit_cpu"] = process_cpu() - cpu
                result["admit_gc"] = pauses.as_dict()
                lat = sorted(parker.latencies)
                result["latency"] = {
                    "p50": statistics.median(lat),
                    "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
                    "max": lat[-1],
                }
                lanes = parker.runner.lanes
                parked = sum(is_parked(lane) for name, lane in lanes.items()
                             if name.startswith("task-"))  # fmt: skip
                result["parked"] = parked
                result["parked_point"] = snapshot_point()
                if settings.trace:
                    assert first is not None
                    result["memory"] = traced(first, settings.lanes)
                    types_after = Counter(type(o).__name__ for o in gc.get_objects())
                    result["objects"] = {
                        name: (types_after[name] - types_before[name]) / settings.lanes
                        for name, _ in (types_after - types_before).most_common(20)
                    }
                else:
                    result["parked_window"] = await cpu_window(settings.window)
                    result["still_parked"] = sum(
                        is_parked(lane) for name, lane in lanes.items() if name.startswith("task-")
                    )
    finally:
        if tracemalloc.is_tracing():
            tracemalloc.stop()
        shutil.rmtree(root, ignore_errors=True)
    return result


def traced(first: tracemalloc.Snapshot, lanes: int) -> dict[str, Any]:
    """Allocated since ``first`` and still held (net: what was freed counts against it), per
    lane; by function and by line (see :func:`where`). The bench's own bookkeeping (the
    latencies it keeps) is counted apart."""
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    second = tracemalloc.take_snapshot().filter_traces(ignore)
    first = first.filter_traces(ignore)
    functions: Counter[str] = Counter()
    lines: Counter[str] = Counter()
    blocks = 0
    for stat in second.compare_to(first, "traceback"):
        function, line = where(stat.traceback)
        functions[function] += stat.size_diff
        lines[line] += stat.size_diff
        blocks += stat.count_diff
    bench = sum(size for name, size in functions.items() if "bench/" in name)
    total = sum(functions.values())
    return {
        "bytes_per_lane": (total - bench) / lanes,
        "bench_bytes_per_lane": bench / lanes,
        "blocks_per_lane": blocks / lanes,
        "functions": [(name, size / lanes) for name, size in functions.most_common(30)],
        "lines": [(name, size / lanes) for name, size in lines.most_common(30)],
    }


def run_child(settings: ChildSettings) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "bench.task_lanes",
        "--child",
        str(settings.frames),
        "--lanes",
        str(settings.lanes),
        "--warm",
        str(settings.warm),
        "--window",
        str(settings.window),
        "--concurrency",
        str(settings.concurrency),
        "--rounds",
        str(settings.rounds),
    ]
    start = time.perf_counter()
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=LIMIT + 60, check=False
    )
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            result: dict[str, Any] = json.loads(line[len(RESULT_MARK) :])
            result["child_seconds"] = time.perf_counter() - start
            return result
    tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-5:])
    raise SystemExit(f"child {command[4:]} exited {done.returncode}: {tail}")


# --------------------------------------------------------------------------------- matrix


def time_matrix() -> dict[str, Any]:
    command = [str(REPO / ".venv/bin/pytest"), "-q", *MATRIX, "-p", "no:randomly"]
    start = time.perf_counter()
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=LIMIT, check=False
    )
    wall = time.perf_counter() - start
    last = (done.stdout.strip().splitlines() or [""])[-1]
    return {"seconds": wall, "returncode": done.returncode, "summary": last}


# --------------------------------------------------------------------------------- report


def verdict(value: float, target: float, *, strict: bool = False) -> str:
    met = value < target if strict else value <= target
    return "met" if met else "MISSED"


def per_lane(size: dict[str, Any]) -> dict[str, float]:
    """Differences between the parked point and the zero-lane point, per lane."""
    n = size["lanes"]
    zero, parked = size["zero"], size["parked_point"]
    return {
        key: (parked[key] - zero[key]) / n
        for key in ("rss", "fds", "tasks", "threads", "gc_objects")
    }


def report(
    sizes: list[dict[str, Any]], traces: list[dict[str, Any]], matrix: dict[str, Any] | None
) -> list[str]:
    lines = [
        "parked lanes, untraced (one child process per size):",
        f"{'lanes':>7} {'parked':>7} {'admit ms/lane':>13} {'CPU ms/lane':>11} "
        f"{'p50 ms':>7} {'p99 ms':>7} {'RSS KiB/lane':>12} {'fds/lane':>8} "
        f"{'tasks/lane':>10} {'CPU % zero':>10} {'CPU % parked':>12} {'parked/zero':>11}",
    ]
    for size in sizes:
        n, diff = size["lanes"], per_lane(size)
        zero, busy = size["zero_window"]["percent"], size["parked_window"]["percent"]
        ratio = f"{busy / zero:.2f}" if zero > 0 else "-"
        lines.append(
            f"{n:>7} {size['still_parked']:>7} {size['admit_wall'] / n * 1e3:>13.2f} "
            f"{size['admit_cpu'] / n * 1e3:>11.2f} {size['latency']['p50'] * 1e3:>7.1f} "
            f"{size['latency']['p99'] * 1e3:>7.1f} {diff['rss'] / 1024:>12.1f} "
            f"{diff['fds']:>8.2f} {diff['tasks']:>10.2f} {zero:>10.3f} {busy:>12.3f} "
            f"{ratio:>11}"
        )
    for size in sizes:
        zero, parked = size["zero"], size["parked_point"]
        lines.append(
            f"  {size['lanes']} lanes: descriptors {zero['fds']} -> {parked['fds']} "
            f"(zero lanes {zero['fd_kinds']}; parked {parked['fd_kinds']}); threads "
            f"{zero['threads']} -> {parked['threads']}; Trio tasks {zero['tasks']} -> "
            f"{parked['tasks']}; garbage collection while admitting: "
            f"{sum(size['admit_gc']['seconds']):.1f} s in all, "
            f"{size['admit_gc']['seconds'][2]:.1f} s in {size['admit_gc']['counts'][2]} "
            f"full collections; context switches in the windows (zero, parked): "
            f"{size['zero_window']['voluntary_switches']:.0f}, "
            f"{size['parked_window']['voluntary_switches']:.0f}; "
            f"child {size['child_seconds']:.0f} s"
        )
    if traces:
        lines += [
            "",
            "parked lanes, tracemalloc (allocated since the zero-lane point and still held):",
            f"{'lanes':>7} {'frames':>6} {'KiB/lane':>8} {'blocks/lane':>11} "
            f"{'bench B/lane':>12} {'RSS KiB/lane (traced)':>21} {'child s':>7}",
        ]
        for trace in traces:
            memory = trace["memory"]
            lines.append(
                f"{trace['lanes']:>7} {trace['frames']:>6} "
                f"{memory['bytes_per_lane'] / 1024:>8.2f} {memory['blocks_per_lane']:>11.1f} "
                f"{memory['bench_bytes_per_lane']:>12.0f} {per_lane(trace)['rss'] / 1024:>21.1f} "
                f"{trace['child_seconds']:>7.0f}"
            )
    lines += ["", "targets (issue #8):"]
    for size in sizes:
        n, diff = size["lanes"], per_lane(size)
        busy = size["parked_window"]["percent"]
        rss = diff["rss"] / 1024
        lines.append(
            f"  {n:>6} parked lanes: CPU {busy:.3f} % of one core (≤ {TARGET_CORE_PERCENT:g} %: "
            f"{verdict(busy, TARGET_CORE_PERCENT)}); RSS {rss:.1f} KiB/lane "
            f"(≤ {TARGET_LANE_KIB:g} KiB: {verdict(rss, TARGET_LANE_KIB)}); "
            f"{diff['fds']:.2f} descriptors/lane "
            f"(none: {verdict(diff['fds'], TARGET_FDS_PER_LANE)})"
        )
    for trace in traces:
        kib = trace["memory"]["bytes_per_lane"] / 1024
        lines.append(
            f"  {trace['lanes']:>6} parked lanes, traced ({trace['frames']} frames): "
            f"{kib:.2f} KiB/lane (≤ {TARGET_LANE_KIB:g} KiB: {verdict(kib, TARGET_LANE_KIB)})"
        )
    if matrix is not None:
        lines.append(
            f"  virtual-time matrix: {matrix['seconds']:.1f} s wall "
            f"(< {TARGET_MATRIX_SECONDS:g} s: "
            f"{verdict(matrix['seconds'], TARGET_MATRIX_SECONDS, strict=True)}); "
            f"pytest: {matrix['summary']} (exit {matrix['returncode']})"
        )
    if traces:
        deepest = max(traces, key=lambda t: (t["frames"], t["lanes"]))
        memory = deepest["memory"]
        lines += [
            "",
            f"held per parked lane ({deepest['lanes']} lanes, {deepest['frames']} frames), "
            "bytes, by the innermost runtime/ or fake_pi/ function:",
            *(f"  {size:>8.0f}  {name}" for name, size in memory["functions"][:20]),
            "by line:",
            *(f"  {size:>8.0f}  {name}" for name, size in memory["lines"][:20]),
            "gc-tracked objects per parked lane: "
            + ", ".join(f"{v:.1f} {k}" for k, v in list(deepest["objects"].items())[:20]),
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--lanes", type=int, default=10_000, help="parked lanes (10000)")
    parser.add_argument(
        "--also", default="1000", help="other sizes, comma-separated ('1000'; '' for none)"
    )
    parser.add_argument("--window", type=float, default=20.0, help="CPU window, seconds (20)")
    parser.add_argument("--concurrency", type=int, default=32, help="unparked lanes at most (32)")
    parser.add_argument("--warm", type=int, default=20, help="warm-up lanes (20)")
    parser.add_argument(
        "--traced-lanes", type=int, default=1000, help="lanes traced with 1 frame (1000; 0: none)"
    )
    parser.add_argument(
        "--grouped-lanes", type=int, default=100, help="lanes traced with --frames (100; 0: none)"
    )
    parser.add_argument("--frames", type=int, default=8, help="frames for --grouped-lanes (8)")
    parser.add_argument(
        "--rounds", type=int, default=0, help="read calls per task before its task_wait (0)"
    )
    parser.add_argument("--no-matrix", action="store_true", help="skip the pytest matrix")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 200 lanes, 5 s")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.lanes, args.also, args.window = 200, "", 5.0
        args.traced_lanes, args.grouped_lanes = 100, 30
    if not 1 <= args.lanes <= 100_000 or args.window <= 0 or args.concurrency < 1:
        parser.error("--lanes: 1-100000; --window > 0; --concurrency ≥ 1")
    if not 0 <= args.rounds <= 100:
        parser.error("--rounds: 0-100")
    if args.child is not None:
        settings = ChildSettings(
            args.lanes, args.warm, args.window, args.concurrency, args.rounds, frames=args.child
        )
        print(RESULT_MARK + json.dumps(trio.run(child, settings)), flush=True)
        return 0

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    counts = sorted({args.lanes, *(int(s) for s in args.also.split(",") if s.strip())})
    header = [
        f"# bench.task_lanes, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"machine: {os.cpu_count()} CPUs; {background_load()}",
        f"CPU window {args.window:g} s; at most {args.concurrency} lanes unparked at a time; "
        f"{args.warm} warm-up lanes; {args.rounds} read calls per task before its task_wait",
        "",
    ]
    sizes: list[dict[str, Any]] = []
    traces: list[dict[str, Any]] = []
    plan = [ChildSettings(n, args.warm, args.window, args.concurrency, args.rounds) for n in counts]
    for lanes, frames in ((args.traced_lanes, 1), (args.grouped_lanes, args.frames)):
        if lanes > 0:
            plan.append(
                ChildSettings(lanes, args.warm, args.window, args.concurrency, args.rounds, frames)
            )
    for settings in plan:
        log(
            f"{settings.lanes} lanes, "
            + (f"traced ({settings.frames} frames)" if settings.trace else "untraced")
            + f" ({background_load()})"
        )
        result = run_child(settings)
        log(f"  took {result['child_seconds']:.0f} s")
        (traces if settings.trace else sizes).append(result)
    matrix = None
    if not args.no_matrix:
        log(f"virtual-time matrix ({background_load()})")
        matrix = time_matrix()
    lines = [*header, *report(sizes, traces, matrix), "", f"after: {background_load()}"]
    print("\n".join(lines), flush=True)
    if args.json:
        args.json.write_text(
            json.dumps({"sizes": sizes, "traces": traces, "matrix": matrix}, indent=1),
            encoding="utf-8",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
