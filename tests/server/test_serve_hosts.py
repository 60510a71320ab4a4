"""Several ``pi-runtime serve`` hosts on one PostgreSQL database (docs/design/scale-out.md,
issue #19): lanes owned under leases, a dead host's lanes claimed by the others, a paused
host fenced out by epoch.

Each host is a real process with a local state directory and work root of its own, seen by
it at the *same* path as by every other host — as on separate machines, where every host
has ``/srv/pi-runtime`` — because a session's requests name their working directory and a
replay's must be byte-identical: each runs in a private mount namespace (``unshare
--mount``) where its own directory is bind-mounted over the common path. The tests use
Fake-Pi workers, a scripted model server shared by all hosts, and real websocket clients.

No test sleeps on the real clock: a lease runs out on the database's clock (a short
``lease_seconds``), and each step waits for the event it needs — a FIFO the tool writes, a
result frame, a line a host logs.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import trio
from trio_websocket import open_websocket_url

from fake_pi.scenario import TINY_PNG, Attach, Call, Step, Text, ToolCalls
from runtime._journal._postgres import open_pg_store
from runtime._linux._proctree import EPOCH_ENV, TreeProof, kill_tree, new_nonce, read_environ
from runtime._pi._session_settle import interrupted_text
from runtime._records import ModelResponse, Record

from .._procs import (
    KILL_BOUND,
    alive_with_nonce,
    epoch_nonces,
    hosts_run_under,
    kill_orphaned_epochs,
    workers_under,
)
from .._wire import Client, Frame, message
from .._workers import scripted_upstream
from ..journal.pg_fixtures import (
    PostgresServer,
    execute,
    pg_dsn,
    pg_server,
    start_server,
    stop_server,
)
from ..task_harness import done, make_worktree, say, wait
from .test_serve_e2e import LISTENING, REPO

__all__ = ["pg_dsn", "pg_server"]  # the fixtures this module uses
LIMIT: Final = 120.0
LEASE: Final = 4.0
"""Seconds a host's lease lasts here: a dead host's lanes are claimed this long after (short,
yet long enough that a host starved by a loaded machine keeps its other leases)."""
STOP_BOUND: Final = 60.0
"""Seconds the hosts still running as a test ends have to stop on SIGTERM (a drain with no
turn running is quick: the bound only turns a host that hangs into a failure)."""


class HostProcess:
    """One ``pi-runtime serve`` host in its own mount namespace."""

    def __init__(self, name: str, process: trio.Process, private: Path) -> None:
        self.name = name
        self.process = process
        self.private = private
        """The host's own directory (what it sees at the common path)."""
        self.stdout = b""
        self.stderr = b""
        self._changed = trio.Event()
        self.port = 0
        self.namespace: tuple[int, int] | None = None
        """Its mount namespace (device, inode), held open until the deployment ends
        (:meth:`hold_namespace`): a process found in it is this host's."""
        self._namespace_fd: int | None = None
        self.crashed = False
        """SIGKILLed by the test: what it left running is swept when the deployment ends."""

    def hold_namespace(self) -> None:
        """Open the host's mount namespace: held open, its inode — the namespace's name — is
        not reused by another host's while the deployment lasts, whatever this one does."""
        fd = os.open(f"/proc/{self.process.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        self._namespace_fd = fd
        self.namespace = _identity(os.fstat(fd))

    def release_namespace(self) -> None:
        if self._namespace_fd is not None:
            os.close(self._namespace_fd)
            self._namespace_fd = None

    @property
    def token(self) -> str:
        return (self.private / "state" / "token").read_text()

    async def read(self, stream: trio.abc.ReceiveStream, which: str) -> None:
        while data := await stream.receive_some(65536):
            setattr(self, which, getattr(self, which) + data)
            self._changed.set()
            self._changed = trio.Event()
        self._changed.set()

    async def until(self, which: str, pattern: bytes) -> re.Match[bytes]:
        """Wait until the host printed (``stdout``) or logged (``stderr``) ``pattern``."""
        while (found := re.search(pattern, getattr(self, which))) is None:
            if self.process.returncode is not None and self.process.poll() is not None:
                raise AssertionError(f"{self.name} ended: {self.stderr.decode()[-2000:]}")
            await self._changed.wait()
        return found

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[Client]:
        async with open_websocket_url(f"ws://127.0.0.1:{self.port}/") as ws:
            client = Client(ws)
            welcome = await client.hello(self.token)
            assert welcome["type"] == "welcome", welcome
            yield client

    def signal(self, number: int) -> None:
        """Send ``number`` to the host; SIGKILL is a crash (:attr:`crashed`)."""
        if number == signal.SIGKILL:
            self.crashed = True
        self.process.send_signal(number)

    async def kill(self) -> None:
        self.signal(signal.SIGKILL)
        await self.process.wait()


def _identity(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_dev, stat.st_ino


def _namespace_of(pid: int) -> tuple[int, int] | None:
    """The mount namespace of process ``pid`` (None: it is gone)."""
    try:
        return _identity(os.stat(f"/proc/{pid}/ns/mnt"))
    except OSError:
        return None


async def _stop(hosts: list[HostProcess]) -> None:
    """Stop every host still running as an operator would: SIGTERM (a paused one continued
    first), and wait for its drained exit, 0, at most :data:`STOP_BOUND` seconds — on the
    process, not the clock. A worker a host then left running is the end-of-test check's to
    find (``no_worker_left_by_hosts``), not swept."""
    running = [host for host in hosts if host.process.returncode is None]
    for host in running:
        host.signal(signal.SIGCONT)
        host.signal(signal.SIGTERM)
    with trio.move_on_after(STOP_BOUND):
        for host in running:
            await host.process.wait()
    stuck = [host.name for host in running if host.process.returncode is None]
    assert not stuck, f"hosts still running {STOP_BOUND} s after SIGTERM: {stuck}"
    failed = {host.name: host.process.returncode for host in running if host.process.returncode}
    assert not failed, f"hosts that did not stop cleanly on SIGTERM (exit status): {failed}"


def _left_by_crashes(hosts: list[HostProcess], common: Path) -> dict[int, str]:
    """The workers (``workers_under`` the common path) in the namespace of a host the test
    SIGKILLed: exactly what its crash left, with each one's host and command line."""
    crashed = {host.namespace: host.name for host in hosts if host.crashed and host.namespace}
    found = {}
    for pid, line in workers_under(common).items():
        namespace = _namespace_of(pid)
        if namespace is not None and (name := crashed.get(namespace)) is not None:
            found[pid] = f"{name}: {line}"
    return found


async def _sweep_crashed(hosts: list[HostProcess], common: Path) -> None:
    """Kill what the hosts the test SIGKILLed left running — exactly the workers in their
    own namespaces, each whole tree by its epoch's nonce (its descendants carry it too) — and
    check that none of it is left. A worker of any other host is left for the end-of-test
    check."""
    left = _left_by_crashes(hosts, common)
    nonces = {n for pid in left if (n := _nonce_of(pid)) is not None}
    for nonce in nonces:
        report = await kill_tree(TreeProof(nonce=nonce), give_up_after=KILL_BOUND)
        assert report.clean, report
    still = _left_by_crashes(hosts, common)
    assert not still, f"what the test's crashes left survived its sweep: {still}"


def _nonce_of(pid: int) -> str | None:
    prefix = f"{EPOCH_ENV}=".encode()
    for entry in (read_environ(pid) or b"").split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode()
    return None


def _config(dsn: str, url: str, name: str, lease: float = LEASE) -> str:
    return (
        'state_dir = "state"\nwork_root = "work"\n'
        'default_grants = ["bash", "attach", "send_text_update"]\n\n'
        f'[model]\nbase_url = "{url}"\n\n'
        f'[store]\nurl = "{dsn}"\nlease_seconds = {lease}\npoll_seconds = 0.1\n'
        f'host_name = "{name}"\ntask_takeover_seconds = 0\n'
    )


@contextlib.asynccontextmanager
async def deployment(root: Path, dsn: str, url: str, *, lease: float = LEASE) -> AsyncIterator[Any]:
    """Start hosts with ``start(name)`` (each in its own namespace, all at one path,
    ``start.common``: short, as ``/srv/pi-runtime`` would be — a socket's path must fit in
    108 bytes); a name started again is that host restarted on its own directory.

    When the block ends, every host still running is stopped gracefully (SIGTERM, its drained
    exit awaited), and what a host the test SIGKILLed (:meth:`HostProcess.kill`) left running
    — the workers in its own mount namespace, and only those — is killed; a worker any other
    host left is then found by the end-of-test check (``tests/_procs.py``'s
    ``no_worker_left_by_hosts``), which fails the test. Should the block fail, every host is
    SIGKILLed and everything of theirs swept."""
    common = Path(tempfile.mkdtemp(prefix="pi-hosts-", dir="/tmp"))
    hosts_run_under(common)  # every worker runs with its HOME under it, in any namespace
    hosts: list[HostProcess] = []
    async with trio.open_nursery() as nursery:

        async def start(name: str) -> HostProcess:
            private = root / "hosts" / name
            private.mkdir(parents=True, mode=0o700, exist_ok=True)
            (private / "config.toml").write_text(_config(dsn, url, name, lease))
            serve = f"{sys.executable} -m runtime._cli serve --port 0 --config {common}/config.toml"
            script = f"mount --bind {private} {common} && cd {common} && exec {serve}"
            unshare = ["unshare", "--mount", "--propagation", "private"]
            if os.geteuid() != 0:
                unshare.append("--map-root-user")
            process = await trio.lowlevel.open_process(
                [*unshare, "sh", "-c", script],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            host = HostProcess(name, process, private)
            hosts.append(host)
            assert process.stdout is not None
            assert process.stderr is not None
            nursery.start_soon(host.read, process.stdout, "stdout")
            nursery.start_soon(host.read, process.stderr, "stderr")
            host.port = int((await host.until("stdout", LISTENING.pattern)).group(2))
            host.hold_namespace()  # its own (``unshare`` then ``sh`` exec the host: one pid)
            return host

        start.common = common  # type: ignore[attr-defined]
        try:
            yield start
            await _stop(hosts)
            await _sweep_crashed(hosts, common)
        except BaseException:
            for host in hosts:  # what each host logged, for the failure's report
                print(f"--- host {host.name} stderr ---\n{host.stderr.decode(errors='replace')}")
            with trio.CancelScope(shield=True):
                for host in hosts:
                    if host.process.returncode is None:
                        host.process.send_signal(signal.SIGCONT)
                        host.process.kill()
                    await host.process.wait()
                await kill_orphaned_epochs(common)  # a failed test's: everything of theirs
            raise
        finally:
            for host in hosts:
                host.release_namespace()
            os.rmdir(common)  # empty: only ever a mount point inside the namespaces
            nursery.cancel_scope.cancel()


def _bash(command: str) -> Step:
    return ToolCalls(calls=[Call(name="bash", arguments={"command": command}, id="c1")])


async def _results(dsn: str) -> list[tuple[str, int]]:
    """Every published result in the database: (delivery id, seq)."""
    rows = await execute(
        dsn,
        "SELECT frame FROM pi_runtime.log_records WHERE log = 'results.log' AND seq > 0 "
        "ORDER BY seq",
    )
    found = []
    for (frame,) in rows:
        text = bytes(frame).decode("utf-8", "replace")
        if '"type":"result_published"' in text:
            delivery = re.search(r'"delivery_id":"([^"]+)"', text)
            seq = re.search(r'"seq":(\d+)', text)
            assert delivery is not None
            assert seq is not None
            found.append((delivery.group(1), int(seq.group(1))))
    return found


async def test_three_hosts_a_dead_hosts_lane_is_claimed_and_its_tool_not_run_again(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S10-S13, S20, S21: three hosts, a room on each (each admitting host claims its room).
    Host A is SIGKILLed while dm:1's ``bash`` tool runs — its intent and the model response
    that asked for it journaled. After A's lease runs out another host claims dm:1, kills
    A's leftover tool, restores the session from the database and replays: the model hears
    "possibly ran", the tool ran once, the model response is not asked for again. Every
    delivery has exactly one result, in one gap-free seq order, streamed to a client of
    each surviving host."""
    started, runs = tmp_path / "started.fifo", tmp_path / "runs"
    os.mkfifo(started)
    command = f"echo x >> {runs}; echo go > {started}; sleep 300"
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([_bash(command)]) as (model, url),  # then: "You said: …"
            deployment(tmp_path, pg_dsn, url) as start,
        ):
            a = await start("a")  # alone: no other host can claim dm:1 before A does (S10)
            async with a.connect() as on_a:
                await on_a.send(message("d1", room="dm:1"))
                accepted = await on_a.until(lambda f: f["type"] == "accepted")
                assert accepted["disposition"] == "started"
                await trio.to_thread.run_sync(started.read_bytes)  # the tool runs on A
                on_a_workers = epoch_nonces(start.common)  # A is the only host with one
                b, c = [await start(name) for name in "bc"]
                await a.kill()
            async with b.connect() as on_b, c.connect() as on_c:
                await on_b.send(message("d2", "to b", room="dm:2"))
                await on_c.send(message("d3", "to c", room="dm:3"))
                seen_b = await _collect(on_b, {"d1", "d2", "d3"})
                seen_c = await _collect(on_c, {"d1", "d2", "d3"})
                assert on_a_workers
                survivors = [n for n in on_a_workers if alive_with_nonce(n)]
                assert survivors == []  # nothing of A's worker and its tool is left
            claims = [h for h in (b, c) if re.search(rb"lane dm:1 claimed at epoch 2", h.stderr)]
    assert len(claims) == 1  # one host claimed A's lane
    assert seen_b == seen_c
    d1, d2, d3 = (seen_b[d] for d in ("d1", "d2", "d3"))
    assert d1["outcome"] == "reply"
    assert d1["text"].startswith(f"The tool said: {interrupted_text('bash')}")
    assert (d2["outcome"], d3["outcome"]) == ("reply", "reply")
    assert "to b" in d2["text"]
    assert "to c" in d3["text"]
    assert sorted(f["seq"] for f in (d1, d2, d3)) == [1, 2, 3]
    assert sorted(await _results(pg_dsn)) == sorted((d, f["seq"]) for d, f in seen_b.items())
    assert runs.read_text() == "x\n"  # the tool ran once
    assert model.request_count == 4  # d1's tool call once (journaled), d1's answer, d2, d3
    (replay,) = [r for r in model.requests if _tools(r.body)]
    assert _tools(replay.body) == [interrupted_text("bash")]


async def test_a11_a_picture_attached_on_one_host_is_sent_and_fetched_on_another(
    tmp_path: Path, pg_dsn: str
) -> None:
    """A11: the agent on host A attaches a picture; its bytes are in the database before the
    outcome that names them. A client of host B — whose own root has never held them — gets
    the result with the picture not lost and fetches its bytes from B, which keeps them."""
    png = base64.b64decode(TINY_PNG)
    digest = hashlib.sha256(png).hexdigest()
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([Attach(), Text(text="drawn on a")]) as (_model, url),
            deployment(tmp_path, pg_dsn, url) as start,
        ):
            a = await start("a")  # alone: no other host can claim dm:1 before A does (S10)
            async with a.connect() as on_a:
                await on_a.send(message("d1", room="dm:1"))
                accepted = await on_a.until(lambda f: f["type"] == "accepted")
                b = await start("b")
            async with b.connect() as on_b:
                seen = await _collect(on_b, {"d1"})
                await on_b.send({"type": "fetch_attachment", "id": digest})
                chunk = await on_b.until(lambda f: f["type"] in ("attachment_data", "error"))
    result = seen["d1"]
    assert (result["text"], [x["sha256"] for x in result["attachments"]]) == (
        "drawn on a",
        [digest],
    )
    assert accepted["disposition"] == "started"
    assert result["attachments"][0]["lost"] is False
    assert chunk["type"] == "attachment_data", chunk
    assert (chunk["last"], base64.b64decode(chunk["data"])) == (True, png)
    assert (a.private / "state" / "attachments" / digest).read_bytes() == png
    assert (b.private / "state" / "attachments" / digest).read_bytes() == png


def _tools(body: dict[str, Any]) -> list[str]:
    return [m["content"] for m in body.get("messages", []) if m.get("role") == "tool"]


async def _collect(client: Client, wanted: set[str]) -> dict[str, Frame]:
    """The result frames of ``wanted`` (each once: a second one fails the test)."""
    seen: dict[str, Frame] = {}
    while set(seen) != wanted:
        frame = await client.until(lambda f: f["type"] == "result")
        assert frame["delivery_id"] not in seen, f"a second result: {frame}"
        seen[frame["delivery_id"]] = frame
    return seen


async def test_a_paused_host_is_fenced_out_and_nothing_is_doubled(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S11, S12, the zombie: host A is SIGSTOPped while d1's model request is open, past its
    lease; B claims dm:1, kills A's worker, replays and answers d1. A is then SIGCONTed: it
    gives the lane up (its deadline passed, or its next write is refused by epoch) and
    writes nothing more for it — every record of A's worker epoch precedes every record of
    B's in d1's log, one model response is journaled (B's), d1 has one result — while A goes
    on serving its other rooms."""
    a_asked = trio.Event()
    arrived = 0

    async def on_request(n: int) -> None:
        nonlocal arrived
        arrived = n
        if n == 1:  # A's request: never answered (A is paused, then fenced out)
            a_asked.set()
            await trio.sleep_forever()

    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([], on_request=on_request) as (model, url),
            deployment(tmp_path, pg_dsn, url) as start,
        ):
            a = await start("a")  # alone: no other host can claim dm:1 before A does (S10)
            async with a.connect() as on_a:
                await on_a.send(message("d1", room="dm:1"))
                accepted = await on_a.until(lambda f: f["type"] == "accepted")
                assert accepted["disposition"] == "started"
                await a_asked.wait()
            b = await start("b")
            a.signal(signal.SIGSTOP)
            async with b.connect() as on_b:
                d1 = await on_b.result("d1")  # claimed after A's lease ran out
                await b.until("stderr", rb"lane dm:1 claimed at epoch 2")
                a.signal(signal.SIGCONT)
                await a.until("stderr", rb"lane dm:1 given up at epoch 1")
                async with a.connect() as again:
                    await again.send(message("d2", "still here", room="dm:2"))
                    d2 = await again.result("d2")
                    await again.send({"type": "status"})
                    status = await again.until(lambda f: f["type"] == "status")
                assert await on_b.result("d2") == d2  # every host streams every result
    assert d1["outcome"] == "reply"
    assert (d2["outcome"], d2["seq"]) == ("reply", 2)
    assert "dm:1" not in [room["room"] for room in status["rooms"]]  # A holds it no more
    assert sorted(await _results(pg_dsn)) == [("d1", 1), ("d2", 2)]
    records = await _delivery_records(pg_dsn, tmp_path, "d1")
    epochs = [r.epoch for r in records if hasattr(r, "epoch") and r.epoch > 0]
    assert epochs == sorted(epochs)  # nothing of A's epoch (1) after B's (2)
    responses = [r for r in records if isinstance(r, ModelResponse)]
    assert [r.epoch for r in responses] == [2]
    assert arrived == 3  # A's request for d1 (never answered), B's replay of it, d2
    assert model.request_count == 2  # the two answered


async def _delivery_records(dsn: str, root: Path, delivery_id: str) -> list[Record]:
    async with open_pg_store(dsn, root=root / "reader") as store:
        return list((await store.read_delivery_log(delivery_id)).records)


async def test_a_database_restart_under_two_hosts_loses_nothing(
    tmp_path: Path, pg_dsn: str, pg_server: PostgresServer
) -> None:
    """PG11-PG13 under S10-S21: two hosts, rooms spread over them, deliveries sent to both;
    the database is restarted (``pg_ctl stop -m fast``, every session cut) with deliveries in
    flight and more sent while it is down. The hosts reconnect — a lane whose lease could not
    be renewed meanwhile is given up and claimed again —, every delivery is admitted once and
    has exactly one result, in one gap-free seq order seen alike by both hosts' clients."""
    wanted = {f"d{n}" for n in range(1, 11)}

    def deliver(n: int) -> Frame:
        return message(f"d{n}", f"number {n}", room=f"dm:{n % 3}")

    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([]) as (_model, url),
            deployment(tmp_path, pg_dsn, url) as start,
        ):
            a, b = [await start(name) for name in "ab"]
            async with a.connect() as on_a, b.connect() as on_b:
                for n in range(1, 5):
                    await (on_a if n % 2 else on_b).send(deliver(n))
                first = await _collect(on_a, {f"d{n}" for n in range(1, 5)})
                await stop_server(pg_server)
                try:
                    for n in range(5, 11):
                        await (on_a if n % 2 else on_b).send(deliver(n))
                finally:
                    await start_server(pg_server)
                seen_a = {**first, **await _collect(on_a, wanted - set(first))}
                seen_b = await _collect(on_b, wanted)
    assert seen_a == seen_b
    assert sorted(f["seq"] for f in seen_a.values()) == list(range(1, 11))
    for frame in seen_a.values():  # each its own reply, or absorbed into one of a burst (L10)
        if frame["outcome"] == "absorbed":
            assert seen_a[frame["absorbed_into"]]["outcome"] == "reply"
        else:
            assert frame["outcome"] == "reply"
    assert sorted(d for d, _seq in await _results(pg_dsn)) == sorted(wanted)
    admitted = await execute(
        pg_dsn,
        "SELECT count(*) FROM pi_runtime.log_records WHERE log = 'admissions/admissions.log' "
        "AND seq > 0",
    )
    assert admitted == [(10,)]


async def submitted_waiting(host: HostProcess, worktree: Path) -> None:
    """Task ``t1`` on ``worktree`` submitted to ``host``, and waiting for its user there."""
    async with host.connect() as client:
        submit = {"type": "task_submit", "task_id": "t1", "prompt": "do the task",
                  "worktree": str(worktree)}  # fmt: skip
        await client.send(submit)
        await client.until(lambda f: f["type"] == "task_accepted")
        await client.until(lambda f: f["type"] == "task_event" and f["state"] == "waiting")


async def test_s30_s32_a_task_on_a_killed_host_is_claimed_and_held_host_lost(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S30-S32 with real hosts: a task submitted to A waits for its user; B, asked about it,
    answers ``task_elsewhere``. A is SIGKILLed; once its lease ran out B claims the task and —
    its worktree and session being A's alone — holds it ``host_lost:a``, launching nothing."""
    worktree = make_worktree(tmp_path)
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream([wait()]) as (model, url),
            deployment(tmp_path, pg_dsn, url) as start,
        ):
            a = await start("a")
            b = await start("b")
            await submitted_waiting(a, worktree)
            await b.until("stderr", rb"task t1: held by host 'a'")  # B looked
            async with b.connect() as client:
                await client.send({"type": "task_show", "task_id": "t1"})
                refused = await client.until(lambda f: f["type"] == "error")
                assert refused["code"] == "task_elsewhere", refused
                await a.kill()
                asked = model.request_count
                await b.until("stderr", rb"task t1: lane claimed")
                await client.send({"type": "task_show", "task_id": "t1"})
                view = await client.until(lambda f: f["type"] == "task_view")
    assert view["hold_reason"] == "host_lost:a", json.dumps(view)
    assert view["process_epoch"] == 1
    assert model.request_count == asked  # B asked nothing


async def test_s35_a_killed_host_started_again_gets_its_task_back_and_ends_it(
    tmp_path: Path, pg_dsn: str
) -> None:
    """S35 with real hosts: A's task waits for its user; A is SIGKILLed and B, once A's lease
    ran out, holds the task ``host_lost:a``. A is started again on its own directory: B sees
    A's own lease and gives the task back, A claims it, and the user's reply sent to A runs it
    to its end there — in its own session, B having launched nothing."""
    worktree = make_worktree(tmp_path)
    steps: list[Step] = [wait(), say("asked"), done(), say("finished")]
    with trio.fail_after(LIMIT):
        async with (
            scripted_upstream(steps) as (model, url),
            deployment(tmp_path, pg_dsn, url) as start,
        ):
            a = await start("a")
            b = await start("b")
            await submitted_waiting(a, worktree)
            await a.kill()
            await b.until("stderr", rb"task t1: lane claimed")
            a = await start("a")
            await b.until("stderr", rb"task t1: host 'a' is back; given back to it")
            await a.until("stderr", rb"task t1: lane claimed")
            async with a.connect() as client:
                await client.send({"type": "task_show", "task_id": "t1"})
                view = await client.until(lambda f: f["type"] == "task_view")
                await client.send({"type": "task_reply", "task_id": "t1", "text": "the blue one"})
                await client.until(lambda f: f["type"] == "task_view")
                ended = await client.until(
                    lambda f: f["type"] == "task_event" and f.get("ended") is not None
                )
    assert view["hold_reason"] is None, json.dumps(view)
    assert view["state"] == "waiting"
    assert ended["ended"] == "done", json.dumps(ended)
    assert model.request_count == 4  # each step asked once: B asked nothing


async def _plant_worker(host: HostProcess, common: Path) -> tuple[int, str]:
    """A stand-in for a worker ``host`` failed to stop: a process in its mount namespace, its
    HOME under the common path and an epoch nonce (what every worker carries), left running
    on its own (not the test's child); its pid and nonce."""
    nonce = new_nonce()
    enter = ["nsenter", f"--mount=/proc/{host.process.pid}/ns/mnt", "--"]
    script = "sleep 300 </dev/null >/dev/null 2>&1 & echo $!"
    env = {**os.environ, "HOME": f"{common}/work/planted-{host.name}", EPOCH_ENV: nonce}
    planted = await trio.run_process([*enter, "sh", "-c", script], env=env, capture_stdout=True)
    return int(planted.stdout), nonce


async def test_a_worker_a_stopped_host_left_is_found_and_a_killed_hosts_is_swept(
    tmp_path: Path, pg_dsn: str
) -> None:
    """The deployment's own end (docs/design/lanes.md, "No worker outlives its test"): a host
    the test did not crash is stopped gracefully (SIGTERM, drained), never SIGKILLed and
    swept, so a worker it left running is still there for the end-of-test check
    (``no_worker_left_by_hosts``) to find; what a host SIGKILLed on purpose left — exactly the
    processes of its own namespace — is swept. A stand-in for a left worker is planted in
    each host's namespace: the stopped host's is found, the killed host's is gone."""
    with trio.fail_after(LIMIT):
        async with scripted_upstream([]) as (_model, url):
            async with deployment(tmp_path, pg_dsn, url) as start:
                kept, crashed = await start("a"), await start("b")
                common: Path = start.common
                left_pid, left_nonce = await _plant_worker(kept, common)
                _, swept_nonce = await _plant_worker(crashed, common)
                await crashed.kill()
            found = workers_under(common)
            swept = alive_with_nonce(swept_nonce)
            report = await kill_tree(TreeProof(nonce=left_nonce), give_up_after=KILL_BOUND)
    assert list(found) == [left_pid], found  # for the end-of-test check to fail on
    assert swept == []
    assert report.clean, report
