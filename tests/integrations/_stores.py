"""A PostgreSQL schema and a Redis key prefix of a test's own, removed afterwards.

Shared by the conftests that open an ADK session service or a LangGraph saver on
each touba store: other sessions of the suite use the same servers at the same time.
"""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import pytest

from tests._services import postgres_dsn, redis_url

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

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


class Opens(Protocol[T_co]):
    """The four constructors ``ToubaSessionService`` and ``ToubaSaver`` both have."""

    def memory(self) -> T_co: ...

    def sqlite(self, path: str) -> T_co: ...

    def postgres(self, dsn: str, *, table_prefix: str) -> T_co: ...

    def redis(self, url: str, *, prefix: str) -> T_co: ...


def open_store(
    name: str, private_dir: Path, opens: Opens[T], *, package: str, label: str
) -> Iterator[Store[T]]:
    """The ``name`` store of ``opens`` (``ToubaSessionService`` or ``ToubaSaver``) for a
    test: a file in ``private_dir``, or a schema or key prefix named after ``label``
    (and a random tag), removed afterwards. Skips when ``package`` has no such backend."""
    if importlib.util.find_spec(f"{package}._{name}") is None:
        pytest.skip(f"the {name} backend of {package} is not on this branch")
    tag = uuid.uuid4().hex[:12]
    if name == "memory":
        yield Store(name, opens.memory, persistent=False)
    elif name == "sqlite":
        path = str(private_dir / f"{label}.sqlite")
        yield Store(name, lambda: opens.sqlite(path), persistent=True)
    elif name == "postgres":
        schema = f"touba_{label}_{tag}"
        with own_schema(schema) as dsn:
            table = f"{schema}.{label}"
            yield Store(name, lambda: opens.postgres(dsn, table_prefix=table), persistent=True)
    else:
        prefix = f"touba-{label}:{tag}:"
        with own_prefix(prefix) as url:
            yield Store(name, lambda: opens.redis(url, prefix=prefix), persistent=True)
