"""Fixtures of the journal tests: a throw-away PostgreSQL for the PostgreSQL store
(``pg_fixtures.py``)."""

from .pg_fixtures import pg_blank_dsn, pg_dsn, pg_server

__all__ = ["pg_blank_dsn", "pg_dsn", "pg_server"]
