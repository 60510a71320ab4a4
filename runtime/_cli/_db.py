"""``db migrate``: create or upgrade the PostgreSQL store's schema
(``docs/design/postgres-store.md``)."""

from __future__ import annotations

import argparse
import os
from typing import Final

import trio

from .._errors import PiRuntimeError, ReasonCode
from ._base import EXIT_OK, Commands

STORE_VARIABLE: Final = "PI_RUNTIME_STORE"
"""The environment variable naming the store's database when no DSN is given."""


def register(commands: Commands) -> None:
    db = commands.group(
        "db", "manage the PostgreSQL store's database", "Manage the PostgreSQL journal store."
    )
    migrate = db.add(
        "migrate",
        "create or upgrade the store's schema",
        "Create the PostgreSQL store's tables in the database, or upgrade them to the schema "
        "version this pi-runtime needs, and print that version. Idempotent; refuses a schema "
        "newer than this pi-runtime knows (store_schema_newer). Needs the postgres extra "
        "(pip install 'pi-runtime[postgres]').",
        _db_migrate,
    )
    migrate.add_argument(
        "dsn",
        nargs="?",
        metavar="DSN",
        help=f"the database, as a libpq connection string or URI (default: ${STORE_VARIABLE}). "
        "Keep the password out of it: libpq reads PGPASSWORD, ~/.pgpass and service files",
    )


def _db_migrate(args: argparse.Namespace) -> int:
    dsn = args.dsn if args.dsn is not None else os.environ.get(STORE_VARIABLE)
    if dsn is None:
        raise PiRuntimeError(
            ReasonCode.STORE_NOT_CONFIGURED,
            f"no database given: pass a DSN or set ${STORE_VARIABLE}",
        )
    try:
        from .._journal._postgres import migrate
    except ImportError:
        raise PiRuntimeError(
            ReasonCode.STORE_UNAVAILABLE,
            "the PostgreSQL store needs psycopg: pip install 'pi-runtime[postgres]'",
        ) from None
    version = trio.run(migrate, dsn)
    print(f"schema version {version}")
    return EXIT_OK
