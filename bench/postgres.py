"""PostgreSQL benchmark (issue #19): durable steps and admissions on the shared store, against
DBOS Transact on the same PostgreSQL and against the file store, in one run.

Run it from the repository root (the ``bench`` extra: ``pip install -e '.[bench]'``)::

    .venv/bin/python -m bench.postgres            # 3 rounds, about two minutes
    .venv/bin/python -m bench.postgres --quick    # one short round

A throw-away PostgreSQL (``pgserver``: its data directory on the repository's disk, under
``.cache/``, as the file store's). Per round, every case in turn:

* **steps**: a step is what the gate writes around one tool call — a ``ToolIntent`` append
  and a ``ToolOutcome`` append, each awaited until durable — on a delivery log of its own,
  for 1 and 16 concurrent lanes (Trio tasks). On PostgreSQL each lane holds a lease and
  every append is fenced by it (``INSERT … SELECT … FOR SHARE``, scale-out.md S11), with the
  store's default pool (2 connections) as a host runs it; on the file store in a state
  directory beside the database's.
* **DBOS**: DBOS Transact with its system database on the **same** PostgreSQL server (a
  database of its own), one workflow per lane running two ``@DBOS.step()`` calls per durable
  step, 1 and 16 workflows (in a subprocess: ``bench/journal.py``'s worker).
* **admissions**: hosts appending ``Admission`` records to the one shared admission log as
  ``serve`` does (``try_append``; on a lost race ``refresh`` and again: one gap-free order,
  S21), 16 producers per host; one host, then three hosts at once (three processes).

It prints the median over rounds and the ratios the issue names, each taken per round:
PostgreSQL step / DBOS step (target ≥ 2), three hosts / one host (target ≥ 2), and the
PostgreSQL step against the file store's. Nothing asserts; the figures go into
``docs/design/performance.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Final

import psycopg
import trio

warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
from pgserver.postgres_server import get_server  # noqa: E402

from runtime._journal._interface import Log  # noqa: E402
from runtime._journal._postgres import PgLog, migrate, open_pg_store  # noqa: E402
from runtime._journal._store import delivery_key, open_store  # noqa: E402

from .journal import REPO, RESULT_MARK, admission, run_dbos, tool_intent, tool_outcome  # noqa: E402

ROUNDS: Final = 3
SECONDS: Final = 3.0
QUICK_SECONDS: Final = 1.0
PRODUCERS: Final = 16
"""Concurrent admissions per host (16 rooms' clients at once)."""
HOSTS: Final = 3


async def _steps(logs: list[Log], seconds: float) -> tuple[int, float]:
    """Durable steps (intent + outcome, each awaited) on each log, side by side."""
    dkey = delivery_key("bench")
    done = [0] * len(logs)
    start = time.perf_counter()
    deadline = start + seconds

    async def lane(i: int, log: Log) -> None:
        step = 0
        while time.perf_counter() < deadline:
            intent = tool_intent(dkey, log.next_seq, step)
            await log.append(intent)
            await log.append(tool_outcome(intent.intent_id, step))
            step += 1
        done[i] = step

    async with trio.open_nursery() as nursery:
        for i, log in enumerate(logs):
            nursery.start_soon(lane, i, log)
    return sum(done), time.perf_counter() - start


async def pg_steps(dsn: str, root: Path, lanes: int, seconds: float, n: int) -> float:
    async with open_pg_store(dsn, root=root / f"pg-{n}-{lanes}") as store:
        logs: list[Log] = []
        for i in range(lanes):
            fence = await store.claim(f"bench:{n}:{lanes}:{i}", ttl=600)
            assert fence is not None
            logs.append(await store.create_delivery_log(f"bench-{n}-{lanes}-{i}", fence=fence))
        steps, elapsed = await _steps(logs, seconds)
    return steps / elapsed


async def file_steps(root: Path, lanes: int, seconds: float, n: int) -> float:
    state = root / f"file-{n}-{lanes}"
    async with open_store(state) as store:
        logs: list[Log] = [await store.create_delivery_log(f"bench-{i}") for i in range(lanes)]
        steps, elapsed = await _steps(logs, seconds)
    shutil.rmtree(state, ignore_errors=True)
    return steps / elapsed


# -- admissions: one host, three hosts ----------------------------------------------------


async def admit_worker(
    dsn: str, root: str, name: str, seconds: float, start_at: float, index: int
) -> None:
    """One host's admissions (a subprocess): ``PRODUCERS`` tasks appending to the shared log
    from wall-clock ``start_at`` for ``seconds``, as the room worker's shared admission does."""
    async with open_pg_store(dsn, root=Path(root) / name) as store:
        log = store.admissions
        assert isinstance(log, PgLog)
        admitted = lost = 0
        await trio.sleep(max(0.0, start_at - time.time()))
        deadline = time.perf_counter() + seconds

        async def producer(p: int) -> None:
            nonlocal admitted, lost
            n = 0
            while time.perf_counter() < deadline:
                record = admission(p, n)
                while await log.try_append(record) is None:  # as the room worker does
                    lost += 1
                    await log.refresh()
                admitted += 1
                n += 1

        began = time.perf_counter()
        cpu = time.process_time()
        async with trio.open_nursery() as nursery:
            for p in range(PRODUCERS):
                nursery.start_soon(producer, index * PRODUCERS + p)  # unique delivery ids
        elapsed = time.perf_counter() - began
        cpu = time.process_time() - cpu
        commits = log.commits
    facts = {
        "admitted": admitted, "lost": lost, "seconds": elapsed, "commits": commits, "cpu": cpu,
    }  # fmt: skip
    print(RESULT_MARK + json.dumps(facts))


async def admissions(dsn: str, root: Path, hosts: int, seconds: float, n: int) -> dict[str, float]:
    """``hosts`` host processes admitting at once: admissions/s in all, races lost."""
    start_at = time.time() + 3.0  # every process imported and connected by then
    procs = [
        await trio.lowlevel.open_process(
            [sys.executable, "-m", "bench.postgres", "--admit-worker", dsn, str(root),
             f"h{n}-{hosts}-{i}", str(seconds), str(start_at), str((n * 10 + hosts) * 10 + i)],
            stdout=subprocess.PIPE, cwd=REPO,
        )
        for i in range(hosts)
    ]  # fmt: skip
    results = []
    await trio.sleep(max(0.0, start_at - time.time()))
    busy = _cpu_busy()  # from the start of the window (the imports and connects before it)
    for proc in procs:
        assert proc.stdout is not None
        out = b""
        while data := await proc.stdout.receive_some(65536):
            out += data
        await proc.wait()
        line = next(x for x in out.decode().splitlines() if x.startswith(RESULT_MARK))
        results.append(json.loads(line[len(RESULT_MARK) :]))
    seconds_max = max(r["seconds"] for r in results)
    after = _cpu_busy()
    window = (after[1] - busy[1]) or 1.0
    return {
        "busy": (after[0] - busy[0]) / window,  # of every core, host processes and server
        "cpu_per_1k": 1000
        * sum(r["cpu"] for r in results)
        / max(1, sum(r["admitted"] for r in results)),
        "rate": sum(r["admitted"] for r in results) / seconds_max,
        "lost": sum(r["lost"] for r in results) / max(1, sum(r["admitted"] for r in results)),
        "group": sum(r["admitted"] for r in results) / max(1, sum(r["commits"] for r in results)),
    }


def _cpu_busy() -> tuple[float, float]:
    """(busy, all) jiffies of every core so far (``/proc/stat``): the machine's share busy
    over a window is the difference of two readings."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return float(sum(fields) - idle), float(sum(fields))


# -- the run -------------------------------------------------------------------------------


def _dbos_database(dsn: str) -> str:
    """A database of DBOS's own on the same server; its SQLAlchemy URL."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS dbos_bench")
        conn.execute("CREATE DATABASE dbos_bench")
        info = conn.info
        host, port, user = info.host, info.port, info.user
    return f"postgresql://{user}@/dbos_bench?host={host}&port={port}"


async def _round(dsn: str, dbos_url: str, root: Path, seconds: float, n: int) -> dict[str, float]:
    row: dict[str, float] = {}
    cases: list[tuple[str, Callable[[], Awaitable[float]]]] = [
        ("pg_1", lambda: pg_steps(dsn, root, 1, seconds, n)),
        ("file_1", lambda: file_steps(root, 1, seconds, n)),
        ("pg_16", lambda: pg_steps(dsn, root, 16, seconds, n)),
        ("file_16", lambda: file_steps(root, 16, seconds, n)),
    ]
    for key, case in cases:
        row[key] = await case()
    samples, facts = await trio.to_thread.run_sync(run_dbos, root / f"dbos-{n}", seconds, dbos_url)
    if not facts.get("ok"):
        raise SystemExit(f"DBOS did not run: {facts}")
    row["dbos_1"] = samples["dbos_1"].rate
    row["dbos_16"] = samples["dbos_16"].rate
    one = await admissions(dsn, root, 1, seconds, n)
    three = await admissions(dsn, root, HOSTS, seconds, n)
    row["admit_1"], row["lost_1"], row["group_1"] = one["rate"], one["lost"], one["group"]
    row["admit_3"], row["lost_3"], row["group_3"] = three["rate"], three["lost"], three["group"]
    row["busy_1"], row["busy_3"] = one["busy"], three["busy"]
    row["cpu_1"], row["cpu_3"] = one["cpu_per_1k"], three["cpu_per_1k"]
    row["r_pg_dbos_1"] = row["pg_1"] / row["dbos_1"]
    row["r_pg_dbos_16"] = row["pg_16"] / row["dbos_16"]
    row["r_pg_file_1"] = row["pg_1"] / row["file_1"]
    row["r_pg_file_16"] = row["pg_16"] / row["file_16"]
    row["r_hosts"] = row["admit_3"] / row["admit_1"]
    return row


LABELS: Final = (
    ("pg_1", "PostgreSQL store: durable steps, 1 lane (fenced)", "steps/s"),
    ("pg_16", "PostgreSQL store: durable steps, 16 lanes (fenced)", "steps/s"),
    ("dbos_1", "DBOS on the same PostgreSQL: steps, 1 workflow", "steps/s"),
    ("dbos_16", "DBOS on the same PostgreSQL: steps, 16 workflows", "steps/s"),
    ("file_1", "file store: durable steps, 1 lane", "steps/s"),
    ("file_16", "file store: durable steps, 16 lanes", "steps/s"),
    ("admit_1", f"admissions, 1 host x {PRODUCERS} producers", "records/s"),
    ("admit_3", f"admissions, {HOSTS} hosts x {PRODUCERS} producers", "records/s"),
    ("lost_1", "  races lost per admission, 1 host", "ratio"),
    ("lost_3", f"  races lost per admission, {HOSTS} hosts", "ratio"),
    ("group_1", "  admissions per commit (group size), 1 host", "ratio"),
    ("group_3", f"  admissions per commit (group size), {HOSTS} hosts", "ratio"),
    ("busy_1", "  machine busy (all cores) during admissions, 1 host", "share"),
    ("busy_3", f"  machine busy (all cores) during admissions, {HOSTS} hosts", "share"),
    ("cpu_1", "  host CPU per 1000 admissions, 1 host", "s"),
    ("cpu_3", f"  host CPU per 1000 admissions, {HOSTS} hosts", "s"),
    ("r_pg_dbos_1", "PostgreSQL step / DBOS step, 1 lane (target >= 2)", "ratio"),
    ("r_pg_dbos_16", "PostgreSQL step / DBOS step, 16 lanes (target >= 2)", "ratio"),
    ("r_hosts", f"admissions {HOSTS} hosts / 1 host (target >= 2)", "ratio"),
    ("r_pg_file_1", "PostgreSQL step / file-store step, 1 lane", "ratio"),
    ("r_pg_file_16", "PostgreSQL step / file-store step, 16 lanes", "ratio"),
)


@contextlib.asynccontextmanager
async def throwaway_postgres(name: str) -> AsyncIterator[tuple[str, Path, Path]]:
    """A throw-away PostgreSQL (``pgserver``), migrated, and a work directory, both under the
    repository's ``.cache/`` (its disk, not tmpfs): ``(dsn, work directory, data directory)``;
    stopped and removed when the block ends."""
    cache = REPO / ".cache"
    cache.mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f"bench-{name}-", dir=cache))
    data = Path(tempfile.mkdtemp(prefix="bench-pgdata-", dir=cache))
    os.chmod(data, 0o755)  # as root PostgreSQL runs as the pgserver user
    server = await trio.to_thread.run_sync(lambda: get_server(data / "data", cleanup_mode="stop"))
    try:
        dsn = server.get_uri()
        await migrate(dsn)
        yield dsn, root, data
    finally:
        server.cleanup()
        shutil.rmtree(data, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def print_medians(
    found: Sequence[dict[str, float]], labels: Sequence[tuple[str, str, str]], width: int = 58
) -> None:
    """The median, min and max over rounds of each ``(key, label, unit)``."""
    print(f"\n{'case':<{width}} {'median':>10} {'min':>10} {'max':>10}  unit")
    for key, label, unit in labels:
        values = [row[key] for row in found]
        print(
            f"{label:<{width}} {statistics.median(values):>10.3g} {min(values):>10.3g} "
            f"{max(values):>10.3g}  {unit}"
        )


async def _main(rounds: int, seconds: float) -> None:
    async with throwaway_postgres("pg") as (dsn, root, data):
        dbos_url = await trio.to_thread.run_sync(_dbos_database, dsn)
        with psycopg.connect(dsn) as conn:
            version = conn.execute("SHOW server_version").fetchone()
            fsync = conn.execute("SHOW fsync").fetchone()
            sync = conn.execute("SHOW synchronous_commit").fetchone()
        print(
            f"bench.postgres: {rounds} rounds of {seconds:g} s per case; PostgreSQL "
            f"{version and version[0]} (fsync={fsync and fsync[0]}, synchronous_commit="
            f"{sync and sync[0]}) on {data}; {platform.node()} {os.cpu_count()} cores; "
            f"{time.strftime('%Y-%m-%d')}"
        )
        found = []
        for n in range(1, rounds + 1):
            found.append(await _round(dsn, dbos_url, root, seconds, n))
            print(f"round {n}: " + ", ".join(f"{k}={v:.3g}" for k, v in found[-1].items()))
        print_medians(found, LABELS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.postgres", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="one short round")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--admit-worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.admit_worker:
        dsn, root, name, seconds, start_at, index = args.admit_worker
        trio.run(admit_worker, dsn, root, name, float(seconds), float(start_at), int(index))
        return 0
    rounds = args.rounds or (1 if args.quick else ROUNDS)
    trio.run(_main, rounds, QUICK_SECONDS if args.quick else SECONDS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
