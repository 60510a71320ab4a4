"""A throw-away PostgreSQL for the tests of the PostgreSQL store (``pgserver``, offline).

Fixtures (made available to ``tests/journal/`` by its ``conftest.py``):

* ``pg_server`` (session): one PostgreSQL per test process — under pytest-xdist one per worker,
  each in its own temporary directory — started once (a few seconds), stopped and removed at
  the end.
* ``pg_dsn``: a fresh database for one test, migrated to the store's schema, dropped after it
  (with whatever connections are still open to it).
* ``pg_blank_dsn``: the same without the schema (what ``pi-runtime db migrate`` starts from).

Helpers for tests that need to reach under the store: :func:`execute` (one statement on a
connection of its own, off the Trio loop), :func:`admin_dsn` (the same server's ``postgres``
database, for what cannot be done from inside the test's own), :func:`terminate_backends`
(end every connection to the test's database, as an operator would, and wait until they are
gone), :func:`stop_server` and :func:`start_server` (the test process's whole server, as a
database restart does: a test that stops it starts it again before it ends, the server is
shared by the tests of the process) and :func:`cutting_proxy` (a TCP proxy that cuts one
connection at a chosen moment, as a network or a load balancer would).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import psycopg
import pytest
import trio
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from runtime._journal._postgres import migrate

with warnings.catch_warnings():  # platformdirs, imported by pgserver, on a machine without one
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
    from pgserver._commands import POSTGRES_BIN_PATH
    from pgserver.postgres_server import PostgresServer, get_server

__all__ = [
    "CuttingProxy",
    "PostgresServer",
    "admin_dsn",
    "cutting_proxy",
    "database_name",
    "execute",
    "pg_blank_dsn",
    "pg_dsn",
    "pg_server",
    "start_server",
    "stop_server",
    "terminate_backends",
]


def _system_user_ready() -> None:
    """As root, pgserver runs PostgreSQL as a user ``pgserver`` it creates with ``useradd``
    outside its own lock: create it under that lock first, so xdist workers starting at once
    do not race to add it."""
    if os.geteuid() != 0:
        return
    from pgserver.utils import ensure_user_exists

    with PostgresServer._lock:
        ensure_user_exists("pgserver")


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    """One PostgreSQL for this test process, in a directory of its own that is removed after.

    Not below pytest's ``tmp_path_factory``: as root the server runs as ``pgserver``, which
    must traverse every parent of its data directory, and every pytest session that starts
    (a second run, a CI job on the same machine) makes ``/tmp/pytest-of-<user>`` 0700 again —
    the running server then cannot open its own files and stops (PANIC, permission denied)."""
    _system_user_ready()
    top = Path(tempfile.mkdtemp(prefix="pi-runtime-pg-"))
    try:
        server = get_server(top / "data", cleanup_mode="stop")
        try:
            yield server
        finally:
            server.cleanup()
    finally:
        shutil.rmtree(top, ignore_errors=True)


@contextlib.contextmanager
def _database(server: PostgresServer, *, migrated: bool) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:20]}"
    with psycopg.connect(server.get_uri(), autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        dsn = server.get_uri(name)
        if migrated:
            trio.run(migrate, dsn)
        yield dsn
    finally:
        with psycopg.connect(server.get_uri(), autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture
def pg_dsn(pg_server: PostgresServer) -> Iterator[str]:
    with _database(pg_server, migrated=True) as dsn:
        yield dsn


@pytest.fixture
def pg_blank_dsn(pg_server: PostgresServer) -> Iterator[str]:
    with _database(pg_server, migrated=False) as dsn:
        yield dsn


def _execute(dsn: str, query: str, params: Sequence[Any] | None) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cursor = conn.execute(query, params)
        return cursor.fetchall() if cursor.description is not None else []


async def execute(
    dsn: str, query: str, params: Sequence[Any] | None = None
) -> list[tuple[Any, ...]]:
    """Run one statement on a connection of its own (autocommit); the rows it returned."""
    return await trio.to_thread.run_sync(_execute, dsn, query, params)


def database_name(dsn: str) -> str:
    return str(conninfo_to_dict(dsn)["dbname"])


def admin_dsn(dsn: str) -> str:
    """The server's ``postgres`` database, as the superuser of ``dsn``."""
    return make_conninfo(dsn, dbname="postgres")


async def terminate_backends(dsn: str) -> int:
    """End every connection to ``dsn``'s database (from the ``postgres`` database) and wait,
    up to 10 s each, until each is gone; how many there were."""
    rows = await execute(
        admin_dsn(dsn),
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000)) FROM pg_stat_activity "
        "WHERE datname = %s AND pid <> pg_backend_pid()",
        [database_name(dsn)],
    )
    return int(rows[0][0])


# -- the whole server ---------------------------------------------------------------------


def _stop(server: PostgresServer) -> None:
    subprocess.run(
        [POSTGRES_BIN_PATH / "pg_ctl", "-D", server.pgdata, "-w", "-m", "fast", "stop"],
        user=server.system_user,  # as root: the server's own user (pg_ctl refuses root)
        check=True,
        capture_output=True,  # pg_ctl stop starts no process that could hold the pipes
        timeout=60,
    )


def _start(server: PostgresServer) -> None:
    with PostgresServer._lock:
        server.ensure_postgres_running()  # as pgserver started it: same socket, same log


async def stop_server(server: PostgresServer) -> None:
    """Stop the test process's PostgreSQL (``pg_ctl stop -m fast``: every session is
    terminated, as in a database restart) and wait until it is down."""
    await trio.to_thread.run_sync(_stop, server)


async def start_server(server: PostgresServer) -> None:
    """Start it again (if it is not running), the way ``pgserver`` did, and wait until it
    takes connections; the server's handle then knows its new postmaster (so the session's
    end stops the right process)."""
    await trio.to_thread.run_sync(_start, server)


# -- a proxy that cuts connections --------------------------------------------------------


def _answered(data: bytes) -> bool:
    """Whether ``data`` (the server's side of the protocol) holds a whole ``ReadyForQuery``
    message: the server has finished the request before it (and committed it, in
    autocommit)."""
    at = 0
    while at + 5 <= len(data):
        length = int.from_bytes(data[at + 1 : at + 5], "big")
        if data[at : at + 1] == b"Z" and at + 1 + length <= len(data):
            return True
        at += 1 + length
    return False


class CuttingProxy:
    """A TCP proxy in front of the test's PostgreSQL (:func:`cutting_proxy`); connect to
    :attr:`dsn`. It forwards bytes both ways, until told to cut (:meth:`cut_next`)."""

    def __init__(self, dsn: str, server_socket: str) -> None:
        self.dsn = dsn
        """The test's database, through the proxy."""
        self.connections = 0
        """Connections accepted so far."""
        self.cuts = 0
        """Connections cut so far."""
        self._socket = server_socket
        self._cut: Literal["request", "reply"] | None = None

    def cut_next(self, where: Literal["request", "reply"]) -> None:
        """Cut the next connection that sends a request (``request``: it is dropped, the
        server never sees it) or that the server answers (``reply``: the answer is dropped
        once the server sent its ``ReadyForQuery``, so the request was carried out); the
        client sees the connection close, nothing else."""
        self._cut = where

    async def _serve(self, client: trio.SocketStream) -> None:
        self.connections += 1
        async with (
            client,
            await trio.open_unix_socket(self._socket) as server,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(self._pump, client, server, "request", nursery.cancel_scope)
            nursery.start_soon(self._pump, server, client, "reply", nursery.cancel_scope)

    async def _pump(
        self,
        source: trio.SocketStream,
        sink: trio.SocketStream,
        direction: Literal["request", "reply"],
        both: trio.CancelScope,
    ) -> None:
        held = b""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while data := await source.receive_some():
                if self._cut != direction:
                    await sink.send_all(data)
                    continue
                held += data
                if direction == "request" or _answered(held):
                    self._cut = None
                    self.cuts += 1
                    break
        both.cancel()  # closes both sides


@contextlib.asynccontextmanager
async def cutting_proxy(dsn: str) -> AsyncIterator[CuttingProxy]:
    """A :class:`CuttingProxy` on ``127.0.0.1`` for the database ``dsn`` (pgserver's Unix
    socket) for the duration of the block; every connection through it is closed after."""
    params = conninfo_to_dict(dsn)
    socket = f"{params['host']}/.s.PGSQL.{params.get('port') or 5432}"
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    proxied = make_conninfo(
        dsn, host="127.0.0.1", port=str(port), sslmode="disable", gssencmode="disable"
    )
    proxy = CuttingProxy(proxied, socket)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, proxy._serve, listeners)
        try:
            yield proxy
        finally:
            nursery.cancel_scope.cancel()
