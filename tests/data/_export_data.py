"""Deployments of every store kind for the export / import tests, and the data they hold.

``Deployment(kind)`` builds the memory store (SQLite file or the real PostgreSQL
server, in tables of its own), a history store (SQLite, PostgreSQL or Redis, through
``tests.history._stores``) and a SQLite checkpoint store; ``populate`` fills one with a
session of every record kind, plus another session that a session export must leave
out.
"""

from __future__ import annotations

import io
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from tests._services import postgres_dsn
from tests.history._stores import Stores as HistoryStores
from tests.memory.conftest import drop_postgres_tables
from touba.data import Stores, write_export
from touba.history import ConversationIdentity
from touba.history._record import new_head
from touba.memory import SqliteMemoryStore
from touba.memory._model import CreateEventOp
from touba.providers._types import TraceCall
from touba.runtime import SqliteCheckpointStore, SqliteResourceBinding
from touba.runtime._resources import ResourceAddress

__all__ = ["Deployment", "conversation", "export_bytes", "populate", "records_of"]


class Clock:
    """An aware clock that moves a millisecond at each reading: distinct, ordered times."""

    def __init__(self) -> None:
        self.now = datetime(2026, 3, 1, 9, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        self.now += timedelta(milliseconds=1)
        return self.now


@dataclass
class Deployment:
    """A memory store of ``memory_kind``, a history store of ``history_kind`` and a
    SQLite checkpoint store, under ``tmp_path`` / the real servers; ``close()``."""

    memory_kind: str
    history_kind: str
    tmp_path: Path
    name: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    limits: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.dir = self.tmp_path / self.name
        self.dir.mkdir(mode=0o700)
        self.histories = HistoryStores(self.history_kind, self.dir)
        self.histories.prepare()
        self._pg: tuple[str, str] | None = None
        if self.memory_kind == "sqlite":
            memory: Any = SqliteMemoryStore(self.dir / "memory.db", clock=Clock())
        else:
            from touba.memory.postgres import PostgresMemoryStore

            self._pg = (postgres_dsn(), f"tx_{uuid.uuid4().hex[:10]}")
            memory = PostgresMemoryStore(self._pg[0], prefix=self._pg[1], clock=Clock())
        resources: Any = SqliteResourceBinding(self.dir / "resources.db")
        if self._pg is not None:
            from touba.runtime import PostgresResourceBinding

            resources = PostgresResourceBinding(self._pg[0], table=f"{self._pg[1]}_resources")
        self.stores = Stores(
            memory=memory,
            histories=(self.histories("h", **self.limits),),
            checkpoints=SqliteCheckpointStore(self.dir / "checkpoints.db"),
            resources=resources,
        )

    @property
    def memory(self) -> Any:
        return self.stores.memory

    @property
    def history(self) -> Any:
        return self.stores.histories[0]

    async def close(self) -> None:
        await self.memory.close()
        checkpoints: Any = self.stores.checkpoints
        await checkpoints.close()
        resources: Any = self.stores.resources
        await resources.close()
        await self.histories.cleanup()
        if self._pg is not None:
            drop_postgres_tables(*self._pg)
            import psycopg
            from psycopg import sql

            with psycopg.connect(self._pg[0], autocommit=True) as conn:
                for name in ("resources", "resources_meta"):
                    table = sql.Identifier(f"{self._pg[1]}_{name}")
                    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))


def conversation(
    run_id: str, invocation: str, *, messages: int = 4, size: int = 40
) -> dict[str, Any]:
    """A decision-history record of ``messages`` messages in exchanges of two."""
    who = ConversationIdentity("app", "openai", "gpt", "native", run_id, invocation, "agent")
    exchanges: list[list[dict[str, Any]]] = []
    for n in range(messages):
        if n % 2 == 0:
            exchanges.append([])
        exchanges[-1].append({"kind": "input", "text": f"{n}:" + "é" * size})
    return new_head(who) | {"exchanges": exchanges}


async def save(store: Any, key: str, record: dict[str, Any]) -> None:
    async def put(current: Any) -> tuple[dict[str, Any], None]:
        return record, None

    await store.transact(key, put)


async def populate(deployment: Deployment, session: str = "s1", *, other: str = "s2") -> None:
    """A session of every record kind, and ``other``, a session that is not exported."""
    memory = deployment.memory
    for sid in (session, other):
        await memory.open_session(sid, owner="user-1", agent_ref="support", mode="live")
        for n in range(3):
            call = TraceCall("c1", "lookup", {"order": n}, "ok", {"found": [1, None, "ü"]}, None)
            await memory.append_turn(
                sid,
                user=f"question {n} \x00 ünï",
                replies=[f"answer {n}", "more"],
                trace=[[call]] if n else [],
                invocation_id=f"inv-{sid}-{n}",
                context={"turns": n, "settings": {"full": True}},
            )
        owner = f"session:{sid}"
        event = await memory.create_event(
            owner=owner, type="task", title="Refund", details="order 7", session_id=sid
        )
        await memory.update_event(owner, event.id, {"status": "in_progress"}, session_id=sid)
        await memory.update_event(
            owner,
            event.id,
            {"details": "order 8"},
            session_id="panel",
            actor="operator",
            op_id=f"op-{sid}",
        )
        await memory.create_event(
            owner=owner, type="note", title="Closed", details="", session_id=sid
        )
        await memory.end_session(sid)
        job, _ = await memory.enqueue_job(
            session_id=sid, owner=owner, agent_ref="support", transcript_ref="t", max_attempts=3
        )
        claimed = await memory.claim_job("w", 60, job_id=job.id)
        await memory.record_job_ops(
            job.id, claimed.lease_token, [CreateEventOp("task", "From extraction")]
        )
        await memory.complete_job(job.id, claimed.lease_token, {"created": 1})
        for n in range(2):
            await save(deployment.history, f"app:{sid}:{n}", conversation(sid, f"i{n}"))
        binding: Any = deployment.stores.resources
        for scope, key in (("session", "notes"), ("run", "cart"), ("session", "zz")):
            address = ResourceAddress("orders", scope, sid)  # type: ignore[arg-type]
            await binding.put(address, key, {"items": [1, 2], "who": "ünï"})
        await binding.put(ResourceAddress("orders", "agent", "support"), "shared", 1)
        await deployment.stores.checkpoints.save(  # type: ignore[union-attr]
            f"cp-{sid}", {"run_id": sid, "agent_ref": "support", "input": "ünï", "n": [1.5, None]}
        )


async def export_bytes(stores: Stores, **selection: str) -> bytes:
    out = io.BytesIO()
    await write_export(stores, out, **selection)
    return out.getvalue()


def records_of(data: bytes) -> list[bytes]:
    """The record lines of an export (its header, which has the time, left out)."""
    return data.splitlines()[1:]
