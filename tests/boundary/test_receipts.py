"""The receipt and document store (runtime._boundary._receipts): tests named after the invariants
R1… of ``docs/design/receipts.md``. R1-R4 and the reads run on both backends (R9): a real
SQLite file in a temporary state directory, and the tables of a real, throw-away PostgreSQL
database (``tests/journal/pg_fixtures.py``); what only one backend has (SQLite's WAL and
busy locks, R6 and R8; PostgreSQL's hosts and broken connections, R9) is tested on it."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest
import trio
import trio.testing

from runtime._boundary import _receipts, _receipts_pg
from runtime._boundary._calls import GateCall
from runtime._boundary._receipts import (
    RECEIPT_DB,
    RECEIPT_OPERATIONS,
    STORE_RETRY,
    ReceiptStore,
    SqliteReceiptStore,
    input_fingerprint,
    is_transient,
    open_receipt_store,
)
from runtime._boundary._receipts_pg import PgReceiptStore
from runtime._boundary._tools import DocumentTools
from runtime._clock import Backoff
from runtime._errors import GateError, ReasonCode, ReceiptRefusal
from runtime._journal._postgres import open_pg_store

from ..journal.pg_fixtures import cutting_proxy, execute, pg_dsn, pg_server

__all__ = ["pg_dsn", "pg_server"]  # the fixtures this module uses
LIMIT: Final = 30.0
Opener = Callable[[], Awaitable[ReceiptStore]]
"""Opens the store under test again (the same state: a restart)."""


async def store(tmp_path: Path) -> SqliteReceiptStore:
    return await open_receipt_store(tmp_path, now_ms=lambda: 1_000)


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path | str]:
    """Which store, and where: a state directory, or a migrated database's DSN."""
    if request.param == "sqlite":
        return "sqlite", tmp_path
    return "postgresql", request.getfixturevalue("pg_dsn")


@pytest.fixture
async def reopen(backend: tuple[str, Path | str], tmp_path: Path) -> AsyncIterator[Opener]:
    kind, where = backend
    if kind == "sqlite":
        assert isinstance(where, Path)

        async def sqlite() -> ReceiptStore:
            return await open_receipt_store(where, now_ms=lambda: 1_000)

        yield sqlite
        return
    assert isinstance(where, str)
    async with open_pg_store(where, root=tmp_path / "state") as journal:

        async def postgresql() -> ReceiptStore:
            return PgReceiptStore(journal, now_ms=lambda: 1_000)

        yield postgresql


def write(content: str, base: str | None = None, doc: str = "notes") -> dict[str, Any]:
    return {"document_id": doc, "content": content, "base_revision_id": base}


async def test_r1_r2_an_orphaned_write_applies_once_then_replays_its_receipt(
    reopen: Opener,
) -> None:
    """The same guarded write serves the original call and any recovery: the first applies
    (revision and receipt together), every later one with the same intent id and input
    replays the saved result and writes nothing — also after the store is opened again."""
    with trio.fail_after(LIMIT):
        s = await reopen()
        first = await s.write_document("d1:7", write("hello"))
        again = await s.write_document("d1:7", write("hello"))  # recovery
        await s.aclose()
        s = await reopen()
        late = await s.write_document("d1:7", write("hello"))  # the original, late
        revisions = await s.revisions("notes")
        read = await s.read_document({"document_id": "notes"})
        await s.aclose()
    assert first == again == late
    assert first["base_revision_id"] is None
    assert revisions == [first["revision_id"]]
    assert read == {"document_id": "notes", "revision_id": first["revision_id"], "content": "hello"}


async def test_r1_the_key_is_the_intent_id_two_writes_of_one_delivery_never_collide(
    reopen: Opener,
) -> None:
    """Two calls in one delivery (the provider may reuse its tool-call id; the runtime's
    intent ids differ) are two writes, each on the revision before it."""
    with trio.fail_after(LIMIT):
        s = await reopen()
        one = await s.write_document("d1:7", write("one"))
        two = await s.write_document("d1:9", write("two", base=one["revision_id"]))
        assert await s.revisions("notes") == [one["revision_id"], two["revision_id"]]
        assert (await s.read_document({"document_id": "notes"}))["content"] == "two"
        await s.aclose()


async def test_r2_a_reused_key_with_other_input_is_refused_and_changes_nothing(
    reopen: Opener,
) -> None:
    with trio.fail_after(LIMIT):
        s = await reopen()
        first = await s.write_document("d1:7", write("hello"))
        with pytest.raises(ReceiptRefusal) as refused:
            await s.write_document("d1:7", write("other"))
        assert refused.value.code is ReasonCode.RECEIPT_KEY_CONFLICT
        with pytest.raises(ReceiptRefusal) as elsewhere:  # another document, the same key
            await s.write_document("d1:7", write("hello", doc="other"))
        assert elsewhere.value.code is ReasonCode.RECEIPT_KEY_CONFLICT
        assert await s.revisions("notes") == [first["revision_id"]]
        assert await s.revisions("other") == []
        assert (await s.read_document({"document_id": "notes"}))["content"] == "hello"
        await s.aclose()


async def test_r3_a_stale_base_is_refused_and_changes_nothing(reopen: Opener) -> None:
    """Compare-and-swap: a write on a revision that is no longer the head (someone wrote
    after the agent read) is a conflict, and no receipt is kept — the call can be retried
    on the new head under a new intent."""
    with trio.fail_after(LIMIT):
        s = await reopen()
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
        {"document_id": "d", "content": "a\0b"},
    ],
    ids=["missing", "empty-id", "control-char", "long-id", "wrong-type", "extra", "too-big", "nul"],
)
async def test_r4_invalid_input_is_refused_and_writes_nothing(
    reopen: Opener, args: dict[str, Any]
) -> None:
    """Refused before anything is written: no revision, and no receipt (the same intent id
    then applies a valid write)."""
    with trio.fail_after(LIMIT):
        s = await reopen()
        with pytest.raises(ReceiptRefusal) as refused:
            await s.write_document("d1:7", args)
        assert refused.value.code is ReasonCode.DOCUMENT_INVALID
        assert await s.revisions("d") == []
        applied = await s.write_document("d1:7", write("valid", doc="d"))
        assert await s.revisions("d") == [applied["revision_id"]]
        await s.aclose()


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


def test_r7_only_the_registrys_operations_are_receipt_operations() -> None:
    """R7: ``write_document`` (its receipt row) and ``attach`` (its recorded outcome is the
    receipt: docs/design/attachments.md), nothing else."""
    assert frozenset({"write_document", "attach"}) == RECEIPT_OPERATIONS


def test_the_fingerprint_is_over_the_canonical_input() -> None:
    a = input_fingerprint("write_document", {"document_id": "d", "content": "x"})
    b = input_fingerprint("write_document", {"content": "x", "document_id": "d"})
    assert a == b
    assert a != input_fingerprint("write_document", {"document_id": "d", "content": "y"})


async def test_reading_an_unknown_document_is_a_tool_error(reopen: Opener) -> None:
    with trio.fail_after(LIMIT):
        s = await reopen()
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


async def traced_store(tmp_path: Path) -> tuple[SqliteReceiptStore, Trace]:
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


# R9: on a shared PostgreSQL journal the store is the database's, one for every host. Each
# "host" here is a journal store of its own (its own connections), as two processes have.


@contextlib.asynccontextmanager
async def two_hosts(dsn: str, root: Path) -> AsyncIterator[tuple[ReceiptStore, ReceiptStore]]:
    async with (
        open_pg_store(dsn, root=root / "a") as a,
        open_pg_store(dsn, root=root / "b") as b,
    ):
        yield PgReceiptStore(a, now_ms=lambda: 1_000), PgReceiptStore(b, now_ms=lambda: 2_000)


async def test_r9_one_intent_written_by_two_hosts_at_once_applies_once(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A dead host's late write and its successor's recovery of the same intent, at the same
    moment, many times over: each intent has one revision and one receipt, and both hosts
    get the same result (the second serialised behind the first by the intent's lock)."""
    results: dict[str, list[dict[str, Any]]] = {}
    with trio.fail_after(LIMIT):
        async with two_hosts(pg_dsn, tmp_path) as (a, b), trio.open_nursery() as nursery:
            for n in range(20):
                intent = f"d1:{n}"
                results[intent] = []

                async def one(host: ReceiptStore, intent: str = intent, n: int = n) -> None:
                    answer = await host.write_document(intent, write("x", doc=f"doc{n}"))
                    results[intent].append(answer)

                nursery.start_soon(one, a)
                nursery.start_soon(one, b)
    for answers in results.values():
        assert len(answers) == 2
        assert answers[0] == answers[1]
    rows = await execute(pg_dsn, "SELECT count(*) FROM pi_runtime.receipt_revisions")
    receipts = await execute(pg_dsn, "SELECT count(*) FROM pi_runtime.receipts")
    assert rows == receipts == [(20,)]


async def test_r9_two_hosts_writing_one_document_on_one_base_one_wins(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Compare-and-swap across hosts (R3): two intents on the same head at once, many times
    over — exactly one applies, the other is refused ``document_stale_base``; the
    document's history is one chain, each revision on the one before."""
    outcomes: list[str] = []
    with trio.fail_after(LIMIT):
        async with two_hosts(pg_dsn, tmp_path) as (a, b):
            head = (await a.write_document("d0:1", write("start")))["revision_id"]
            for n in range(10):
                won: list[str] = []

                async def one(
                    host: ReceiptStore, intent: str, base: str = head, won: list[str] = won
                ) -> None:
                    try:
                        won.append(
                            (await host.write_document(intent, write(intent, base)))["revision_id"]
                        )
                    except ReceiptRefusal as refusal:
                        outcomes.append(str(refusal.code))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(one, a, f"a:{n}")
                    nursery.start_soon(one, b, f"b:{n}")
                assert len(won) == 1
                head = won[0]
            chain = await a.revisions("notes")
            rows = await execute(
                pg_dsn,
                "SELECT revision_id, base_revision_id FROM pi_runtime.receipt_revisions "
                "ORDER BY made",
            )
    assert outcomes == ["document_stale_base"] * 10
    assert len(chain) == 11
    assert [base for _, base in rows] == [None, *chain[:-1]]
    assert chain[-1] == head


async def test_r9_a_commit_whose_answer_is_lost_is_found_applied_not_applied_again(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection is cut right after the server answered the write's ``COMMIT`` (the
    answer never reaches the host). The store runs the whole write again on a new connection:
    the receipt the lost attempt committed is found, its saved result returned, and the
    document has one revision."""
    apply = _receipts.apply_write
    with trio.fail_after(LIMIT):
        async with (
            cutting_proxy(pg_dsn) as proxy,
            open_pg_store(proxy.dsn, root=tmp_path / "state") as journal,
        ):

            def cut_at_commit(*args: Any) -> dict[str, Any]:
                result = apply(*args)
                if proxy.cuts == 0:
                    proxy.cut_next("reply")  # the next answer is the COMMIT's
                return result

            monkeypatch.setattr(_receipts_pg, "apply_write", cut_at_commit)
            s = PgReceiptStore(journal, now_ms=lambda: 1_000)
            result = await s.write_document("d1:7", write("once"))
            assert proxy.cuts == 1
            revisions = await s.revisions("notes")
    assert revisions == [result["revision_id"]]
    assert await execute(pg_dsn, "SELECT count(*) FROM pi_runtime.receipts") == [(1,)]


async def test_r9_a_database_that_cannot_be_reached_leaves_the_call_unsettled(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Not a refusal (R5): with the journal store closed under it the write raises, the
    tool answers ``receipt_store_failed`` (the call stays unsettled) and nothing is written."""
    with trio.fail_after(LIMIT):
        async with open_pg_store(pg_dsn, root=tmp_path / "state") as journal:
            s = PgReceiptStore(journal, now_ms=lambda: 1_000)
        with pytest.raises(GateError) as failed:
            await DocumentTools(s).write(write_call(), "d1:7")
    assert failed.value.code is ReasonCode.RECEIPT_STORE_FAILED
    assert await execute(pg_dsn, "SELECT count(*) FROM pi_runtime.receipts") == [(0,)]
