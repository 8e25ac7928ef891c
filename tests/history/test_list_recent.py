"""``list_recent``: the panel's page of conversations, read with ``LIMIT`` (SQLite, PostgreSQL).

The panel's conversations page read every conversation to show 50: with 20,000 stored
that was 120 ms of the panel's CPU a request (measured on PostgreSQL), during which
its other requests waited. ``list_recent(limit=, offset=)`` reads one page and a count.
What it returns must be what the panel computed from ``list`` before: the conversations
held or not expired, the most recently updated first.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests._services import postgres_dsn
from tests.history._stores import Stores, holding
from tests.history.conftest import _built
from touba.errors import ConfigurationError


@pytest.fixture(
    params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
)
async def paged(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stores]:
    async for built in _built(request.param, tmp_path):
        yield built


async def put(record: Any) -> tuple[dict[str, int], None]:
    return {"v": 1}, None


def expire(stores: Stores, key: str) -> None:
    """Make ``key``'s conversation expired, by the store's own clock."""
    if stores.kind == "sqlite":
        [path] = stores.location("main")
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE touba_history_sessions SET expires_at = 1 WHERE key = ?", (key,))
        return
    _dsn, table = stores.location("main")
    schema, name = table.split(".")
    with psycopg.connect(postgres_dsn(), autocommit=True) as conn:
        conn.execute(
            sql.SQL("UPDATE {} SET expires_at = now() - interval '1 second' WHERE key = %s").format(
                sql.Identifier(schema, name)
            ),
            (key,),
        )


async def test_pages_are_the_live_conversations_newest_first(paged: Stores) -> None:
    store = paged()
    for n in range(7):
        await store.transact(f"k{n}", put)
    expire(paged, "k2")
    task, leave = await holding(store, "new", lambda snapshot: (None, None))  # a bare one
    try:
        listed = [r for r in await store.list(purge=False) if r.active or not r.expired]
        listed.sort(key=lambda r: r.updated_at, reverse=True)
        pages = [await store.list_recent(limit=3, offset=offset) for offset in (0, 3, 6)]
    finally:
        leave.set()
        await task
    assert [total for _, total in pages] == [7, 7, 7]
    keys = [row.key for rows, _ in pages for row in rows]
    assert keys == [row.key for row in listed]
    assert keys[0] == "new"  # taken last: the newest
    assert "k2" not in keys  # expired
    assert sorted(keys) == sorted(["new", "k0", "k1", "k3", "k4", "k5", "k6"])
    assert [row for rows, _ in pages for row in rows] == listed  # the same rows, field for field
    assert await store.list_recent(limit=3, offset=9) == ([], 6)  # "new" released since


@pytest.mark.parametrize(("limit", "offset"), [(-1, 0), (3, -1)])
async def test_a_negative_limit_or_offset_is_refused(
    paged: Stores, limit: int, offset: int
) -> None:
    with pytest.raises(ConfigurationError):
        await paged().list_recent(limit=limit, offset=offset)
