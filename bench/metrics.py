"""What the metrics cost (issue #22, docs/design/operations.md "Metrics").

Run it from the repository root::

    .venv/bin/python -m bench.metrics              # 1,000 room lanes and 1,000 task lanes
    .venv/bin/python -m bench.metrics --lanes 100  # a quick run

Two questions, each answered against a baseline measured in the same run:

* **A scrape**: ``GET /metrics``'s encoding (``prometheus_client``'s, what the handler runs on
  the Trio thread) with the server's collector reading a real room worker holding ``--lanes``
  idle room lanes (made as an admission makes them, no turn run) and a real task runner holding
  ``--lanes`` task lanes parked waiting for the user (in-process Fake-Pi, each in a worktree of
  its own, on a real file store): milliseconds and CPU per scrape, and the share of one core a
  scrape every second takes. Baseline: the same registry with the servers' collector reading
  no server (the event metrics and the process collector alone).
* **An open operator page**: what its event stream does each second with the same server —
  build the page's state (``OperatorPage.snapshot``: the rooms, the pending deliveries and every
  task's view, as ``task show`` builds it), encode it, and re-read the token file (a rotated
  token ends the session): CPU per push, and the share of one core at one push a second.
  Baseline: the same with no room or task lane (what a push costs whatever the lanes: the
  token re-read, the encoding, the loop).
* **The hot path**: the cost of one counter increment, one labelled increment and one histogram
  observation, against one durable journal append (a lane log on this machine's disk, p50)
  measured in the same run: an append records three observations (its latency, the writer's
  fdatasync and batch size), so the ratio of those three to the append is what the metrics add
  to the journal.

Nothing asserts; CI does not run it. Figures go into docs/design/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
import time
import timeit
from collections.abc import AsyncIterator, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import trio
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest

from fake_pi.model_server import ReceivedRequest, ScriptedModel, body_digest
from fake_pi.scenario import Call, Step, Text, ToolCalls
from runtime._clock import Clocks
from runtime._config import RoomWorkerConfig
from runtime._journal._store import open_store
from runtime._metrics import REGISTRY
from runtime._metrics import labelled as child
from runtime._pi._launch import ModelRoute
from runtime._records import TaskReply
from runtime._rooms._worker import RoomWorker, open_room_worker
from runtime._server._metrics import COLLECTOR
from runtime._server._page import PUSH_SECONDS, OperatorPage
from runtime._server._token import ensure_token, read_token
from runtime._tasks._runner import open_task_runner
from runtime._tasks._service import TaskService
from runtime._tasks._watchdog import WatchdogPolicy
from runtime._wire import TaskSpec
from runtime.testing._in_process import InProcessWorkers

SCRAPES: Final = 30
APPENDS: Final = 400
ROUTE: Final = ModelRoute(provider="fake", model="fake-model")


@dataclass
class Observed:
    """What the collector and the operator page read (``RoomServer``'s attributes)."""

    worker: RoomWorker
    tasks: TaskService
    state_dir: Path
    connections: Sized = field(default_factory=set)
    worker_id: str = "bench"

    async def status(self) -> dict[str, Any]:
        raise NotImplementedError

    async def cancel(self, delivery_id: str) -> dict[str, Any]:
        raise NotImplementedError


async def page_cost(server: Observed) -> float:
    """Median CPU milliseconds of one push of an open page's event stream: the state built
    and encoded, and the token re-read (which the page does in a worker thread), timed on
    this thread alone (``thread_time``: the in-process workers' and the journal's threads
    are not counted)."""
    page = OperatorPage(server, secure=False, allowed_hosts=frozenset())
    cpus = []
    for _ in range(SCRAPES):
        await trio.lowlevel.checkpoint()
        cpu = time.thread_time()
        msgspec.json.encode(page.state())
        read_token(server.state_dir)
        cpus.append(time.thread_time() - cpu)
    return statistics.median(cpus) * 1000


def scrape_cost(registry: CollectorRegistry) -> tuple[float, float]:
    """Median wall and CPU milliseconds of one encoding of ``registry``."""
    walls, cpus = [], []
    for _ in range(SCRAPES):
        wall, cpu = time.perf_counter(), time.process_time()
        generate_latest(registry)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls) * 1000, statistics.median(cpus) * 1000


def wait_step() -> ToolCalls:
    return ToolCalls(calls=[Call(name="task_wait", arguments={"question": "which one?"})])


@dataclass
class WaitOnEveryPrompt(ScriptedModel):
    """Answers each task's prompt with a ``task_wait`` and its tool result with a text, for
    any number of tasks at once (a scenario's order would be the interleaving's)."""

    def next_step(self, body: dict[str, Any]) -> Step:
        messages = body.get("messages") or [{}]
        step: Step = Text(text="asked") if messages[-1].get("role") == "tool" else wait_step()
        self.requests.append(ReceivedRequest(body, body_digest(body), step))
        return step


@contextlib.asynccontextmanager
async def parked_tasks(root: Path, count: int) -> AsyncIterator[TaskService]:
    """A task runner with ``count`` tasks parked waiting for the user."""
    workers = InProcessWorkers(model=WaitOnEveryPrompt())
    policy = WatchdogPolicy()
    async with (
        open_store(root / "tasks-state") as store,
        open_task_runner(
            store, workers=workers, route=ROUTE, policy=policy, work_root=root / "work"
        ) as runner,
    ):
        async with runner.events(buffer=100 * count) as events:
            for i in range(count):
                tree = root / "trees" / f"t{i}"
                tree.mkdir(parents=True)
                spec = TaskSpec(
                    task_id=f"t{i}", prompt="wait", worktree=str(tree), grants=frozenset()
                )
                await runner.submit(spec)
            waiting: set[str] = set()
            while len(waiting) < count:  # until every task waits for its user
                event = await events.receive()
                if event.state == "waiting":
                    waiting.add(event.task_id)
        yield TaskService(runner, policy, policy)


async def scrape_bench(root: Path, lanes: int) -> dict[str, float]:
    config = RoomWorkerConfig(state_dir=str(root / "state"), work_root=str(root / "rwork"))
    async with open_room_worker(config) as worker:
        state = Path(config.state_dir)
        await trio.to_thread.run_sync(ensure_token, state)
        async with parked_tasks(root / "none", 0) as no_tasks:
            page_base = await page_cost(Observed(worker, no_tasks, state))  # no lane at all
    async with open_room_worker(config) as worker, parked_tasks(root, lanes) as tasks:
        for i in range(lanes):
            worker._lane(f"dm:{i}")  # an idle lane, as an admission makes it
        await trio.sleep(0.1)
        base_wall, base_cpu = scrape_cost(REGISTRY)  # the collector reads no server yet
        observed = Observed(worker, tasks, state)
        page_cpu = await page_cost(observed)
        COLLECTOR.servers.append(observed)
        try:
            wall, cpu = scrape_cost(REGISTRY)
            size = len(generate_latest(REGISTRY))
        finally:
            COLLECTOR.servers.clear()
        assert len(worker.status()) == lanes
        assert sum(v.state == "waiting" for v in tasks.tasks()) == lanes
    return {
        "baseline_ms": base_wall,
        "baseline_cpu_ms": base_cpu,
        "scrape_ms": wall,
        "scrape_cpu_ms": cpu,
        "bytes": float(size),
        "page_cpu_ms": page_cpu,
        "page_baseline_cpu_ms": page_base,
    }


async def append_p50(root: Path) -> float:
    """The median seconds of one durable append to a lane log on this disk."""
    async with open_store(root / "append-state", clocks=Clocks.system()) as store:
        log = await store.open_lane_log("task:bench")
        record = TaskReply(correlation="c", text="x" * 200)
        took = []
        for _ in range(APPENDS):
            start = time.perf_counter()
            await log.append(record)
            took.append(time.perf_counter() - start)
        await store.close_log(log)
    return statistics.median(took)


def op_costs() -> dict[str, float]:
    registry = CollectorRegistry()
    counter = Counter("bench_c", "c", registry=registry)
    labelled = Counter("bench_l", "l", ["outcome"], registry=registry)
    histogram = Histogram("bench_h", "h", registry=registry)
    n = 200_000
    return {
        "inc_ns": timeit.timeit(counter.inc, number=n) / n * 1e9,
        "labels_inc_ns": timeit.timeit(lambda: labelled.labels("reply").inc(), number=n) / n * 1e9,
        "cached_inc_ns": timeit.timeit(lambda: child(labelled, "reply").inc(), number=n) / n * 1e9,
        "observe_ns": timeit.timeit(lambda: histogram.observe(0.003), number=n) / n * 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.metrics", description=__doc__)
    parser.add_argument("--lanes", type=int, default=1000, help="room lanes and task lanes")
    parser.add_argument("--dir", help="where to create the state directories (not tmpfs)")
    args = parser.parse_args(argv)
    base = Path(args.dir or ".cache")
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-metrics-", dir=base)).resolve()
    try:
        started = time.perf_counter()
        scrape = trio.run(scrape_bench, root, args.lanes)
        setup = time.perf_counter() - started
        append = trio.run(append_p50, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ops = op_costs()
    per_append = (ops["observe_ns"] * 3) / 1e9
    print(f"bench.metrics: {args.lanes} idle room lanes + {args.lanes} parked task lanes "
          f"(set up in {setup:.1f} s)")  # fmt: skip
    print(
        f"  scrape: {scrape['scrape_ms']:.2f} ms wall, {scrape['scrape_cpu_ms']:.2f} ms CPU, "
        f"{scrape['bytes'] / 1024:.1f} KiB; baseline (no server collector) "
        f"{scrape['baseline_ms']:.2f} ms; ratio {scrape['scrape_ms'] / scrape['baseline_ms']:.1f}x"
    )
    print(f"  one scrape a second: {scrape['scrape_cpu_ms'] / 10:.2f} % of a core")
    print(
        f"  one open operator page (a push a second): {scrape['page_cpu_ms']:.2f} ms CPU per "
        f"push = {scrape['page_cpu_ms'] / 10:.2f} % of a core (a push each second; the page pushes "
        f"every {PUSH_SECONDS:g} s and on a task's change); baseline (no lanes) "
        f"{scrape['page_baseline_cpu_ms']:.2f} ms; scrape + page "
        f"{(scrape['scrape_cpu_ms'] + scrape['page_cpu_ms']) / 10:.2f} % of a core"
    )
    print(
        f"  ops: inc {ops['inc_ns']:.0f} ns, labels().inc {ops['labels_inc_ns']:.0f} ns, "
        f"labelled().inc (the runtime's cached child) {ops['cached_inc_ns']:.0f} ns, "
        f"observe {ops['observe_ns']:.0f} ns"
    )
    print(
        f"  journal append p50 {append * 1e3:.3f} ms; its three observations "
        f"{per_append * 1e6:.2f} us = {per_append / append * 100:.3f} % of it"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
