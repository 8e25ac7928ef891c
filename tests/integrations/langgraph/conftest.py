"""The stores ToubaSaver's tests run on: one opener per backend, a fresh store per test.

Each opener is an async context manager taking the test's private directory and a unique
tag (use it for a PostgreSQL schema or a Redis key prefix), yielding a fresh, empty
:class:`~touba.integrations.langgraph._backend.SaverBackend` and removing what it created
afterwards. Add a store: write its opener, put it in ``OPENERS`` and its name (with its
mark) in ``BACKENDS``.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import pytest

from touba.integrations.langgraph._backend import SaverBackend

Opener = Callable[[Path, str], AbstractAsyncContextManager[SaverBackend]]


@asynccontextmanager
async def open_memory(directory: Path, tag: str) -> AsyncIterator[SaverBackend]:
    from touba.integrations.langgraph._memory import MemorySaverBackend

    backend = MemorySaverBackend()
    try:
        yield backend
    finally:
        await backend.close()


@asynccontextmanager
async def open_sqlite(directory: Path, tag: str) -> AsyncIterator[SaverBackend]:
    from touba.integrations.langgraph._sqlite import SqliteSaverBackend

    backend = SqliteSaverBackend(directory / f"{tag}.sqlite")
    try:
        yield backend
    finally:
        await backend.close()


@asynccontextmanager
async def open_postgres(directory: Path, tag: str) -> AsyncIterator[SaverBackend]:
    import psycopg
    from psycopg import sql

    from tests._services import postgres_dsn
    from touba.integrations.langgraph._postgres import PostgresSaverBackend

    dsn = postgres_dsn()
    schema = sql.Identifier(tag)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(sql.SQL("CREATE SCHEMA {}").format(schema))
    backend = PostgresSaverBackend(dsn, table_prefix=f"{tag}.lg")
    try:
        yield backend
    finally:
        await backend.close()
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(schema))


@asynccontextmanager
async def open_redis(directory: Path, tag: str) -> AsyncIterator[SaverBackend]:
    import redis

    from tests._services import redis_url
    from touba.integrations.langgraph._redis import RedisSaverBackend

    url = redis_url()
    prefix = f"touba-test-lg:{tag}:"
    backend = RedisSaverBackend(url, prefix=prefix)
    try:
        yield backend
    finally:
        await backend.close()
        with redis.Redis.from_url(url) as client:
            keys = list(client.scan_iter(match=prefix + "*", count=1000))
            if keys:
                client.delete(*keys)


OPENERS: dict[str, Opener] = {
    "memory": open_memory,
    "sqlite": open_sqlite,
    "postgres": open_postgres,
    "redis": open_redis,
}

BACKENDS = [
    "memory",
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("redis", marks=pytest.mark.redis),
]


@pytest.fixture(params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    """The store under test (``memory``, ``sqlite``, ...)."""
    return str(request.param)


@pytest.fixture
def store_tag() -> str:
    """A tag unique to the test: a file name, a schema, a key prefix."""
    return "lg" + uuid.uuid4().hex[:12]


@pytest.fixture
async def backend(
    backend_name: str, private_dir: Path, store_tag: str
) -> AsyncIterator[SaverBackend]:
    """A fresh, empty backend of ``backend_name``, closed and removed after the test."""
    async with OPENERS[backend_name](private_dir, store_tag) as opened:
        yield opened
