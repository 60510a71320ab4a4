"""Adversarial tests of the receipts (``docs/design/receipts.md`` R1…, gate T13): a damaged
receipt, a dead worker's receipt call settled from its session, input no store can hold.
Each test is named after the rule it tries to break; the store is a real SQLite file in a
temporary state directory or, where marked, the tables of a real, throw-away PostgreSQL
database (``tests/journal/pg_fixtures.py``)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import pytest
import trio
import trio.testing

from runtime._boundary._calls import GateCall, Saved
from runtime._boundary._gate import MemoryLog, RecordingGateJournal, canonical_args
from runtime._boundary._receipts import (
    RECEIPT_DB,
    ReceiptDamaged,
    ReceiptStore,
    open_receipt_store,
)
from runtime._boundary._receipts_pg import PgReceiptStore
from runtime._boundary._tools import DocumentTools
from runtime._errors import GateError, ReasonCode, ReceiptRefusal
from runtime._journal._postgres import open_pg_store
from runtime._records import ReplayClass, ToolIntent, ToolOutcome

from ..journal.pg_fixtures import execute, pg_dsn, pg_server

__all__ = ["pg_dsn", "pg_server"]  # the fixtures this module uses
LIMIT: Final = 30.0
KEY: Final = "k"
Damage = Callable[[str, str], Awaitable[None]]
"""``damage(statement, value)``: run an ``UPDATE`` of the receipts table (``{receipts}`` named
in it, ``?`` its one parameter) directly on the store's database, behind the runtime's back."""


@pytest.fixture(params=["sqlite", "postgresql"])
def where(request: pytest.FixtureRequest) -> str | None:
    """Which store: ``None`` for SQLite in ``tmp_path``, or a migrated database's DSN."""
    return None if request.param == "sqlite" else str(request.getfixturevalue("pg_dsn"))


@contextlib.asynccontextmanager
async def backend(
    dsn: str | None, tmp_path: Path
) -> AsyncIterator[tuple[Callable[[], Awaitable[ReceiptStore]], Damage]]:
    """An opener of the store under test (the same state each time) and its :data:`Damage`."""
    if dsn is None:

        async def sqlite() -> ReceiptStore:
            return await open_receipt_store(tmp_path, now_ms=lambda: 1_000)

        async def damage_file(statement: str, value: str) -> None:
            with contextlib.closing(sqlite3.connect(tmp_path / RECEIPT_DB)) as db, db:
                db.execute(statement.format(receipts="receipts"), (value,))

        yield sqlite, damage_file
        return
    async with open_pg_store(dsn, root=tmp_path / "state") as journal:

        async def postgresql() -> ReceiptStore:
            return PgReceiptStore(journal, now_ms=lambda: 1_000)

        async def damage_table(statement: str, value: str) -> None:
            sql = statement.format(receipts="pi_runtime.receipts").replace("?", "%s")
            await execute(dsn, sql, [value])

        yield postgresql, damage_table


def flip(text: str, at: int) -> str:
    """``text`` with the character at ``at`` changed to another one of its kind (a hex digit
    for a hex digit): one flipped byte that leaves the row well-formed."""
    old = text[at]
    new = ("1" if old != "1" else "2") if old in "0123456789abcdef" else chr(ord(old) ^ 1)
    return text[:at] + new + text[at + 1 :]


ARGS: Final = {"document_id": "notes", "content": "the applied content"}


@pytest.mark.parametrize("part", ["fingerprint", "result", "key"])
async def test_r2_a_damaged_receipt_fails_closed_never_a_definite_answer(
    where: str | None, part: str, tmp_path: Path
) -> None:
    """A receipt is proof only while it is intact. One byte of a committed receipt is
    flipped behind the runtime's back — in its input fingerprint, in its saved result (the
    revision id it reports) or in its key (so it is no longer found under its intent id) —
    and the same write is run again, as a recovery does. Each damage used to become a
    definite answer: a fingerprint that no longer matches was refused
    ``receipt_key_conflict`` ("applied with other input": settled as a tool error for a write
    that applied with exactly this input); a result whose revision id changed was handed to
    the model as the saved result (a revision that does not exist); a receipt not found
    under its key let the write run again, refused ``document_stale_base`` by its own
    revision (settled as "not applied" for a write that applied). A damaged receipt must
    fail closed: not a refusal (so the call stays unsettled, ``receipt_store_failed``),
    nothing written, the document still at the one revision."""
    with trio.fail_after(LIMIT):
        async with backend(where, tmp_path) as (reopen, damage):
            s = await reopen()
            applied = await s.write_document("k:7", ARGS)
            await s.aclose()
            if part == "fingerprint":
                await damage("UPDATE {receipts} SET input_fingerprint = ?", "0" * 64)
            elif part == "result":
                wrong = dict(applied, revision_id=flip(applied["revision_id"], 10))
                encoded = json.dumps(wrong, separators=(",", ":"))
                await damage("UPDATE {receipts} SET result = ?", encoded)
            else:
                await damage("UPDATE {receipts} SET intent_id = ?", "k:6")
            s = await reopen()
            with pytest.raises(ReceiptDamaged) as raised:  # not a ReceiptRefusal
                await s.write_document("k:7", ARGS)
            assert "k:7" in str(raised.value)
            with pytest.raises(GateError) as failed:  # the tool: not settled (R5)
                await DocumentTools(s).write(GateCall("c1", "write_document", ARGS), "k:7")
            assert failed.value.code is ReasonCode.RECEIPT_STORE_FAILED
            assert await s.revisions("notes") == [applied["revision_id"]]
            read = await s.read_document({"document_id": "notes"})
            await s.aclose()
    assert read["revision_id"] == applied["revision_id"]


async def test_r2_a_byte_flipped_on_disk_in_a_receipt_fails_closed(tmp_path: Path) -> None:
    """The same on the file itself: the store is closed (its WAL checkpointed into the
    database file), one byte of the receipt's fingerprint is flipped in ``receipts.sqlite``
    (SQLite keeps no checksum of a row's text: it reads the row as valid), and the store
    opened again. The recovery's write is not refused ``receipt_key_conflict`` (a definite
    answer, settled, for a write that applied): it fails closed, nothing written."""
    s = await open_receipt_store(tmp_path, now_ms=lambda: 1_000)
    with trio.fail_after(LIMIT):
        applied = await s.write_document("k:7", ARGS)
        with contextlib.closing(sqlite3.connect(tmp_path / RECEIPT_DB)) as db:
            (saved,) = db.execute("SELECT input_fingerprint FROM receipts").fetchone()
        await s.aclose()
    path = tmp_path / RECEIPT_DB
    data = path.read_bytes()
    assert data.count(saved.encode()) == 1  # the receipt's own bytes, nowhere else
    at = data.index(saved.encode()) + 5
    path.write_bytes(data[:at] + flip(saved, 5)[5].encode() + data[at + 1 :])
    s = await open_receipt_store(tmp_path, now_ms=lambda: 1_000)
    with trio.fail_after(LIMIT):
        with pytest.raises(GateError) as failed:
            await DocumentTools(s).write(GateCall("c1", "write_document", ARGS), "k:7")
        revisions = await s.revisions("notes")
        await s.aclose()
    assert failed.value.code is ReasonCode.RECEIPT_STORE_FAILED
    assert revisions == [applied["revision_id"]]


# ------------------------------------------- T13: a dead worker's call, settled from its session


def receipt_intent(call_id: str, args: dict[str, Any], seq: int = 1) -> ToolIntent:
    return ToolIntent(
        intent_id=f"{KEY}:{seq}",
        step=0,
        tool_call_id=call_id,
        name="write_document",
        args=canonical_args(args),
        replay_class=ReplayClass.RECEIPT,
        epoch=0,
    )


@pytest.mark.parametrize("committed", [True, False], ids=["receipt-committed", "never-applied"])
async def test_t13_a_dead_workers_receipt_call_is_settled_with_its_recorded_arguments(
    tmp_path: Path, committed: bool
) -> None:
    """Settling a dead worker's dangling ``write_document`` (T12, T13) runs the guarded write
    under the original intent id — with the arguments the intent *recorded*, the ones the
    gate was asked with and the write ran with. The session holds them as the model sent
    them, before Pi coerced them to the tool's schema (a number where a string is due:
    ``"document_id": 2024`` becomes ``"2024"``). Run with the session's, the write was
    refused ``document_invalid`` and that refusal recorded as the call's outcome: a write
    whose receipt had committed before the host died was reported to the model as refused
    (never applied), and one that had not was refused instead of applied once."""
    recorded = {"document_id": "2024", "content": "42"}  # as Pi validated them
    sent = {"document_id": 2024, "content": 42}  # as the model sent them (the session)
    intent = receipt_intent("c1", recorded)
    log = MemoryLog(records=[intent])
    store = await open_receipt_store(tmp_path, now_ms=lambda: 1_000)
    journal = RecordingGateJournal(
        log,
        key=KEY,
        epoch=1,
        granted=["write_document"],
        existing=[intent],
        runtime_tools=DocumentTools(store).handlers(),
    )
    with trio.fail_after(LIMIT):
        before = await store.write_document("k:1", recorded) if committed else None
        settled = await journal.settle(GateCall("c1", "write_document", sent))
        revisions = await store.revisions("2024")
        read = await store.read_document({"document_id": "2024"})
        await store.aclose()
    assert not settled.is_error, settled.content
    answer = json.loads(settled.content[0]["text"])
    if before is not None:
        assert answer == before  # its saved result: nothing written again
    assert revisions == [answer["revision_id"]]  # applied exactly once
    assert read["content"] == "42"
    (outcome,) = [r for r in log.records if isinstance(r, ToolOutcome)]
    assert outcome.intent_id == "k:1"
    assert not outcome.is_error


async def test_t13_t14_a_settled_receipt_call_of_another_tool_runs_no_write(
    tmp_path: Path,
) -> None:
    """The other side of settling with the recorded arguments: a dangling call whose id
    names a ``write_document`` intent but asks as another tool is still refused (T14),
    nothing written and nothing recorded."""
    intent = receipt_intent("c1", {"document_id": "notes", "content": "x"})
    log = MemoryLog(records=[intent])
    store = await open_receipt_store(tmp_path, now_ms=lambda: 1_000)
    journal = RecordingGateJournal(
        log,
        key=KEY,
        epoch=1,
        granted=["write_document", "read_document"],
        existing=[intent],
        runtime_tools=DocumentTools(store).handlers(),
    )
    with trio.fail_after(LIMIT):
        settled = await journal.settle(GateCall("c1", "read_document", {"document_id": "notes"}))
        revisions = await store.revisions("notes")
        await store.aclose()
    assert settled.is_error
    assert ReasonCode.GATE_REPLAY_MISMATCH in settled.content[0]["text"]
    assert revisions == []
    assert log.records == [intent]


# ---------------------------------------------------------- R4: input no store can hold


async def test_r4_content_that_is_not_unicode_text_is_refused_not_a_store_failure(
    where: str | None, tmp_path: Path
) -> None:
    """A lone surrogate (``"\\ud800"``: half of a pair, as a truncated emoji escape leaves
    it) is a Python ``str`` but no UTF-8 text: no store can hold it. It used to escape the
    validation as a ``UnicodeEncodeError`` — not a refusal, so the call was left unsettled
    and every recovery failed the same way (``receipt_store_failed``, the delivery failed
    each epoch) for input that can never apply. It is refused ``document_invalid`` before
    anything is written, and the same intent id then applies a valid write."""
    with trio.fail_after(LIMIT):
        async with backend(where, tmp_path) as (reopen, _damage):
            s = await reopen()
            with pytest.raises(ReceiptRefusal) as refused:
                await s.write_document("k:7", {"document_id": "d", "content": "a\ud800b"})
            assert refused.value.code is ReasonCode.DOCUMENT_INVALID
            assert "\ud800" not in refused.value.message
            assert await s.revisions("d") == []
            applied = await s.write_document("k:7", {"document_id": "d", "content": "ok"})
            assert await s.revisions("d") == [applied["revision_id"]]
            await s.aclose()


async def test_t13_a_write_rerun_while_an_earlier_epochs_run_is_under_way_answers_its_result(
    tmp_path: Path,
) -> None:
    """A room's gate outlives its worker: epoch 1's ``write_document`` is still running in the
    runtime (its store slow — here held before it reaches the store) when its worker dies,
    the epoch moves on, and epoch 2's worker replays the call. T13 re-runs the same guarded
    write under the original intent id: the two runs are one write (one applies, the other
    replays its receipt). Whichever ends second used to find no call let run (the first had
    recorded the outcome) and raise ``gate_bad_request``: the live worker was answered 409, a
    tool error, for a write that applied. Both answers are the write's result; one revision,
    one outcome."""
    store = await open_receipt_store(tmp_path, now_ms=lambda: 1_000)
    tools = DocumentTools(store)
    first_may_write, second_may_answer = trio.Event(), trio.Event()
    runs = 0

    async def slow_then_held(call: GateCall, intent_id: str) -> Any:
        nonlocal runs
        runs += 1
        if runs == 1:  # epoch 1's run: slow to reach the store
            await first_may_write.wait()
            return await tools.write(call, intent_id)
        result = await tools.write(call, intent_id)  # epoch 2's: applies, then is slow
        await second_may_answer.wait()
        return result

    log = MemoryLog()
    journal = RecordingGateJournal(
        log,
        key=KEY,
        epoch=1,
        granted=["write_document"],
        runtime_tools={"write_document": slow_then_held},
    )
    call = GateCall("c1", "write_document", ARGS)
    answers: dict[int, Any] = {}

    async def ask(epoch: int) -> None:
        try:
            answers[epoch] = await journal.decide(call)
        except GateError as error:
            answers[epoch] = error

    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, 1)
            await trio.testing.wait_all_tasks_blocked()
            journal.epoch = 2  # the worker died; the lane's next epoch replays the call
            nursery.start_soon(ask, 2)
            await trio.testing.wait_all_tasks_blocked()
            first_may_write.set()  # epoch 1's run replays epoch 2's receipt, records first
            await trio.testing.wait_all_tasks_blocked()
            second_may_answer.set()
        revisions = await store.revisions("notes")
        await store.aclose()
    assert runs == 2
    assert isinstance(answers[2], Saved), answers[2]  # the live worker: the write's result
    assert isinstance(answers[1], Saved), answers[1]
    assert answers[1].result.content == answers[2].result.content
    assert not answers[2].result.is_error
    assert json.loads(answers[2].result.content[0]["text"])["revision_id"] == revisions[0]
    assert len(revisions) == 1
    assert [r.intent_id for r in log.records if isinstance(r, ToolOutcome)] == ["k:1"]
