"""The resource bindings' export primitives: ``scope_items`` pages through every
resource under one scope key, ``import_item`` keeps the exported ``updated_at`` and
never replaces a value. On the RAM, SQLite and PostgreSQL bindings."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests._services import postgres_dsn
from touba.runtime import MemoryResourceBinding, SqliteResourceBinding
from touba.runtime._resources import ResourceAddress


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def binding(request: pytest.FixtureRequest, private_dir: Path) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield MemoryResourceBinding()
        return
    if request.param == "sqlite":
        async with SqliteResourceBinding(private_dir / "resources.db") as sqlite_binding:
            yield sqlite_binding
        return
    import psycopg
    from psycopg import sql

    from touba.runtime import PostgresResourceBinding

    dsn, table = postgres_dsn(), f"tr_{uuid.uuid4().hex[:10]}"
    pg_binding = PostgresResourceBinding(dsn, table=table)
    try:
        yield pg_binding
    finally:
        await pg_binding.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            for name in (table, f"{table}_meta"):
                conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(name)))


def at(resource: str, scope: str = "session", key: str = "s1") -> ResourceAddress:
    return ResourceAddress(resource, scope, key)  # type: ignore[arg-type]


async def test_scope_items_pages_through_every_resource_of_one_scope_key(binding: Any) -> None:
    for resource in ("b", "a"):
        for n in range(5):
            await binding.put(at(resource), f"k{n}", {"n": n, "r": resource})
    await binding.put(at("a", key="s2"), "k0", 0)  # another session
    await binding.put(at("a", scope="user", key="s1"), "k0", 0)  # another scope

    seen: list[tuple[str, str]] = []
    after = ("", "")
    while page := await binding.scope_items("session", "s1", after=after, limit=3):
        assert len(page) <= 3
        for address, item in page:
            assert (address.scope, address.scope_key) == ("session", "s1")
            assert item.value == {"n": int(item.key[1:]), "r": address.resource}
            seen.append((address.resource, item.key))
        after = (page[-1][0].resource, page[-1][1].key)

    assert seen == [(r, f"k{n}") for r in ("a", "b") for n in range(5)]


async def test_import_item_keeps_updated_at_and_never_replaces(binding: Any) -> None:
    then = datetime(2025, 5, 1, 12, 30, 15, 123456, tzinfo=UTC)

    assert await binding.import_item(at("a"), "k", {"v": [1, "ü"]}, then) is True
    assert await binding.import_item(at("a"), "k", {"v": "other"}, datetime.now(UTC)) is False

    item = await binding.get(at("a"), "k")
    assert item.value == {"v": [1, "ü"]}
    assert item.updated_at == then
