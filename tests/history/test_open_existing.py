"""``create=False``: the history stores open an existing store only.

A missing file or table, or a file holding another kind of store (or another
application's data), raises ``ConfigurationError`` and nothing is created or
changed: bytes, modes and the directory's files (SQLite), the tables (PostgreSQL).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sqlite3
import stat
import uuid
from contextlib import closing
from pathlib import Path

import pytest

from tests._services import postgres_dsn
from touba.errors import ConfigurationError, DecisionHistoryRecordInvalid
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import SqliteMemoryStore


def _files(directory: Path) -> dict[str, tuple[str, int]]:
    return {
        p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), stat.S_IMODE(p.stat().st_mode))
        for p in sorted(directory.iterdir())
    }


async def test_sqlite_create_false_opens_only_an_existing_history_store(
    private_dir: Path,
) -> None:
    async with SqliteMemoryStore(private_dir / "memory.sqlite"):
        pass
    with closing(sqlite3.connect(private_dir / "app.sqlite")) as conn:
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
        conn.commit()
    os.chmod(private_dir / "app.sqlite", 0o644)
    (private_dir / "notes.txt").write_text("not a database\n")
    before = _files(private_dir)
    with pytest.raises(ConfigurationError, match=r"there is no file .*nothing was created"):
        SqliteHistoryStore(private_dir / "absent.sqlite", create=False)
    for name in ("memory.sqlite", "app.sqlite"):
        with pytest.raises(ConfigurationError, match="holds no touba decision history store"):
            SqliteHistoryStore(private_dir / name, create=False)
    with pytest.raises(DecisionHistoryRecordInvalid, match="not a database"):
        SqliteHistoryStore(private_dir / "notes.txt", create=False)
    assert _files(private_dir) == before

    async with SqliteHistoryStore(private_dir / "history.sqlite") as store:  # creates
        await store.usage()
    async with SqliteHistoryStore(private_dir / "history.sqlite", create=False) as store:
        assert (await store.usage()).sessions == 0


@pytest.mark.postgres
def test_postgres_create_false_creates_no_table() -> None:
    import psycopg

    from touba.history.postgres import PostgresHistoryStore

    dsn = postgres_dsn()
    table = f"touba_open_{uuid.uuid4().hex[:10]}"

    async def go() -> None:
        store = PostgresHistoryStore(dsn, table=table, create=False)
        with pytest.raises(ConfigurationError, match="there is no touba history table"):
            await store.open()
        await store.close()
        with psycopg.connect(dsn) as conn:
            found = conn.execute(
                "SELECT count(*) FROM pg_tables WHERE tablename LIKE %s", (table + "%",)
            ).fetchone()
        assert found == (0,)
        async with PostgresHistoryStore(dsn, table=table):  # creates
            pass
        async with PostgresHistoryStore(dsn, table=table, create=False) as existing:
            assert (await existing.usage()).sessions == 0

    try:
        asyncio.run(go())
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for suffix in ("_messages", "", "_meta", "_usage"):
                conn.execute(f'DROP TABLE IF EXISTS "{table}{suffix}" CASCADE')
            for function in ("usage_count", "usage_count_row", "usage_take", "messages_changed"):
                conn.execute(f'DROP FUNCTION IF EXISTS "{table}_{function}" CASCADE')
