"""Where a contract test's checkpoint store or resource binding lives, on every backend.

A :class:`Place` is one test's storage: RAM (one shared instance), a SQLite
file in a private directory, or PostgreSQL tables of their own
(``touba_t_<random>``, dropped at teardown; skipped without a server, failed
under ``CI=true``, see ``tests/_services.py``). ``place.checkpoints()`` and
``place.resources()`` open one more handle on that storage (another
connection for the durable ones), all closed at teardown; ``place.argv()``
tells a subprocess (:mod:`tests.runtime._race`) where the storage is.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from touba.runtime import (
    MemoryCheckpointStore,
    MemoryResourceBinding,
    SqliteCheckpointStore,
    SqliteResourceBinding,
)

ROOT = Path(__file__).resolve().parents[2]
Kind = Literal["memory", "sqlite", "postgres"]
KINDS: tuple[Any, ...] = (
    "memory",
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
)
DURABLE_KINDS: tuple[Any, ...] = KINDS[1:]


def subprocess_env() -> dict[str, str]:
    """This environment, with this checkout's ``src`` and root first on the path."""
    path = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def open_checkpoints(kind: str, *where: str) -> Any:
    """A new checkpoint store handle on the durable storage ``where`` names."""
    if kind == "sqlite":
        return SqliteCheckpointStore(where[0], timeout=30)
    from touba.runtime import PostgresCheckpointStore

    return PostgresCheckpointStore(where[0], table=where[1])


def open_resources(kind: str, *where: str) -> Any:
    """A new resource binding handle on the durable storage ``where`` names."""
    if kind == "sqlite":
        return SqliteResourceBinding(where[0], timeout=30)
    from touba.runtime import PostgresResourceBinding

    return PostgresResourceBinding(where[0], table=where[1])


@dataclass
class Place:
    kind: Kind
    where: tuple[str, ...] = ()
    opened: list[Any] = field(default_factory=list)
    _memory: dict[str, Any] = field(default_factory=dict)

    @property
    def durable(self) -> bool:
        return self.kind != "memory"

    def checkpoints(self) -> Any:
        if self.kind == "memory":
            return self._memory.setdefault("checkpoints", MemoryCheckpointStore())
        store = open_checkpoints(self.kind, *self.where)
        self.opened.append(store)
        return store

    def resources(self) -> Any:
        if self.kind == "memory":
            return self._memory.setdefault("resources", MemoryResourceBinding())
        binding = open_resources(self.kind, *self.where)
        self.opened.append(binding)
        return binding

    def argv(self) -> list[str]:
        assert self.durable, "RAM storage cannot be shared with another process"
        return [self.kind, *self.where]

    def table(self) -> str:
        assert self.kind == "postgres"
        return self.where[1]


@asynccontextmanager
async def place(kind: Kind, tmp_path: Path) -> AsyncIterator[Place]:
    """One test's storage of ``kind``, emptied at the end."""
    if kind == "memory":
        yield Place(kind)
        return
    if kind == "sqlite":
        directory = tmp_path / "private"
        directory.mkdir(mode=0o700, exist_ok=True)
        found = Place(kind, (str(directory / "store.sqlite"),))
        try:
            yield found
        finally:
            for handle in found.opened:
                await handle.close()
        return
    import psycopg
    from psycopg import sql

    from tests._services import postgres_dsn

    dsn = postgres_dsn()
    table = f"touba_t_{uuid.uuid4().hex[:10]}"
    found = Place(kind, (dsn, table))
    try:
        yield found
    finally:
        for handle in found.opened:
            await handle.close()
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            names = [sql.Identifier(table), sql.Identifier(f"{table}_meta")]
            await conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.SQL(", ").join(names)))


async def postgres_sql(dsn: str, statement: str, table: str, *params: Any) -> list[tuple[Any, ...]]:
    """Runs ``statement`` with ``{t}`` and ``{meta}`` naming the test's tables; its rows."""
    import psycopg
    from psycopg import sql

    composed = sql.SQL(statement).format(
        t=sql.Identifier(table), meta=sql.Identifier(f"{table}_meta")
    )
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(composed, params)
        return await cur.fetchall() if cur.description else []


async def race_in_processes(
    where: Place, what: Literal["checkpoints", "resources"], count: int, processes: int = 4
) -> list[list[str]]:
    """Start ``processes`` racers (:mod:`tests.runtime._race`), all connected first, then
    let them go at once; the items each one won."""
    command = [sys.executable, "-m", "tests.runtime._race", what, str(count), *where.argv()]
    racers: list[asyncio.subprocess.Process] = []
    try:
        for _ in range(processes):
            racer = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=ROOT,
                env=subprocess_env(),
            )
            racers.append(racer)
        for racer in racers:
            assert racer.stdout is not None
            line = await asyncio.wait_for(racer.stdout.readline(), 30)
            if line != b"ready\n":
                _, errors = await racer.communicate()
                raise AssertionError(f"a racer did not start: {line!r} {errors.decode()}")
        for racer in racers:
            assert racer.stdin is not None
            racer.stdin.write(b"go\n")
            await racer.stdin.drain()
        won = []
        for racer in racers:
            out, errors = await asyncio.wait_for(racer.communicate(), 60)
            assert racer.returncode == 0, errors.decode()
            won.append(json.loads(out))
        return won
    finally:
        for racer in racers:
            if racer.returncode is None:
                racer.kill()
                await racer.wait()
