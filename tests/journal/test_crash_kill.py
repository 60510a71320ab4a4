"""SIGKILL a real writer process at random points; every journal must survive.

``tests/journal/crash_writer.py`` runs a seeded workload against a state directory and
reports, on a pipe, every record it is about to hand over (``I``) and every
append that returned (``A``). This test SIGKILLs it at a random point — at
birth, inside ``open_store`` (lock take-over and recovery), right after it is
ready, or after a random number of acknowledgements — reaps it, takes every
complete line it wrote, and reopens the directory in-process to check:

* every acknowledged record is there, at its seq, with its digest (J1, J2);
* every record that is there was announced by the writer (no garbage), and
  every header belongs to its file;
* every log reads cleanly: a SIGKILL keeps the page cache, so the only damage
  a reader may meet is a torn final frame (a ``write`` cut short), which is
  discarded (J3); anything else would fail closed with a reason code (J4) and
  fails this test (an empty log, or one holding only a torn header, reads as
  holding nothing: nothing in it was ever acknowledged);
* the lock is free, and the new owner's ``previous_owner`` is the killed
  process (J9).

One state directory is reused across many kills (so recovery itself gets
killed, and torn tails are cut by the next run), alongside several fresh
ones. Most writers are forked from a per-campaign fork server (an interpreter
start costs more than a whole writer life); a share are fresh interpreters
started with ``trio.lowlevel.open_process``, killed during start-up too.

The seed is printed (and named in every failure); set ``PI_CRASH_SEED`` to
replay a workload and ``PI_CRASH_KILLS`` to change the number of kills.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, NoReturn

import pytest
import trio

from runtime import JournalError, ReasonCode, open_store
from runtime._journal._journal import LogContents, encode_record, read_log
from runtime._journal._store import ADMISSIONS, LOCK, OWNER, RESULTS, delivery_key, lane_key
from runtime._journal._sync_log import read_owed
from runtime._linux._fs import OsFileSystem
from runtime._linux._proc import ProcessIdentity, identity_of
from runtime._records import Header, LogKind
from tests.journal.crash_writer import DOCUMENTS, record_digest

WRITER: Final = Path(__file__).with_name("crash_writer.py")
KILLS: Final = int(os.environ.get("PI_CRASH_KILLS", "240"))
LONG_LIVED_SHARE: Final = 0.4
"""Share of the kills spent on the one reused state directory."""
KILLS_PER_FRESH_DIR: Final = 10
SPAWNED_SHARE: Final = 0.1
"""Share of the writers started as a fresh interpreter (``open_process``); the rest
are forked by a per-campaign fork server, which pays the interpreter start once."""
CAMPAIGNS: Final = 3
"""Writers running side by side: the long-lived directory, and the fresh ones in two
halves (two cores stay busy while a campaign verifies)."""
RUN_TIMEOUT: Final = 30.0
"""Bound on one writer's life (start-up to reaped), however slow the machine."""
"""Product bug (reported): a kill between the writer thread's ``open(O_CREAT)`` of a
new log and its first ``write`` leaves an empty file, which every reader refuses
with ``journal_header_missing`` — a delivery or lane that was never acknowledged
becomes unreadable, and an empty ``admissions``/``results`` log stops
``open_store`` for good. Such a refusal is fail-closed and loses nothing
acknowledged, so it is tolerated (and counted) while this is True; set it to
False once an empty log reads as "never created"."""

_DELIVERY_LOG: Final = re.compile(r"deliveries/([0-9a-f]{32})\.log")
_LANE_LOG: Final = re.compile(r"lanes/([0-9a-f]{32})/lane\.log")


@dataclass
class Stats:
    kills: int = 0
    spawned: int = 0
    phases: Counter[str] = field(default_factory=Counter)
    acked: int = 0
    torn_tails: int = 0
    torn_bytes: int = 0
    stale_temp_files: int = 0
    logs_checked: int = 0
    empty_logs: int = 0
    """Logs left holding no acknowledged record by a kill (empty or torn header)."""
    no_fork: trio.Lock = field(default_factory=trio.Lock)
    """Held while this process holds a state directory's lock (a verification) and while it
    starts a process: a child forked meanwhile holds a copy of the lock's descriptor until it
    execs, and a writer of that directory started then found it locked (a flake seen once in
    a few thousand kills)."""


@dataclass
class StateDir:
    """One state directory and everything its writers announced and acknowledged."""

    root: Path
    seed: str
    runs: int = 0
    intents: dict[str, dict[int, str]] = field(default_factory=dict)
    """rel -> seq -> digest of the last record announced for that seq."""
    acked: dict[str, dict[int, str]] = field(default_factory=dict)
    """rel -> seq -> digest of every acknowledged record."""
    doc_intents: dict[str, dict[int, str]] = field(default_factory=dict)
    doc_acked: dict[str, int] = field(default_factory=dict)
    """rel -> highest acknowledged version."""
    verified: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """rel -> (inode, size, mtime) when it last passed; unchanged files are skipped."""

    def fail(self, message: str) -> NoReturn:
        pytest.fail(f"[seed {self.seed}, {self.root.name} run {self.runs}] {message}")


class Run:
    """One writer process: what it reported, from complete lines only."""

    def __init__(self, state: StateDir, phase: str) -> None:
        self.state = state
        self.phase = phase
        """Where it is to be killed (see :func:`_choose_kill_point`)."""
        self.pid: int | None = None
        self.identity: ProcessIdentity | None = None
        """Read from ``/proc`` by this test while the writer was alive."""
        self.reported: ProcessIdentity | None = None
        """The owner identity the writer reported once its store was open."""
        self.ready_nonce: str | None = None
        self.started = False
        self.acks = 0
        self.wait_status: int | None = None
        """Set by the fork server's ``X`` line once it reaped the writer."""

    def line(self, line: str) -> None:
        state = self.state
        kind, *fields = line.split(" ")
        if kind == "P":
            self.pid = int(fields[0])
        elif kind == "X":
            if int(fields[0]) != self.pid:
                state.fail(f"the fork server reaped {fields[0]}, not the writer {self.pid}")
            self.wait_status = int(fields[1])
        elif kind == "S":
            self.started = True
        elif kind == "R":
            pid, start_time, boot, nonce, _previous = fields
            self.reported = ProcessIdentity(pid=int(pid), start_time=int(start_time), boot_id=boot)
            self.ready_nonce = nonce
        elif kind in ("I", "A"):
            rel, seq, digest = fields[0], int(fields[1]), fields[2]
            if kind == "I":
                state.intents.setdefault(rel, {})[seq] = digest
                return
            if seq > 0 and state.intents.get(rel, {}).get(seq) != digest:
                state.fail(f"{rel} seq {seq} acknowledged without a matching announcement")
            state.acked.setdefault(rel, {})[seq] = digest
            self.acks += 1
        elif kind in ("d", "D"):
            rel, version, digest = fields[0], int(fields[1]), fields[2]
            if kind == "d":
                state.doc_intents.setdefault(rel, {})[version] = digest
                return
            if state.doc_intents.get(rel, {}).get(version) != digest:
                state.fail(f"document {rel} v{version} acknowledged without an announcement")
            state.doc_acked[rel] = max(version, state.doc_acked.get(rel, 0))
            self.acks += 1
        elif kind == "E":
            rel, code = fields
            if code != ReasonCode.JOURNAL_HEADER_MISSING or state.acked.get(rel):
                state.fail(f"the writer was refused {rel} ({code})")
            # the test's own read must refuse it the same way (checked in _read_all)
        else:
            state.fail(f"unexpected line from the writer: {line!r}")

    def reaped(self) -> bool:
        return self.wait_status is not None

    def triggered(self, phase: str, want: int) -> bool:
        return (
            (phase == "fork" and self.pid is not None)
            or (phase == "start" and self.started)
            or (phase == "ready" and self.ready_nonce is not None)
            or (phase == "acks" and self.acks >= want)
        )


class Lines:
    """Complete lines from a pipe; a line counts only once its newline arrived."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = b""

    async def receive(self) -> list[str] | None:
        """The next complete lines (maybe none yet), or ``None`` at end of file."""
        data = await self._stream.receive_some(65536)
        if not data:
            return None
        self._buffer += bytes(data)
        *lines, self._buffer = self._buffer.split(b"\n")
        return [line.decode() for line in lines]

    async def until(self, run: Run, done: Callable[[], bool], errors: Path) -> None:
        while not done():
            lines = await self.receive()
            if lines is None:
                run.state.fail(f"the writer's pipe closed early; stderr:\n{_tail(errors)}")
            for line in lines:
                run.line(line)


class ForkServer:
    """``crash_writer.py --fork-server``: one interpreter start per campaign."""

    def __init__(self, process: trio.Process, errors: Path) -> None:
        assert process.stdin is not None
        assert process.stdout is not None
        self.process = process
        self.stdin = process.stdin
        self.lines = Lines(process.stdout)
        self.errors = errors


@contextlib.asynccontextmanager
async def open_fork_server(tmp: Path, stats: Stats) -> AsyncIterator[ForkServer]:
    errors = tmp / "fork-server.stderr"
    async with stats.no_fork:
        with errors.open("wb") as stderr:
            process = await trio.lowlevel.open_process(
                [sys.executable, str(WRITER), "--fork-server"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
            )
    try:
        yield ForkServer(process, errors)
        assert process.stdin is not None
        await process.stdin.aclose()  # the server exits at end of input
        with trio.fail_after(RUN_TIMEOUT):
            assert await process.wait() == 0, _tail(errors)
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()  # its writer, if any, dies with it (PR_SET_PDEATHSIG)
                await process.wait()
            for stream in (process.stdin, process.stdout):
                if stream is not None:
                    await stream.aclose()


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:]


def _choose_kill_point(rng: random.Random, first: str) -> tuple[str, int]:
    """When to kill: at birth, on entering open_store, once ready, or after N acks."""
    phase = rng.choices((first, "start", "ready", "acks"), weights=(5, 15, 10, 70))[0]
    want = 0
    if phase == "acks":
        want = rng.choice((rng.randint(1, 8), rng.randint(8, 60), rng.randint(60, 250)))
    return phase, want


async def kill_forked(state: StateDir, server: ForkServer, rng: random.Random) -> Run:
    """Fork a writer, SIGKILL it at a random point; the server reaps it."""
    phase, want = _choose_kill_point(rng, "fork")
    run = Run(state, phase)
    command = f"{state.root} {state.seed} {state.runs}\n"
    pidfd: int | None = None
    try:
        with trio.fail_after(RUN_TIMEOUT):
            await server.stdin.send_all(command.encode())
            await server.lines.until(run, lambda: run.pid is not None, server.errors)
            assert run.pid is not None
            pidfd = os.pidfd_open(run.pid)  # the server reaps only after it dies
            run.identity = identity_of(run.pid)
            if run.identity is None or run.reaped():
                state.fail(f"the forked writer died at once; stderr:\n{_tail(server.errors)}")
            await server.lines.until(
                run,
                lambda: run.triggered(phase, want) or run.reaped(),
                server.errors,
            )
            if run.reaped():
                state.fail(
                    f"the writer exited by itself before the kill ({phase} {want}); "
                    f"stderr:\n{_tail(server.errors)}"
                )
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            # every line it wrote precedes the server's X line
            await server.lines.until(run, run.reaped, server.errors)
    finally:
        if pidfd is not None:
            if not run.reaped():
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)
    status = run.wait_status
    if status is None or not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        state.fail(f"writer ended with wait status {status}, not by SIGKILL")
    return run


async def kill_spawned(state: StateDir, rng: random.Random, tmp: Path, stats: Stats) -> Run:
    """Start a fresh interpreter on the writer, SIGKILL it at a random point, reap it.

    The kill can land anywhere, interpreter start-up included.
    """
    phase, want = _choose_kill_point(rng, "spawn")
    errors = tmp / "writer.stderr"
    async with stats.no_fork:
        with errors.open("wb") as stderr:
            process = await trio.lowlevel.open_process(
                [sys.executable, str(WRITER), str(state.root), state.seed, str(state.runs)],
                stdout=subprocess.PIPE,
                stderr=stderr,
            )
    run = Run(state, phase)
    run.pid = process.pid
    try:
        run.identity = identity_of(process.pid)
        assert run.identity is not None  # not reaped yet, so /proc/<pid> exists
        assert process.stdout is not None
        lines = Lines(process.stdout)
        with trio.fail_after(RUN_TIMEOUT):
            if phase != "spawn":
                await lines.until(run, lambda: run.triggered(phase, want), errors)
            process.send_signal(signal.SIGKILL)
            await process.wait()
            # everything it wrote before it died is still in the pipe
            while (received := await lines.receive()) is not None:
                for line in received:
                    run.line(line)
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()
            if process.stdout is not None:
                await process.stdout.aclose()
    if process.returncode != -signal.SIGKILL:
        state.fail(f"writer ended with {process.returncode}, not SIGKILL:\n{_tail(errors)}")
    return run


async def crash_once(
    state: StateDir, server: ForkServer, rng: random.Random, stats: Stats, tmp: Path
) -> None:
    """One writer life: start, SIGKILL at a random point, reap, verify the directory."""
    state.runs += 1
    if rng.random() < SPAWNED_SHARE:
        stats.spawned += 1
        run = await kill_spawned(state, rng, tmp, stats)
    else:
        run = await kill_forked(state, server, rng)
    stats.kills += 1
    stats.phases[run.phase] += 1
    stats.acked += run.acks
    await verify(state, run, stats)


# -- verification --------------------------------------------------------------------


def _expected_header(rel: str) -> tuple[LogKind, str | None] | None:
    """The kind of log at ``rel`` and the key its subject must hash to."""
    if rel == ADMISSIONS:
        return LogKind.ADMISSIONS, None
    if rel == RESULTS:
        return LogKind.RESULTS, None
    if match := _DELIVERY_LOG.fullmatch(rel):
        return LogKind.DELIVERY, match.group(1)
    if match := _LANE_LOG.fullmatch(rel):
        return LogKind.LANE, match.group(1)
    return None


def _log_rels(root: Path) -> set[str]:
    rels = {rel for rel in (ADMISSIONS, RESULTS) if (root / rel).exists()}
    if (root / "deliveries").is_dir():
        rels |= {f"deliveries/{p.name}" for p in (root / "deliveries").iterdir()}
    if (root / "lanes").is_dir():
        rels |= {f"lanes/{p.parent.name}/lane.log" for p in (root / "lanes").glob("*/lane.log")}
    return rels


def _check_log(state: StateDir, rel: str, contents: LogContents) -> None:
    """Acknowledged prefix intact (J2); nothing there that was not announced."""
    expected = _expected_header(rel)
    if expected is None:
        state.fail(f"unexpected file {rel}")
    kind, key = expected
    digests = [record_digest(encode_record(record)) for record in contents.records]
    for seq, digest in sorted(state.acked.get(rel, {}).items()):
        if seq >= len(digests):
            state.fail(f"{rel}: acknowledged record {seq} is missing (log ends at {len(digests)})")
        if digests[seq] != digest:
            state.fail(f"{rel}: record {seq} is not the acknowledged one")
    if contents.records:
        header = contents.records[0]
        if not isinstance(header, Header) or header.kind != kind:
            state.fail(f"{rel}: header {header!r} is not a {kind} header")
        if kind is LogKind.DELIVERY and delivery_key(header.subject) != key:
            state.fail(f"{rel}: header subject {header.subject!r} does not name this file")
        if kind is LogKind.LANE and lane_key(header.subject) != key:
            state.fail(f"{rel}: header subject {header.subject!r} does not name this file")
    announced = state.intents.get(rel, {})
    for seq, digest in enumerate(digests[1:], start=1):
        if announced.get(seq) != digest:
            state.fail(f"{rel}: record {seq} was never announced by a writer (garbage accepted)")


def _check_documents(state: StateDir) -> None:
    """A replaced document is whole: the acknowledged version or a later announced one."""
    for rel in DOCUMENTS:
        path = state.root / rel
        acked = state.doc_acked.get(rel)
        if not path.exists():
            if acked is not None:
                state.fail(f"document {rel} v{acked} was acknowledged but is gone")
            continue
        data = path.read_bytes()
        version = int(json.loads(data)["version"])
        if state.doc_intents.get(rel, {}).get(version) != record_digest(data):
            state.fail(f"document {rel} holds v{version}, which no writer announced")
        if acked is not None and version < acked:
            state.fail(f"document {rel} went back from acknowledged v{acked} to v{version}")


def _read_all(state: StateDir, stats: Stats) -> dict[str, LogContents]:
    """Read every log without changing anything (as a read-only view would)."""
    root = state.root
    fs = OsFileSystem()
    read: dict[str, LogContents] = {}
    owed = read_owed(fs, str(root))  # before the logs, as a read-only view must (J17)
    for rel in sorted(_log_rels(root) | set(state.acked)):
        path = root / rel
        if not path.exists():
            state.fail(f"{rel} has acknowledged records but no file")
        info = path.stat()
        fingerprint = (info.st_ino, info.st_size, info.st_mtime_ns)
        if (
            state.verified.get(rel) == fingerprint
            and rel not in (ADMISSIONS, RESULTS)
            and rel not in owed
        ):
            continue
        try:
            contents = read_log(fs, str(root), rel, owed=owed)
        except JournalError as exc:
            # J4 would fail closed with a stable code; after a SIGKILL nothing may.
            state.fail(f"{rel} does not read cleanly after a SIGKILL: {exc} (code {exc.code})")
        stats.logs_checked += 1
        if contents.next_seq == 0:
            stats.empty_logs += 1
        if contents.torn_bytes:
            stats.torn_tails += 1
            stats.torn_bytes += contents.torn_bytes
            assert rel in owed or contents.good_length + contents.torn_bytes == info.st_size
        _check_log(state, rel, contents)
        state.verified[rel] = fingerprint
        read[rel] = contents
    _check_documents(state)
    stale = [name for name in os.listdir(root) if ".tmp-" in name] if root.exists() else []
    stats.stale_temp_files = max(stats.stale_temp_files, len(stale))
    return read


def _lock_is_free(root: Path) -> bool:
    try:
        fd = os.open(root / LOCK, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing the description drops the flock too
    return True


async def verify(state: StateDir, run: Run, stats: Stats) -> None:
    """J1, J2, J3, J4 and J9 after one kill."""
    async with stats.no_fork:
        await _verify_locked(state, run, stats)


async def _verify_locked(state: StateDir, run: Run, stats: Stats) -> None:
    root = state.root
    if not await trio.to_thread.run_sync(_lock_is_free, root):
        state.fail("the state-directory lock is still held after the writer was reaped")
    before = await trio.to_thread.run_sync(_read_all, state, stats)
    async with open_store(root) as store:
        previous = store.previous_owner
        if run.ready_nonce is not None:
            # it wrote its owner record before it said it was ready
            if run.reported != run.identity:
                state.fail(f"the writer reported owner {run.reported}, it is {run.identity}")
            if previous is None or previous.identity != run.identity:
                state.fail(f"previous owner {previous} is not the killed writer {run.identity}")
            assert previous.nonce == run.ready_nonce
        elif previous is not None and previous.identity != run.identity:
            state.fail(f"previous owner {previous} is neither absent nor the killed writer")
        # reopening the shared logs cuts a torn tail and keeps exactly the good records
        for journal in (store.admissions, store.results):
            held = before.get(journal.rel)
            if held is not None and held.next_seq:
                assert journal.contents.records == held.records
                size = await trio.to_thread.run_sync(os.path.getsize, store.path(journal.rel))
                assert size == held.good_length
    # a clean release removed the owner record, so the next writer takes over freely
    assert not (root / OWNER).exists()
    state.verified.pop(ADMISSIONS, None)
    state.verified.pop(RESULTS, None)


# -- the test ------------------------------------------------------------------------


async def _campaign(
    dirs: list[tuple[StateDir, int]], rng: random.Random, stats: Stats, tmp: Path
) -> None:
    async with open_fork_server(tmp, stats) as server:
        for state, kills in dirs:
            while kills:
                await crash_once(state, server, rng, stats, tmp)
                kills -= 1


@pytest.mark.slow
async def test_sigkill_at_random_points_keeps_the_acknowledged_prefix(tmp_path: Path) -> None:
    """J1, J2, J3, J4, J9: SIGKILL a writer at random points, many times.

    Every acknowledged record survives with its seq and digest, nothing
    unannounced is accepted, every log reads cleanly (only a torn final frame
    is discarded), the lock is free and the killed writer is the recorded
    previous owner.
    """
    seed = os.environ.get("PI_CRASH_SEED") or f"{random.SystemRandom().getrandbits(32):08x}"
    print(f"crash test seed {seed} (set PI_CRASH_SEED={seed} to replay the workload)")
    started = time.monotonic()
    stats = Stats()
    long_kills = int(KILLS * LONG_LIVED_SHARE)
    fresh = [
        (StateDir(tmp_path / f"fresh-{i}" / "state", f"{seed}-{i}"), KILLS_PER_FRESH_DIR)
        for i in range(-(-(KILLS - long_kills) // KILLS_PER_FRESH_DIR))
    ]
    long_lived = (StateDir(tmp_path / "long" / "state", f"{seed}-long"), long_kills)
    campaigns = [[long_lived]] + [fresh[i :: CAMPAIGNS - 1] for i in range(CAMPAIGNS - 1)]
    for state, _ in [long_lived, *fresh]:
        state.root.parent.mkdir()
    async with trio.open_nursery() as nursery:
        for i, dirs in enumerate(campaigns):
            work = tmp_path / f"campaign-{i}"
            work.mkdir()
            nursery.start_soon(_campaign, dirs, random.Random(f"{seed}:{i}"), stats, work)
    elapsed = time.monotonic() - started
    print(
        f"seed {seed}: {stats.kills} kills ({stats.spawned} of fresh interpreters) in "
        f"{elapsed:.1f}s, kill points {dict(stats.phases)}, "
        f"{stats.acked} acknowledgements, {stats.logs_checked} log reads, "
        f"{stats.torn_tails} torn tails ({stats.torn_bytes} bytes), "
        f"at most {stats.stale_temp_files} stale temp files in a state directory, "
        f"{stats.empty_logs} logs holding no acknowledged record"
    )
    assert stats.kills >= min(KILLS, 200)
    assert stats.acked > 0
