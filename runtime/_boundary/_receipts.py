"""Transactional receipts: the SQLite document store behind ``write_document`` /
``read_document`` (docs/design/receipts.md; ``docs/design/receipts.md``).

A ``receipt`` tool commits its effect and its receipt in **one** transaction, so after any
crash the receipt is proof: present means applied (and holds the saved result), absent means
not applied. Recovery of an orphaned call therefore runs the *same* guarded write as an
ordinary call: the receipt's saved result, or the write applied exactly once. The invariants
(R1…) are in the design page; in short:

* the receipt key is the runtime-minted intent id, never the provider's tool-call id (R1);
* a key seen before with the same input replays the saved result and writes nothing; with
  other input it is refused ``receipt_key_conflict`` (R2);
* a write is compare-and-swap on ``base_revision_id``: a stale base is refused
  ``document_stale_base`` and changes nothing (R3); invalid input is refused
  ``document_invalid`` (R4) — each a *definite* refusal that rolled back, so the call settles
  as a tool error; any other failure raises and leaves the call unsettled (R5);
* the database is opened only by the runtime, in WAL mode with ``synchronous=FULL``, and used
  off the Trio loop, one statement sequence at a time (R6);
* only the operations in :data:`RECEIPT_OPERATIONS` are ``receipt`` (R7).
"""

from __future__ import annotations

import contextlib
import hashlib
import sqlite3
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, Final, TypeVar

import msgspec
import trio

from .._clock import Clocks
from .._errors import ReasonCode, ReceiptRefusal

__all__ = [
    "RECEIPT_DB",
    "RECEIPT_OPERATIONS",
    "ReceiptStore",
    "open_receipt_store",
    "receipt_store",
]

RECEIPT_DB: Final = "receipts.sqlite"
"""The store's file in the state directory."""
RECEIPT_OPERATIONS: Final = frozenset({"write_document"})
"""The registry of receipt-backed operations (R7): nothing else is treated as ``receipt``."""
MAX_DOCUMENT_ID: Final = 200
MAX_CONTENT_BYTES: Final = 1024 * 1024

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS documents (
    document_id TEXT PRIMARY KEY,
    head_revision_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS revisions (
    revision_id TEXT PRIMARY KEY,
    document_id TEXT NOT NULL,
    base_revision_id TEXT,
    content TEXT NOT NULL,
    created_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS receipts (
    intent_id TEXT PRIMARY KEY,
    operation TEXT NOT NULL,
    input_fingerprint TEXT NOT NULL,
    result TEXT NOT NULL
);
"""

_T = TypeVar("_T")


class _WriteInput(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    document_id: str
    content: str
    base_revision_id: str | None = None


class _ReadInput(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    document_id: str


def _convert(args: Mapping[str, Any], kind: type[_T]) -> _T:
    try:
        value = msgspec.convert(dict(args), kind)
    except msgspec.ValidationError as error:
        raise ReceiptRefusal(ReasonCode.DOCUMENT_INVALID, str(error)) from None
    document_id = getattr(value, "document_id", "")
    if not 0 < len(document_id) <= MAX_DOCUMENT_ID or not document_id.isprintable():
        raise ReceiptRefusal(
            ReasonCode.DOCUMENT_INVALID,
            f"document_id must be 1 to {MAX_DOCUMENT_ID} printable characters",
        )
    return value


def input_fingerprint(operation: str, args: Mapping[str, Any]) -> str:
    """The sha256 of the operation and its canonical (key-sorted) arguments."""
    canonical = msgspec.json.encode({"operation": operation, "args": dict(args)}, order="sorted")
    return hashlib.sha256(canonical).hexdigest()


class ReceiptStore:
    """The receipt and document store; obtain it from :func:`open_receipt_store`."""

    def __init__(self, connection: sqlite3.Connection, *, now_ms: Callable[[], int]) -> None:
        self._db = connection
        self._now_ms = now_ms
        self._limiter = trio.CapacityLimiter(1)  # R6: one statement sequence at a time

    async def _run(self, fn: Callable[[], _T]) -> _T:
        return await trio.to_thread.run_sync(fn, limiter=self._limiter)

    async def write_document(self, intent_id: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """The receipt-guarded write of ``write_document`` (an ordinary call and a recovery
        alike): the saved result of ``intent_id``'s receipt, or the write applied once with
        its receipt, in one transaction. Raises :class:`ReceiptRefusal` for a definite
        refusal; any other exception leaves the call unsettled."""
        request = _convert(args, _WriteInput)
        if len(request.content.encode()) > MAX_CONTENT_BYTES:
            raise ReceiptRefusal(
                ReasonCode.DOCUMENT_INVALID, f"content is over {MAX_CONTENT_BYTES} bytes"
            )
        fingerprint = input_fingerprint("write_document", msgspec.to_builtins(request))
        return await self._run(lambda: self._write(intent_id, request, fingerprint))

    def _write(self, intent_id: str, request: _WriteInput, fingerprint: str) -> dict[str, Any]:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            saved = db.execute(
                "SELECT input_fingerprint, result FROM receipts WHERE intent_id = ?", (intent_id,)
            ).fetchone()
            if saved is not None:  # R2: proof it applied
                if saved[0] != fingerprint:
                    raise ReceiptRefusal(
                        ReasonCode.RECEIPT_KEY_CONFLICT,
                        f"intent {intent_id} was applied with other input; it cannot apply again",
                    )
                db.execute("ROLLBACK")
                result: dict[str, Any] = msgspec.json.decode(saved[1])
                return result
            head = db.execute(
                "SELECT head_revision_id FROM documents WHERE document_id = ?",
                (request.document_id,),
            ).fetchone()
            current = None if head is None else head[0]
            if request.base_revision_id != current:  # R3: compare-and-swap
                raise ReceiptRefusal(
                    ReasonCode.DOCUMENT_STALE_BASE,
                    f"document {request.document_id} is at revision {current}, not "
                    f"{request.base_revision_id}: read it again, then write on its revision",
                )
            revision = "rev-" + hashlib.sha256(intent_id.encode()).hexdigest()[:24]
            db.execute(
                "INSERT INTO revisions VALUES (?, ?, ?, ?, ?)",
                (revision, request.document_id, current, request.content, self._now_ms()),
            )
            db.execute(
                "INSERT INTO documents VALUES (?, ?) ON CONFLICT(document_id) "
                "DO UPDATE SET head_revision_id = excluded.head_revision_id",
                (request.document_id, revision),
            )
            result = {
                "document_id": request.document_id,
                "revision_id": revision,
                "base_revision_id": current,
            }
            db.execute(
                "INSERT INTO receipts VALUES (?, ?, ?, ?)",
                (intent_id, "write_document", fingerprint, msgspec.json.encode(result).decode()),
            )
            db.execute("COMMIT")  # the revision and its receipt, or neither
            return result
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    async def read_document(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """``read_document`` (``safe``): the head revision and its content."""
        request = _convert(args, _ReadInput)

        def read() -> dict[str, Any]:
            row = self._db.execute(
                "SELECT r.revision_id, r.content FROM documents d "
                "JOIN revisions r ON r.revision_id = d.head_revision_id "
                "WHERE d.document_id = ?",
                (request.document_id,),
            ).fetchone()
            if row is None:
                raise ReceiptRefusal(
                    ReasonCode.DOCUMENT_UNKNOWN, f"no document {request.document_id}"
                )
            return {"document_id": request.document_id, "revision_id": row[0], "content": row[1]}

        return await self._run(read)

    async def revisions(self, document_id: str) -> list[str]:
        """Every revision id of ``document_id``, oldest first (for tests and diagnostics)."""

        def query() -> list[str]:
            rows = self._db.execute(
                "SELECT revision_id FROM revisions WHERE document_id = ? ORDER BY rowid",
                (document_id,),
            ).fetchall()
            return [row[0] for row in rows]

        return await self._run(query)

    async def aclose(self) -> None:
        await self._run(self._db.close)


def _connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = FULL")  # R6: a commit is on disk when it returns
        db.executescript(_SCHEMA)
    except BaseException:
        db.close()
        raise
    return db


async def open_receipt_store(
    state_dir: Path | str, *, now_ms: Callable[[], int] | None = None
) -> ReceiptStore:
    """Open (creating) ``<state_dir>/receipts.sqlite``; close it with ``aclose``."""
    path = Path(state_dir) / RECEIPT_DB
    db = await trio.to_thread.run_sync(_connect, path)
    return ReceiptStore(db, now_ms=now_ms or Clocks.system().wall.time_ms)


@contextlib.asynccontextmanager
async def receipt_store(
    state_dir: Path | str, *, now_ms: Callable[[], int] | None = None
) -> AsyncIterator[ReceiptStore]:
    """:func:`open_receipt_store` for the block; closed on the way out, even if cancelled."""
    store = await open_receipt_store(state_dir, now_ms=now_ms)
    try:
        yield store
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()
