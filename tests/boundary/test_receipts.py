"""The receipt and document store (runtime._boundary._receipts): tests named after the invariants
R1… of ``docs/design/receipts.md``, on a real SQLite file in a temporary state directory."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any, Final

import pytest
import trio

from runtime._boundary._receipts import (
    RECEIPT_DB,
    RECEIPT_OPERATIONS,
    ReceiptStore,
    input_fingerprint,
    open_receipt_store,
)
from runtime._errors import ReasonCode, ReceiptRefusal

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
