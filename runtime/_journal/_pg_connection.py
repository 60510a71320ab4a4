"""The PostgreSQL store's connections: credentials kept out of every text, one blocking
connection per :class:`Connection` driven from Trio through a thread of its own, and how a
broken connection is told from a definite refusal (docs/design/postgres-store.md).

The DSN may hold a password: no error, log line, record or file holds it. Every message that
names the database uses :func:`redact_dsn` / :func:`describe`; the server's own error texts
are scrubbed of the password too (:func:`reason`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

import psycopg
import trio
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import TupleRow

from .._clock import Backoff, own_limiter
from .._errors import DiskFailedError, ReasonCode

__all__ = [
    "DEFAULT_RETRY",
    "Broken",
    "Closed",
    "Conn",
    "Connection",
    "RolledBack",
    "Unreachable",
    "Unsettled",
    "Vanished",
    "connect",
    "describe",
    "lost",
    "parse_dsn",
    "redact_dsn",
    "rolled_back",
    "server_reason",
]

_T = TypeVar("_T")
Conn = psycopg.Connection[TupleRow]

_SECRET_KEYS: Final = ("password", "sslpassword")
_DEFAULTS: Final = {
    "application_name": ("PGAPPNAME", "pi-runtime"),
    "connect_timeout": ("PGCONNECT_TIMEOUT", "10"),
}
"""Connection parameters (and the libpq variable that also sets them) given unless the DSN
or the environment names them: a connection attempt never waits forever."""


# -- credentials ------------------------------------------------------------------------------


def redact_dsn(dsn: str) -> str:
    """``dsn`` without its password (nor ``sslpassword``), fit for an error or a log line:
    ``postgresql://ann:secret@db/x`` becomes ``user=ann dbname=x host=db``. A DSN that does
    not parse is not shown at all (where its password begins cannot be known)."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error:
        return "<a DSN that does not parse>"
    return describe(params)


def describe(params: Mapping[str, Any]) -> str:
    shown = {k: v for k, v in params.items() if k not in _SECRET_KEYS and k not in _DEFAULTS}
    return make_conninfo("", **shown) or "<the default of the PG* environment>"


def scrub(text: str, params: Mapping[str, Any]) -> str:
    """``text`` (a server's or libpq's message) with every secret of ``params`` and of the
    environment replaced by ``***``."""
    secrets = [params.get(key) for key in _SECRET_KEYS]
    secrets += [os.environ.get("PGPASSWORD"), os.environ.get("PGSSLPASSWORD")]
    for secret in secrets:
        if secret:
            text = text.replace(str(secret), "***")
    return text


def parse_dsn(dsn: str) -> dict[str, Any]:
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error:
        problem = "the DSN does not parse (it is not shown: it may hold a password)"
    else:
        defaults = {k: v for k, (env, v) in _DEFAULTS.items() if not os.environ.get(env)}
        return {**defaults, **params}
    raise DiskFailedError(ReasonCode.STORE_UNAVAILABLE, problem)


def server_reason(exc: psycopg.Error, params: Mapping[str, Any]) -> str:
    """A short, scrubbed account of a driver error: its class, SQLSTATE and first line."""
    first = (str(exc).strip().splitlines() or [""])[0]
    state = f" [{exc.sqlstate}]" if exc.sqlstate else ""
    return scrub(f"{type(exc).__name__}{state}: {first}", params)


class Unreachable(Exception):
    """No connection could be made (raised in a worker thread; its text is scrubbed), or no
    call went through within the retry policy's bound."""


class Broken(Exception):
    """The connection broke during a call (the server ended the session or went away, the
    network or a proxy cut it): what the call sent may or may not have taken effect. Its text
    is scrubbed."""


class RolledBack(Exception):
    """The server rolled the call back whole and the session lives on: a statement cancelled
    (``statement_timeout``, ``lock_timeout``, an operator's ``pg_cancel_backend``), a
    deadlock, a serialization failure. Nothing of the call took effect, and nothing about
    what it wrote was refused: it may be tried again. Its text is scrubbed."""


class Closed(Exception):
    """The store is closed: no connection is made any more."""


class Vanished(Exception):
    """An append's row was neither inserted nor found (deleted under the store)."""


class Unsettled(Exception):
    """An append neither committed nor was refused within the retry policy's bound."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


DEFAULT_RETRY: Final = Backoff(attempts=10, first_delay=0.1, max_delay=5.0)
"""How long the store keeps trying work whose connection broke or could not be made, unless
:func:`open_pg_store` is given another backoff: 10 tries, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5, 5,
5 s apart (21.3 s of waiting). It replaces a connection cut while idle at the first retry
(0.1 s) and bridges a database restart (a fast restart takes well under a second to a few
seconds, a busy server's shutdown checkpoint or a short crash recovery some more) with margin;
an outage longer than that stops admissions within half a minute instead of holding every
caller. Each try may also wait up to ``connect_timeout`` (10 s unless the DSN says otherwise)
for its connection."""

_SESSION_ENDED: Final = "57P"
"""SQLSTATE ``57P01`` to ``57P05``: the server ended the session (an administrator, a shutdown, a
crash, a dropped database, an idle-session timeout) — the call's outcome is not its answer."""


_ROLLED_BACK: Final = frozenset({"40001", "40P01", "55P03", "57014"})
"""SQLSTATEs of a call the server rolled back for a passing reason, not for what it wrote:
``serialization_failure``, ``deadlock_detected``, ``lock_not_available`` (``lock_timeout``),
``query_canceled`` (``statement_timeout``, ``pg_cancel_backend``)."""


def lost(conn: Conn, exc: psycopg.Error) -> bool:
    """Whether ``exc`` means the session is gone (not a refusal of what was sent)."""
    state = exc.sqlstate or ""
    return conn.closed or state.startswith("08") or state.startswith(_SESSION_ENDED)


def rolled_back(exc: psycopg.Error) -> bool:
    """Whether ``exc`` (the session alive) rolled the call back for a passing reason: what
    it sent did not take effect, and trying it again may work (PG12)."""
    return exc.sqlstate in _ROLLED_BACK


# -- connections ------------------------------------------------------------------------------


_SESSION: Final = (
    "SELECT current_setting('synchronous_commit'), current_setting('transaction_isolation')"
)


def connect(params: Mapping[str, Any]) -> Conn:
    """A new autocommit connection whose commits are synchronous (blocking) and whose
    transactions are ``read committed``, whatever the server's defaults (PG4)."""
    try:
        conn = psycopg.connect(autocommit=True, **params)
        try:
            row = conn.execute(_SESSION).fetchone()
            if row is not None and row[0] == "off":  # COMMIT must mean durable (J1)
                conn.execute("SET synchronous_commit TO on")
            if row is not None and row[1] != "read committed":
                # a fence re-checks its lease row after waiting for a renewal, a resolution
                # finds the row a waited-for backend committed: both only at read committed
                conn.execute("SET default_transaction_isolation TO 'read committed'")
        except BaseException:
            conn.close()
            raise
    except psycopg.Error as exc:
        problem = f"cannot reach the database {describe(params)}: {server_reason(exc, params)}"
    else:
        return conn
    raise Unreachable(problem)  # outside the handler: no driver text rides along as context


class Connection:
    """One database connection, used by one worker thread at a time; (re)connected on use,
    and dropped as soon as a call finds it broken (the next call makes a new one)."""

    def __init__(self, params: Mapping[str, Any]) -> None:
        self._params = params
        self._limiter = own_limiter()
        self._conn: Conn | None = None
        """Touched only by the thread that holds the limiter."""
        self._closed = False

    async def run(self, fn: Callable[[Conn], _T]) -> _T:
        """Run ``fn(connection)`` once, in a worker thread. Raises :class:`Unreachable` when
        no connection can be made (nothing was sent), :class:`Broken` when the connection
        broke during the call (what it sent may have taken effect), :class:`RolledBack` when
        the server rolled it back for a passing reason (nothing took effect), :class:`Closed`
        once closed, and the driver's error when the server refused (a definite answer)."""
        return await trio.to_thread.run_sync(self._call, fn, limiter=self._limiter)

    def _live(self) -> Conn:
        if self._closed:
            raise Closed("the store is closed")
        if self._conn is None or self._conn.closed:
            self._conn = None
            self._conn = connect(self._params)
        return self._conn

    def _call(self, fn: Callable[[Conn], _T]) -> _T:
        conn = self._live()
        try:
            return fn(conn)
        except psycopg.Error as exc:
            broken = lost(conn, exc)
            if not broken and not rolled_back(exc):
                raise
            why = server_reason(exc, self._params)
        if not broken:  # the session lives on: nothing took effect, it may be tried again
            raise RolledBack(f"the database {describe(self._params)} rolled a call back: {why}")
        self._conn = None
        conn.close()
        problem = f"the connection to the database {describe(self._params)} broke: {why}"
        raise Broken(problem)  # outside the handler: no driver text rides along as context

    async def aclose(self) -> None:
        """Close the connection, after the call in flight (which holds the limiter)."""
        await trio.to_thread.run_sync(self._close, limiter=self._limiter)

    def _close(self) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
