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
database, for what cannot be done from inside the test's own) and :func:`terminate_backends`
(end every connection to the test's database, as a server restart or an operator would, and
wait until they are gone).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from runtime._journal._postgres import migrate

with warnings.catch_warnings():  # platformdirs, imported by pgserver, on a machine without one
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
    from pgserver.postgres_server import PostgresServer, get_server

__all__ = [
    "admin_dsn",
    "database_name",
    "execute",
    "pg_blank_dsn",
    "pg_dsn",
    "pg_server",
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
