"""The PostgreSQL store's schema: its tables, created and upgraded by numbered migrations
(``pi-runtime db migrate``), and the version a host refuses to go past
(docs/design/postgres-store.md, "Versions").
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any, Final

import psycopg
import trio

from .._errors import DiskFailedError, JournalError, ReasonCode
from ._pg_connection import Conn, Unreachable, connect, describe, parse_dsn, server_reason
from ._store import ADMISSIONS, RESULTS

__all__ = [
    "CHANNEL",
    "MIGRATIONS",
    "RELEASED",
    "SCHEMA",
    "STORE_SCHEMA_VERSION",
    "migrate",
    "newer_schema",
    "schema_version",
]

SCHEMA: Final = "pi_runtime"
"""The PostgreSQL schema (namespace) every table of the store lives in."""

CHANNEL: Final = "pi_runtime_shared_logs"
"""The ``NOTIFY`` channel an append to a shared log is announced on (its payload: the log's
name), and a released lease (:data:`RELEASED`), at its commit (scale-out.md S23)."""
RELEASED: Final = "released"
"""The announcement of a lease given up: a lane may be claimed now."""

_VERSION_TABLE: Final = f"""
CREATE TABLE IF NOT EXISTS {SCHEMA}.schema_version (
    singleton   boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    version     integer     NOT NULL CHECK (version >= 0),
    migrated_at timestamptz NOT NULL DEFAULT now()
)"""

MIGRATIONS: Final[tuple[tuple[str, ...], ...]] = (
    # 1: the logs, their poison, the documents (issue #19)
    (
        f"""CREATE TABLE {SCHEMA}.log_records (
            log   text COLLATE "C" NOT NULL,
            seq   bigint NOT NULL CHECK (seq >= 0),
            frame bytea  NOT NULL,
            PRIMARY KEY (log, seq)
        )""",
        f"""CREATE TABLE {SCHEMA}.log_poison (
            log         text COLLATE "C" PRIMARY KEY,
            good_seq    bigint      NOT NULL CHECK (good_seq >= 0),
            reason      text        NOT NULL,
            document    bytea       NOT NULL,
            poisoned_at timestamptz NOT NULL DEFAULT now()
        )""",
        f"""CREATE TABLE {SCHEMA}.documents (
            name       text COLLATE "C" PRIMARY KEY,
            data       bytea       NOT NULL,
            updated_at timestamptz NOT NULL DEFAULT now()
        )""",
    ),
    # 2: lane leases and their epochs; appends to the shared logs announced (scale-out.md)
    (
        f"""CREATE TABLE {SCHEMA}.lanes (
            lane        text COLLATE "C" PRIMARY KEY,
            owner       text        NOT NULL,
            epoch       bigint      NOT NULL CHECK (epoch > 0),
            lease_until timestamptz NOT NULL,
            claimed_at  timestamptz NOT NULL DEFAULT now()
        )""",
        f"""CREATE FUNCTION {SCHEMA}.announce_shared_append() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN PERFORM pg_notify('{CHANNEL}', NEW.log); RETURN NULL; END $$""",
        f"""CREATE TRIGGER shared_append AFTER INSERT ON {SCHEMA}.log_records FOR EACH ROW
            WHEN (NEW.log IN ('{ADMISSIONS}', '{RESULTS}'))
            EXECUTE FUNCTION {SCHEMA}.announce_shared_append()""",
    ),
    # 3: the receipt and document store of write_document / read_document (receipts.md R9)
    (
        f"""CREATE TABLE {SCHEMA}.receipt_documents (
            document_id      text COLLATE "C" PRIMARY KEY,
            head_revision_id text NOT NULL
        )""",
        f"""CREATE TABLE {SCHEMA}.receipt_revisions (
            revision_id      text COLLATE "C" PRIMARY KEY,
            document_id      text COLLATE "C" NOT NULL,
            base_revision_id text,
            content          text   NOT NULL,
            created_ms       bigint NOT NULL,
            made             bigint GENERATED ALWAYS AS IDENTITY
        )""",
        f"""CREATE INDEX receipt_revisions_by_document
            ON {SCHEMA}.receipt_revisions (document_id, made)""",
        f"""CREATE TABLE {SCHEMA}.receipts (
            intent_id         text COLLATE "C" PRIMARY KEY,
            operation         text NOT NULL,
            input_fingerprint text NOT NULL,
            result            text NOT NULL
        )""",
    ),
    # 4: the shared logs' compaction and the expired deliveries (retention.md RT11)
    (
        f"""CREATE TABLE {SCHEMA}.compaction (
            singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
            generation bigint  NOT NULL CHECK (generation >= 0)
        )""",
        f"INSERT INTO {SCHEMA}.compaction (generation) VALUES (0)",
        f"""CREATE TABLE {SCHEMA}.expired_deliveries (
            delivery_id     text COLLATE "C" PRIMARY KEY,
            forget_after_ms bigint NOT NULL,
            generation      bigint NOT NULL
        )""",
        f"""CREATE INDEX expired_deliveries_by_generation
            ON {SCHEMA}.expired_deliveries (generation)""",
    ),
    # 5: the expired task lanes (retention.md RT13)
    (
        f"""CREATE TABLE {SCHEMA}.expired_tasks (
            lane_key        text COLLATE "C" PRIMARY KEY,
            task_id         text   NOT NULL,
            forget_after_ms bigint NOT NULL
        )""",
    ),
    # 6: the worktree each live task holds, across hosts (scale-out.md S33, watchdog.md TL13)
    (
        f"""CREATE TABLE {SCHEMA}.task_worktrees (
            task_id  text COLLATE "C" PRIMARY KEY,
            worktree text COLLATE "C" NOT NULL
        )""",
        f"CREATE INDEX task_worktrees_by_path ON {SCHEMA}.task_worktrees (worktree)",
    ),
    # 7: the expired ids count [retention] forget_days at lookup (retention.md RT4, RT11,
    # RT13): each row's own time, and the deployment's count in one row. A row written
    # before has no since_ms and keeps its forget-after time.
    (
        f"ALTER TABLE {SCHEMA}.expired_deliveries ADD COLUMN since_ms bigint",
        f"ALTER TABLE {SCHEMA}.expired_tasks ADD COLUMN since_ms bigint",
        f"""CREATE TABLE {SCHEMA}.retention (
            singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
            forget_ms bigint CHECK (forget_ms >= 0)
        )""",
        f"INSERT INTO {SCHEMA}.retention (forget_ms) VALUES (NULL)",
    ),
)
"""``MIGRATIONS[n - 1]`` takes the schema from version ``n - 1`` to ``n``. Only appended to,
never edited: a database migrated once must mean the same thing to every later version."""

STORE_SCHEMA_VERSION: Final = len(MIGRATIONS)
"""The database schema this code creates and the only one it opens."""

_MIGRATION_LOCK: Final = zlib.crc32(b"pi-runtime db migrate")
"""The transaction-level advisory lock that serialises concurrent migrations."""


def schema_version(conn: Conn) -> int:
    row = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", [f"{SCHEMA}.schema_version"]
    ).fetchone()
    if row is None or not row[0]:
        return 0
    version = conn.execute(f"SELECT version FROM {SCHEMA}.schema_version").fetchone()
    return int(version[0]) if version else 0


def newer_schema(version: int, params: Mapping[str, Any]) -> JournalError:
    return JournalError(
        ReasonCode.STORE_SCHEMA_NEWER,
        f"the database {describe(params)} has store schema version {version}, newer than "
        f"this pi-runtime's {STORE_SCHEMA_VERSION}; upgrade pi-runtime to use it",
    )


def _migrate(params: Mapping[str, Any]) -> int:
    conn = connect(params)
    try:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", [_MIGRATION_LOCK])
            version = schema_version(conn)
            if version > STORE_SCHEMA_VERSION:
                raise newer_schema(version, params)
            if version == STORE_SCHEMA_VERSION:
                return version  # no DDL: a role without CREATE may run it on a current one
            conn.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
            conn.execute(_VERSION_TABLE)
            for statements in MIGRATIONS[version:]:
                for statement in statements:
                    conn.execute(statement)
            conn.execute(
                f"INSERT INTO {SCHEMA}.schema_version (version) VALUES (%s) "
                "ON CONFLICT (singleton) DO UPDATE SET version = EXCLUDED.version, "
                "migrated_at = now()",
                [STORE_SCHEMA_VERSION],
            )
    finally:
        conn.close()
    return STORE_SCHEMA_VERSION


async def migrate(dsn: str) -> int:
    """Create the store's schema in the database ``dsn`` names, or upgrade it; return the
    version now in place (:data:`STORE_SCHEMA_VERSION`). Idempotent, and safe to run from
    several processes at once (an advisory lock serialises them; each migration is one
    transaction with its version bump). Refuses a schema newer than this code knows
    (``store_schema_newer``) and leaves it untouched."""
    params = parse_dsn(dsn)
    try:
        return await trio.to_thread.run_sync(_migrate, params)
    except Unreachable as exc:
        problem = str(exc)
    except psycopg.Error as exc:
        problem = f"migrating the database {describe(params)} failed: {server_reason(exc, params)}"
    raise DiskFailedError(ReasonCode.STORE_UNAVAILABLE, problem)
