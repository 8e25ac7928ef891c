"""A ``ToubaSessionService`` per touba store, and a way to reopen it on the same data.

Each test gets its own SQLite file, PostgreSQL schema or Redis key prefix, removed
afterwards (other sessions of the suite share the servers).
"""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests._services import postgres_dsn, redis_url
from touba.integrations.adk import ToubaSessionService

STORES = [
    "memory",
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("redis", marks=pytest.mark.redis),
]


@dataclass
class Store:
    """One touba store for a test: ``open()`` is a new service on the same data."""

    name: str
    open: Callable[[], ToubaSessionService]
    persistent: bool  # a reopened service sees what an earlier one stored


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, private_dir: Path) -> Iterator[Store]:
    yield from _store(str(request.param), private_dir)


@pytest.fixture(params=STORES[1:])
def persistent_store(request: pytest.FixtureRequest, private_dir: Path) -> Iterator[Store]:
    yield from _store(str(request.param), private_dir)


def _store(name: str, private_dir: Path) -> Iterator[Store]:
    if importlib.util.find_spec(f"touba.integrations.adk._{name}") is None:
        pytest.skip(f"the {name} backend of ToubaSessionService is not on this branch")
    tag = uuid.uuid4().hex[:12]
    if name == "memory":
        yield Store(name, ToubaSessionService.memory, persistent=False)
    elif name == "sqlite":
        path = str(private_dir / "adk.sqlite")
        yield Store(name, lambda: ToubaSessionService.sqlite(path), persistent=True)
    elif name == "postgres":
        yield from _postgres(tag)
    else:
        yield from _redis(tag)


def _postgres(tag: str) -> Iterator[Store]:
    import psycopg
    from psycopg import sql

    dsn = postgres_dsn()
    schema = f"touba_adk_runner_{tag}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    try:
        prefix = f"{schema}.adk"
        yield Store(
            "postgres",
            lambda: ToubaSessionService.postgres(dsn, table_prefix=prefix),
            persistent=True,
        )
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def _redis(tag: str) -> Iterator[Store]:
    import redis

    url = redis_url()
    prefix = f"touba-adk-runner:{tag}:"
    try:
        yield Store("redis", lambda: ToubaSessionService.redis(url, prefix=prefix), persistent=True)
    finally:
        with redis.Redis.from_url(url) as client:
            keys = list(client.scan_iter(match=prefix + "*", count=1000))
            if keys:
                client.delete(*keys)


@pytest.fixture
async def service(store: Store) -> AsyncIterator[Any]:
    opened = store.open()
    try:
        yield opened
    finally:
        await opened.close()
