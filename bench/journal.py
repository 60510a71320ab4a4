"""Journal benchmark: durable steps, group-committed admissions, raw disk limits, DBOS.

Run it from the repository root::

    .venv/bin/python -m bench.journal            # full run, about two minutes
    .venv/bin/python -m bench.journal --quick    # a few-second smoke run

Everything is measured in ONE run, on fresh state directories under the
repository's ``.cache/`` (same disk as the repository; never tmpfs; ``--dir``
overrides), and every ratio is taken against baselines measured in that same
run. The machine is noisy (2 cores, shared), so:

* the cases the targets compare (raw appends, 1 lane, 16 lanes, and the
  one-lane prototypes) take turns in short slices inside one round, so a drift
  of the disk or the CPU hits numerator and denominator alike;
* every case is repeated in rounds (3; ``--quick``: 1); the table shows the
  median over rounds and the spread, each ratio is computed per round before
  taking its median, and a per-round table shows how loaded the machine was
  (pressure-stall figures from ``/proc/pressure``).

What is measured:

* durable steps/s: a step is a ``ToolIntent`` append and a ``ToolOutcome``
  append, each awaited until durable, to a per-delivery log; 1, 16 and 64
  concurrent lanes (Trio tasks), each with its own delivery log (and, for
  comparison, 16 lanes sharing one log, and 16 lanes with 16 writer shards);
* group-committed admissions/s: 64 and 256 producers appending ``Admission``
  records to ``store.admissions``;
* raw limits of this disk: ``os.write`` + ``os.fdatasync`` per record (one
  thread, and 16 threads on 16 files), and an atomic document replace
  (exclusive temp file, write, fsync, rename, directory fsync);
* where the time goes: the same cases on a file system whose ``fdatasync`` is
  a no-op (the runtime's own overhead), the bare Trio-to-thread hand-off,
  ``os.write`` without sync, record encoding, and the CPU time of the process
  per operation;
* prototypes of a faster one-lane append (benchmark code, not the runtime):
  acknowledging through a per-log eventfd (also into a log ``fallocate``d ahead, so
  each sync is an overwrite with no size change), syncing inline on the Trio thread, or
  syncing through Linux AIO (``IOCB_CMD_FDSYNC``: the kernel's own worker, no thread
  of ours, the task waiting on an eventfd);
* the peer: DBOS Transact 3.x with a SQLite system database in WAL mode, one
  workflow per lane running two ``@DBOS.step()`` calls per durable step, at 1
  and 16 concurrent workflows (in a subprocess, so its threads never overlap
  the other cases).

The targets are printed as PASS/MISS for information only; nothing asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final

import trio

from runtime._journal._frame import encode_frame
from runtime._journal._journal import Journal, encode_record
from runtime._journal._store import delivery_key, open_store
from runtime._journal._writer import _signalled
from runtime._linux._fs import OsFileSystem
from runtime._records import Admission, Fingerprints, ReplayClass, ToolIntent, ToolOutcome

from ._aio import open_aio

REPO: Final = Path(__file__).resolve().parents[1]
RESULT_MARK: Final = "BENCH-JSON "
MAX_OPS: Final = 5_000_000
"""Hard cap on operations per case, on top of its time budget."""
DBOS_STEPS_PER_WORKFLOW: Final = 20
PAIRED_SLICES: Final = 8
"""Raw appends, 1 lane and 16 lanes take turns in this many slices per round."""
NON_DISK_FS: Final = frozenset({"tmpfs", "ramfs", "devtmpfs", "proc", "sysfs"})

# -- realistic payloads ----------------------------------------------------------------

TOOL_ARGS: Final = json.dumps(
    {"command": "cd src && ls -la && git status --short && git diff --stat", "timeout": 120},
    separators=(",", ":"),
    sort_keys=True,
)
TOOL_OUTPUT: Final = (
    " M runtime/_journal/_store.py\n M runtime/_journal/_writer.py\n?? bench/journal.py\n"
    + "total 128\n"
    + "".join(
        f"-rw-r--r-- 1 dev dev {1000 + i * 37:6d} Nov 29 19:5{i % 10} file_{i:02d}.py\n"
        for i in range(8)
    )
)
REQUEST_TEXT: Final = (
    "please look at the failing test in tests/journal/test_store.py and fix it " * 3
)
RENDERED_PROMPT: Final = (
    "You are Pi, a coding agent working in the repository. " * 6
) + REQUEST_TEXT
HEX64: Final = "0123456789abcdef" * 4


def tool_intent(dkey: str, seq: int, step: int) -> ToolIntent:
    return ToolIntent(
        intent_id=f"{dkey}:{seq}",
        step=step,
        tool_call_id=f"call_{step:08d}",
        name="bash",
        args=TOOL_ARGS,
        replay_class=ReplayClass.SAFE,
        epoch=1,
    )


def tool_outcome(intent_id: str, step: int) -> ToolOutcome:
    return ToolOutcome(
        intent_id=intent_id,
        tool_call_id=f"call_{step:08d}",
        content=[{"type": "text", "text": TOOL_OUTPUT}],
    )


def admission(producer: int, n: int) -> Admission:
    return Admission(
        delivery_id=f"delivery-{producer}-{n}",
        lane=f"!room{producer % 16}:example.org",
        request={
            "room": f"!room{producer % 16}:example.org",
            "sender": "@alice:example.org",
            "event_id": f"$event{producer}x{n}",
            "text": REQUEST_TEXT,
        },
        fingerprints=Fingerprints(request=HEX64, authority=HEX64, settings=HEX64),
        rendered_prompt=RENDERED_PROMPT,
        admitted_ms=time.time_ns() // 1_000_000,
    )


def step_frames() -> tuple[bytes, bytes]:
    """The exact frames one runtime step writes (intent, outcome)."""
    dkey = delivery_key("bench")
    intent = tool_intent(dkey, 1, 0)
    return (
        encode_frame(1, [encode_record(intent)]),
        encode_frame(2, [encode_record(tool_outcome(intent.intent_id, 0))]),
    )


# -- results ---------------------------------------------------------------------------


@dataclass
class Sample:
    """One case in one round: ``ops`` operations in ``seconds``."""

    ops: int
    seconds: float
    latencies_us: list[float] = field(default_factory=list)
    cpu_seconds: float = 0.0
    """CPU time of this whole process (every thread) meanwhile; 0 if not taken."""

    @property
    def rate(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else 0.0

    @property
    def p50_us(self) -> float | None:
        """Median latency of one operation, where latencies were recorded."""
        return percentile(self.latencies_us, 0.5) if self.latencies_us else None


@dataclass(frozen=True)
class Case:
    key: str
    label: str
    unit: str


CASES: Final = (
    Case("raw_fdatasync", "raw append: write+fdatasync, 1 thread", "records/s"),
    Case("raw_step", "raw-limit step = two raw appends", "steps/s"),
    Case("lanes_1", "runtime: durable steps, 1 lane", "steps/s"),
    Case("lanes_16", "runtime: durable steps, 16 lanes", "steps/s"),
    Case("lanes_16_per_file", "runtime: 16 lanes, each log synced alone (no sync log)", "steps/s"),
    Case("lanes_64", "runtime: durable steps, 64 lanes", "steps/s"),
    Case("raw_parallel_16", "raw append: 16 threads, 16 files", "records/s"),
    Case("raw_parallel_16_step", "raw-limit step, 16 threads", "steps/s"),
    Case("lanes_16_shards_16", "runtime: 16 lanes, writer_shards=16", "steps/s"),
    Case("shared_16", "runtime: 16 lanes sharing ONE log (group commit)", "steps/s"),
    Case("admissions_64", "runtime: admissions, 64 producers", "records/s"),
    Case("admissions_256", "runtime: admissions, 256 producers", "records/s"),
    Case("raw_atomic", "raw atomic replace (tmp+fsync+rename+dir fsync)", "ops/s"),
    Case("nosync_lanes_1", "runtime, fdatasync no-op: steps, 1 lane", "steps/s"),
    Case("nosync_lanes_16", "runtime, fdatasync no-op: steps, 16 lanes", "steps/s"),
    Case("nosync_admissions_256", "runtime, fdatasync no-op: admissions, 256", "records/s"),
    Case("proto_token_1", "prototype: thread + run_sync_soon ack, 1 lane", "steps/s"),
    Case("proto_eventfd_1", "prototype: thread + per-log eventfd ack, 1 lane", "steps/s"),
    Case("proto_prealloc_1", "prototype: eventfd ack, fallocated log, 1 lane", "steps/s"),
    Case("proto_prealloc_kept_1", "prototype: the same, one log kept all round", "steps/s"),
    Case("proto_inline_1", "prototype: inline fdatasync on Trio, 1 lane", "steps/s"),
    Case("proto_aio_1", "prototype: write on Trio + AIO fdatasync, 1 lane", "steps/s"),
    Case("handoff", "Trio->writer thread->Trio hand-off alone", "round trips/s"),
    Case("to_thread", "trio.to_thread.run_sync(no-op)", "round trips/s"),
    Case("write_only", "raw os.write without sync", "records/s"),
    Case("encode", "encode_record + encode_frame", "records/s"),
    Case("dbos_1", "DBOS+SQLite WAL: steps, 1 workflow", "steps/s"),
    Case("dbos_16", "DBOS+SQLite WAL: steps, 16 workflows", "steps/s"),
)
CASE_BY_KEY: Final = {case.key: case for case in CASES}


@dataclass(frozen=True)
class Settings:
    rounds: int
    case_seconds: float
    raw_seconds: float
    micro_seconds: float
    dbos_seconds: float


FULL: Final = Settings(
    rounds=3, case_seconds=2.0, raw_seconds=1.0, micro_seconds=0.5, dbos_seconds=2.0
)
QUICK: Final = Settings(
    rounds=1, case_seconds=0.3, raw_seconds=0.3, micro_seconds=0.1, dbos_seconds=0.5
)


def process_cpu() -> float:
    """User + system CPU seconds of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


# -- where to measure ------------------------------------------------------------------


@dataclass(frozen=True)
class Mount:
    mountpoint: str
    fstype: str
    device: str


def mount_of(path: Path) -> Mount:
    """The /proc/mounts entry holding ``path`` (longest mount-point prefix)."""
    real = os.path.realpath(path)
    best = Mount("", "unknown", "unknown")
    with open("/proc/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            parts = line.split()
            if len(parts) < 3:
                continue
            device, mountpoint, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
            prefix = mountpoint.rstrip("/") + "/"
            inside = real == mountpoint or real.startswith(prefix) or mountpoint == "/"
            if inside and len(mountpoint) >= len(best.mountpoint):
                best = Mount(mountpoint, fstype, device)
    return best


def choose_base(explicit: str | None) -> Path:
    """A directory on a real disk: ``--dir``, else the repo's ``.cache/``, else /var/tmp."""
    candidates = [Path(explicit)] if explicit else [REPO / ".cache", Path("/var/tmp")]
    for candidate in candidates:
        candidate.mkdir(parents=True, exist_ok=True)
        if mount_of(candidate).fstype not in NON_DISK_FS:
            return candidate
    raise SystemExit(f"no on-disk directory among {[str(c) for c in candidates]} (all tmpfs?)")


def _read_sys(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError:
        return "?"


def describe_machine(base: Path) -> dict[str, str]:
    mount = mount_of(base)
    block = os.path.basename(os.path.realpath(mount.device)) if mount.device.startswith("/") else ""
    usage = shutil.disk_usage(base)
    same_disk = os.stat(base).st_dev == os.stat(REPO).st_dev
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "cpus": str(os.cpu_count()),
        "cpu": _cpu_model(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "trio": trio.__version__,
        "bench dir": str(base),
        "mount": f"{mount.device} on {mount.mountpoint} type {mount.fstype}",
        "same device as repo": "yes" if same_disk else "NO",
        "disk size": f"{usage.total / 2**30:.0f} GiB, {usage.free / 2**30:.0f} GiB free",
        "block device": (
            f"{block}: rotational={_read_sys(f'/sys/block/{block}/queue/rotational')}, "
            f"write_cache={_read_sys(f'/sys/block/{block}/queue/write_cache')}, "
            f"vendor={_read_sys(f'/sys/block/{block}/device/vendor')}"
            if block
            else "?"
        ),
    }


def background_load() -> str:
    """Load average and pressure stall figures: how busy the machine was meanwhile."""
    parts = [f"loadavg {_read_sys('/proc/loadavg').split(' ', 3)[:3]}"]
    for kind in ("cpu", "io"):
        line = _read_sys(f"/proc/pressure/{kind}").splitlines()[0:1]
        if line:
            fields = dict(f.split("=", 1) for f in line[0].split()[1:])
            parts.append(f"{kind} pressure some avg60={fields.get('avg60', '?')}%")
    return ", ".join(parts)


def pressure_totals() -> dict[str, float]:
    """Cumulative 'some' stall time (seconds) of cpu and io, and a timestamp."""
    totals = {"at": time.perf_counter()}
    for kind in ("cpu", "io"):
        for line in _read_sys(f"/proc/pressure/{kind}").splitlines():
            if line.startswith("some"):
                fields = dict(f.split("=", 1) for f in line.split()[1:])
                totals[kind] = int(fields.get("total", "0")) / 1e6
    return totals


def pressure_since(start: dict[str, float]) -> dict[str, float]:
    """Share of wall time (percent) some task stalled on cpu / io since ``start``."""
    end = pressure_totals()
    wall = end["at"] - start["at"]
    return {
        kind: 100 * (end[kind] - start[kind]) / wall
        for kind in ("cpu", "io")
        if kind in start and kind in end and wall > 0
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


# -- raw disk limits -------------------------------------------------------------------


def open_log(path: Path) -> int:
    """An append-only file, its first frame already durable (as a created log's header)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.write(fd, step_frames()[0])
    os.fdatasync(fd)
    return fd


def raw_appends(fd: int, seconds: float) -> Sample:
    """(a) One ``os.write`` + ``os.fdatasync`` per record, this thread, for ``seconds``."""
    frames = step_frames()
    latencies: list[float] = []
    n = 0
    start = now = time.perf_counter()
    cpu0 = process_cpu()
    deadline = start + seconds
    while now < deadline and n < MAX_OPS:
        os.write(fd, frames[n & 1])
        os.fdatasync(fd)
        after = time.perf_counter()
        latencies.append((after - now) * 1e6)
        now = after
        n += 1
    return Sample(n, now - start, latencies, cpu_seconds=process_cpu() - cpu0)


def run_threads(count: int, seconds: float, work: Callable[[int, float], int]) -> Sample:
    """Run ``work(i, deadline)`` on ``count`` threads released together; sum their ops."""
    counts = [0] * count
    barrier = threading.Barrier(count + 1)
    deadline = [0.0]

    def body(i: int) -> None:
        barrier.wait()
        counts[i] = work(i, deadline[0])

    pool = [threading.Thread(target=body, args=(i,), name=f"bench-{i}") for i in range(count)]
    for thread in pool:
        thread.start()
    start = time.perf_counter()
    cpu0 = process_cpu()
    deadline[0] = start + seconds
    barrier.wait()
    for thread in pool:
        thread.join()
    return Sample(sum(counts), time.perf_counter() - start, cpu_seconds=process_cpu() - cpu0)


def raw_parallel(directory: Path, seconds: float, threads: int) -> Sample:
    """write+fdatasync per record on ``threads`` threads, each with its own file."""
    frames = step_frames()
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
    fds = [os.open(directory / f"raw-{i}.log", flags, 0o600) for i in range(threads)]
    for fd in fds:
        os.write(fd, frames[0])
        os.fdatasync(fd)

    def work(i: int, deadline: float) -> int:
        fd = fds[i]
        n = 0
        while n < MAX_OPS and time.perf_counter() < deadline:
            os.write(fd, frames[n & 1])
            os.fdatasync(fd)
            n += 1
        return n

    try:
        return run_threads(threads, seconds, work)
    finally:
        for fd in fds:
            os.close(fd)


def raw_atomic(directory: Path, seconds: float) -> Sample:
    """(b) Per record: exclusive temp file, write, fsync, rename, directory fsync."""
    data = step_frames()[0]
    target = str(directory / "doc.json")
    tmp = target + ".tmp"
    n = 0
    start = time.perf_counter()
    cpu0 = process_cpu()
    deadline = start + seconds
    while time.perf_counter() < deadline and n < MAX_OPS:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, target)
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        n += 1
    return Sample(n, time.perf_counter() - start, cpu_seconds=process_cpu() - cpu0)


def write_only(directory: Path, seconds: float) -> Sample:
    """``os.write`` of a step frame, no sync: the syscall cost alone."""
    frames = step_frames()
    fd = os.open(
        directory / "nosync.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600
    )
    try:
        n = 0
        start = time.perf_counter()
        cpu0 = process_cpu()
        deadline = start + seconds
        while n < MAX_OPS:
            for _ in range(256):
                os.write(fd, frames[n & 1])
                n += 1
            if time.perf_counter() >= deadline:
                break
        return Sample(n, time.perf_counter() - start, cpu_seconds=process_cpu() - cpu0)
    finally:
        os.close(fd)


def encode_cost(seconds: float) -> Sample:
    """What the runtime spends encoding one record and framing it (pure CPU)."""
    dkey = delivery_key("bench")
    n = 0
    start = time.perf_counter()
    cpu0 = process_cpu()
    deadline = start + seconds
    while n < MAX_OPS:
        for _ in range(128):
            intent = tool_intent(dkey, n, n)
            encode_frame(n, [encode_record(intent)])
            encode_frame(n + 1, [encode_record(tool_outcome(intent.intent_id, n))])
            n += 2
        if time.perf_counter() >= deadline:
            break
    return Sample(n, time.perf_counter() - start, cpu_seconds=process_cpu() - cpu0)


# -- the runtime -----------------------------------------------------------------------


class NoSyncFileSystem(OsFileSystem):
    """The real file system with ``fdatasync``/``fsync`` as no-ops (benchmark only).

    Every other step of an append (encode, hand-off, ``write``, acknowledge)
    still runs, so a step on it costs exactly the runtime's own overhead.
    """

    def fdatasync(self, handle: int) -> None:
        return None

    def fsync(self, handle: int) -> None:
        return None


async def drive_lanes(journals: list[Journal], seconds: float) -> Sample:
    """One Trio task per journal, each appending intent+outcome steps for ``seconds``."""
    counts = [0] * len(journals)
    latencies: list[float] = []
    start = time.perf_counter()
    cpu0 = process_cpu()
    deadline = start + seconds

    async def lane(i: int) -> None:
        journal = journals[i]
        dkey = journal.rel  # stands in for the delivery hash in the intent id
        steps = 0
        while steps < MAX_OPS:
            before = time.perf_counter()
            if before >= deadline:
                break
            intent = tool_intent(dkey, journal.next_seq, journal.next_seq // 2)
            await journal.append(intent)
            await journal.append(tool_outcome(intent.intent_id, intent.step))
            latencies.append((time.perf_counter() - before) * 1e6)
            steps += 1
        counts[i] = steps

    async with trio.open_nursery() as nursery:
        for i in range(len(journals)):
            nursery.start_soon(lane, i)
    return Sample(
        sum(counts), time.perf_counter() - start, latencies, cpu_seconds=process_cpu() - cpu0
    )


def _add(total: Sample, part: Sample) -> None:
    total.ops += part.ops
    total.seconds += part.seconds
    total.latencies_us.extend(part.latencies_us)
    total.cpu_seconds += part.cpu_seconds


async def lanes_case(
    root: Path, lanes: int, seconds: float, *, no_sync: bool = False, shards: int = 8
) -> Sample:
    """``lanes`` concurrent lanes, each appending intent+outcome steps to its own log."""
    fs = NoSyncFileSystem() if no_sync else None
    async with open_store(root, fs=fs, writer_shards=shards) as store:
        journals = [await store.create_delivery_log(f"bench-{i}") for i in range(lanes)]
        return await drive_lanes(journals, seconds)


async def admissions_case(
    root: Path, producers: int, seconds: float, *, no_sync: bool = False
) -> Sample:
    """``producers`` concurrent tasks appending admissions to the shared log."""
    fs = NoSyncFileSystem() if no_sync else None
    async with open_store(root, fs=fs) as store:
        counts = [0] * producers
        latencies: list[float] = []
        start = time.perf_counter()
        cpu0 = process_cpu()
        deadline = start + seconds

        async def producer(p: int) -> None:
            n = 0
            while n < MAX_OPS:
                before = time.perf_counter()
                if before >= deadline:
                    break
                await store.admissions.append(admission(p, n))
                latencies.append((time.perf_counter() - before) * 1e6)
                n += 1
            counts[p] = n

        async with trio.open_nursery() as nursery:
            for p in range(producers):
                nursery.start_soon(producer, p)
        return Sample(
            sum(counts), time.perf_counter() - start, latencies, cpu_seconds=process_cpu() - cpu0
        )


# -- prototypes of a faster append (benchmark only, not the runtime) -------------------
#
# Each runs the one-lane step loop against one log file with the runtime's framing
# (encode_record on the Trio side, encode_frame + write + fdatasync where the
# variant says), so the three differ only in how the Trio task waits.

_LOG_FLAGS: Final = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC


async def _proto_steps(seconds: float, append: Callable[[int, bytes], Awaitable[None]]) -> Sample:
    dkey = delivery_key("bench-proto")
    seq = 1
    step = 0
    latencies: list[float] = []
    start = time.perf_counter()
    cpu0 = process_cpu()
    deadline = start + seconds
    while step < MAX_OPS:
        before = time.perf_counter()
        if before >= deadline:
            break
        intent = tool_intent(dkey, seq, step)
        await append(seq, encode_record(intent))
        await append(seq + 1, encode_record(tool_outcome(intent.intent_id, step)))
        seq += 2
        step += 1
        latencies.append((time.perf_counter() - before) * 1e6)
    return Sample(step, time.perf_counter() - start, latencies, cpu_seconds=process_cpu() - cpu0)


async def proto_token_case(directory: Path, seconds: float) -> Sample:
    """Writer thread, acknowledged through ``TrioToken.run_sync_soon(event.set)``
    (the runtime's mechanism, minus its bookkeeping)."""
    fd = os.open(directory / "proto-token.log", _LOG_FLAGS, 0o600)
    token = trio.lowlevel.current_trio_token()
    inbox: queue.SimpleQueue[tuple[int, bytes, trio.Event] | None] = queue.SimpleQueue()

    def worker() -> None:
        while (item := inbox.get()) is not None:
            seq, payload, done = item
            os.write(fd, encode_frame(seq, [payload]))
            os.fdatasync(fd)
            token.run_sync_soon(done.set)

    async def append(seq: int, payload: bytes) -> None:
        done = trio.Event()
        inbox.put((seq, payload, done))
        await done.wait()

    thread = threading.Thread(target=worker, name="bench-proto-token", daemon=True)
    thread.start()
    try:
        return await _proto_steps(seconds, append)
    finally:
        inbox.put(None)
        await trio.to_thread.run_sync(thread.join)
        os.close(fd)


async def _eventfd_steps(seconds: float, write: Callable[[bytes], None], name: str) -> Sample:
    """The one-lane step loop against a writer thread that ``write``s each frame (and syncs
    it), acknowledged on an eventfd the (single) appending task waits on directly."""
    efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    inbox: queue.SimpleQueue[tuple[int, bytes] | None] = queue.SimpleQueue()

    def worker() -> None:
        while (item := inbox.get()) is not None:
            seq, payload = item
            write(encode_frame(seq, [payload]))
            os.eventfd_write(efd, 1)

    async def append(seq: int, payload: bytes) -> None:
        inbox.put((seq, payload))
        await _signalled(efd)  # the runtime's own wait (journal.md J20)

    thread = threading.Thread(target=worker, name=name, daemon=True)
    thread.start()
    try:
        return await _proto_steps(seconds, append)
    finally:
        inbox.put(None)
        await trio.to_thread.run_sync(thread.join)
        os.close(efd)


async def proto_eventfd_case(directory: Path, seconds: float) -> Sample:
    """Writer thread, acknowledged on the log's own eventfd, which the (single)
    appending task waits on directly: one scheduler pass instead of two."""
    fd = os.open(directory / "proto-eventfd.log", _LOG_FLAGS, 0o600)

    def write(frame: bytes) -> None:
        os.write(fd, frame)
        os.fdatasync(fd)

    try:
        return await _eventfd_steps(seconds, write, "bench-proto-eventfd")
    finally:
        os.close(fd)


PREALLOCATED: Final = 1 << 20
"""The prototype's growth step: the file is ``fallocate``d this much ahead of its frames."""


async def proto_prealloc_case(directory: Path, seconds: float, *, kept: bool = False) -> Sample:
    """As :func:`proto_eventfd_case`, into a file ``fallocate``d ahead in 1 MiB steps: each
    frame overwrites allocated space (``pwrite`` at the logical end), so its ``fdatasync``
    has no size change to commit — only each growth step has. The runtime does this for a
    delivery's log since journal.md J19; this is the same with nothing around it.

    A fresh file each slice; ``kept``: one file for the whole round, grown slice after slice
    as the runtime case's one lane log is (a file's age may change what its syncs cost)."""
    path = directory / ("proto-prealloc-kept.log" if kept else "proto-prealloc.log")
    if not kept or not path.exists():
        path.unlink(missing_ok=True)
        _KEPT_ENDS.pop(path, None)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    end, allocated = _KEPT_ENDS.get(path, (0, 0))

    def write(frame: bytes) -> None:
        nonlocal end, allocated
        if end + len(frame) > allocated:
            os.posix_fallocate(fd, allocated, PREALLOCATED)
            allocated += PREALLOCATED
        os.pwrite(fd, frame, end)
        end += len(frame)
        os.fdatasync(fd)

    try:
        return await _eventfd_steps(seconds, write, "bench-proto-prealloc")
    finally:
        os.close(fd)
        if kept:
            _KEPT_ENDS[path] = (end, allocated)


_KEPT_ENDS: Final[dict[Path, tuple[int, int]]] = {}
"""A kept prototype log's frames' end and allocated length, from one slice to the next."""


async def proto_inline_case(directory: Path, seconds: float) -> Sample:
    """No hand-off: write + fdatasync on the Trio thread (blocks the loop meanwhile)."""
    fd = os.open(directory / "proto-inline.log", _LOG_FLAGS, 0o600)

    async def append(seq: int, payload: bytes) -> None:
        os.write(fd, encode_frame(seq, [payload]))
        os.fdatasync(fd)
        await trio.lowlevel.checkpoint()

    try:
        return await _proto_steps(seconds, append)
    finally:
        os.close(fd)


async def proto_aio_case(directory: Path, seconds: float) -> Sample:
    """No thread of ours: the frame written on the Trio thread (page cache), its
    ``fdatasync`` run by the kernel's AIO worker, the task waiting on an eventfd
    (``bench/_aio.py``). ``nan`` where the kernel gives no AIO context."""
    aio = open_aio()
    if aio is None:
        return Sample(0, 0.0)
    fd = os.open(directory / "proto-aio.log", _LOG_FLAGS, 0o600)

    async def append(seq: int, payload: bytes) -> None:
        os.write(fd, encode_frame(seq, [payload]))
        await aio.fdatasync(fd)

    try:
        return await _proto_steps(seconds, append)
    finally:
        aio.close()
        os.close(fd)


PROTOTYPES: Final[dict[str, Callable[[Path, float], Awaitable[Sample]]]] = {
    "proto_token_1": proto_token_case,
    "proto_eventfd_1": proto_eventfd_case,
    "proto_prealloc_1": proto_prealloc_case,
    "proto_prealloc_kept_1": partial(proto_prealloc_case, kept=True),
    "proto_inline_1": proto_inline_case,
    "proto_aio_1": proto_aio_case,
}


async def paired_case(root: Path, seconds: float, slices: int) -> dict[str, Sample]:
    """Raw appends, 1 lane, 16 lanes and the one-lane prototypes, taking turns.

    The target ratios compare these, and the disk's speed drifts (other work
    on the machine), so they run interleaved in ``slices`` short slices on the
    same disk, the lanes in one state directory; each gets ``seconds`` in all.
    """
    part = seconds / slices
    async with contextlib.AsyncExitStack() as stack:
        store = await stack.enter_async_context(open_store(root / "state"))
        one = [await store.create_delivery_log("bench-one")]
        many = [await store.create_delivery_log(f"bench-many-{i}") for i in range(16)]
        shared = [await store.create_delivery_log("bench-shared")] * 16
        own = await stack.enter_async_context(open_store(root / "per-file", sync_log=False))
        per_file = [await own.create_delivery_log(f"bench-many-{i}") for i in range(16)]
        fd = open_log(root / "raw.log")
        keys = ["raw_fdatasync", "lanes_1", "lanes_16", "lanes_16_per_file", "shared_16"]
        keys += PROTOTYPES
        totals = {key: Sample(0, 0.0) for key in keys}
        try:
            for _ in range(slices):
                # blocking on purpose: the writer threads are idle meanwhile
                _add(totals["raw_fdatasync"], raw_appends(fd, part))
                _add(totals["lanes_1"], await drive_lanes(one, part))
                _add(totals["lanes_16"], await drive_lanes(many, part))
                _add(totals["lanes_16_per_file"], await drive_lanes(per_file, part))
                _add(totals["shared_16"], await drive_lanes(shared, part))
                for key, prototype in PROTOTYPES.items():
                    _add(totals[key], await prototype(root, part))
        finally:
            os.close(fd)
        return totals


async def handoff_case(seconds: float) -> Sample:
    """The writer pool's hand-off with no I/O: SimpleQueue.put, a thread wakes,
    ``TrioToken.run_sync_soon(event.set)``, the task wakes."""
    token = trio.lowlevel.current_trio_token()
    inbox: queue.SimpleQueue[trio.Event | None] = queue.SimpleQueue()

    def worker() -> None:
        while (event := inbox.get()) is not None:
            token.run_sync_soon(event.set)

    thread = threading.Thread(target=worker, name="bench-handoff", daemon=True)
    thread.start()
    try:
        n = 0
        start = time.perf_counter()
        cpu0 = process_cpu()
        deadline = start + seconds
        latencies: list[float] = []
        while n < MAX_OPS and (before := time.perf_counter()) < deadline:
            event = trio.Event()
            inbox.put(event)
            await event.wait()
            latencies.append((time.perf_counter() - before) * 1e6)
            n += 1
        return Sample(n, time.perf_counter() - start, latencies, cpu_seconds=process_cpu() - cpu0)
    finally:
        inbox.put(None)
        await trio.to_thread.run_sync(thread.join)


async def to_thread_case(seconds: float) -> Sample:
    n = 0
    start = time.perf_counter()
    cpu0 = process_cpu()
    deadline = start + seconds
    latencies: list[float] = []
    while n < MAX_OPS and (before := time.perf_counter()) < deadline:
        await trio.to_thread.run_sync(int)
        latencies.append((time.perf_counter() - before) * 1e6)
        n += 1
    return Sample(n, time.perf_counter() - start, latencies, cpu_seconds=process_cpu() - cpu0)


# -- the peer: DBOS Transact with SQLite in WAL mode -----------------------------------


def dbos_worker(
    directory: Path, seconds: float, concurrencies: list[int], url: str | None = None
) -> dict[str, Any]:
    """Run in a subprocess: DBOS workflows of ``DBOS_STEPS_PER_WORKFLOW`` durable steps, on
    a SQLite system database in ``directory`` or, given ``url``, on that PostgreSQL one
    (``bench/postgres.py``)."""
    from importlib.metadata import version

    from dbos import DBOS, DBOSConfig

    db = directory / "dbos.sqlite"
    if url is None:
        # WAL is persistent in the database file: switch it on before DBOS opens it.
        with contextlib.closing(sqlite3.connect(db)) as connection:
            connection.execute("PRAGMA journal_mode=WAL")
    config: DBOSConfig = {
        "name": "pi-runtime-bench",
        "system_database_url": url or f"sqlite:///{db}",
        "application_version": "bench",
        "log_level": "WARNING",
    }
    DBOS(config=config)
    dkey = delivery_key("bench")
    intent_record = json.loads(encode_record(tool_intent(dkey, 1, 0)))
    outcome_record = json.loads(encode_record(tool_outcome(f"{dkey}:1", 0)))

    def record_intent(step: int, record: dict[str, Any]) -> dict[str, Any]:
        return record

    def record_outcome(step: int, record: dict[str, Any]) -> dict[str, Any]:
        return record

    intent_step = DBOS.step(name="tool_intent")(record_intent)
    outcome_step = DBOS.step(name="tool_outcome")(record_outcome)

    def lane(steps: int) -> int:
        for step in range(steps):
            intent_step(step, intent_record)
            outcome_step(step, outcome_record)
        return steps

    lane_workflow = DBOS.workflow(name="lane")(lane)
    DBOS.launch()
    try:
        lane_workflow(2)  # warm up
        journal_mode, synchronous = "postgresql", -1
        if url is None:
            with contextlib.closing(sqlite3.connect(db)) as connection:
                journal_mode = str(connection.execute("PRAGMA journal_mode").fetchone()[0])
                synchronous = int(connection.execute("PRAGMA synchronous").fetchone()[0])

        def work(i: int, deadline: float) -> int:
            steps = 0
            while steps < MAX_OPS and time.perf_counter() < deadline:
                steps += lane_workflow(DBOS_STEPS_PER_WORKFLOW)
            return steps

        results: dict[str, dict[str, float]] = {}
        for concurrency in concurrencies:
            sample = run_threads(concurrency, seconds, work)
            results[str(concurrency)] = {
                "steps": float(sample.ops),
                "seconds": sample.seconds,
                "cpu": sample.cpu_seconds,
            }
        return {
            "ok": True,
            "dbos": version("dbos"),
            "sqlite": sqlite3.sqlite_version,
            "journal_mode": journal_mode,
            "synchronous": synchronous,
            "results": results,
        }
    finally:
        DBOS.destroy()


def run_dbos(
    directory: Path, seconds: float, url: str | None = None
) -> tuple[dict[str, Sample], dict[str, Any]]:
    """DBOS in a subprocess (on ``url``'s PostgreSQL, or SQLite in ``directory``); returns its
    samples and facts (or the reason it failed)."""
    directory.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "bench.journal",
        "--dbos-worker",
        str(directory),
        "--dbos-seconds",
        str(seconds),
        *(["--dbos-url", url] if url else []),
    ]
    try:
        done = subprocess.run(
            command,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120 + 4 * seconds,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        return {}, {"ok": False, "error": f"DBOS worker timed out after {exc.timeout:.0f}s"}
    tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
    facts: dict[str, Any] = {
        "ok": False,
        "error": f"the DBOS worker exited {done.returncode} without a result",
        "detail": tail,
    }
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            facts = json.loads(line[len(RESULT_MARK) :])
    if not facts.get("ok"):
        if "No module named 'dbos'" in str(facts.get("error")):
            facts["detail"] = "install it with: .venv/bin/pip install 'dbos>=3'"
        return {}, facts
    samples = {
        f"dbos_{c}": Sample(
            int(r["steps"]), float(r["seconds"]), cpu_seconds=float(r.get("cpu", 0.0))
        )
        for c, r in facts["results"].items()
    }
    return samples, facts


def dbos_worker_main(directory: str, seconds: float, url: str | None = None) -> int:
    try:
        facts = dbos_worker(Path(directory), seconds, [1, 16], url)
    except Exception as exc:  # report why DBOS could not run, never crash the bench
        facts = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(RESULT_MARK + json.dumps(facts), flush=True)
    return 0


# -- one round -------------------------------------------------------------------------


def run_round(
    base: Path,
    settings: Settings,
    round_no: int,
    log: Callable[[str], None],
    *,
    with_dbos: bool = True,
) -> tuple[dict[str, Sample], dict[str, Any], dict[str, float]]:
    samples: dict[str, Sample] = {}
    cs, rs, ms = settings.case_seconds, settings.raw_seconds, settings.micro_seconds
    pressure_start = pressure_totals()

    @contextlib.contextmanager
    def fresh(name: str) -> Iterator[Path]:
        path = base / f"round{round_no}-{name}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(mode=0o700, parents=True)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def record(key: str, sample: Sample) -> None:
        samples[key] = sample
        case = CASE_BY_KEY[key]
        log(f"  round {round_no}: {case.label}: {sample.rate:,.0f} {case.unit}")

    with fresh("paired") as d:
        for key, sample in trio.run(paired_case, d, cs, PAIRED_SLICES).items():
            record(key, sample)
    raw = samples["raw_fdatasync"]
    samples["raw_step"] = Sample(raw.ops // 2, raw.seconds)
    with fresh("lanes64") as d:
        record("lanes_64", trio.run(lanes_case, d / "state", 64, cs))
    with fresh("rawpar") as d:
        record("raw_parallel_16", raw_parallel(d, rs, 16))
    par = samples["raw_parallel_16"]
    samples["raw_parallel_16_step"] = Sample(par.ops // 2, par.seconds)
    with fresh("lanes16s16") as d:
        record("lanes_16_shards_16", trio.run(partial(lanes_case, d / "state", 16, cs, shards=16)))
    for producers in (64, 256):
        with fresh(f"adm{producers}") as d:
            record(f"admissions_{producers}", trio.run(admissions_case, d / "state", producers, cs))
    with fresh("atomic") as d:
        record("raw_atomic", raw_atomic(d, rs))
    nosync_seconds = 2 * ms
    with fresh("nosync1") as d:
        record(
            "nosync_lanes_1",
            trio.run(partial(lanes_case, d / "state", 1, nosync_seconds, no_sync=True)),
        )
    with fresh("nosync16") as d:
        record(
            "nosync_lanes_16",
            trio.run(partial(lanes_case, d / "state", 16, nosync_seconds, no_sync=True)),
        )
    with fresh("nosyncadm") as d:
        record(
            "nosync_admissions_256",
            trio.run(partial(admissions_case, d / "state", 256, nosync_seconds, no_sync=True)),
        )
    record("handoff", trio.run(handoff_case, ms))
    record("to_thread", trio.run(to_thread_case, ms))
    with fresh("write") as d:
        record("write_only", write_only(d, ms))
    record("encode", encode_cost(ms))
    dbos_facts: dict[str, Any] = {"ok": False, "error": "skipped (--no-dbos)"}
    if with_dbos:
        with fresh("dbos") as d:
            dbos_samples, dbos_facts = run_dbos(d, settings.dbos_seconds)
        for key, sample in dbos_samples.items():
            record(key, sample)
        if not dbos_facts.get("ok"):
            log(f"  round {round_no}: DBOS did not run: {dbos_facts.get('error')}")
    return samples, dbos_facts, pressure_since(pressure_start)


# -- report ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    label: str
    key: str
    goal: float
    higher_is_better: bool
    formula: Callable[[dict[str, Sample]], float | None]


def _ratio(a: str, b: str) -> Callable[[dict[str, Sample]], float | None]:
    def ratio(samples: dict[str, Sample]) -> float | None:
        if a not in samples or b not in samples or samples[b].rate == 0:
            return None
        return samples[a].rate / samples[b].rate

    return ratio


def _rate(key: str) -> Callable[[dict[str, Sample]], float | None]:
    def rate(samples: dict[str, Sample]) -> float | None:
        return samples[key].rate if key in samples else None

    return rate


def _vs_raw(key: str) -> Callable[[dict[str, Sample]], float | None]:
    """Step latency of a one-lane case / (2 x raw append latency)."""

    def ratio(samples: dict[str, Sample]) -> float | None:
        if key not in samples or "raw_fdatasync" not in samples or samples[key].rate == 0:
            return None
        return samples["raw_fdatasync"].rate / (2 * samples[key].rate)

    return ratio


def _vs_raw_p50(key: str) -> Callable[[dict[str, Sample]], float | None]:
    """Median step latency of a one-lane case / (2 x median raw append latency)."""

    def ratio(samples: dict[str, Sample]) -> float | None:
        if key not in samples or "raw_fdatasync" not in samples:
            return None
        step, raw = samples[key].p50_us, samples["raw_fdatasync"].p50_us
        return step / (2 * raw) if step is not None and raw else None

    return ratio


TARGETS: Final = (
    Target(
        "1 lane: mean step latency / (2 x mean raw append)",
        "t_raw",
        2.0,
        False,
        _vs_raw("lanes_1"),
    ),
    Target(
        "1 lane: p50 step latency / (2 x p50 raw append)",
        "t_raw_p50",
        2.0,
        False,
        _vs_raw_p50("lanes_1"),
    ),
    Target(
        "1 lane steps/s / DBOS(SQLite WAL) 1 workflow",
        "t_dbos",
        2.0,
        True,
        _ratio("lanes_1", "dbos_1"),
    ),
    Target(
        "16 lanes steps/s / 1 lane steps/s", "t_scale", 2.5, True, _ratio("lanes_16", "lanes_1")
    ),
    Target("16 lanes / 1 lane (issue #23)", "t_scale23", 6.0, True, _ratio("lanes_16", "lanes_1")),
    Target("admissions/s, 64 producers", "t_adm64", 20_000, True, _rate("admissions_64")),
    Target("admissions/s, 256 producers", "t_adm256", 20_000, True, _rate("admissions_256")),
)


VS_RAW: Final = (
    ("runtime, fdatasync no-op (overhead alone)", "nosync_lanes_1"),
    ("prototype: thread + run_sync_soon ack", "proto_token_1"),
    ("prototype: thread + per-log eventfd ack", "proto_eventfd_1"),
    ("prototype: the same into a fallocated log", "proto_prealloc_1"),
    ("prototype: the same, one log kept all round", "proto_prealloc_kept_1"),
    ("prototype: inline fdatasync on Trio", "proto_inline_1"),
    ("prototype: write on Trio + AIO fdatasync", "proto_aio_1"),
)

INFO_RATIOS: Final = (
    ("16 lanes / DBOS 16 workflows", "lanes_16", "dbos_16"),
    ("64 lanes / 1 lane", "lanes_64", "lanes_1"),
    ("1 lane / raw-limit step", "lanes_1", "raw_step"),
    ("16 lanes / raw-limit step (16 threads)", "lanes_16", "raw_parallel_16_step"),
    ("raw 16 threads / raw 1 thread", "raw_parallel_16", "raw_fdatasync"),
    ("16 lanes shards=16 / shards=8 (default)", "lanes_16_shards_16", "lanes_16"),
    ("16 lanes sharing one log / 1 lane", "shared_16", "lanes_1"),
    ("16 lanes sharing one log / 16 lanes, own logs", "shared_16", "lanes_16"),
    ("16 lanes, each log synced alone / 1 lane", "lanes_16_per_file", "lanes_1"),
    ("16 lanes with the sync log / each log synced alone", "lanes_16", "lanes_16_per_file"),
    ("DBOS 16 / DBOS 1", "dbos_16", "dbos_1"),
)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt_rate(value: float) -> str:
    if value != value:  # NaN
        return "n/a"
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def per_round(rounds: list[dict[str, Sample]], loads: list[dict[str, float]]) -> list[str]:
    """The key figures of each round beside how loaded the machine was meanwhile."""
    lines = [
        "per round (stall = share of time some task waited for cpu / io, this bench included):",
        f"  {'round':>5} {'cpu stall':>9} {'io stall':>8} {'raw p50 us':>10} {'1 lane':>8} "
        f"{'16 lanes':>8} {'T1 mean':>7} {'T1 p50':>6} {'T2 dbos':>7} {'T3 16/1':>7}",
    ]

    def text(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    for i, (samples, load) in enumerate(zip(rounds, loads, strict=True), 1):
        raw = samples.get("raw_fdatasync")
        lines.append(
            f"  {i:>5} {text(load.get('cpu'), '.0f'):>8}% {text(load.get('io'), '.0f'):>7}% "
            f"{text(raw.p50_us if raw else None, '.0f'):>10} "
            f"{text(_rate('lanes_1')(samples), ',.0f'):>8} "
            f"{text(_rate('lanes_16')(samples), ',.0f'):>8} "
            f"{text(_vs_raw('lanes_1')(samples), '.2f'):>7} "
            f"{text(_vs_raw_p50('lanes_1')(samples), '.2f'):>6} "
            f"{text(_ratio('lanes_1', 'dbos_1')(samples), '.2f'):>7} "
            f"{text(_ratio('lanes_16', 'lanes_1')(samples), '.2f'):>7}"
        )
    return lines


def build_report(rounds: list[dict[str, Sample]]) -> tuple[list[str], dict[str, Any]]:
    lines: list[str] = []
    data: dict[str, Any] = {"cases": {}, "targets": {}, "ratios": {}}
    width = max(len(case.label) for case in CASES)
    lines.append(
        f"{'case':<{width}}  {'median':>10}  {'min':>10}  {'max':>10}  {'unit':<13}  "
        f"{'us/op':>8}  {'p50 us':>8}  {'p99 us':>8}  {'cpu us/op':>9}  {'cores':>5}"
    )
    lines.append("-" * (width + 100))
    for case in CASES:
        rates = [r[case.key].rate for r in rounds if case.key in r]
        if not rates:
            lines.append(f"{case.label:<{width}}  {'n/a':>10}")
            continue
        latencies = [lat for r in rounds if case.key in r for lat in r[case.key].latencies_us]
        med = _median(rates)
        us_per_op = 1e6 / med if med else float("nan")
        p50 = percentile(latencies, 0.5) if latencies else None
        p99 = percentile(latencies, 0.99) if latencies else None
        timed = [r[case.key] for r in rounds if case.key in r and r[case.key].cpu_seconds > 0]
        cpu_us = _median([t.cpu_seconds / t.ops * 1e6 for t in timed if t.ops])
        cores = _median([t.cpu_seconds / t.seconds for t in timed if t.seconds])
        lines.append(
            f"{case.label:<{width}}  {fmt_rate(med):>10}  {fmt_rate(min(rates)):>10}  "
            f"{fmt_rate(max(rates)):>10}  {case.unit:<13}  {us_per_op:>8.1f}  "
            f"{(f'{p50:.0f}' if p50 is not None else ''):>8}  "
            f"{(f'{p99:.0f}' if p99 is not None else ''):>8}  "
            f"{(f'{cpu_us:.1f}' if timed else ''):>9}  {(f'{cores:.2f}' if timed else ''):>5}"
        )
        data["cases"][case.key] = {
            "label": case.label,
            "unit": case.unit,
            "median": med,
            "min": min(rates),
            "max": max(rates),
            "rounds": rates,
            "p50_us": p50,
            "p99_us": p99,
            "cpu_us_per_op": cpu_us if timed else None,
            "cores": cores if timed else None,
        }
    lines.append("")
    lines.append("targets (ratios per round, median over rounds; informational only):")
    for target in TARGETS:
        values = [v for r in rounds if (v := target.formula(r)) is not None]
        if not values:
            lines.append(f"  {target.label:<52} {'n/a':>10}   MISS (not measured)")
            data["targets"][target.key] = {"label": target.label, "value": None, "pass": False}
            continue
        value = _median(values)
        ok = value >= target.goal if target.higher_is_better else value <= target.goal
        sign = ">=" if target.higher_is_better else "<="
        per_round = ", ".join(fmt_ratio(v) for v in values)
        lines.append(
            f"  {target.label:<52} {fmt_ratio(value):>10}   target {sign} {fmt_ratio(target.goal)}"
            f"   {'PASS' if ok else 'MISS'}   (rounds: {per_round})"
        )
        data["targets"][target.key] = {
            "label": target.label,
            "value": value,
            "goal": target.goal,
            "pass": ok,
            "rounds": values,
        }
    lines.append("")
    lines.append("other ratios (per round, median):")
    for label, a, b in INFO_RATIOS:
        values = [v for r in rounds if (v := _ratio(a, b)(r)) is not None]
        value = _median(values)
        lines.append(f"  {label:<52} {fmt_ratio(value):>10}")
        data["ratios"][label] = value
    lines.append("")
    lines.append("one-lane step latency / (2 x raw append latency), as target 1:   mean       p50")
    for label, key in (("runtime (the target's own figure)", "lanes_1"), *VS_RAW):
        mean = _median([v for r in rounds if (v := _vs_raw(key)(r)) is not None])
        p50 = _median([v for r in rounds if (v := _vs_raw_p50(key)(r)) is not None])
        lines.append(f"  {label:<52} {fmt_ratio(mean):>10} {fmt_ratio(p50):>9}")
        data["ratios"][f"vs raw (mean): {label}"] = mean
        data["ratios"][f"vs raw (p50): {label}"] = p50
    lines.append("")
    lines.append(
        "where one durable append's time goes (us; median over rounds):        mean       p50"
    )
    for label, mean, p50 in breakdown(rounds):
        p50_text = "" if p50 != p50 else f"{p50:.1f}"
        lines.append(f"  {label:<62} {mean:>8.1f}  {p50_text:>8}")
        data["breakdown_us"] = data.get("breakdown_us", {}) | {label: {"mean": mean, "p50": p50}}
    return lines, data


def fmt_ratio(value: float) -> str:
    if value != value:
        return "n/a"
    return f"{value:,.0f}" if value >= 1000 else f"{value:.2f}"


def breakdown(rounds: list[dict[str, Sample]]) -> list[tuple[str, float, float]]:
    """(label, mean us, p50 us) per append; p50 is NaN where no latencies exist."""

    def us(key: str, per: float = 1.0) -> tuple[float, float]:
        rates = [r[key].rate for r in rounds if key in r]
        p50s = [p for r in rounds if key in r and (p := r[key].p50_us) is not None]
        mean = 1e6 / _median(rates) / per if rates else float("nan")
        return mean, (_median(p50s) / per if p50s else float("nan"))

    step, raw, nosync = us("lanes_1", 2), us("raw_fdatasync"), us("nosync_lanes_1", 2)
    write, encode, handoff = us("write_only"), us("encode"), us("handoff")
    # tight loops without per-op timing: their mean stands in for their median
    write, encode = (write[0], write[0]), (encode[0], encode[0])
    rest = tuple(n - h - w - e for n, h, w, e in zip(nosync, handoff, write, encode, strict=True))
    gap = tuple(a - r - n for a, r, n in zip(step, raw, nosync, strict=True))
    rows: list[tuple[str, tuple[float, float]]] = [
        ("runtime append, 1 lane (half a step)", step),
        ("raw write+fdatasync", raw),
        ("runtime overhead: append with fdatasync no-op (half a step)", nosync),
        ("  of which the bare hand-off round trip (no I/O)", handoff),
        ("  of which os.write (no sync)", write),
        ("  of which encode_record + encode_frame", encode),
        ("  rest (Trio scheduling, Event, records, bookkeeping)", (rest[0], rest[1])),
        ("left over: append - raw - no-op-sync overhead", (gap[0], gap[1])),
        ("trio.to_thread.run_sync round trip, for comparison", us("to_thread")),
    ]
    return [(label, mean, p50) for label, (mean, p50) in rows]


# -- entry point -----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.journal", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="a few-second smoke run")
    parser.add_argument("--rounds", type=int, help="repetitions of every case (default 3, quick 1)")
    parser.add_argument("--dir", help="where to create the temporary state dirs (not tmpfs)")
    parser.add_argument("--json", help="also write every figure to this JSON file")
    parser.add_argument("--no-dbos", action="store_true", help="skip the DBOS peer")
    parser.add_argument("--dbos-worker", help=argparse.SUPPRESS)
    parser.add_argument("--dbos-seconds", type=float, default=2.0, help=argparse.SUPPRESS)
    parser.add_argument("--dbos-url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dbos_worker:
        return dbos_worker_main(args.dbos_worker, args.dbos_seconds, args.dbos_url)

    settings = QUICK if args.quick else FULL
    if args.rounds:
        settings = Settings(
            args.rounds,
            settings.case_seconds,
            settings.raw_seconds,
            settings.micro_seconds,
            settings.dbos_seconds,
        )
    base_parent = choose_base(args.dir)
    base = Path(tempfile.mkdtemp(prefix="bench-journal-", dir=base_parent))
    os.chmod(base, 0o700)
    machine = describe_machine(base)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    print("pi-runtime journal benchmark" + (" (quick)" if args.quick else ""))
    for key, value in machine.items():
        print(f"  {key}: {value}")
    intent_frame, outcome_frame = step_frames()
    print(
        f"  record frames: intent {len(intent_frame)} B, outcome {len(outcome_frame)} B, "
        f"admission {len(encode_record(admission(0, 0)))} B; "
        f"{settings.rounds} round(s), {settings.case_seconds:g}s per runtime case"
    )
    print(f"  background load before: {background_load()}")
    rounds: list[dict[str, Sample]] = []
    loads: list[dict[str, float]] = []
    dbos_facts: dict[str, Any] = {}
    started = time.perf_counter()
    try:
        for round_no in range(1, settings.rounds + 1):
            samples, facts, load = run_round(
                base, settings, round_no, log, with_dbos=not args.no_dbos
            )
            rounds.append(samples)
            loads.append(load)
            if facts.get("ok") or not dbos_facts:
                dbos_facts = facts
    finally:
        shutil.rmtree(base, ignore_errors=True)
    elapsed = time.perf_counter() - started
    if dbos_facts.get("ok"):
        print(
            f"  DBOS {dbos_facts['dbos']}, SQLite {dbos_facts['sqlite']}, "
            f"journal_mode={dbos_facts['journal_mode']}, synchronous={dbos_facts['synchronous']} "
            f"(2 = FULL), {DBOS_STEPS_PER_WORKFLOW} durable steps per workflow"
        )
    else:
        detail = dbos_facts.get("detail")
        print(f"  DBOS did not run: {dbos_facts.get('error')}" + (f" ({detail})" if detail else ""))
    print(f"  background load after: {background_load()}")
    for round_no, load in enumerate(loads, 1):
        stalls = ", ".join(f"{k} {v:.0f}%" for k, v in load.items())
        print(f"  round {round_no}: time some task stalled waiting ({stalls})")
    print(f"  measured in {elapsed:.0f}s")
    print()
    lines, data = build_report(rounds)
    lines += ["", *per_round(rounds, loads)]
    print("\n".join(lines))
    if args.json:
        data["machine"] = machine
        data["dbos"] = dbos_facts
        data["settings"] = settings.__dict__
        data["pressure_per_round"] = loads
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
