"""A room-worker host for the crash tests: ``python tests/rooms/room_host.py SPEC.json``.

It opens the room worker on the spec's configuration (relative paths resolve against the
spec's ``base``), delivers the spec's messages in order (an item ``{"wait_fifo": PATH}``
waits until something writes that FIFO, e.g. a tool that has started), then follows the
results until it has seen ``expect`` of them (acknowledging each when ``ack`` is true)
and exits 0. Every fact is one JSON line on stdout, written and flushed as it happens, so a
test can SIGKILL the host right after a named point::

    {"accepted": {...}}   the admission is durable (L1)
    {"refused": CODE}     the delivery was refused
    {"event": {...}}      typing / text_update / tool_activity
    {"result": {...}}     a published result (durable, L5)
    {"acked": SEQ}        the acknowledgement is durable
    {"paused": POINT}     the spec's ``pause`` barrier was passed; the host stops whole
                          right after it, to be killed

``pause`` names a barrier inside the runtime and how many times to pass it first, and how many
results the host must have reported before it stops there (``results``, default 0: the pass
waits for them in its task, the host's other tasks going on):
``{"point": "model_response" | "tool_intent" | "receipt_commit", "nth": N, "results": R}`` — right
after the N-th model response (or tool intent, or receipt transaction) is durable, before the worker
hears of it; ``"attachment_stored"`` — an ``attach`` call's file is durable in the attachment root,
its outcome not yet recorded; ``"attachment_outcome"`` — the outcome naming it is durable;
``"outcome_of:ID"`` — the outcome of tool call ``ID`` is durable; ``"poisoned_publish"`` — right
before a ``journal_poisoned`` result is published; ``"compaction:journal"`` — a compaction removed
step journals; ``"compaction:expired"`` — the expired-id filter is durable;
``"compaction:admissions"`` — the admission log was rewritten, the result log not yet
(docs/design/retention.md RT5); ``"compaction:rows"`` — on PostgreSQL, the compaction's transaction
committed, the host not yet told (RT11); ``"epoch_launched"`` — the N-th worker epoch is launched
and proven, its ``EpochStarted`` not yet appended (the launch window, docs/design/workers.md W13).

``fake`` gives every Fake-Pi epoch the host starts these behaviours (Fake-Pi's ``at`` barriers,
e.g. ``{"startup": "hang"}``: a worker that never reads its stdin).

The host stops **whole** at the point (``tests/_host_process.py``'s :func:`stop_here`: it
sends itself ``SIGSTOP``), not just the task that passed it: another room's turn, a lane's
ticks, a lease renewal or a writer thread would otherwise go on for as long as the test's
SIGKILL takes. Stopped, it is as the SIGKILL at the point would have left it, however late the
kill comes.

``wall_days`` sets the host's wall clock that many days from now (negative: the past; it then
stands still), so its results are published that long ago. ``compact`` compacts the shared
logs once the results were followed (``{"compacted": {"settled": N, "expired": N}}``).

``fault`` makes one write of one delivery's log fail (``{"delivery": ID, "nth": N, "errno":
E}``, the N-th write to that log, before it happens; ``tests/faultfs.py``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import trio

from fake_pi._behaviours import Behaviours, FakeConfig
from runtime._boundary._attach import AttachTool
from runtime._boundary._calls import GateCall, GateResult
from runtime._boundary._gate import RecordingGateJournal
from runtime._boundary._steps import DeliveryStepJournal
from runtime._clock import Clocks, MockWallClock, SystemSilenceClock
from runtime._config import config_from_dict
from runtime._errors import DeliveryError
from runtime._journal._interface import JournalStore
from runtime._journal._postgres import PgStore
from runtime._journal._store import Store, delivery_key
from runtime._linux._fs import OsFileSystem
from runtime._pi._launch import WorkerProgram
from runtime._records import LogKind, Record, ToolIntent, ToolOutcome
from runtime._rooms import _retention, _worker
from runtime._rooms._outbox import ResultOutbox
from runtime._rooms._worker import RoomWorker, open_room_worker
from runtime._wire import DeliveryResult
from tests._host_process import (
    emit,
    pause_after_receipt_commit,
    pause_when_epoch_launched,
    stop_here,
)
from tests.faultfs import Fault, FaultyFileSystem


class Reported:
    """How many results the host has reported so far (a pause may wait for some: ``results``)."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = trio.Event()

    def one_more(self) -> None:
        self.count += 1
        self._changed.set()
        self._changed = trio.Event()

    async def at_least(self, wanted: int) -> None:
        while self.count < wanted:
            await self._changed.wait()


RESULTS = Reported()


async def follow_events(worker: RoomWorker) -> None:
    async for event in worker.events():
        emit({"event": msgspec.to_builtins(event)})


def install_pause(point: str, nth: int, results: int = 0) -> None:
    """Stop the whole host right after the ``nth`` pass of a barrier (:func:`stop_here`), once
    it has reported ``results`` results."""
    passed = 0

    async def barrier() -> None:
        nonlocal passed
        passed += 1
        if passed == nth:
            await RESULTS.at_least(results)  # the other rooms' results the test wants first
            stop_here(point)

    if point == "epoch_launched":
        pause_when_epoch_launched(nth)
    elif point == "model_response":
        record_response = DeliveryStepJournal.record_response

        async def after_response(self: DeliveryStepJournal, digest: str, chunks: list[str]) -> None:
            await record_response(self, digest, chunks)
            await barrier()

        DeliveryStepJournal.record_response = after_response  # type: ignore[method-assign]
    elif point == "tool_intent":
        append = RecordingGateJournal._append

        async def after_intent(self: RecordingGateJournal, record: Record) -> int:
            seq = await append(self, record)
            if isinstance(record, ToolIntent):
                await barrier()
            return seq

        RecordingGateJournal._append = after_intent  # type: ignore[method-assign]
    elif point == "attachment_stored":  # the file is durable, its outcome not yet recorded
        attach = AttachTool.__call__

        async def after_store(self: AttachTool, call: GateCall, intent_id: str) -> GateResult:
            result = await attach(self, call, intent_id)
            if result.attachments:
                await barrier()
            return result

        AttachTool.__call__ = after_store  # type: ignore[method-assign]
    elif point == "attachment_outcome":  # the outcome naming it is durable, no result yet
        append_outcome = RecordingGateJournal._append

        async def after_outcome(self: RecordingGateJournal, record: Record) -> int:
            seq = await append_outcome(self, record)
            if isinstance(record, ToolOutcome) and record.attachments:
                await barrier()
            return seq

        RecordingGateJournal._append = after_outcome  # type: ignore[method-assign]
    elif point.startswith("outcome_of:"):  # the outcome of that tool-call id is durable
        call_id = point.removeprefix("outcome_of:")
        append_any = RecordingGateJournal._append

        async def after_call(self: RecordingGateJournal, record: Record) -> int:
            seq = await append_any(self, record)
            if isinstance(record, ToolOutcome) and record.tool_call_id == call_id:
                await barrier()
            return seq

        RecordingGateJournal._append = after_call  # type: ignore[method-assign]
    elif point == "receipt_commit":
        pause_after_receipt_commit(barrier)
    elif point == "poisoned_publish":
        publish = ResultOutbox.publish

        async def before_poisoned(self: ResultOutbox, **fields: Any) -> DeliveryResult:
            if fields.get("code") == "journal_poisoned":
                await barrier()
            return await publish(self, **fields)

        ResultOutbox.publish = before_poisoned  # type: ignore[method-assign]
    elif point == "compaction:journal":
        remove = _retention.remove_step_journals

        async def after_removal(store: JournalStore, deliveries: Any, **kw: Any) -> int:
            removed = await remove(store, deliveries, **kw)
            if removed:
                await barrier()
            return removed

        _retention.remove_step_journals = after_removal
        _worker.__dict__["remove_step_journals"] = after_removal  # a shared store's (RT11)
    elif point == "compaction:rows":
        compact_rows = PgStore.compact_shared

        async def after_rows(self: PgStore, fence: Any, **kw: Any) -> int | None:
            generation = await compact_rows(self, fence, **kw)
            await barrier()
            return generation

        PgStore.compact_shared = after_rows  # type: ignore[method-assign]
    elif point == "compaction:expired":
        expire = Store.expire

        async def after_expire(self: Store, since_ms: Any, **kw: Any) -> None:
            await expire(self, since_ms, **kw)
            await barrier()

        Store.expire = after_expire  # type: ignore[method-assign]
    elif point == "compaction:admissions":
        rewrite = Store.rewrite_shared

        async def after_rewrite(self: Store, journal: Any, records: Any, **kw: Any) -> Any:
            kind = journal.contents.header.kind
            rewritten = await rewrite(self, journal, records, **kw)
            if kind is LogKind.ADMISSIONS:
                await barrier()
            return rewritten

        Store.rewrite_shared = after_rewrite  # type: ignore[method-assign]
    else:
        raise ValueError(f"unknown pause point {point!r}")


async def _nothing() -> AsyncIterator[DeliveryResult]:
    results: tuple[DeliveryResult, ...] = ()
    for result in results:
        yield result


async def main(spec: dict[str, Any]) -> None:
    base = Path(spec["base"])
    if "pause" in spec:
        pause = spec["pause"]
        install_pause(pause["point"], pause.get("nth", 1), pause.get("results", 0))
    config = config_from_dict(spec["config"], base=base)
    if "fake" in spec:  # every Fake-Pi epoch with these barriers (its --fake-config)
        path = base / "fake-config.json"
        path.write_bytes(msgspec.json.encode(FakeConfig(behaviours=Behaviours(at=spec["fake"]))))
        program = WorkerProgram.fake_pi()
        behaving = dataclasses.replace(
            program, command=(*program.command, "--fake-config", str(path))
        )
        _worker.__dict__["worker_program"] = lambda config: behaving
    fs = None
    if "fault" in spec:  # one write of one delivery's log fails (tests/faultfs.py)
        fault = spec["fault"]
        where = delivery_key(fault["delivery"])
        plan = Fault("write", fault["nth"], "before", fault["errno"], path_contains=where)
        fs = FaultyFileSystem(OsFileSystem(), plan)
    # Counting a delivery file's writes needs each record written to it as it is appended:
    # through the step sync log (J12) it reaches the file later, whenever the other room's
    # records share its batch. A failing write of owed records is J15's (test_sync_log.py).
    sync_log = "fault" not in spec
    clocks = None
    if "wall_days" in spec:
        start = time.time_ns() // 1_000_000 + int(spec["wall_days"] * 86_400_000)
        clocks = Clocks(silence=SystemSilenceClock(), wall=MockWallClock.reading(start))
    async with (
        open_room_worker(config, base_dir=base, fs=fs, clocks=clocks, sync_log=sync_log) as worker,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(follow_events, worker)
        for message in spec.get("deliver", []):
            if "wait_fifo" in message:  # a step of the script: wait until a tool writes it
                await trio.to_thread.run_sync(Path(message["wait_fifo"]).read_bytes)
                continue
            try:
                emit({"accepted": msgspec.to_builtins(await worker.deliver(message))})
            except DeliveryError as error:
                emit({"refused": str(error.code)})
        seen = 0
        expect = spec.get("expect", 0)
        async for result in worker.results() if expect > 0 else _nothing():
            emit({"result": msgspec.to_builtins(result)})
            RESULTS.one_more()
            if spec.get("ack"):
                await worker.ack(result.seq)
                emit({"acked": result.seq})
            seen += 1
            if seen >= expect:
                break
        if spec.get("compact"):
            done = await worker.compact()
            emit({"compacted": {"settled": len(done.settled), "expired": len(done.expired)}})
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main, json.loads(Path(sys.argv[1]).read_text()))
