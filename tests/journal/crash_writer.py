"""A writer process for the crash tests: it runs a seeded workload until killed.

Usage::

    python tests/journal/crash_writer.py STATE_DIR SEED RUN [--hold]
    python tests/journal/crash_writer.py --fork-server

It opens the state directory with :func:`runtime.open_store`, finishes the
deliveries an earlier (killed) run left in flight (named by one small document
per delivery task, replaced before each delivery's log is created), and then appends records from
several concurrent Trio tasks — tool intent/outcome pairs to fresh delivery
logs, admissions from concurrent producers (group commit), lane log appends,
result publications and document replaces — until it is killed.

It reports on stdout, one line per event, each written with a single
``os.write`` (shorter than ``PIPE_BUF``, so a line is never interleaved)::

    S <pid>                                  about to open the store
    R <pid> <start_time> <boot_id> <nonce> <previous pid or ->
                                             the store is open (owner record)
    I <rel> <seq> <digest>                   about to hand this record over
    A <rel> <seq> <digest>                   the append returned: durable
    d <rel> <version> <digest>               about to replace this document
    D <rel> <version> <digest>               the replace returned: durable
    E <rel> <reason code>                    a log was refused (failed closed)

``I`` is written *before* the record is handed to the writer threads, so any
record that can be found in a log was announced; ``A`` is written only *after*
``append`` returned, so every acknowledged line names a durable record (J1).
The digest is :func:`record_digest` of the encoded record (or of the whole
document). ``RUN`` makes delivery ids unique across runs on one directory.

With ``--hold`` it only opens the store, reports ``R`` and waits (for the
state-directory lock tests). With ``--fork-server`` it forks a writer per
command read from stdin (see :func:`fork_server`), so that hundreds of kills do
not each pay for an interpreter start.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import random
import signal
import sys
import traceback
from typing import Final, NoReturn

import trio

from runtime import Journal, JournalError, Store, open_store
from runtime._journal._journal import encode_record
from runtime._journal._store import delivery_key
from runtime._records import (
    Admission,
    EpochStarted,
    Fingerprints,
    OutboxAction,
    Outcome,
    Record,
    ReplayClass,
    Result,
    ResultPublished,
    StepAbandoned,
    ToolIntent,
    ToolOutcome,
)

LANES: Final = ("lane-0", "lane-1")
DOCUMENTS: Final = ("doc-0.json", "doc-1.json")
DELIVERY_TASKS: Final = 3
_PR_SET_PDEATHSIG: Final = 1
ADMISSION_PRODUCERS: Final = 4
SMALL_GENERATION: Final = 4096
"""The sync log size past which a generation is full, in every other run (default 4 MiB)."""


def inflight_document(task: int) -> str:
    """The document naming the delivery a delivery task is working on."""
    return f"inflight-{task}.json"


def record_digest(data: bytes) -> str:
    """The digest reported for a record's (or a document's) bytes."""
    return hashlib.sha256(data).hexdigest()[:32]


def report(*fields: object) -> None:
    """One line to the parent, written whole and unbuffered."""
    line = (" ".join(str(field) for field in fields) + "\n").encode()
    assert len(line) < 4096, "a report line must fit in PIPE_BUF"
    written = os.write(1, line)
    assert written == len(line)


def text(rng: random.Random, big_chance: float) -> str:
    """A payload: usually short, sometimes several pages (so a kill can tear it)."""
    size = rng.randint(16_000, 64_000) if rng.random() < big_chance else rng.randint(10, 300)
    return rng.randbytes(size // 2 + 1).hex()[:size]


async def append(journal: Journal, record: Record) -> int:
    """Announce, append, and acknowledge one record."""
    digest = record_digest(encode_record(record))
    seq = journal.next_seq  # the seq the pool assigns, synchronously, in append()
    report("I", journal.rel, seq, digest)
    got = await journal.append(record)
    if got != seq:
        raise AssertionError(f"{journal.rel}: announced seq {seq}, append returned {got}")
    report("A", journal.rel, seq, digest)
    return seq


def ack_header(journal: Journal) -> None:
    """Acknowledge a log's header (durable once the log was created or opened)."""
    if journal.contents.next_seq == 0:
        raise AssertionError(f"{journal.rel} was opened without a durable header")
    report("A", journal.rel, 0, record_digest(encode_record(journal.contents.records[0])))


class Workload:
    def __init__(self, store: Store, seed: str, run: int) -> None:
        self.store = store
        self.seed = seed
        self.run = run

    def rng(self, name: str) -> random.Random:
        return random.Random(f"{self.seed}:{self.run}:{name}")

    def now(self) -> int:
        return self.store.clocks.wall.time_ms()

    async def recover(self) -> None:
        """Finish the deliveries an earlier run left in flight (reopens torn tails)."""
        for task in range(DELIVERY_TASKS):
            data = await self.store.read_document(inflight_document(task))
            if data is None:
                continue
            delivery_id = json.loads(data)["delivery_id"]
            rel = self.store.delivery_rel(delivery_id)
            try:
                contents = await self.store.read_delivery_log(delivery_id)
            except FileNotFoundError:
                continue  # killed before the log was created
            except JournalError as exc:
                report("E", rel, exc.code)  # refused (fail closed); the parent judges it
                continue
            if contents.next_seq == 0:
                continue  # its header never became durable: it was never created
            if isinstance(contents.records[-1], Result):
                continue
            journal = await self.store.open_delivery_log(delivery_id)
            ack_header(journal)
            step = sum(isinstance(r, ToolIntent) for r in contents.records)
            await append(journal, StepAbandoned(step=step, reason="crashed", epoch=self.run))
            await append(
                journal,
                Result(outcome=Outcome.FAILED, code="crashed", finished_ms=self.now()),
            )
            await self.store.close_log(journal)

    async def deliveries(self, task: int) -> None:
        rng = self.rng(f"delivery-{task}")
        n = 0
        while True:
            n += 1
            delivery_id = f"r{self.run}-t{task}-{n}"
            # what a restart must finish, durable before the log exists
            await self.store.write_document(
                inflight_document(task), json.dumps({"delivery_id": delivery_id}).encode()
            )
            journal = await self.store.create_delivery_log(delivery_id)
            ack_header(journal)
            key = delivery_key(delivery_id)
            for step in range(rng.randint(1, 4)):
                call = f"call_{step}"
                intent_id = f"{key}:{journal.next_seq}"
                await append(
                    journal,
                    ToolIntent(
                        intent_id=intent_id,
                        step=step,
                        tool_call_id=call,
                        name=rng.choice(("bash", "read", "edit")),
                        args=json.dumps({"n": step, "arg": text(rng, 0.0)}),
                        replay_class=rng.choice(list(ReplayClass)),
                        epoch=self.run,
                    ),
                )
                await append(
                    journal,
                    ToolOutcome(
                        intent_id=intent_id,
                        tool_call_id=call,
                        content=[{"type": "text", "text": text(rng, 0.3)}],
                        is_error=rng.random() < 0.1,
                    ),
                )
            if rng.random() < 0.8:
                await append(
                    journal,
                    Result(outcome=Outcome.REPLY, text=text(rng, 0.0), finished_ms=self.now()),
                )
            await self.store.close_log(journal)

    async def admissions(self, producer: int) -> None:
        rng = self.rng(f"admission-{producer}")
        n = 0
        while True:
            n += 1
            request = {"n": n, "producer": producer, "text": text(rng, 0.0)}
            await append(
                self.store.admissions,
                Admission(
                    delivery_id=f"r{self.run}-a{producer}-{n}",
                    lane=rng.choice(LANES),
                    request=request,
                    fingerprints=Fingerprints(
                        request=record_digest(json.dumps(request).encode()),
                        authority=record_digest(b"authority"),
                        settings=record_digest(b"settings"),
                    ),
                    rendered_prompt=text(rng, 0.03),
                    admitted_ms=self.now(),
                ),
            )

    async def lane(self, lane: str) -> None:
        rng = self.rng(lane)
        try:
            journal = await self.store.open_lane_log(lane)
        except JournalError as exc:
            report("E", self.store.lane_rel(lane), exc.code)  # the parent judges it
            return
        ack_header(journal)
        me = self.store.owner
        await append(
            journal,
            EpochStarted(
                epoch=self.run,
                pid=me.pid,
                start_time=me.start_time,
                boot_id=me.boot_id,
                nonce=me.nonce,
                started_ms=self.now(),
            ),
        )
        n = 0
        while True:
            n += 1
            action_id = f"r{self.run}-{n}"
            for state in ("reserved", "done"):
                await append(
                    journal,
                    OutboxAction(
                        action_id=action_id,
                        kind="continue",
                        state=state,
                        detail={"note": text(rng, 0.1)},
                    ),
                )

    async def results(self) -> None:
        rng = self.rng("results")
        journal = self.store.results
        while True:
            await append(
                journal,
                ResultPublished(
                    seq=journal.next_seq,
                    delivery_id=f"r{self.run}-res-{journal.next_seq}",
                    room=rng.choice(LANES),
                    outcome=rng.choice(list(Outcome)),
                    text=text(rng, 0.05),
                ),
            )

    async def documents(self) -> None:
        rng = self.rng("documents")
        versions: dict[str, int] = {}
        for rel in DOCUMENTS:
            data = await self.store.read_document(rel)
            versions[rel] = 0 if data is None else int(json.loads(data)["version"])
        while True:
            rel = rng.choice(DOCUMENTS)
            versions[rel] += 1
            version = versions[rel]
            document = {"version": version, "run": self.run, "pad": text(rng, 0.1)}
            encoded = json.dumps(document).encode()
            digest = record_digest(encoded)
            report("d", rel, version, digest)
            await self.store.write_document(rel, encoded)
            report("D", rel, version, digest)

    async def run_forever(self) -> None:
        await self.recover()
        async with trio.open_nursery() as nursery:
            for task in range(DELIVERY_TASKS):
                nursery.start_soon(self.deliveries, task)
            for producer in range(ADMISSION_PRODUCERS):
                nursery.start_soon(self.admissions, producer)
            for lane in LANES:
                nursery.start_soon(self.lane, lane)
            nursery.start_soon(self.results)
            nursery.start_soon(self.documents)


async def main(state_dir: str, seed: str, run: int, hold: bool) -> None:
    report("S", os.getpid())
    async with open_store(state_dir) as store:
        owner = store.owner
        previous = store.previous_owner
        report(
            "R",
            owner.pid,
            owner.start_time,
            owner.boot_id,
            owner.nonce,
            "-" if previous is None else previous.pid,
        )
        if hold:
            await trio.sleep_forever()
        if run % 2:  # every other run: sync log generations that fill every few batches, so
            # kills land while full ones wait for their logs' records (J12) and are removed
            store._pool._rotate_bytes = SMALL_GENERATION
        ack_header(store.admissions)
        ack_header(store.results)
        await Workload(store, seed, run).run_forever()


def _die_with_parent() -> None:
    """Make the kernel SIGKILL this process if its fork server dies (no orphans)."""
    server = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != server:  # the server died before the prctl took effect
        os._exit(1)


def _forked_writer(state_dir: str, seed: str, run: int) -> NoReturn:
    code = 1
    try:
        _die_with_parent()
        trio.run(main, state_dir, seed, run, False)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def fork_server() -> None:
    """Fork one writer per command line ``STATE_DIR SEED RUN`` read from stdin.

    Start-up (importing Trio and the runtime) is paid once; each writer is a
    fresh process forked from this single-threaded one, which runs nothing
    between forks. For each command it reports ``P <pid>`` once the writer
    exists and ``X <pid> <wait status>`` once it has reaped it; the writer's own
    lines go to the same stdout, all of them before ``X``.
    """
    for line in sys.stdin.buffer:
        state_dir, seed, run = line.decode().split()
        pid = os.fork()
        if pid == 0:
            _forked_writer(state_dir, seed, int(run))
        report("P", pid)
        _, status = os.waitpid(pid, 0)
        report("X", pid, status)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args == ["--fork-server"]:
        fork_server()
        sys.exit(0)
    hold = "--hold" in args
    if hold:
        args.remove("--hold")
    if len(args) != 3:
        sys.exit("usage: crash_writer.py STATE_DIR SEED RUN [--hold] | --fork-server")
    trio.run(main, args[0], args[1], int(args[2]), hold)
