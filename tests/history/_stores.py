"""Stores of every kind for history tests, built on the real backends.

``Stores(kind, tmp_path)`` builds ``memory``, ``sqlite`` (real files),
``postgres`` or ``redis`` stores (the real servers of ``TOUBA_POSTGRES_DSN`` /
``TOUBA_REDIS_URL``, in a schema or key prefix of the test); stores built
with the same name share their data, as separate workers do.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests._services import postgres_dsn, redis_url
from touba.history import ConversationIdentity, MemoryHistoryStore
from touba.providers import CapabilitySpec

__all__ = ["DURABLE", "KINDS", "LOOKUP", "WHO", "Stores", "build", "holding", "state"]

# The conversation the history-level tests hold, in namespace "n".
WHO = ConversationIdentity("n", "openai", "m", "native", "r", "i", "agent")

# The capability the provider-level tests offer.
LOOKUP = CapabilitySpec(
    "lookup_order",
    "Find an order",
    {"type": "object", "properties": {"order_id": {"type": "string"}}},
)

KINDS = [
    "memory",
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("redis", marks=pytest.mark.redis),
]
DURABLE = [k for k in KINDS if k != "memory"]


# -- stores -------------------------------------------------------------------------------


@dataclass
class Stores:
    """Builds stores of one kind; stores built with the same ``name`` share their data
    (the same file, table or prefix: separate connections, as separate workers have)."""

    kind: str
    tmp_path: Path
    made: list[Any] = field(default_factory=list)
    memory: dict[str, MemoryHistoryStore] = field(default_factory=dict)
    root: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:12]}")

    def location(self, name: str) -> tuple[str, ...]:
        """Arguments naming where ``name``'s data lives, for a child process too."""
        if self.kind == "sqlite":
            return (str(self.tmp_path / f"{name}.sqlite"),)
        if self.kind == "postgres":
            return (postgres_dsn(), f"{self.root}.{name}")
        return (redis_url(), f"touba-capacity:{self.root}:{name}:")

    def __call__(self, name: str = "main", **limits: Any) -> Any:
        if self.kind == "memory":
            if name not in self.memory:
                self.memory[name] = MemoryHistoryStore(**limits)
            return self.memory[name]
        store = build(self.kind, *self.location(name), **limits)
        self.made.append(store)
        return store

    def prepare(self) -> None:
        if self.kind == "postgres":
            import psycopg
            from psycopg import sql

            with psycopg.connect(postgres_dsn(), autocommit=True) as conn:
                conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(self.root)))

    async def cleanup(self) -> None:
        for store in self.made:
            await store.close()
        if self.kind == "postgres":
            import psycopg
            from psycopg import sql

            with psycopg.connect(postgres_dsn(), autocommit=True) as conn:
                drop = sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(self.root))
                conn.execute(drop)
        if self.kind == "redis":
            from redis.asyncio import Redis

            client = Redis.from_url(redis_url())
            keys = [k async for k in client.scan_iter(match=f"touba-capacity:{self.root}:*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()


def build(kind: str, *where: str, **limits: Any) -> Any:
    """A durable store of ``kind`` at ``where`` (also run by the child processes)."""
    if kind == "sqlite":
        from touba.history.sqlite import SqliteHistoryStore

        return SqliteHistoryStore(where[0], **limits)
    if kind == "postgres":
        from touba.history.postgres import PostgresHistoryStore

        return PostgresHistoryStore(where[0], table=where[1], **limits)
    from touba.history.redis import RedisHistoryStore

    return RedisHistoryStore(where[0], prefix=where[1], **limits)


async def state(store: Any) -> list[Any]:
    """Everything observable about a store's conversations, content included."""
    rows = await store.list()
    return [(row, await store.read(row.key)) for row in rows]


async def holding(
    store: Any, key: str, saved: Callable[[Any], tuple[Any, Any]]
) -> tuple[asyncio.Task[Any], asyncio.Event]:
    """Starts ``store.transact(key, ...)`` and returns once its callback is running: the key
    stays reserved until the returned event is set, then the callback returns
    ``saved(snapshot)`` (or raises what ``saved`` raises). Returns the task and that event."""
    inside, leave = asyncio.Event(), asyncio.Event()

    async def hold(snapshot: Any) -> tuple[Any, Any]:
        inside.set()
        await leave.wait()
        return saved(snapshot)

    task = asyncio.create_task(store.transact(key, hold))
    await inside.wait()
    return task, leave
