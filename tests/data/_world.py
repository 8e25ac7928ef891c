"""A deployment of real stores holding two users' data of every kind, and raw scans of it.

``Deployment(kind, tmp_path)`` opens the stores of one kind of deployment:

- ``sqlite``: memory, history, checkpoints and resources in four SQLite files;
- ``postgres``: the four in one PostgreSQL schema of the test (dropped afterwards);
- ``redis``: histories in Redis (a key prefix of the test), memory in SQLite, checkpoints
  and resources in this process;
- ``ram``: histories in RAM, memory in SQLite, checkpoints and resources in this process.

``populate(user)`` writes, through the stores' own APIs, every kind of row a user leaves:
sessions, turns (with a turn context), key events and their updates, extraction jobs,
decision histories of the user's sessions and of a run outside them, checkpoints (of a
session, of the user only by its body), and resource values of every scope. Every row
of ``user`` carries ``marker(user)``; ids carry the user id. ``raw()`` dumps every row or
key the deployment holds, as text; ``file_bytes()`` the SQLite files' bytes.
"""

from __future__ import annotations

import sqlite3
import uuid
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests._services import postgres_dsn, redis_url
from touba.data import Stores
from touba.history import (
    CapabilityCall,
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
    MemoryHistoryStore,
    Observation,
)
from touba.memory import MemoryConfig, SqliteMemoryStore
from touba.runtime import MemoryCheckpointStore, MemoryResourceBinding, SqliteCheckpointStore
from touba.runtime._resources import ResourceAddress

__all__ = ["KINDS", "Deployment", "marker", "outside_run", "sessions_of"]

KINDS = ["sqlite", "ram", "postgres", "redis"]
AGENT = "support"


def marker(user: str) -> str:
    """The string placed in every row of ``user``'s."""
    return f"MARKER-{user.upper()}-Zq9"


def sessions_of(user: str) -> list[str]:
    return [f"s-{user}-1", f"s-{user}-2"]


def outside_run(user: str) -> str:
    """A run of the user's outside any chat session, known by its checkpoint's body only."""
    return f"r-{user}-batch"


def identity(run_id: str) -> ConversationIdentity:
    return ConversationIdentity("t", "openai", "m", "native", run_id, f"i-{run_id}", AGENT)


async def write_history(store: Any, run_id: str, mark: str) -> str:
    """One conversation of ``run_id``: a call, its result, a final answer; its key."""
    history = DecisionHistory(HistoryConfig(store=store, namespace="t"))
    who = identity(run_id)
    made = (CapabilityCall(f"c-{run_id}", "lookup", {"q": mark}),)

    async def ask(window: HistoryWindow) -> DecisionMessage:
        return DecisionMessage(text=None, calls=made, provider="openai", opaque={"m": mark})

    async def answer(window: HistoryWindow) -> DecisionMessage:
        return DecisionMessage(text=f"done {mark}", calls=(), provider="openai", opaque={})

    await history.step(who, [], ask)
    result = Observation(made[0].call_id, "lookup", {"q": mark}, "ok", result={"r": mark})
    await history.step(who, [result], answer)
    return who.key


@dataclass
class Deployment:
    kind: str
    tmp_path: Path
    stores: Stores = field(init=False)
    root: str = field(default_factory=lambda: f"e{uuid.uuid4().hex[:10]}")
    closers: list[Any] = field(default_factory=list)

    # -- building ---------------------------------------------------------------------------

    def path(self, name: str) -> Path:
        directory = self.tmp_path / "private"
        directory.mkdir(mode=0o700, exist_ok=True)
        self.tmp_path.chmod(0o700)
        return directory / f"{name}.db"

    async def open(self) -> Stores:
        kind = self.kind
        if kind == "postgres":
            import psycopg
            from psycopg import sql

            from touba.history.postgres import PostgresHistoryStore
            from touba.memory.postgres import PostgresMemoryStore
            from touba.runtime import PostgresCheckpointStore, PostgresResourceBinding

            dsn = postgres_dsn()
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(
                    sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.root))
                )
            memory: Any = PostgresMemoryStore(dsn, prefix=f"{self.root}.touba_memory")
            history: Any = PostgresHistoryStore(dsn, table=f"{self.root}.touba_history")
            checkpoints: Any = PostgresCheckpointStore(dsn, table=f"{self.root}.touba_checkpoints")
            resources: Any = PostgresResourceBinding(dsn, table=f"{self.root}.touba_resources")
            for store in (memory, checkpoints, resources):
                await store.open()
        else:
            memory = SqliteMemoryStore(self.path("memory"))
            if kind == "sqlite":
                from touba.history.sqlite import SqliteHistoryStore
                from touba.runtime import SqliteResourceBinding

                history = SqliteHistoryStore(self.path("history"))
                checkpoints = SqliteCheckpointStore(self.path("checkpoints"))
                resources = SqliteResourceBinding(self.path("resources"))
            else:
                if kind == "redis":
                    from touba.history.redis import RedisHistoryStore

                    history = RedisHistoryStore(redis_url(), prefix=self.prefix)
                else:
                    history = MemoryHistoryStore()
                checkpoints = MemoryCheckpointStore()
                resources = MemoryResourceBinding()
        self.closers = [s for s in (memory, history, checkpoints, resources) if hasattr(s, "close")]
        self.stores = Stores(
            memory=memory, histories=(history,), checkpoints=checkpoints, resources=resources
        )
        return self.stores

    @property
    def prefix(self) -> str:
        return f"touba-erase:{self.root}:"

    async def close(self) -> None:
        for store in self.closers:
            await store.close()
        self.closers = []

    async def cleanup(self) -> None:
        await self.close()
        if self.kind == "postgres":
            import psycopg
            from psycopg import sql

            with psycopg.connect(postgres_dsn(), autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(self.root)))
        if self.kind == "redis":
            from redis.asyncio import Redis

            client = Redis.from_url(redis_url())
            keys = [k async for k in client.scan_iter(match=f"{self.prefix}*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()

    # -- data -------------------------------------------------------------------------------

    async def populate(self, user: str) -> None:
        stores = self.stores
        mark = marker(user)
        owner = f"user:{user}"
        memory: Any = stores.memory
        for sid in sessions_of(user):
            await memory.open_session(sid, owner=owner, agent_ref=AGENT, mode="live")
            for n in range(2):
                await memory.append_turn(
                    sid,
                    user=f"{mark} question {n}",
                    replies=[f"{mark} reply {n}"],
                    invocation_id=f"inv-{user}-{n}",
                    context={"note": mark, "n": n},
                )
            event = await memory.create_event(
                owner=owner,
                type="refund",
                title=f"{mark} refund",
                details=f"{mark} order",
                session_id=sid,
                op_id=f"op-{sid}",
            )
            await memory.update_event(
                owner, event.id, {"details": f"{mark} refunded"}, session_id=sid, op_id=f"u-{sid}"
            )
            await memory.end_session(sid)
            await memory.enqueue_job(
                session_id=sid,
                owner=owner,
                agent_ref=AGENT,
                transcript_ref=f"{sid}@2",
                max_attempts=3,
            )
            await write_history(stores.histories[0], sid, mark)
        await write_history(stores.histories[0], outside_run(user), mark)
        checkpoints: Any = stores.checkpoints
        await checkpoints.save(
            f"cp-{user}-1",
            {"run_id": sessions_of(user)[0], "session_id": sessions_of(user)[0], "input": mark},
        )
        await checkpoints.save(
            f"cp-{user}-2", {"run_id": outside_run(user), "user_id": user, "input": mark}
        )
        resources: Any = stores.resources
        for scope, key in (
            ("user", user),
            ("session", sessions_of(user)[1]),
            ("run", outside_run(user)),
        ):
            await resources.put(ResourceAddress("notes", scope, key), "k1", {"text": mark})  # type: ignore[arg-type]

    async def populate_shared(self) -> None:
        """What belongs to no user: an agent's settings and agent-scoped resources."""
        memory: Any = self.stores.memory
        await memory.save_memory_config(AGENT, MemoryConfig(), actor="cli")
        resources: Any = self.stores.resources
        await resources.put(ResourceAddress("notes", "agent", AGENT), "k", {"text": "shared"})

    # -- raw scans --------------------------------------------------------------------------

    async def raw(self) -> list[str]:
        """Every row of every table (SQLite, PostgreSQL) or every Redis key and value under
        the prefix, as text; the in-process stores' contents as their repr."""
        out: list[str] = []
        for store in (
            self.stores.memory,
            self.stores.histories[0],
            self.stores.checkpoints,
            self.stores.resources,
        ):
            out.extend(await self._raw_store(store))
        return out

    async def _raw_store(self, store: Any) -> list[str]:
        name = type(store).__name__
        if name.startswith("Sqlite"):
            return []  # read from the files, after the stores are closed: sqlite_rows()
        if name.startswith("Postgres"):
            return await self._pg_rows()
        if name == "RedisHistoryStore":
            return await self._redis_rows()
        if name == "MemoryHistoryStore":
            return sorted(f"{k}: {v!r}" for k, v in store._entries.items())
        if name in ("MemoryCheckpointStore", "MemoryResourceBinding"):
            items = sorted(f"{k!r}: {v!r}" for k, v in store._items.items())
            return items + sorted(f"{k!r}: {v!r}" for k, v in getattr(store, "_times", {}).items())
        raise AssertionError(f"no raw scan for {name}")

    async def _pg_rows(self) -> list[str]:
        import psycopg
        from psycopg import sql

        out: list[str] = []
        async with await psycopg.AsyncConnection.connect(postgres_dsn()) as conn:
            tables = await (
                await conn.execute(
                    "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                    (self.root,),
                )
            ).fetchall()
            for (table,) in sorted(tables):
                query = sql.SQL("SELECT t::text FROM {} t ORDER BY 1").format(
                    sql.Identifier(self.root, table)
                )
                rows = await (await conn.execute(query)).fetchall()
                out.extend(f"{table}: {r[0]}" for r in rows)
        return sorted(set(out))

    async def _redis_rows(self) -> list[str]:
        from redis.asyncio import Redis

        client = Redis.from_url(redis_url())
        out: list[str] = []
        try:
            async for raw_key in client.scan_iter(match=f"{self.prefix}*"):
                key = raw_key.decode() if isinstance(raw_key, bytes) else str(raw_key)
                found_type = await client.type(raw_key)
                kind = found_type.decode() if isinstance(found_type, bytes) else str(found_type)
                value: Any
                if kind == "string":
                    value = await client.get(raw_key)
                elif kind == "hash":
                    value = sorted((await client.hgetall(raw_key)).items())
                elif kind == "list":
                    value = await client.lrange(raw_key, 0, -1)
                elif kind == "zset":
                    value = await client.zrange(raw_key, 0, -1, withscores=True)
                elif kind == "set":
                    value = sorted(await client.smembers(raw_key))
                else:
                    raise AssertionError(f"unexpected Redis type {kind}")
                out.append(f"{key}: {value!r}")
        finally:
            await client.aclose()
        return sorted(out)

    def sqlite_files(self) -> list[Path]:
        directory = self.tmp_path / "private"
        return sorted(directory.glob("*.db")) if directory.exists() else []

    def sqlite_rows(self) -> list[str]:
        """Every row of every table of every SQLite file (the stores closed)."""
        out: list[str] = []
        for path in self.sqlite_files():
            with closing(sqlite3.connect(path)) as conn:
                names = conn.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table'"
                ).fetchall()
                for (table,) in names:
                    rows = conn.execute(f'SELECT * FROM "{table}"')  # noqa: S608
                    out.extend(f"{path.name}:{table}: {row!r}" for row in rows)
        return sorted(out)

    def file_bytes(self) -> bytes:
        """The SQLite files' raw bytes, WAL checkpointed into them first (stores closed)."""
        data = b""
        for path in self.sqlite_files():
            with closing(sqlite3.connect(path)) as conn:
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            data += path.read_bytes()
            for side in ("-wal", "-journal"):
                companion = path.with_name(path.name + side)
                if companion.exists():
                    data += companion.read_bytes()
        return data
