"""``create=False``: the memory stores open an existing store only (nothing created)."""

from __future__ import annotations

import asyncio
import hashlib
import stat
from pathlib import Path

import pytest

from tests.memory.conftest import drop_postgres_tables
from touba.errors import ConfigurationError
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import SqliteMemoryStore


def _files(directory: Path) -> dict[str, tuple[str, int]]:
    return {
        p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), stat.S_IMODE(p.stat().st_mode))
        for p in sorted(directory.iterdir())
    }


async def test_sqlite_create_false_opens_only_an_existing_memory_store(
    private_dir: Path,
) -> None:
    async with SqliteHistoryStore(private_dir / "history.sqlite"):
        pass
    before = _files(private_dir)
    with pytest.raises(ConfigurationError, match=r"there is no file .*nothing was created"):
        SqliteMemoryStore(private_dir / "absent.sqlite", create=False)
    with pytest.raises(ConfigurationError, match="holds no touba chat memory store"):
        SqliteMemoryStore(private_dir / "history.sqlite", create=False)
    assert _files(private_dir) == before
    async with SqliteMemoryStore(private_dir / "memory.sqlite"):  # creates
        pass
    async with SqliteMemoryStore(private_dir / "memory.sqlite", create=False) as store:
        assert await store.count_sessions() == 0


@pytest.mark.postgres
def test_postgres_create_false_creates_no_table(pg_prefix: tuple[str, str]) -> None:
    import psycopg

    from touba.memory.postgres import PostgresMemoryStore

    dsn, prefix = pg_prefix

    async def go() -> None:
        store = PostgresMemoryStore(dsn, prefix=prefix, create=False)
        with pytest.raises(ConfigurationError, match="there is no touba chat memory table"):
            await store.open()
        await store.close()
        with psycopg.connect(dsn) as conn:
            found = conn.execute(
                "SELECT count(*) FROM pg_tables WHERE tablename LIKE %s", (prefix + "%",)
            ).fetchone()
        assert found == (0,)
        async with PostgresMemoryStore(dsn, prefix=prefix):  # creates
            pass
        async with PostgresMemoryStore(dsn, prefix=prefix, create=False) as existing:
            assert await existing.count_sessions() == 0

    try:
        asyncio.run(go())
    finally:
        drop_postgres_tables(dsn, prefix)
