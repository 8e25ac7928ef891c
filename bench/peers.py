"""touba's decision history against openai-agents' sessions, store by store.

One **decision** is the work an agent's memory does between two model calls:
save the result of the call the model made, read the window the model is sent,
save the model's next decision. Each system does it its own way, through its
public API, on the same data:

- **touba**: one ``DecisionHistory.step`` (the real history step: reservation,
  record check, the result appended, the bounded window of complete exchanges,
  the decision appended, the reservation released) through each built-in
  store, with ``HistoryConfig(max_messages=128)``.
- **openai-agents** 0.24: ``add_items([result])``, ``get_items(limit=128)``,
  ``add_items([decision])`` on ``SQLiteSession`` (the file),
  ``SQLAlchemySession`` (PostgreSQL through asyncpg), ``RedisSession``, and
  ``SQLiteSession(":memory:")`` beside touba's RAM store.
- **floor** (SQLite only): the same work done minimally with the standard
  library's ``sqlite3`` in one hop to a worker thread (``asyncio.to_thread``,
  the least an asyncio program pays to use ``sqlite3``): ``json.dumps`` of the
  result and ``INSERT`` into ``m(id INTEGER PRIMARY KEY, conv INTEGER, body
  TEXT)`` in its own ``BEGIN IMMEDIATE`` .. ``COMMIT``; ``SELECT body FROM m
  WHERE conv = ? ORDER BY id DESC LIMIT 128`` on the index ``(conv, id)`` and
  ``json.loads`` of each row; ``json.dumps`` and ``INSERT`` of the decision in
  a second ``BEGIN IMMEDIATE`` .. ``COMMIT``. No reservation, no bounds, no
  check of what it reads. The **2-hop floor** does the same work in two hops,
  split where an agent calls its model (the result's commit and the read in
  the first, the decision's commit in the second): the least a memory that
  reads before the model call and writes after it pays, as touba does.
- **LangGraph** (optional, when ``langgraph-checkpoint-sqlite`` /
  ``-postgres`` are installed): one ``graph.ainvoke`` of a one-node graph
  whose ``messages`` channel uses ``add_messages``, the result as input and
  the decision as the node's output, with ``AsyncSqliteSaver`` /
  ``AsyncPostgresSaver`` (``durability="sync"``); the node reads the last 128
  messages of the state.

Every message is 1 KiB of compact JSON in its system's own form (a touba
result or decision message; a Responses ``function_call_output`` or
``function_call`` item; a LangChain ``ToolMessage`` or ``AIMessage``).
SQLite runs in WAL mode with ``synchronous=FULL`` for every system (touba's
own setting; the peers' connections are given the same pragmas); PostgreSQL
with ``fsync`` on (checked and printed); Redis as the server is configured
(printed).

Tables, all measured in one run:

1. **Per decision**: conversations retaining N = 10, 100, 1,000 and 10,000
   messages, decided in interleaved rounds (every system and size once per
   round, the order rotating); the median per system and size, the ratio of
   touba to the peer, touba's and the peer's ratio to the floor, and touba's
   to the 2-hop floor. A
   conversation that grew more than 10 % past its N is seeded again between
   two timed decisions, so N stays what the row says. At N = 10 the window
   holds the 10 messages there are; from N = 128 on, 128.
2. **Growth**: each system's median at N over its median at N = 10.
3. **Bytes per message on disk** (SQLite): ``(page_count - freelist_count) *
   page_size`` of a file holding one conversation of N messages, after a WAL
   checkpoint, less the same for the empty schema, divided by N.
4. **Throughput**: 1, 2, 4 and 8 conversations (N = 100) decided concurrently
   in one process for a few seconds each, decisions per second; then 8
   conversations driven from 4 processes (PostgreSQL), touba against
   ``SQLAlchemySession`` and against touba with the same 8 conversations in
   one process, in 3 alternating rounds (ratios within a round, medians),
   with the CPUs that one process keeps busy (its own and, read from
   ``/proc`` on a local server, PostgreSQL's): what more processes can gain
   on this machine is bounded by the CPUs left.
   Each system keeps its default connection pool (touba's PostgreSQL store:
   4 connections; SQLAlchemy: 5 plus 10 overflow); the SQLite peers open
   their file once per session, as the SDK does.

Benchmarks are not tests: nothing here asserts a time.

    .venv/bin/python bench/peers.py [--quick] [--stores memory,sqlite,postgres,redis]
        [--sizes 10,100,1000,10000] [--rounds 60] [--seconds 2] [--no-langgraph]
        [--no-throughput] [--no-processes]

PostgreSQL and Redis are the servers of ``TOUBA_POSTGRES_DSN`` and
``TOUBA_REDIS_URL`` (defaults ``postgresql://postgres@127.0.0.1:5432/test``,
``redis://127.0.0.1:6379/0``); an unreachable one is skipped with a note.
Needs the ``bench`` extra: ``pip install -e ".[all,dev,bench]"``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import socket
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

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
from touba.history._common import MiB
from touba.history._model import ResultMessage, message_bytes, message_to_dict
from touba.history._record import join_record, new_head

SIZES = (10, 100, 1_000, 10_000)
STORES = ("memory", "sqlite", "postgres", "redis")
WINDOW = 128
MESSAGE = 1024  # bytes of compact JSON per message
NAMESPACE = "bench"
THROUGHPUT_SIZE = 100
LEVELS = (1, 2, 4, 8)
PROCESSES = 4
PER_PROCESS = 2
PROCESS_ROUNDS = 3
DSN = os.environ.get("TOUBA_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TOUBA_REDIS_URL", "redis://127.0.0.1:6379/0")


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _padded(build: Callable[[str], Any], measure: Callable[[Any], int]) -> Any:
    """``build(pad)`` with ``pad`` sized so that the message weighs MESSAGE bytes."""
    bare = measure(build(""))
    return build("x" * max(MESSAGE - bare, 0))


def _call_id(n: int) -> str:
    return f"call-{n:08d}"


# the work, in each system's own messages -------------------------------------------------


def touba_decision(n: int) -> DecisionMessage:
    def build(pad: str) -> DecisionMessage:
        call = CapabilityCall(_call_id(n), "lookup_order", {"order_id": f"A{n:08d}"})
        return DecisionMessage(text=pad, calls=(call,))

    return _padded(build, message_bytes)  # type: ignore[no-any-return]


def touba_observation(call: CapabilityCall) -> Observation:
    def build(pad: str) -> ResultMessage:
        return ResultMessage(call.call_id, call.name, call.arguments, "ok", {"text": pad})

    result: ResultMessage = _padded(build, message_bytes)
    return Observation(call.call_id, call.name, call.arguments, "ok", result.result)


def agents_call(n: int) -> dict[str, Any]:
    def build(pad: str) -> dict[str, Any]:
        arguments = _compact({"order_id": f"A{n:08d}", "note": pad})
        return {
            "type": "function_call",
            "call_id": _call_id(n),
            "name": "lookup_order",
            "arguments": arguments,
        }

    return _padded(build, lambda item: len(_compact(item).encode()))  # type: ignore[no-any-return]


def agents_output(n: int) -> dict[str, Any]:
    def build(pad: str) -> dict[str, Any]:
        return {"type": "function_call_output", "call_id": _call_id(n), "output": pad}

    return _padded(build, lambda item: len(_compact(item).encode()))  # type: ignore[no-any-return]


# conversations -------------------------------------------------------------------------


class Conversation(Protocol):
    retained: int

    async def seed(self) -> None: ...

    def prepare(self) -> None:
        """Build the next decision's messages (not timed)."""
        ...

    async def decide(self) -> None: ...


@dataclass
class ToubaConversation:
    """One decision history conversation: ``DecisionHistory.step`` per decision."""

    history: DecisionHistory
    identity: ConversationIdentity
    size: int
    retained: int = 0
    step: int = 0
    pending: CapabilityCall | None = None
    next: tuple[Observation, DecisionMessage] | None = None

    async def seed(self) -> None:
        store = self.history.store
        with contextlib.suppress(Exception):
            await store.delete(self.identity.key)  # type: ignore[attr-defined]
        exchanges = max((self.size - 1) // 2, 0)
        rows: list[list[dict[str, Any]]] = []
        for n in range(exchanges):
            decision = touba_decision(n)
            (call,) = decision.calls
            result = ResultMessage.from_observation(touba_observation(call))
            rows.append([message_to_dict(decision), message_to_dict(result)])
        last = touba_decision(exchanges)
        rows.append([message_to_dict(last)])
        head = new_head(self.identity)
        head["pending"] = [{"call_id": c.call_id, "name": c.name} for c in last.calls]
        size = sum(message_bytes(m) for ex in rows for m in ex)
        head["stats"] = {
            "exchanges": len(rows),
            "messages": sum(len(ex) for ex in rows),
            "bytes": size,
        }
        record = join_record(head, rows)

        async def put(_: dict[str, Any] | None) -> tuple[dict[str, Any], None]:
            return record, None

        await store.transact(self.identity.key, put)
        self.retained = head["stats"]["messages"]
        self.step = exchanges + 1
        self.pending = last.calls[0]
        self.next = None

    def prepare(self) -> None:
        assert self.pending is not None
        self.next = (touba_observation(self.pending), touba_decision(self.step))

    async def decide(self) -> None:
        if self.next is None:
            self.prepare()
        assert self.next is not None
        (observation, decision), self.next = self.next, None
        self.step += 1

        async def generate(window: HistoryWindow) -> DecisionMessage:
            return decision

        await self.history.step(self.identity, [observation], generate)
        self.pending = decision.calls[0]
        self.retained += 2


@dataclass
class AgentsConversation:
    """One openai-agents session: add the result, read 128 items, add the decision."""

    session: Any
    size: int
    retained: int = 0
    step: int = 0
    next: tuple[dict[str, Any], dict[str, Any]] | None = None

    async def seed(self) -> None:
        await self.session.clear_session()
        items: list[dict[str, Any]] = []
        n = 0
        while len(items) < self.size - 1:
            items += [agents_call(n), agents_output(n)]
            n += 1
        items = items[: max(self.size - 1, 0)]
        items.append(agents_call(n))
        await self.session.add_items(items)
        self.retained = len(items)
        self.step = n + 1
        self.next = None

    def prepare(self) -> None:
        self.next = (agents_output(self.step - 1), agents_call(self.step))

    async def decide(self) -> None:
        if self.next is None:
            self.prepare()
        assert self.next is not None
        (result, decision), self.next = self.next, None
        await self.session.add_items([result])
        await self.session.get_items(limit=WINDOW)
        await self.session.add_items([decision])
        self.step += 1
        self.retained += 2


class FloorConversation:
    """The same work with bare sqlite3: two commits, one indexed read (see the docstring);
    ``hops=2``: split where the model is called (the result and the read in one hop,
    the decision in a second)."""

    def __init__(self, conn: sqlite3.Connection, conv: int, size: int, hops: int = 1) -> None:
        self.conn = conn
        self.conv = conv
        self.size = size
        self.hops = hops
        self.retained = 0
        self.step = 0
        self.next: tuple[dict[str, Any], dict[str, Any]] | None = None

    def prepare(self) -> None:
        self.next = (agents_output(self.step), agents_call(self.step))

    async def seed(self) -> None:
        def seed() -> None:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.execute("DELETE FROM m WHERE conv = ?", (self.conv,))
            self.conn.executemany(
                "INSERT INTO m (conv, body) VALUES (?, ?)",
                [(self.conv, json.dumps(agents_output(n))) for n in range(self.size)],
            )
            self.conn.execute("COMMIT")

        await asyncio.to_thread(seed)
        self.retained = self.size
        self.step = self.size
        self.next = None

    async def decide(self) -> None:
        if self.next is None:
            self.prepare()
        assert self.next is not None
        (result, decision), self.next = self.next, None
        conv, conn = self.conv, self.conn

        def read() -> list[Any]:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO m (conv, body) VALUES (?, ?)", (conv, json.dumps(result)))
            conn.execute("COMMIT")
            rows = conn.execute(
                "SELECT body FROM m WHERE conv = ? ORDER BY id DESC LIMIT ?", (conv, WINDOW)
            ).fetchall()
            return [json.loads(body) for (body,) in reversed(rows)]

        def save() -> None:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO m (conv, body) VALUES (?, ?)", (conv, json.dumps(decision)))
            conn.execute("COMMIT")

        def work() -> list[Any]:
            window = read()
            save()
            return window

        if self.hops == 1:
            await asyncio.to_thread(work)
        else:  # the model would be called between the two
            await asyncio.to_thread(read)
            await asyncio.to_thread(save)
        self.step += 1
        self.retained += 2


def floor_connection(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute(
        "CREATE TABLE IF NOT EXISTS m "
        "(id INTEGER PRIMARY KEY, conv INTEGER NOT NULL, body TEXT NOT NULL)"
    )
    conn.execute("CREATE INDEX IF NOT EXISTS m_conv ON m (conv, id)")
    return conn


class LangGraphConversation:
    """One LangGraph thread: ``ainvoke`` with the result, the node returns the decision."""

    def __init__(self, graph: Any, size: int) -> None:
        self.graph = graph
        self.size = size
        self.retained = 0
        self.step = 0
        self.thread = ""
        self.next: Any = None

    def prepare(self) -> None:
        from langchain_core.messages import ToolMessage

        self.next = _tool(self.step - 1, ToolMessage)

    async def seed(self) -> None:
        from langchain_core.messages import AIMessage, ToolMessage

        self.thread = uuid.uuid4().hex
        self.next = None
        messages: list[Any] = []
        n = 0
        while len(messages) < self.size - 3:
            messages += [_ai(n, AIMessage), _tool(n, ToolMessage)]
            n += 1
        messages = messages[: max(self.size - 3, 0)]
        messages.append(_ai(n, AIMessage))
        messages.append(_tool(n, ToolMessage))
        self.step = n + 1
        await self._invoke(messages)  # the node adds the decision
        self.retained = len(messages) + 1

    async def _invoke(self, messages: list[Any]) -> None:
        await self.graph.ainvoke(
            {"messages": messages},
            {"configurable": {"thread_id": self.thread, "step": self.step}},
            durability="sync",
        )

    async def decide(self) -> None:
        if self.next is None:
            self.prepare()
        message, self.next = self.next, None
        await self._invoke([message])
        self.step += 1
        self.retained += 2


def _ai(n: int, cls: Any) -> Any:
    def build(pad: str) -> Any:
        call = {"name": "lookup_order", "args": {"order_id": f"A{n:08d}"}, "id": _call_id(n)}
        return cls(content=pad, tool_calls=[call], id=f"ai-{n:08d}")

    return _padded(build, _lc_bytes)


def _tool(n: int, cls: Any) -> Any:
    def build(pad: str) -> Any:
        return cls(content=pad, tool_call_id=_call_id(n), id=f"tool-{n:08d}")

    return _padded(build, _lc_bytes)


def _lc_bytes(message: Any) -> int:
    return len(_compact(message.model_dump(mode="json")).encode())


def _langgraph(checkpointer: Any) -> Any:
    from typing import Annotated, TypedDict

    from langchain_core.messages import AIMessage
    from langchain_core.runnables import RunnableConfig
    from langgraph.graph import END, START, StateGraph
    from langgraph.graph.message import add_messages

    # The functional form: evaluated here, where add_messages is in scope.
    State = TypedDict("State", {"messages": Annotated[list[Any], add_messages]})  # noqa: UP013

    def model(state: Any, config: RunnableConfig) -> dict[str, Any]:
        state["messages"][-WINDOW:]  # the window the model would be sent
        step = config["configurable"]["step"]
        return {"messages": [_ai(step, AIMessage)]}

    graph = StateGraph(State)
    graph.add_node("model", model)
    graph.add_edge(START, "model")
    graph.add_edge("model", END)
    return graph.compile(checkpointer=checkpointer)


# stores, one per kind: how each system opens it ----------------------------------------


def _history(store: Any) -> DecisionHistory:
    return DecisionHistory(
        HistoryConfig(
            store=store,
            namespace=NAMESPACE,
            max_messages=WINDOW,
            max_retained_bytes=256 * MiB,
        )
    )


def _identity(name: str) -> ConversationIdentity:
    return ConversationIdentity(NAMESPACE, "bench", "m", "native", "run", name, "agent")


_LIMITS: dict[str, Any] = {"max_sessions": 1024, "max_store_bytes": 4096 * MiB}


class Backend:
    """What a store kind needs: touba's store, the peer's sessions, cleanup."""

    kind: str
    peer_name: str = "—"

    def __init__(self, run: str, directory: Path) -> None:
        self.run = run
        self.directory = directory
        self._closers: list[Callable[[], Awaitable[Any]]] = []
        self._store: Any = None

    async def touba_store(self) -> Any:
        raise NotImplementedError

    async def touba(self, name: str, size: int) -> ToubaConversation:
        if self._store is None:
            self._store = await self.touba_store()
            self._closers.append(self._store.close)
        return ToubaConversation(_history(self._store), _identity(f"{self.run}-{name}"), size)

    async def peer(self, name: str, size: int) -> AgentsConversation | None:
        return None

    async def floor(self, name: str, size: int) -> FloorConversation | None:
        return None

    async def floor2(self, name: str, size: int) -> FloorConversation | None:
        floor = await self.floor(name, size)
        if floor is not None:
            floor.hops = 2
        return floor

    async def langgraph_saver(self) -> Any:
        """The LangGraph checkpointer of this kind, set up, its connection closed with the
        backend; None where LangGraph (or its saver for this kind) is not installed."""
        return None

    async def langgraph(self, name: str, size: int) -> LangGraphConversation | None:
        if not hasattr(self, "_graph"):
            saver = await self.langgraph_saver()
            self._graph = None if saver is None else _langgraph(saver)
        return None if self._graph is None else LangGraphConversation(self._graph, size)

    async def close(self) -> None:
        for closer in reversed(self._closers):
            with contextlib.suppress(Exception):
                await closer()
        self._closers.clear()


class MemoryBackend(Backend):
    kind = "memory"
    peer_name = "SQLiteSession(':memory:')"

    async def touba_store(self) -> Any:
        return MemoryHistoryStore(ttl_seconds=86400, **_LIMITS)

    async def peer(self, name: str, size: int) -> AgentsConversation:
        session = _agents_sqlite(name, ":memory:")
        self._closers.append(_closer(session))
        return AgentsConversation(session, size)


def _closer(session: Any) -> Callable[[], Awaitable[Any]]:
    async def close() -> None:
        result = session.close()
        if asyncio.iscoroutine(result):
            await result

    return close


def _agents_sqlite(name: str, path: str | Path) -> Any:
    from agents import SQLiteSession

    class FullSyncSQLiteSession(SQLiteSession):
        """SQLiteSession with the pragmas touba's store sets (WAL is the SDK's own)."""

        @staticmethod
        def _configure_connection(conn: sqlite3.Connection) -> None:
            SQLiteSession._configure_connection(conn)
            conn.execute("PRAGMA synchronous=FULL")

    return FullSyncSQLiteSession(name, path)


class SqliteBackend(Backend):
    kind = "sqlite"
    peer_name = "SQLiteSession"

    async def touba_store(self) -> Any:
        from touba.history.sqlite import SqliteHistoryStore

        return SqliteHistoryStore(self.directory / "touba.sqlite", **_LIMITS)

    async def peer(self, name: str, size: int) -> AgentsConversation:
        session = _agents_sqlite(name, self.directory / "agents.sqlite")
        self._closers.append(_closer(session))
        return AgentsConversation(session, size)

    async def floor(self, name: str, size: int) -> FloorConversation:
        conn = floor_connection(self.directory / "floor.sqlite")
        self._closers.append(_async(conn.close))
        return FloorConversation(conn, abs(hash(name)) % 2**31, size)

    async def langgraph_saver(self) -> Any:
        try:
            import aiosqlite
            from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
        except ImportError:
            return None
        conn = await aiosqlite.connect(self.directory / "langgraph.sqlite")
        await conn.execute("PRAGMA journal_mode=WAL")
        await conn.execute("PRAGMA synchronous=FULL")
        saver = AsyncSqliteSaver(conn)
        await saver.setup()
        self._closers.append(conn.close)
        return saver


def _async(function: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
    async def call() -> Any:
        return function()

    return call


class PostgresBackend(Backend):
    kind = "postgres"
    peer_name = "SQLAlchemySession"

    def __init__(self, run: str, directory: Path) -> None:
        super().__init__(run, directory)
        self.schema = f"touba_bench_{run}"
        self._engine: Any = None

    async def prepare(self) -> None:
        import psycopg

        async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
            await conn.execute(f'CREATE SCHEMA "{self.schema}"')

    async def touba_store(self) -> Any:
        from touba.history.postgres import PostgresHistoryStore

        return PostgresHistoryStore(dsn=DSN, table=f"{self.schema}.h", **_LIMITS)

    async def peer(self, name: str, size: int) -> AgentsConversation:
        from agents.extensions.memory.sqlalchemy_session import SQLAlchemySession

        if self._engine is None:
            self._engine = agents_engine(self.schema)
            self._closers.append(self._engine.dispose)
        session = SQLAlchemySession(name, engine=self._engine, create_tables=True)
        return AgentsConversation(session, size)

    async def langgraph_saver(self) -> Any:
        try:
            import psycopg
            from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
            from psycopg.rows import dict_row
        except ImportError:
            return None
        conn = await psycopg.AsyncConnection.connect(
            DSN,
            autocommit=True,
            prepare_threshold=0,
            row_factory=dict_row,
            options=f"-csearch_path={self.schema}",
        )
        saver = AsyncPostgresSaver(conn)
        await saver.setup()
        self._closers.append(conn.close)
        return saver

    async def close(self) -> None:
        await super().close()
        import psycopg

        async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')


def agents_engine(schema: str) -> Any:
    from sqlalchemy.ext.asyncio import create_async_engine

    parts = urlsplit(DSN)
    url = parts._replace(scheme="postgresql+asyncpg").geturl()
    return create_async_engine(url, connect_args={"server_settings": {"search_path": schema}})


class RedisBackend(Backend):
    kind = "redis"
    peer_name = "RedisSession"

    async def touba_store(self) -> Any:
        from touba.history.redis import RedisHistoryStore

        return RedisHistoryStore(url=REDIS_URL, prefix=f"touba-bench:{self.run}:", **_LIMITS)

    async def peer(self, name: str, size: int) -> AgentsConversation:
        from agents.extensions.memory.redis_session import RedisSession

        if not hasattr(self, "_client"):
            import redis.asyncio

            self._client = redis.asyncio.Redis.from_url(REDIS_URL)
            self._closers.append(self._client.aclose)
        session = RedisSession(
            name, redis_client=self._client, key_prefix=f"agents-bench:{self.run}"
        )
        return AgentsConversation(session, size)

    async def close(self) -> None:
        await super().close()
        import redis.asyncio

        client = redis.asyncio.Redis.from_url(REDIS_URL)
        for pattern in (f"touba-bench:{self.run}:*", f"agents-bench:{self.run}*"):
            keys = [k async for k in client.scan_iter(match=pattern, count=1000)]
            if keys:
                await client.delete(*keys)
        await client.aclose()


BACKENDS: dict[str, type[Backend]] = {
    "memory": MemoryBackend,
    "sqlite": SqliteBackend,
    "postgres": PostgresBackend,
    "redis": RedisBackend,
}


def _reachable(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or default_port), 1
        ):
            return True
    except OSError:
        return False


def available_stores(stores: str) -> list[str]:
    """The stores of ``stores`` (comma-separated) whose server answers; says which not."""
    kinds = [k for k in stores.split(",") if k]
    unknown = set(kinds) - set(BACKENDS)
    if unknown:
        raise SystemExit(f"unknown store(s): {', '.join(sorted(unknown))}")
    available = []
    for kind in kinds:
        url, port = {"postgres": (DSN, 5432), "redis": (REDIS_URL, 6379)}.get(kind, ("", 0))
        if url and not _reachable(url, port):
            print(f"({kind} skipped: {url} unreachable)")
            continue
        available.append(kind)
    return available


@contextlib.asynccontextmanager
async def backend(kind: str, run: str) -> AsyncIterator[Backend]:
    with tempfile.TemporaryDirectory(prefix="touba-bench-") as tmp:
        directory = Path(tmp)  # mkdtemp makes it 0700, as touba's SQLite store requires
        opened = BACKENDS[kind](run, directory)
        if isinstance(opened, PostgresBackend):
            await opened.prepare()
        try:
            yield opened
        finally:
            await opened.close()


# measuring -----------------------------------------------------------------------------

SYSTEMS = ("touba", "peer", "floor", "floor2", "langgraph")


@dataclass
class Row:
    system: str
    size: int
    conversation: Conversation
    timings: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.timings) if self.timings else float("nan")


async def _make(b: Backend, system: str, size: int, name: str) -> Conversation | None:
    maker = {
        "touba": b.touba,
        "peer": b.peer,
        "floor": b.floor,
        "floor2": b.floor2,
        "langgraph": b.langgraph,
    }[system]
    conversation = await maker(name, size)
    if conversation is not None:
        await conversation.seed()
    return conversation


async def _timed(conversation: Conversation, size: int) -> float:
    if conversation.retained > size * 1.1 + 2:  # keep N what the row says (not timed)
        await conversation.seed()
    conversation.prepare()
    started = time.perf_counter()
    await conversation.decide()
    return time.perf_counter() - started


async def per_decision(
    b: Backend, sizes: Sequence[int], rounds: int, langgraph_rounds: int, use_langgraph: bool
) -> list[Row]:
    rows: list[Row] = []
    for size in sizes:
        for system in ("touba", "peer", "floor", "floor2"):
            conversation = await _make(b, system, size, f"{system}-{size}")
            if conversation is not None:
                rows.append(Row(system, size, conversation))
    for row in rows:  # warm up
        for _ in range(3):
            await _timed(row.conversation, row.size)
    for r in range(rounds):
        shift = r % len(rows)
        for row in rows[shift:] + rows[:shift]:
            row.timings.append(await _timed(row.conversation, row.size))
    if use_langgraph:
        graphs: list[Row] = []
        for size in sizes:
            conversation = await _make(b, "langgraph", size, f"langgraph-{size}")
            if conversation is not None:
                graphs.append(Row("langgraph", size, conversation))
        if graphs:
            for row in graphs:
                await _timed(row.conversation, row.size)
            for r in range(langgraph_rounds):
                shift = r % len(graphs)
                for row in graphs[shift:] + graphs[:shift]:
                    row.timings.append(await _timed(row.conversation, row.size))
        rows += graphs
    return rows


async def throughput(b: Backend, system: str, level: int, seconds: float) -> float | None:
    conversations = []
    for i in range(level):
        conversation = await _make(b, system, THROUGHPUT_SIZE, f"tp-{system}-{level}-{i}")
        if conversation is None:
            return None
        conversations.append(conversation)
    for conversation in conversations:
        await conversation.decide()
    return await _drive(conversations, seconds)


async def _drive(conversations: Sequence[Conversation], seconds: float) -> float:
    done = [0]
    started = time.perf_counter()
    stop = started + seconds

    async def loop(conversation: Conversation) -> None:
        while time.perf_counter() < stop:
            await conversation.decide()
            done[0] += 1

    await asyncio.gather(*(loop(c) for c in conversations))
    return done[0] / (time.perf_counter() - started)


def _process_worker(
    system: str, run: str, index: int, seconds: float, barrier: Any, results: Any
) -> None:
    async def main() -> float:
        b = PostgresBackend(run, Path(tempfile.gettempdir()))
        conversations = []
        try:
            for i in range(PER_PROCESS):
                conversation = await _make(b, system, THROUGHPUT_SIZE, f"mp-{system}-{index}-{i}")
                assert conversation is not None
                await conversation.decide()
                conversations.append(conversation)
            await asyncio.to_thread(barrier.wait)
            return await _drive(conversations, seconds)
        finally:
            await Backend.close(b)  # the schema is the parent's to drop

    results.put(asyncio.run(main()))


def postgres_cpu_seconds() -> float | None:
    """CPU time (user + system) of this machine's PostgreSQL processes so far, from
    ``/proc``; None where it cannot be read (no ``/proc``, a remote server)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    ticks, seen = 0, False
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone since listed, or not ours to read
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        if name.startswith("postgres"):
            values = fields.split()
            ticks += int(values[11]) + int(values[12])  # utime, stime (fields 14, 15)
            seen = True
    return ticks / os.sysconf("SC_CLK_TCK") if seen else None


async def cpu_of_single(b: Backend, seconds: float) -> tuple[float, float, float | None]:
    """touba's one-process throughput with the CPUs it keeps busy: (decisions/s,
    cores used by this process, cores used by the PostgreSQL server or None)."""
    started, server = time.perf_counter(), postgres_cpu_seconds()
    own = os.times()
    rate = await throughput(b, "touba", PROCESSES * PER_PROCESS, seconds)
    assert rate is not None
    elapsed, after, server_after = time.perf_counter() - started, os.times(), postgres_cpu_seconds()
    client = (after.user - own.user + after.system - own.system) / elapsed
    busy = None if server is None or server_after is None else (server_after - server) / elapsed
    return rate, client, busy


def across_processes(system: str, run: str, seconds: float) -> float:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES)
    results = context.Queue()
    workers = [
        context.Process(target=_process_worker, args=(system, run, i, seconds, barrier, results))
        for i in range(PROCESSES)
    ]
    for worker in workers:
        worker.start()
    rates: list[float] = [results.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join()
    return sum(rates)


def disk_bytes(sizes: Sequence[int], report: Callable[[str], None]) -> None:
    """Bytes per message on disk: page_count * page_size delta, per system, SQLite."""

    def used(path: Path) -> int:
        conn = sqlite3.connect(path)
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            pages, free, page = (
                conn.execute(f"PRAGMA {p}").fetchone()[0]
                for p in ("page_count", "freelist_count", "page_size")
            )
            return int((pages - free) * page)
        finally:
            conn.close()

    async def used_by(system: str, size: int) -> int:
        with tempfile.TemporaryDirectory(prefix="touba-bench-") as tmp:
            b = SqliteBackend("disk", Path(tmp))
            await _make(b, system, size, "disk")
            await b.close()
            name = {"touba": "touba.sqlite", "peer": "agents.sqlite", "floor": "floor.sqlite"}
            return used(Path(tmp) / name[system])

    def per_message(system: str, size: int) -> float:
        small = 4  # the schema and one conversation's fixed rows, subtracted
        return (asyncio.run(used_by(system, size)) - asyncio.run(used_by(system, small))) / (
            size - small
        )

    report(
        "\nBytes per message on disk (SQLite: (page_count - freelist_count) * page_size, "
        "N messages less 4, / (N - 4))"
    )
    header = f"{'N':>8}{'touba':>8}{'SQLiteSession':>15}{'ratio':>7}{'floor':>7}"
    report(header)
    report("-" * len(header))
    for size in sizes:
        if size < 1000:
            continue
        touba, peer, floor = (per_message(system, size) for system in ("touba", "peer", "floor"))
        report(f"{size:>8,}{touba:>8.0f}{peer:>15.0f}{touba / peer:>7.2f}{floor:>7.0f}")


# reports -------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def report_decisions(kind: str, peer: str, rows: list[Row], report: Callable[[str], None]) -> None:
    by = {(r.system, r.size): r.median for r in rows}
    sizes = sorted({r.size for r in rows})
    has_floor = any(r.system == "floor" for r in rows)
    has_split = any(r.system == "floor2" for r in rows)
    has_graph = any(r.system == "langgraph" for r in rows)
    report(
        f"\n{kind}: median ms per decision (save result, read window of {WINDOW}, save decision)"
    )
    header = f"{'N':>8}{'touba':>9}{peer:>28}{'ratio':>7}"
    if has_floor:
        header += f"{'floor':>8}{'touba/floor':>12}{'peer/floor':>11}"
    if has_split:
        header += f"{'2-hop':>7}{'touba/2-hop':>12}"
    if has_graph:
        header += f"{'LangGraph':>11}{'touba/LG':>10}"
    report(header)
    report("-" * len(header))
    for size in sizes:
        touba, other = by.get(("touba", size), float("nan")), by.get(("peer", size), float("nan"))
        line = f"{size:>8,}{_ms(touba):>9}{_ms(other) if other == other else '—':>28}"
        line += f"{touba / other:>7.2f}" if other == other else f"{'':>7}"
        if has_floor:
            floor = by[("floor", size)]
            line += f"{_ms(floor):>8}{touba / floor:>12.2f}{other / floor:>11.2f}"
        if has_split:
            split = by[("floor2", size)]
            line += f"{_ms(split):>7}{touba / split:>12.2f}"
        if has_graph:
            graph = by.get(("langgraph", size), float("nan"))
            line += f"{_ms(graph):>11}{touba / graph:>10.3f}"
        report(line)
    base = sizes[0]
    report(f"growth (median at N / median at N={base:,}):")
    for system in ("touba", "peer", "floor", "floor2", "langgraph"):
        if (system, base) not in by:
            continue
        name = peer if system == "peer" else system
        ratios = "  ".join(f"{by[(system, s)] / by[(system, base)]:.2f}" for s in sizes)
        report(f"  {name:<28} {ratios}")


async def run_store(
    kind: str, args: argparse.Namespace, run: str, report: Callable[[str], None]
) -> None:
    async with backend(kind, run) as b:
        rows = await per_decision(
            b, args.sizes, args.rounds, args.langgraph_rounds, not args.no_langgraph
        )
        report_decisions(kind, b.peer_name, rows, report)
        if (
            not args.no_langgraph
            and kind in ("sqlite", "postgres")
            and not any(r.system == "langgraph" for r in rows)
        ):
            report("  (LangGraph skipped: langgraph-checkpoint-sqlite/-postgres not installed)")
        if args.no_throughput:
            return
        what = "decisions per second, conversations decided concurrently"
        report(f"{kind}: {what} (N={THROUGHPUT_SIZE})")
        header = f"{'conversations':>14}{'touba':>9}{b.peer_name:>28}{'ratio':>7}"
        report(header)
        report("-" * len(header))
        for level in LEVELS:
            touba = await throughput(b, "touba", level, args.seconds)
            peer = await throughput(b, "peer", level, args.seconds)
            assert touba is not None
            line = f"{level:>14}{touba:>9.0f}"
            line += f"{peer:>28.0f}{touba / peer:>7.2f}" if peer else f"{'—':>28}"
            report(line)
    if kind == "postgres" and not args.no_processes:
        async with backend(kind, run + "mp") as b:
            for system in ("touba", "peer"):  # the tables, before processes race to create them
                await _make(b, system, 2, f"prepare-{system}")
            # Alternating windows (touba's processes, the peer's, touba in one process),
            # PROCESS_ROUNDS times: the machine's load changes between windows, so the
            # ratios are taken within a round and their median reported.
            rates: dict[str, list[float]] = {"touba": [], "peer": [], "single": []}
            cores: list[tuple[float, float | None]] = []  # the single process's, per round
            for _ in range(PROCESS_ROUNDS):
                for system in ("touba", "peer"):
                    rates[system].append(
                        await asyncio.to_thread(across_processes, system, b.run, args.seconds)
                    )
                single, client, server = await cpu_of_single(b, args.seconds)
                rates["single"].append(single)
                cores.append((client, server))
        versus_peer = [t / p for t, p in zip(rates["touba"], rates["peer"], strict=True)]
        versus_single = [t / s for t, s in zip(rates["touba"], rates["single"], strict=True)]
        report(
            f"postgres: {PROCESSES * PER_PROCESS} conversations from {PROCESSES} processes, "
            f"{PROCESS_ROUNDS} alternating rounds (medians): touba "
            f"{statistics.median(rates['touba']):.0f}/s, SQLAlchemySession "
            f"{statistics.median(rates['peer']):.0f}/s, ratio {statistics.median(versus_peer):.2f} "
            f"(rounds {', '.join(f'{r:.2f}' for r in versus_peer)}); touba against itself with "
            f"the same conversations in one process ({statistics.median(rates['single']):.0f}/s): "
            f"{statistics.median(versus_single):.2f} "
            f"(rounds {', '.join(f'{r:.2f}' for r in versus_single)})"
        )
        client = statistics.median(c for c, _ in cores)
        servers = [s for _, s in cores if s is not None]
        if servers:  # what bounds the gain of more processes on this machine
            server, cpus = statistics.median(servers), os.cpu_count() or 1
            report(
                f"  the one process kept {client + server:.2f} of {cpus} CPUs busy (touba's "
                f"process {client:.2f}, the PostgreSQL server {server:.2f}; medians of the "
                f"rounds): more processes can reach at most {cpus / (client + server):.2f}x here"
            )
        else:
            report(f"  the one process used {client:.2f} CPUs (the server's could not be read)")


async def _settings(report: Callable[[str], None], kinds: Sequence[str]) -> None:
    if "postgres" in kinds:
        import psycopg

        async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
            values = []
            for name in ("server_version", "fsync", "synchronous_commit"):
                row = await (await conn.execute(f"SHOW {name}")).fetchone()
                values.append(f"{name}={row[0] if row else '?'}")
        report("PostgreSQL: " + ", ".join(values))
    if "redis" in kinds:
        import redis.asyncio

        client = redis.asyncio.Redis.from_url(REDIS_URL)
        info = await client.info("server")
        config = await client.config_get("append*")
        await client.aclose()
        report(
            f"Redis {info.get('redis_version')}: appendonly={config.get('appendonly')}, "
            f"appendfsync={config.get('appendfsync')}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and shorter runs")
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--langgraph-rounds", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--no-langgraph", action="store_true")
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--no-processes", action="store_true")
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.rounds = args.rounds or (15 if args.quick else 60)
    args.langgraph_rounds = args.langgraph_rounds or (3 if args.quick else 8)
    args.seconds = args.seconds or (0.5 if args.quick else 2.0)
    available = available_stores(args.stores)
    print(
        f"touba vs openai-agents 0.24, {MESSAGE} B messages, window {WINDOW}, "
        f"{args.rounds} interleaved rounds ({args.langgraph_rounds} for LangGraph), "
        f"{os.cpu_count()} CPUs; SQLite WAL + synchronous=FULL everywhere"
    )
    asyncio.run(_settings(print, available))
    run = uuid.uuid4().hex[:8]
    for kind in available:
        asyncio.run(run_store(kind, args, run, print))
    if "sqlite" in available:
        disk_bytes(args.sizes, print)


if __name__ == "__main__":
    main()
