"""The receipt and document store (runtime._boundary._receipts): tests named after the invariants
R1… of ``docs/design/receipts.md``, on a real SQLite file in a temporary state directory."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest
import trio
import trio.testing

from runtime._boundary._calls import GateCall
from runtime._boundary._receipts import (
    RECEIPT_DB,
    RECEIPT_OPERATIONS,
    STORE_RETRY,
    ReceiptStore,
    input_fingerprint,
    is_transient,
    open_receipt_store,
)
from runtime._boundary._tools import DocumentTools
from runtime._clock import Backoff
from runtime._errors import GateError, ReasonCode, ReceiptRefusal

LIMIT: Final = 30.0


async def store(tmp_path: Path) -> ReceiptStore:
    return await open_receipt_store(tmp_path, now_ms=lambda: 1_000)


def write(content: str, base: str | None = None, doc: str = "notes") -> dict[str, Any]:
    return {"document_id": doc, "content": content, "base_revision_id": base}


async def test_r1_r2_an_orphaned_write_applies_once_then_replays_its_receipt(
    tmp_path: Path,
) -> None:
    """The same guarded write serves the original call and any recovery: the first applies
    (revision and receipt together), every later one with the same intent id and input
    replays the saved result and writes nothing."""
    with trio.fail_after(LIMIT):
        s = await store(tmp_path)
        first = await s.write_document("d1:7", write("hello"))
        again = await s.write_document("d1:7", write("hello"))  # recovery
        late = await s.write_document("d1:7", write("hello"))  # the original, late
        revisions = await s.revisions("notes")
        read = await s.read_document({"document_id": "notes"})
        await s.aclose()
    assert first == again == late
    assert first["base_revision_id"] is None
    assert revisions == [first["revision_id"]]
    assert read == {"document_id": "notes", "revision_id": first["revision_id"], "content": "hello"}


async def test_r1_the_key_is_the_intent_id_two_writes_of_one_delivery_never_collide(
    tmp_path: Path,
) -> None:
    """Two calls in one delivery (the provider may reuse its tool-call id; the runtime's
    intent ids differ) are two writes, each on the revision before it."""
    with trio.fail_after(LIMIT):
        s = await store(tmp_path)
        one = await s.write_document("d1:7", write("one"))
        two = await s.write_document("d1:9", write("two", base=one["revision_id"]))
        assert await s.revisions("notes") == [one["revision_id"], two["revision_id"]]
        assert (await s.read_document({"document_id": "notes"}))["content"] == "two"
        await s.aclose()


async def test_r2_a_reused_key_with_other_input_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    with trio.fail_after(LIMIT):
        s = await store(tmp_path)
        first = await s.write_document("d1:7", write("hello"))
        with pytest.raises(ReceiptRefusal) as refused:
            await s.write_document("d1:7", write("other"))
        assert refused.value.code is ReasonCode.RECEIPT_KEY_CONFLICT
        assert await s.revisions("notes") == [first["revision_id"]]
        assert (await s.read_document({"document_id": "notes"}))["content"] == "hello"
        await s.aclose()


async def test_r3_a_stale_base_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """Compare-and-swap: a write on a revision that is no longer the head (someone wrote
    after the agent read) is a conflict, and no receipt is kept — the call can be retried
    on the new head under a new intent."""
    with trio.fail_after(LIMIT):
        s = await store(tmp_path)
        one = await s.write_document("d1:7", write("one"))
        two = await s.write_document("d2:3", write("two", base=one["revision_id"]))
        with pytest.raises(ReceiptRefusal) as refused:
            await s.write_document("d3:5", write("three", base=one["revision_id"]))
        assert refused.value.code is ReasonCode.DOCUMENT_STALE_BASE
        assert await s.revisions("notes") == [one["revision_id"], two["revision_id"]]
        with pytest.raises(ReceiptRefusal):  # no receipt: the same refusal again
            await s.write_document("d3:5", write("three", base=one["revision_id"]))
        with pytest.raises(ReceiptRefusal) as refused:  # a first write must not name a base
            await s.write_document("d4:1", write("new", base="rev-x", doc="other"))
        assert refused.value.code is ReasonCode.DOCUMENT_STALE_BASE
        await s.aclose()


@pytest.mark.parametrize(
    "args",
    [
        {"content": "no id"},
        {"document_id": "", "content": "x"},
        {"document_id": "a\nb", "content": "x"},
        {"document_id": "x" * 201, "content": "x"},
        {"document_id": "d", "content": 5},
        {"document_id": "d", "content": "x", "extra": True},
        {"document_id": "d", "content": "x" * (1024 * 1024 + 1)},
    ],
    ids=["missing", "empty-id", "control-char", "long-id", "wrong-type", "extra", "too-big"],
)
async def test_r4_invalid_input_is_refused_and_writes_nothing(
    tmp_path: Path, args: dict[str, Any]
) -> None:
    with trio.fail_after(LIMIT):
        s = await store(tmp_path)
        with pytest.raises(ReceiptRefusal) as refused:
            await s.write_document("d1:7", args)
        assert refused.value.code is ReasonCode.DOCUMENT_INVALID
        await s.aclose()
    with sqlite3.connect(tmp_path / RECEIPT_DB) as db:
        assert db.execute("SELECT count(*) FROM receipts").fetchone() == (0,)
        assert db.execute("SELECT count(*) FROM revisions").fetchone() == (0,)


async def test_r5_any_other_failure_raises_and_leaves_nothing_half_done(tmp_path: Path) -> None:
    """Not a refusal: the store is closed under the call. The error is not a
    ``ReceiptRefusal`` (the call stays unsettled) and nothing was written."""
    with trio.fail_after(LIMIT):
        s = await store(tmp_path)
        await s.aclose()
        with pytest.raises(sqlite3.ProgrammingError):
            await s.write_document("d1:7", write("hello"))
        s = await store(tmp_path)
        assert await s.revisions("notes") == []
        await s.aclose()


async def test_r6_the_database_is_durable_wal_and_full_sync_and_reopens(tmp_path: Path) -> None:
    with trio.fail_after(LIMIT):
        s = await store(tmp_path)
        first = await s.write_document("d1:7", write("kept"))
        await s.aclose()
        with sqlite3.connect(tmp_path / RECEIPT_DB) as db:
            assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        s = await store(tmp_path)
        assert await s.write_document("d1:7", write("kept")) == first  # the receipt survived
        assert (await s.read_document({"document_id": "notes"}))["content"] == "kept"
        await s.aclose()


async def test_r6_the_connection_runs_with_synchronous_full(tmp_path: Path) -> None:
    with trio.fail_after(LIMIT):
        s = await store(tmp_path)
        full = 2
        assert s._db.execute("PRAGMA synchronous").fetchone() == (full,)
        await s.aclose()


def test_r7_only_write_document_is_a_receipt_operation() -> None:
    assert frozenset({"write_document"}) == RECEIPT_OPERATIONS


def test_the_fingerprint_is_over_the_canonical_input() -> None:
    a = input_fingerprint("write_document", {"document_id": "d", "content": "x"})
    b = input_fingerprint("write_document", {"content": "x", "document_id": "d"})
    assert a == b
    assert a != input_fingerprint("write_document", {"document_id": "d", "content": "y"})


async def test_reading_an_unknown_document_is_a_tool_error(tmp_path: Path) -> None:
    with trio.fail_after(LIMIT):
        s = await store(tmp_path)
        with pytest.raises(ReceiptRefusal) as refused:
            await s.read_document({"document_id": "nothing"})
        assert refused.value.code is ReasonCode.DOCUMENT_UNKNOWN
        await s.aclose()


# R8: a transient store error is retried, bounded. Each test holds a real lock from a second
# connection on the same file, so the store (busy_timeout=0) really gets SQLITE_BUSY, and runs
# on ``autojump_clock`` (MockClock(autojump_threshold=0)): the backoff is slept in virtual
# time. No ``fail_after`` here: autojump would jump to its deadline while an attempt's thread
# runs (the store's limiter is not the default one), and with no other deadline the elapsed
# virtual time is exactly the sum of the pauses. Attempts are counted as the transactions the
# store began, by SQLite's statement trace on the store's connection.

RETRY: Final = STORE_RETRY
"""The defaults are what is tested: 5 attempts, pauses 0.1, 0.2, 0.4, 0.8 s."""
BEGIN: Final = "BEGIN IMMEDIATE"


@dataclass
class Trace:
    """Every statement the store's connection runs (called in the store's thread);
    ``on_begin(n)`` as the n-th transaction begins, before it takes its lock."""

    statements: list[str] = field(default_factory=list)
    on_begin: Callable[[int], None] = lambda n: None

    def __call__(self, sql: str) -> None:
        self.statements.append(sql)
        if sql == BEGIN:
            self.on_begin(self.begun)

    @property
    def begun(self) -> int:
        return self.statements.count(BEGIN)

    def attempt(self, n: int) -> list[str]:
        """The statements of the n-th attempt (from its ``BEGIN IMMEDIATE`` on)."""
        starts = [i for i, sql in enumerate(self.statements) if sql == BEGIN]
        end = starts[n] if n < len(starts) else len(self.statements)
        return self.statements[starts[n - 1] : end]


async def traced_store(tmp_path: Path) -> tuple[ReceiptStore, Trace]:
    """A store that gets ``SQLITE_BUSY`` at once on a lock (``busy_timeout=0``), traced."""
    s = await open_receipt_store(tmp_path, now_ms=lambda: 1_000, busy_timeout=0)
    trace = Trace()
    s._db.set_trace_callback(trace)
    return s, trace


@contextlib.contextmanager
def other_connection(path: Path, *statements: str) -> Iterator[sqlite3.Connection]:
    """A second connection on ``path`` that ran ``statements`` (so holds their locks until
    :func:`release`); usable from the store's thread too."""
    other = sqlite3.connect(path, isolation_level=None, timeout=0, check_same_thread=False)
    try:
        for sql in statements:
            other.execute(sql).fetchall()
        yield other
    finally:
        release(other)
        other.close()


def release(other: sqlite3.Connection) -> None:
    if other.in_transaction:
        other.execute("ROLLBACK")


def write_call(content: str = "hello") -> GateCall:
    return GateCall("c1", "write_document", {"document_id": "notes", "content": content})


def stored(path: Path) -> tuple[int, int]:
    """(revisions, receipts) in the file, read by a fresh connection."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        revisions = db.execute("SELECT count(*) FROM revisions").fetchone()[0]
        receipts = db.execute("SELECT count(*) FROM receipts").fetchone()[0]
    return int(revisions), int(receipts)


async def test_r8_a_lock_released_after_two_busy_attempts_applies_the_write_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The first two attempts find the file write-locked (a real SQLITE_BUSY on ``BEGIN
    IMMEDIATE``); the lock goes as the third begins. The tool answers its normal result, the
    write applied exactly once, after the first two pauses of the backoff."""
    path = tmp_path / RECEIPT_DB
    s, trace = await traced_store(tmp_path)
    with other_connection(path, BEGIN) as lock:
        trace.on_begin = lambda n: release(lock) if n == 3 else None
        start = trio.current_time()
        result = await DocumentTools(s).write(write_call(), "d1:7")
        elapsed = trio.current_time() - start
    assert trace.begun == 3
    assert trace.attempt(1) == trace.attempt(2) == [BEGIN]  # a busy BEGIN: nothing else ran
    assert elapsed == pytest.approx(0.1 + 0.2)
    assert not result.is_error
    answer = json.loads(result.content[0]["text"])
    assert answer["document_id"] == "notes"
    assert answer["base_revision_id"] is None
    assert await s.revisions("notes") == [answer["revision_id"]]
    assert await DocumentTools(s).write(write_call(), "d1:7") == result  # its receipt (R2)
    await s.aclose()
    assert stored(path) == (1, 1)


async def test_r8_a_lock_never_released_fails_the_call_after_the_policys_attempts(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Busy on every attempt: exactly ``attempts`` transactions begun, the summed backoff slept
    (0.1 + 0.2 + 0.4 + 0.8 s), then ``receipt_store_failed`` (the call stays unsettled), no
    transaction left open and nothing written."""
    path = tmp_path / RECEIPT_DB
    s, trace = await traced_store(tmp_path)
    with other_connection(path, BEGIN):
        start = trio.current_time()
        with pytest.raises(GateError) as failed:
            await DocumentTools(s).write(write_call(), "d1:7")
        elapsed = trio.current_time() - start
    assert trace.statements == [BEGIN] * RETRY.attempts == [BEGIN] * 5  # a busy BEGIN: no more
    assert elapsed == pytest.approx(RETRY.total_delay) == 1.5
    assert failed.value.code is ReasonCode.RECEIPT_STORE_FAILED
    assert "database is locked" in failed.value.message
    assert f"after {RETRY.attempts} attempts" in failed.value.message
    assert not s._db.in_transaction
    await s.aclose()
    assert stored(path) == (0, 0)


async def test_r8_a_non_transient_error_is_not_retried(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A real ``SQLITE_FULL`` (the file may not grow: ``max_page_count`` at its size) is an
    ``OperationalError`` like busy, but not transient. After one busy attempt the lock goes and
    the second attempt finds the disk full: it is the last, after one pause. A closed store
    fails at once, without a pause. Nothing is written."""
    path = tmp_path / RECEIPT_DB
    s, trace = await traced_store(tmp_path)
    pages = s._db.execute("PRAGMA page_count").fetchone()[0]
    s._db.execute(f"PRAGMA max_page_count = {pages}")
    with other_connection(path, BEGIN) as lock:
        trace.on_begin = lambda n: release(lock) if n == 2 else None
        start = trio.current_time()
        with pytest.raises(GateError) as failed:
            await DocumentTools(s).write(write_call("x" * 100_000), "d1:7")
        elapsed = trio.current_time() - start
    assert trace.begun == 2
    assert elapsed == pytest.approx(RETRY.first_delay)
    assert failed.value.code is ReasonCode.RECEIPT_STORE_FAILED
    assert "database or disk is full" in failed.value.message
    assert not s._db.in_transaction
    await s.aclose()
    start = trio.current_time()
    with pytest.raises(GateError) as failed:  # closed: sqlite3.ProgrammingError
        await DocumentTools(s).write(write_call(), "d1:7")
    assert trio.current_time() == start
    assert failed.value.code is ReasonCode.RECEIPT_STORE_FAILED
    assert stored(path) == (0, 0)


async def test_r8_a_busy_commit_is_rolled_back_and_the_whole_write_retried(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """``COMMIT`` itself busy, after the receipt check and every insert ran: in rollback-journal
    mode (set here only; in the store's WAL mode a commit needs no lock the writer lacks) a
    reader's shared lock makes it so. SQLite leaves that transaction open; the store rolls it
    back, and the next attempt runs the whole guarded write again, receipt check (R2) first:
    one revision, one receipt."""
    path = tmp_path / RECEIPT_DB
    s, trace = await traced_store(tmp_path)
    assert s._db.execute("PRAGMA journal_mode = DELETE").fetchone() == ("delete",)
    with other_connection(path, "BEGIN", "SELECT count(*) FROM receipts") as reader:
        trace.on_begin = lambda n: release(reader) if n == 2 else None
        start = trio.current_time()
        result = await DocumentTools(s).write(write_call(), "d1:7")
        elapsed = trio.current_time() - start
    first = trace.attempt(1)
    assert first[1].startswith("SELECT input_fingerprint, result FROM receipts")
    assert any(sql.startswith("INSERT INTO receipts") for sql in first)
    assert first[-2:] == ["COMMIT", "ROLLBACK"]
    assert trace.attempt(2)[-1] == "COMMIT"
    assert trace.begun == 2
    assert elapsed == pytest.approx(RETRY.first_delay)
    assert not result.is_error
    await s.aclose()
    assert stored(path) == (1, 1)


def test_r8_the_backoff_grows_by_its_factor_up_to_its_cap() -> None:
    assert list(RETRY.delays()) == pytest.approx([0.1, 0.2, 0.4, 0.8])
    long = Backoff(attempts=7, first_delay=0.5, factor=2.0, max_delay=2.0)
    assert list(long.delays()) == [0.5, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert list(Backoff(attempts=1, first_delay=0.1, max_delay=1.0).delays()) == []


def test_r8_only_busy_and_locked_are_transient() -> None:
    def error(code: int | None) -> sqlite3.Error:
        e = sqlite3.OperationalError("x")
        if code is not None:
            e.sqlite_errorcode = code
        return e

    busy_snapshot, locked_sharedcache = sqlite3.SQLITE_BUSY | 2 << 8, sqlite3.SQLITE_LOCKED | 1 << 8
    for code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, busy_snapshot, locked_sharedcache):
        assert is_transient(error(code))
    for other in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_READONLY, None):
        assert not is_transient(error(other))
    assert not is_transient(ReceiptRefusal(ReasonCode.DOCUMENT_INVALID, "x"))
