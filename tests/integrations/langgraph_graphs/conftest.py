"""A ``ToubaSaver`` per touba store, and a way to reopen it on the same data.

Each test gets its own SQLite file, PostgreSQL schema or Redis key prefix, removed
afterwards (other sessions of the suite share the servers).
"""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests._services import postgres_dsn, redis_url
from touba.integrations.langgraph import ToubaSaver

STORES = [
    "memory",
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("redis", marks=pytest.mark.redis),
]


@dataclass
class Store:
    """One touba store for a test: ``open()`` is a new saver on the same data."""

    name: str
    open: Callable[[], ToubaSaver]
    persistent: bool  # a reopened saver sees what an earlier one stored


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, private_dir: Path) -> Iterator[Store]:
    yield from _store(str(request.param), private_dir)


@pytest.fixture(params=STORES[1:])
def persistent_store(request: pytest.FixtureRequest, private_dir: Path) -> Iterator[Store]:
    yield from _store(str(request.param), private_dir)


def _store(name: str, private_dir: Path) -> Iterator[Store]:
    if importlib.util.find_spec(f"touba.integrations.langgraph._{name}") is None:
        pytest.skip(f"the {name} backend of ToubaSaver is not on this branch")
    tag = uuid.uuid4().hex[:12]
    if name == "memory":
        yield Store(name, ToubaSaver.memory, persistent=False)
    elif name == "sqlite":
        path = str(private_dir / "checkpoints.sqlite")
        yield Store(name, lambda: ToubaSaver.sqlite(path), persistent=True)
    elif name == "postgres":
        yield from _postgres(tag)
    else:
        yield from _redis(tag)


def _postgres(tag: str) -> Iterator[Store]:
    import psycopg
    from psycopg import sql

    dsn = postgres_dsn()
    schema = f"touba_lg_graphs_{tag}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    try:
        prefix = f"{schema}.lg"
        yield Store(
            "postgres", lambda: ToubaSaver.postgres(dsn, table_prefix=prefix), persistent=True
        )
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def _redis(tag: str) -> Iterator[Store]:
    import redis

    url = redis_url()
    prefix = f"touba-lg-graphs:{tag}:"
    try:
        yield Store("redis", lambda: ToubaSaver.redis(url, prefix=prefix), persistent=True)
    finally:
        with redis.Redis.from_url(url) as client:
            keys = list(client.scan_iter(match=prefix + "*", count=1000))
            if keys:
                client.delete(*keys)
