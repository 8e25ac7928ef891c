"""Stores for the integration tests: SQLite on a private file, PostgreSQL and Redis for real."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests._services import postgres_dsn, redis_url

Factory = Callable[..., Any]


def make_factory(
    backend: str, directory: Path, name: str, *, create: bool = True
) -> tuple[Factory, Callable[[], None]]:
    """A store factory (each call: a new store on the same data, named ``name``) and a cleanup."""
    if backend == "sqlite":
        from touba.history.sqlite import SqliteHistoryStore

        path = str(directory / "history.sqlite")
        return (lambda **kw: SqliteHistoryStore(path, **kw)), lambda: None
    if backend == "postgres":
        import psycopg
        from psycopg import sql

        from touba.history.postgres import PostgresHistoryStore

        dsn = postgres_dsn()
        schema = f"touba_integrations_{name}"
        if create:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))

        def drop() -> None:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))

        return (lambda **kw: PostgresHistoryStore(dsn=dsn, table=f"{schema}.h", **kw)), drop
    assert backend == "redis"
    import redis

    from touba.history.redis import RedisHistoryStore

    url = redis_url()
    prefix = f"touba-integrations:{name}:"

    def delete() -> None:
        with redis.Redis.from_url(url) as client:
            keys = list(client.scan_iter(match=prefix + "*", count=1000))
            if keys:
                client.delete(*keys)

    return (lambda **kw: RedisHistoryStore(url=url, prefix=prefix, **kw)), delete


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("redis", marks=pytest.mark.redis),
    ]
)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_name() -> str:
    return uuid.uuid4().hex[:12]


@pytest.fixture
def store_factory(backend: str, private_dir: Path, store_name: str) -> Any:
    factory, cleanup = make_factory(backend, private_dir, store_name)
    yield factory
    cleanup()


@pytest.fixture
async def store(store_factory: Factory) -> AsyncIterator[Any]:
    async with store_factory() as s:
        yield s
