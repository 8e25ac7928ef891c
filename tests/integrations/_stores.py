"""A PostgreSQL schema and a Redis key prefix of a test's own, removed afterwards.

Shared by the conftests that open an ADK session service or a LangGraph saver on
each touba store: other sessions of the suite use the same servers at the same time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

import pytest

from tests._services import postgres_dsn, redis_url

T = TypeVar("T")

STORES = [
    "memory",
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("redis", marks=pytest.mark.redis),
]


@dataclass
class Store(Generic[T]):
    """One touba store for a test: ``open()`` is a new service or saver on the same data."""

    name: str
    open: Callable[[], T]
    persistent: bool  # a reopened one sees what an earlier one stored


def create_schema(schema: str, *, exist_ok: bool = False) -> None:
    """Create the PostgreSQL ``schema`` (``exist_ok``: leave one already there)."""
    import psycopg
    from psycopg import sql

    query = "CREATE SCHEMA IF NOT EXISTS {}" if exist_ok else "CREATE SCHEMA {}"
    with psycopg.connect(postgres_dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL(query).format(sql.Identifier(schema)))


def drop_schema(schema: str) -> None:
    """Drop the PostgreSQL ``schema`` with everything in it."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(postgres_dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def delete_keys(prefix: str) -> None:
    """Delete every Redis key starting with ``prefix``."""
    import redis

    with redis.Redis.from_url(redis_url()) as client:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)


@contextmanager
def own_schema(schema: str) -> Iterator[str]:
    """A new PostgreSQL ``schema`` for the block, dropped after it; yields the DSN."""
    create_schema(schema)
    try:
        yield postgres_dsn()
    finally:
        drop_schema(schema)


@contextmanager
def own_prefix(prefix: str) -> Iterator[str]:
    """Redis keys under ``prefix`` for the block, deleted after it; yields the URL."""
    try:
        yield redis_url()
    finally:
        delete_keys(prefix)
