"""Factories of ToubaSaver for langgraph-checkpoint-conformance (``run_langgraph.py``).

``peers/langgraph/run_conformance.py tests.peers.langgraph_savers:NAME`` enters a factory
once per capability; each entry yields a saver on a fresh, isolated store and removes it
afterwards: a new private directory (SQLite), a new schema (PostgreSQL), a new key prefix
(Redis).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator

from touba.integrations.langgraph import ToubaSaver

__all__ = ["memory", "postgres", "redis", "sqlite"]


async def memory() -> AsyncIterator[ToubaSaver]:
    """A saver on a new RAM store."""
    async with ToubaSaver.memory() as saver:
        yield saver


async def sqlite() -> AsyncIterator[ToubaSaver]:
    """A saver on a new SQLite file in a new private directory."""
    directory = tempfile.mkdtemp(prefix="touba-lg-peers-")  # mode 0700
    try:
        async with ToubaSaver.sqlite(os.path.join(directory, "graph.sqlite")) as saver:
            yield saver
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def postgres() -> AsyncIterator[ToubaSaver]:
    """A saver on new tables in a new PostgreSQL schema, dropped afterwards."""
    import psycopg
    from psycopg import sql

    dsn = os.environ.get("TOUBA_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
    schema = "touba_lg_peers_" + uuid.uuid4().hex[:12]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    try:
        async with ToubaSaver.postgres(dsn, table_prefix=f"{schema}.lg") as saver:
            yield saver
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


async def redis() -> AsyncIterator[ToubaSaver]:
    """A saver under a new Redis key prefix, whose keys are deleted afterwards."""
    import redis.asyncio

    url = os.environ.get("TOUBA_REDIS_URL", "redis://127.0.0.1:6379/0")
    prefix = f"touba:lg-peers:{uuid.uuid4().hex[:12]}:"
    try:
        async with ToubaSaver.redis(url, prefix=prefix) as saver:
            yield saver
    finally:
        client = redis.asyncio.Redis.from_url(url)
        try:
            keys = [key async for key in client.scan_iter(match=prefix + "*", count=1000)]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()
