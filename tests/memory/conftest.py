"""Fixtures for the chat memory tests: a controllable clock and stores on both backends.

``store`` runs a test on SQLite (a real file in a private tmp dir) and on the
real PostgreSQL server of TOUBA_POSTGRES_DSN, in tables of its own
(``tm_<random>_*``) dropped at teardown. Without the server the PostgreSQL
case is skipped, except under ``CI=true`` where it fails.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests._services import postgres_dsn
from touba.memory._sql import SqlMemoryStore
from touba.memory.sqlite import SqliteMemoryStore

POSTGRES_TABLES = (
    "sessions",
    "turns",
    "events",
    "history",
    "jobs",
    "configs",
    "config_changes",
    "meta",
)


class FakeClock:
    """An aware clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def private_dir(private_dir: Path, tmp_path: Path) -> Path:
    os.chmod(tmp_path, 0o700)  # its parent closed too
    return private_dir


def drop_postgres_tables(dsn: str, prefix: str) -> None:
    import psycopg
    from psycopg import sql

    names = [sql.Identifier(f"{prefix}_{t}") for t in POSTGRES_TABLES]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.SQL(", ").join(names)))


@pytest.fixture
def pg_prefix() -> Iterator[tuple[str, str]]:
    """A PostgreSQL DSN and a table prefix of this test alone, dropped afterwards."""
    dsn = postgres_dsn()
    prefix = f"tm_{uuid.uuid4().hex[:10]}"
    yield dsn, prefix
    drop_postgres_tables(dsn, prefix)


MakeStore = Callable[[], SqlMemoryStore]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def make_store(
    request: pytest.FixtureRequest, private_dir: Path, clock: FakeClock
) -> AsyncIterator[MakeStore]:
    """Open stores on one place (same file, same tables): a reopen sees what was saved."""
    made: list[SqlMemoryStore] = []
    if request.param == "sqlite":

        def make() -> SqlMemoryStore:
            made.append(SqliteMemoryStore(private_dir / "memory.db", clock=clock))
            return made[-1]

    else:
        from touba.memory.postgres import PostgresMemoryStore

        dsn, prefix = request.getfixturevalue("pg_prefix")

        def make() -> SqlMemoryStore:
            made.append(PostgresMemoryStore(dsn, prefix=prefix, clock=clock))
            return made[-1]

    yield make
    for store in made:
        await store.close()


@pytest.fixture
async def store(make_store: MakeStore) -> SqlMemoryStore:
    return make_store()
