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
* only the operations in :data:`RECEIPT_OPERATIONS` are ``receipt`` (R7);
* a transient error (SQLite busy or locked) is retried, the whole transaction again, with the
  bounded backoff of :data:`STORE_RETRY` on Trio's clock; when the bound is spent the last
  error raises like any other failure (R8).
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import sqlite3
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import msgspec
import trio

from .._clock import Backoff, Clocks, own_limiter
from .._errors import ReasonCode, ReceiptRefusal

__all__ = [
    "DEFAULT_BUSY_TIMEOUT",
    "RECEIPT_DB",
    "RECEIPT_OPERATIONS",
    "STORE_RETRY",
    "ReceiptDamaged",
    "ReceiptStore",
    "SqliteReceiptStore",
    "Tables",
    "WriteRequest",
    "apply_write",
    "is_transient",
    "open_receipt_store",
    "read_head",
    "receipt_store",
    "revision_of",
]

RECEIPT_DB: Final = "receipts.sqlite"
"""The store's file in the state directory."""
RECEIPT_OPERATIONS: Final = frozenset({"write_document", "attach"})
"""The registry of receipt-backed operations (R7): nothing else is treated as ``receipt``.
``write_document``'s receipt is its row in this store; ``attach``'s is its own recorded outcome
(an attachment joins the reply only through it: docs/design/attachments.md A5)."""
MAX_DOCUMENT_ID: Final = 200
MAX_CONTENT_BYTES: Final = 1024 * 1024
DEFAULT_BUSY_TIMEOUT: Final = 0.1
"""Seconds SQLite's own busy handler waits for a lock inside one attempt (R8): short, because
that wait blocks the store's thread (holding its one-at-a-time limiter, deaf to cancellation,
on the real clock). Longer waits are the backoff's (:data:`STORE_RETRY`), on Trio's clock."""
_TRANSIENT: Final = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED})

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


STORE_RETRY: Final = Backoff(attempts=5, first_delay=0.1, max_delay=2.0)
"""The bounded backoff of a transient store error (R8): 5 tries over 0.1 + 0.2 + 0.4 + 0.8 =
1.5 s of Trio's clock — far longer than any write transaction of this store holds the lock,
short enough that a worker's tool call (and a recovery under the gate's lock) waits at most a
couple of seconds before the delivery fails."""


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` is SQLite's ``SQLITE_BUSY`` or ``SQLITE_LOCKED`` (any extended code):
    another connection held a lock, and the same transaction may succeed later (R8)."""
    code = getattr(error, "sqlite_errorcode", None)
    return (
        isinstance(error, sqlite3.Error) and isinstance(code, int) and (code & 0xFF) in _TRANSIENT
    )


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
    for field, text in msgspec.to_builtins(value).items():
        if isinstance(text, str) and not _is_unicode_text(text):
            raise ReceiptRefusal(
                ReasonCode.DOCUMENT_INVALID,
                f"{field} is not Unicode text: it holds a lone surrogate (half of a pair)",
            )
    document_id = getattr(value, "document_id", "")
    if not 0 < len(document_id) <= MAX_DOCUMENT_ID or not document_id.isprintable():
        raise ReceiptRefusal(
            ReasonCode.DOCUMENT_INVALID,
            f"document_id must be 1 to {MAX_DOCUMENT_ID} printable characters",
        )
    return value


def _is_unicode_text(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8: a lone surrogate is a Python ``str`` but no text
    either store can hold (nor the fingerprint encode), so it is refused, never a failure."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def input_fingerprint(operation: str, args: Mapping[str, Any]) -> str:
    """The sha256 of the operation and its canonical (key-sorted) arguments."""
    canonical = msgspec.json.encode({"operation": operation, "args": dict(args)}, order="sorted")
    return hashlib.sha256(canonical).hexdigest()


@dataclass(frozen=True, slots=True)
class Tables:
    """The names of the store's three tables in one database (R9): the statements of a
    write are the same on both backends, only their table names and placeholders differ."""

    documents: str
    revisions: str
    receipts: str
    placeholder: str = "?"

    def sql(self, statement: str) -> str:
        """``statement`` with ``{documents}``, ``{revisions}``, ``{receipts}`` named and each
        ``?`` in this backend's placeholder."""
        named = statement.format(
            documents=self.documents, revisions=self.revisions, receipts=self.receipts
        )
        return named.replace("?", self.placeholder)


Execute = Callable[[str, Sequence[Any]], list[tuple[Any, ...]]]
"""Run one statement of the open transaction and return its rows (none for a write)."""

_SAVED: Final = "SELECT input_fingerprint, result FROM {receipts} WHERE intent_id = ?"
_REVISION: Final = (
    "SELECT document_id, base_revision_id, content FROM {revisions} WHERE revision_id = ?"
)
_HEAD: Final = "SELECT head_revision_id FROM {documents} WHERE document_id = ?"
_ADD_REVISION: Final = (
    "INSERT INTO {revisions} (revision_id, document_id, base_revision_id, content, created_ms) "
    "VALUES (?, ?, ?, ?, ?)"
)
_MOVE_HEAD: Final = (
    "INSERT INTO {documents} (document_id, head_revision_id) VALUES (?, ?) "
    "ON CONFLICT (document_id) DO UPDATE SET head_revision_id = excluded.head_revision_id"
)
_ADD_RECEIPT: Final = (
    "INSERT INTO {receipts} (intent_id, operation, input_fingerprint, result) VALUES (?, ?, ?, ?)"
)
_READ: Final = (
    "SELECT r.revision_id, r.content FROM {documents} d "
    "JOIN {revisions} r ON r.revision_id = d.head_revision_id WHERE d.document_id = ?"
)


class WriteRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A validated ``write_document`` (R4), its receipt key and fingerprint (R1, R2)."""

    intent_id: str
    document_id: str
    content: str
    base_revision_id: str | None
    fingerprint: str
    created_ms: int


class ReceiptDamaged(Exception):
    """A receipt (or the revision it proves) does not say what it was written to say: a
    byte of the store changed behind the runtime's back. Not a refusal (R5): the call stays
    unsettled, ``receipt_store_failed``, and nothing is written (R2)."""


def revision_of(intent_id: str) -> str:
    """The id of the revision ``intent_id``'s write makes (a function of the intent alone,
    so a revision names the receipt that must stand beside it)."""
    return "rev-" + hashlib.sha256(intent_id.encode()).hexdigest()[:24]


def _proven(
    tables: Tables, execute: Execute, intent_id: str, saved: tuple[Any, ...]
) -> tuple[str, dict[str, Any]]:
    """The fingerprint and saved result of ``intent_id``'s receipt row ``saved``, once they
    are checked against the revision that receipt stands beside (R2): its fingerprint
    recomputed from the revision's document, base and content, and its result rebuilt from
    them, must be what is stored. Anything else is :class:`ReceiptDamaged` — never a
    refusal nor an answer."""
    fingerprint, encoded = saved
    revision = revision_of(intent_id)
    rows = execute(tables.sql(_REVISION), (revision,))

    def damaged(what: str) -> ReceiptDamaged:
        return ReceiptDamaged(
            f"the receipt of intent {intent_id} is damaged ({what}): the store no longer "
            "proves whether it applied; inspect the store"
        )

    if not rows:
        raise damaged(f"its revision {revision} is missing")
    document_id, base, content = rows[0]
    made = {"document_id": document_id, "content": content, "base_revision_id": base}
    if fingerprint != input_fingerprint("write_document", made):
        raise damaged("its fingerprint is not its revision's input")
    try:
        result = msgspec.json.decode(encoded)
    except msgspec.DecodeError:
        raise damaged("its saved result is not JSON") from None
    if result != {"document_id": document_id, "revision_id": revision, "base_revision_id": base}:
        raise damaged("its saved result is not its revision's")
    return str(fingerprint), dict(result)


def apply_write(tables: Tables, execute: Execute, request: WriteRequest) -> dict[str, Any]:
    """The guarded write, inside the caller's open transaction, on either backend: the saved
    result of the intent's receipt (R2), or the revision, the document's new head and the
    receipt, to commit together (R3). Raises :class:`ReceiptRefusal` for a definite refusal
    and :class:`ReceiptDamaged` for a receipt the store no longer holds intact; the caller
    rolls back on any exception."""
    revision = revision_of(request.intent_id)
    saved = execute(tables.sql(_SAVED), (request.intent_id,))
    if saved:  # R2: proof it applied, once it is checked intact
        fingerprint, result = _proven(tables, execute, request.intent_id, saved[0])
        if fingerprint != request.fingerprint:
            raise ReceiptRefusal(
                ReasonCode.RECEIPT_KEY_CONFLICT,
                f"intent {request.intent_id} was applied with other input; it cannot apply again",
            )
        return result
    if execute(tables.sql(_REVISION), (revision,)):  # R2: applied, its receipt lost
        raise ReceiptDamaged(
            f"intent {request.intent_id} made revision {revision} but its receipt is not "
            "found under its key: the store no longer proves what it applied; inspect the store"
        )
    head = execute(tables.sql(_HEAD), (request.document_id,))
    current = head[0][0] if head else None
    if request.base_revision_id != current:  # R3: compare-and-swap
        raise ReceiptRefusal(
            ReasonCode.DOCUMENT_STALE_BASE,
            f"document {request.document_id} is at revision {current}, not "
            f"{request.base_revision_id}: read it again, then write on its revision",
        )
    execute(
        tables.sql(_ADD_REVISION),
        (revision, request.document_id, current, request.content, request.created_ms),
    )
    execute(tables.sql(_MOVE_HEAD), (request.document_id, revision))
    result = {
        "document_id": request.document_id,
        "revision_id": revision,
        "base_revision_id": current,
    }
    encoded = msgspec.json.encode(result).decode()
    execute(
        tables.sql(_ADD_RECEIPT),
        (request.intent_id, "write_document", request.fingerprint, encoded),
    )
    return result


def read_head(tables: Tables, execute: Execute, document_id: str) -> dict[str, Any]:
    """``read_document``: the head revision and its content (``document_unknown`` if none)."""
    rows = execute(tables.sql(_READ), (document_id,))
    if not rows:
        raise ReceiptRefusal(ReasonCode.DOCUMENT_UNKNOWN, f"no document {document_id}")
    return {"document_id": document_id, "revision_id": rows[0][0], "content": rows[0][1]}


class ReceiptStore(abc.ABC):
    """The receipt and document store, on either backend: :func:`open_receipt_store`
    (SQLite, in the state directory) or, on a shared PostgreSQL journal,
    ``runtime._boundary._receipts_pg`` (R9). The validation and the guarded write are
    this class's; a backend runs them in its transactions."""

    def __init__(self, *, now_ms: Callable[[], int]) -> None:
        self._now_ms = now_ms

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
        if "\0" in request.content:  # PostgreSQL's text cannot hold it: refused on both
            raise ReceiptRefusal(ReasonCode.DOCUMENT_INVALID, "content holds a NUL character")
        write = WriteRequest(
            intent_id=intent_id,
            document_id=request.document_id,
            content=request.content,
            base_revision_id=request.base_revision_id,
            fingerprint=input_fingerprint("write_document", msgspec.to_builtins(request)),
            created_ms=self._now_ms(),
        )
        return await self._write(write)

    async def read_document(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """``read_document`` (``safe``): the head revision and its content."""
        return await self._read(_convert(args, _ReadInput).document_id)

    @abc.abstractmethod
    async def _write(self, request: WriteRequest) -> dict[str, Any]:
        """:func:`apply_write` in one committed transaction (retried as the backend must)."""

    @abc.abstractmethod
    async def _read(self, document_id: str) -> dict[str, Any]:
        """:func:`read_head` on the committed state."""

    @abc.abstractmethod
    async def revisions(self, document_id: str) -> list[str]:
        """Every revision id of ``document_id``, oldest first (for tests and diagnostics)."""

    @abc.abstractmethod
    async def aclose(self) -> None: ...


_SQLITE_TABLES: Final = Tables(documents="documents", revisions="revisions", receipts="receipts")


class SqliteReceiptStore(ReceiptStore):
    """The store in ``<state>/receipts.sqlite``; obtain it from :func:`open_receipt_store`."""

    def __init__(
        self,
        connection: sqlite3.Connection,
        *,
        now_ms: Callable[[], int],
        retry: Backoff | None = None,
    ) -> None:
        super().__init__(now_ms=now_ms)
        self._db = connection
        self._retry = retry if retry is not None else STORE_RETRY
        self._limiter = own_limiter()  # R6: one statement sequence at a time

    async def _run(self, fn: Callable[[], _T]) -> _T:
        """``fn`` (one whole statement sequence) off the loop; a transient error runs it again
        after the next pause of the backoff (R8). The pause is slept here, outside the limiter,
        so the store serves others meanwhile. ``fn`` must leave no transaction open when it
        raises: each attempt starts from the committed state."""
        delays = self._retry.delays()
        attempt, waited = 1, 0.0
        while True:
            try:
                return await trio.to_thread.run_sync(fn, limiter=self._limiter)
            except sqlite3.Error as error:
                transient = is_transient(error)
                delay = next(delays, None) if transient else None
                if delay is None:
                    if transient:
                        error.add_note(f"still so after {attempt} attempts over {waited:g} s")
                    elif attempt > 1:
                        error.add_note(f"on attempt {attempt}, after a transient error")
                    raise
            await trio.sleep(delay)
            attempt, waited = attempt + 1, waited + delay

    def _execute(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        return self._db.execute(sql, params).fetchall()

    async def _write(self, request: WriteRequest) -> dict[str, Any]:
        return await self._run(lambda: self._write_once(request))

    def _write_once(self, request: WriteRequest) -> dict[str, Any]:
        db = self._db
        db.execute("BEGIN IMMEDIATE")  # a busy BEGIN starts no transaction: nothing to undo
        try:
            result = apply_write(_SQLITE_TABLES, self._execute, request)
            db.execute("COMMIT")  # the revision and its receipt, or neither
            return result
        except BaseException:
            # A refusal, or a busy COMMIT, leaves the transaction open; SQLITE_FULL or an I/O
            # error may have rolled it back already. Either way the attempt ends with none
            # open (R8).
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    async def _read(self, document_id: str) -> dict[str, Any]:
        return await self._run(lambda: read_head(_SQLITE_TABLES, self._execute, document_id))

    async def revisions(self, document_id: str) -> list[str]:
        def query() -> list[str]:
            rows = self._db.execute(
                "SELECT revision_id FROM revisions WHERE document_id = ? ORDER BY rowid",
                (document_id,),
            ).fetchall()
            return [row[0] for row in rows]

        return await self._run(query)

    async def aclose(self) -> None:
        await trio.to_thread.run_sync(self._db.close, limiter=self._limiter)


def _connect(path: Path, busy_timeout: float) -> sqlite3.Connection:
    if busy_timeout < 0:
        raise ValueError(f"busy_timeout must be 0 or more seconds, not {busy_timeout}")
    db = sqlite3.connect(path, timeout=busy_timeout, isolation_level=None, check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = FULL")  # R6: a commit is on disk when it returns
        db.executescript(_SCHEMA)
    except BaseException:
        db.close()
        raise
    return db


async def open_receipt_store(
    state_dir: Path | str,
    *,
    now_ms: Callable[[], int] | None = None,
    retry: Backoff | None = None,
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
) -> SqliteReceiptStore:
    """Open (creating) ``<state_dir>/receipts.sqlite``; close it with ``aclose``. ``retry``
    bounds the retries of a transient error (default :data:`STORE_RETRY`); ``busy_timeout``
    is SQLite's own wait for a lock within one attempt, in seconds (0: ``SQLITE_BUSY`` at
    once, as the tests use it) (R8)."""
    path = Path(state_dir) / RECEIPT_DB
    db = await trio.to_thread.run_sync(_connect, path, busy_timeout)
    return SqliteReceiptStore(db, now_ms=now_ms or Clocks.system().wall.time_ms, retry=retry)


@contextlib.asynccontextmanager
async def receipt_store(
    state_dir: Path | str,
    *,
    now_ms: Callable[[], int] | None = None,
    retry: Backoff | None = None,
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
) -> AsyncIterator[SqliteReceiptStore]:
    """:func:`open_receipt_store` for the block; closed on the way out, even if cancelled."""
    store = await open_receipt_store(
        state_dir, now_ms=now_ms, retry=retry, busy_timeout=busy_timeout
    )
    try:
        yield store
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()
