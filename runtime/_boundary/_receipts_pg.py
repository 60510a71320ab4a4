"""The receipt and document store in the deployment's PostgreSQL database (receipts.md R9).

On a shared journal (``[store] url``) a lane moves between hosts, and with it every
``write_document`` intent still unsettled: the host that claims the lane recovers the intent
by running the same guarded write. The receipt that proves it applied must therefore be where
every host looks — in the database, next to the journal, not in one host's
``receipts.sqlite``. The write is the one of ``_receipts.py`` (:func:`apply_write`), in one
transaction of :meth:`PgStore.transaction`:

* two transaction-level advisory locks, taken in this order, serialise what must not
  interleave: the intent's (the dead host's late write and its successor's recovery of one
  intent: the second sees the first's receipt) and then the document's (the compare-and-swap of
  two intents on one document). A transaction never waits for an intent's lock while it holds
  a document's, so the two cannot deadlock. Under them, ``READ COMMITTED`` statements see
  everything committed before the lock was granted;
* a connection that breaks around the ``COMMIT`` runs the whole write again, which is safe for
  the reason R8 is: a receipt committed by the lost attempt replays, an absent one applies once.

It needs no fence: an intent reaches the store only after its intent record was written under
the lane's lease, and for one intent any host's write is the same write (R2).
This module imports the optional PostgreSQL driver; the room worker imports it only when the
journal is on PostgreSQL.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

from psycopg import Connection
from psycopg.rows import TupleRow

from .._errors import PiRuntimeError, ReceiptRefusal
from .._journal._pg_schema import SCHEMA
from .._journal._postgres import PgStore
from ._receipts import ReceiptStore, Tables, WriteRequest, apply_write, read_head

__all__ = ["PgReceiptStore", "ReceiptStoreFailed"]

_T = TypeVar("_T")
_Conn = Connection[TupleRow]

TABLES: Final = Tables(
    documents=f"{SCHEMA}.receipt_documents",
    revisions=f"{SCHEMA}.receipt_revisions",
    receipts=f"{SCHEMA}.receipts",
    placeholder="%s",
)
_REVISIONS: Final = (
    f"SELECT revision_id FROM {TABLES.revisions} WHERE document_id = %s ORDER BY made"
)


class ReceiptStoreFailed(Exception):
    """The database could not be used within the journal store's retry policy: the call
    stays unsettled (R5); ``DocumentTools`` reports it ``receipt_store_failed``."""


def _lock_key(kind: str, name: str) -> int:
    """A 64-bit advisory-lock key for ``name`` of ``kind`` (``intent`` or ``document``)."""
    digest = hashlib.sha256(f"pi-runtime receipts {kind}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _execute(conn: _Conn) -> Callable[[str, Sequence[Any]], list[tuple[Any, ...]]]:
    def execute(sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        cursor = conn.execute(sql, params)
        return cursor.fetchall() if cursor.description is not None else []

    return execute


class PgReceiptStore(ReceiptStore):
    """The receipt store in the journal store's database; closed with it (``aclose`` only
    marks this view closed)."""

    def __init__(self, store: PgStore, *, now_ms: Callable[[], int]) -> None:
        super().__init__(now_ms=now_ms)
        self._store = store

    async def _transaction(self, document_id: str, fn: Callable[[_Conn], _T]) -> _T:
        try:
            return await self._store.transaction(f"receipts/{document_id}", fn)
        except ReceiptRefusal:
            raise
        except PiRuntimeError as error:  # store_unavailable, journal_closed: not a refusal
            raise ReceiptStoreFailed(str(error)) from error

    async def _write(self, request: WriteRequest) -> dict[str, Any]:
        def write(conn: _Conn) -> dict[str, Any]:
            for kind, name in (("intent", request.intent_id), ("document", request.document_id)):
                conn.execute("SELECT pg_advisory_xact_lock(%s)", [_lock_key(kind, name)])
            return apply_write(TABLES, _execute(conn), request)

        return await self._transaction(request.document_id, write)

    async def _read(self, document_id: str) -> dict[str, Any]:
        return await self._transaction(
            document_id, lambda conn: read_head(TABLES, _execute(conn), document_id)
        )

    async def revisions(self, document_id: str) -> list[str]:
        def query(conn: _Conn) -> list[str]:
            return [row[0] for row in conn.execute(_REVISIONS, [document_id]).fetchall()]

        return await self._transaction(document_id, query)

    async def aclose(self) -> None:
        """Nothing of its own to close: the connections are the journal store's."""
