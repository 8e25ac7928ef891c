"""One writer per conversation, user or invocation, for each PostgreSQL store with per-key
writes: what ``tests/history/test_pg_no_queue.py`` and ``bench/pg_writers.py`` run.

Each writer is a worker of its own: its own store object on its own DSN (named
``<run>:<writer>`` by :func:`tests._pg_locks.writer_dsn`, so every backend the
store opens belongs to this writer), over tables every writer of the run
shares. :meth:`Writer.write` is one *decision*:

- ``history``: one decision of a conversation through ``DecisionHistory.step``
  (reserve, read the window, the model's answer, append and release), the
  observation of the previous call given;
- ``memory``: a chat turn of the user's session (``append_turn``) and an update
  of the user's key event (``update_event``: its history row added);
- ``checkpoints``: an invocation's running checkpoint moved on one revision
  (``replace``), and every tenth write removed and a new one saved, as the
  runtime does around each step of an invocation;
- ``resources``: a run's business resource (``PostgresResourceBinding``) given a
  value under one of ten keys (an upsert), every tenth write a delete.

:func:`prepare` makes the tables (and, for ``history``, the first write, whose
capacity check shares the room out under the store-wide lock: a step of the
first write only, see ``touba.history.postgres``) before writers start.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

import psycopg
from psycopg import sql

from touba.history import (
    CapabilityCall,
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
    Observation,
)
from touba.history._common import MiB
from touba.history.postgres import PostgresHistoryStore
from touba.memory.postgres import PostgresMemoryStore
from touba.runtime import PostgresCheckpointStore, PostgresResourceBinding, ResourceAddress

__all__ = [
    "KINDS",
    "UNITS",
    "Writer",
    "drop_schema",
    "make_schema",
    "names",
    "prepare",
    "writer",
]

KINDS: Final = ("history", "memory", "checkpoints", "resources")
UNITS: Final = {
    "history": "conversation",
    "memory": "user",
    "checkpoints": "invocation",
    "resources": "run",
}
MAX_SESSIONS: Final = 4096
MAX_STORE_BYTES: Final = 1024 * MiB


class Writer(Protocol):
    """One conversation's (user's, invocation's) worker."""

    decisions: int

    async def open(self) -> None: ...
    async def write(self) -> None: ...
    async def close(self) -> None: ...


def make_schema(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))


def drop_schema(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def names(kind: str, dsn: str, count: int) -> list[str]:
    """``count`` writer names for ``kind``. For ``history``, conversations whose keys
    all hash to one usage shard (``hashtext(key) & 63``): the worst case for a
    store that would count each conversation in its key's shard."""
    if kind != "history":
        return [f"{UNITS[kind][0]}{n}" for n in range(count)]
    candidates = [f"c{n}" for n in range(64 * count)]
    keys = [_identity(name).key for name in candidates]
    with psycopg.connect(dsn, autocommit=True) as conn:
        shards = [
            row[0]
            for row in conn.execute(
                "SELECT hashtext(k) & 63 FROM unnest(%s::text[]) WITH ORDINALITY AS t(k, i)"
                " ORDER BY i",
                (keys,),
            )
        ]
    by_shard: dict[int, list[str]] = {}
    for name, shard in zip(candidates, shards, strict=True):
        by_shard.setdefault(shard, []).append(name)
    mates = max(by_shard.values(), key=len)
    assert len(mates) >= count, "too few candidates for one shard"
    return mates[:count]


def writer(kind: str, dsn: str, schema: str, name: str) -> Writer:
    """The writer ``name`` of ``kind`` on ``dsn``, over the tables of ``schema``."""
    if kind == "history":
        return _HistoryWriter(dsn, schema, name)
    if kind == "memory":
        return _MemoryWriter(dsn, schema, name)
    if kind == "checkpoints":
        return _CheckpointWriter(dsn, schema, name)
    if kind == "resources":
        return _ResourceWriter(dsn, schema, name)
    raise ValueError(f"unknown store {kind!r}")


async def prepare(kind: str, dsn: str, schema: str) -> None:
    """Create ``kind``'s tables in ``schema``; for ``history``, make the first write."""
    first = writer(kind, dsn, schema, "first")
    await first.open()
    try:
        if kind == "history":
            await first.write()
    finally:
        await first.close()


def _identity(name: str) -> ConversationIdentity:
    return ConversationIdentity("pgq", "app", "m", "native", "run", name, "agent")


class _HistoryWriter:
    def __init__(self, dsn: str, schema: str, name: str) -> None:
        self.store = PostgresHistoryStore(
            dsn,
            table=f"{schema}.history",
            max_sessions=MAX_SESSIONS,
            max_store_bytes=MAX_STORE_BYTES,
            worker_id=name,
        )
        self.history = DecisionHistory(
            HistoryConfig(
                store=self.store,
                namespace="pgq",
                max_messages=16,
                max_retained_bytes=256 * MiB,
            )
        )
        self.identity = _identity(name)
        self.pending: CapabilityCall | None = None
        self.decisions = 0

    async def open(self) -> None:
        await self.store.open()

    async def write(self) -> None:
        observations = []
        if self.pending is not None:
            p = self.pending
            observations.append(Observation(p.call_id, p.name, p.arguments, "ok", {"n": 1}))
        call = CapabilityCall(f"c{self.decisions}", "lookup_order", {"order": self.decisions})

        async def generate(window: HistoryWindow) -> DecisionMessage:
            return DecisionMessage(text="checking", calls=(call,))

        await self.history.step(self.identity, observations, generate)
        self.pending = call
        self.decisions += 1

    async def close(self) -> None:
        await self.store.close()


class _MemoryWriter:
    def __init__(self, dsn: str, schema: str, name: str) -> None:
        self.store = PostgresMemoryStore(dsn, prefix=f"{schema}.mem")
        self.owner = f"user:{name}"
        self.session_id = f"s-{name}"
        self.event_id = ""
        self.decisions = 0

    async def open(self) -> None:
        await self.store.open()
        await self.store.open_session(
            self.session_id, owner=self.owner, agent_ref="agent", mode="live"
        )
        event = await self.store.create_event(
            owner=self.owner,
            type="order",
            title="order placed",
            details="waiting",
            session_id=self.session_id,
        )
        self.event_id = event.id

    async def write(self) -> None:
        n = self.decisions
        await self.store.append_turn(self.session_id, user=f"where is it? {n}", replies=["soon"])
        await self.store.update_event(
            self.owner, self.event_id, {"details": f"checked {n}"}, session_id=self.session_id
        )
        self.decisions += 1

    async def close(self) -> None:
        await self.store.close()


class _CheckpointWriter:
    def __init__(self, dsn: str, schema: str, name: str) -> None:
        self.store = PostgresCheckpointStore(dsn, table=f"{schema}.checkpoints")
        self.name = name
        self.checkpoint_id = ""
        self.revision = 0
        self.decisions = 0

    def _body(self) -> dict[str, Any]:
        return {
            "run_id": f"run-{self.name}",
            "invocation_id": self.name,
            "agent_ref": "agent",
            "status": "running",
            "revision": self.revision,
            "steps": [{"call": "lookup_order", "n": self.decisions}],
        }

    async def _start(self) -> None:
        self.checkpoint_id = f"{self.name}-{self.decisions}"
        self.revision = 0
        await self.store.save(self.checkpoint_id, self._body())

    async def open(self) -> None:
        await self.store.open()
        await self._start()

    async def write(self) -> None:
        self.decisions += 1
        if self.decisions % 10 == 0:  # the invocation ends; the next one starts
            assert await self.store.replace(self.checkpoint_id, None, revision=self.revision)
            await self._start()
            return
        self.revision += 1
        moved = await self.store.replace(
            self.checkpoint_id, self._body(), revision=self.revision - 1
        )
        assert moved

    async def close(self) -> None:
        await self.store.close()


class _ResourceWriter:
    def __init__(self, dsn: str, schema: str, name: str) -> None:
        self.store = PostgresResourceBinding(dsn, table=f"{schema}.resources")
        self.address = ResourceAddress("orders", "run", f"run-{name}")
        self.decisions = 0

    async def open(self) -> None:
        await self.store.open()

    async def write(self) -> None:
        self.decisions += 1
        key = f"order-{self.decisions % 10}"
        if self.decisions % 10 == 0:
            await self.store.delete(self.address, key)
        else:
            await self.store.put(self.address, key, {"status": "shipped", "n": self.decisions})

    async def close(self) -> None:
        await self.store.close()
