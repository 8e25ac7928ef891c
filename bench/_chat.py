"""Chat workers that run until told to stop: what bench/load.py and bench/soak.py drive.

Each worker is one user chatting with agent ``support`` through
:class:`~touba.ChatSession` (the app's path: settings read from the memory
store at each turn, the turn stored, the decision history deleted after it):
a session of ``turns_per_session`` turns, ended, then a new one, until
``stop`` is set. A turn is two decisions of the offline
:class:`~touba.testing.ScriptedProvider` (look the order up, then answer);
a message that asks for a refund stops for the operator's approval instead
(``refund`` requires it), leaving a checkpoint waiting.

The scripted provider never runs out here: it is topped up before each turn,
and the requests it keeps for tests are cleared after each, so a long run
holds nothing that grows with the number of turns.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from touba import ChatSession, MemoryConfig
from touba.history import HistoryConfig, HistoryStore
from touba.memory import KeyEventsConfig
from touba.memory._store import MemoryStore
from touba.providers import DecisionRequest
from touba.runtime import CheckpointStore, Program, Runtime
from touba.testing import ScriptedProvider

AGENT = "support"
NAMESPACE = "bench-chat"
TOP_UP = 64


@dataclass
class ChatCounts:
    """What the workers did: decisions the model was asked for, turns, failed turns."""

    decisions: int = 0
    turns: int = 0
    failures: list[str] = field(default_factory=list)


def build_program(provider: Any) -> Program:
    """Agent ``support``: ``lookup_order``, and ``refund``, which needs approval."""
    program = Program()

    @program.capability
    async def lookup_order(order_id: str) -> dict[str, str]:
        """Find an order."""
        return {"order_id": order_id, "status": "shipped"}

    @program.capability(permissions=("orders:write",), requires_approval=True)
    async def refund(order_id: str) -> dict[str, str]:
        """Refund an order."""
        return {"order_id": order_id, "refunded": "yes"}

    program.agent(
        AGENT,
        provider=provider,
        instructions="Answer about orders.",
        capabilities=("lookup_order", "refund"),
        grants=("orders:write",),
        memory=MemoryConfig(key_events=KeyEventsConfig(enabled=False)),
    )
    return program


class ChatModel:
    """The scripted model and its count of decisions, over one history store."""

    def __init__(self, store: HistoryStore | None = None) -> None:
        history = HistoryConfig(store=store, namespace=NAMESPACE) if store is not None else None
        self.counts = ChatCounts()
        self.provider = ScriptedProvider(history=history)

    def decide(self, request: DecisionRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
        self.counts.decisions += 1
        if request.observations:
            [seen] = request.observations
            return ScriptedProvider.final(f"Order {seen.arguments['order_id']}: {seen.status}.")
        if "refund" in str(request.input):
            return ScriptedProvider.call("refund", order_id="A1")
        return ScriptedProvider.call("lookup_order", order_id=f"A{len(request.prior_turns)}")

    def top_up(self) -> None:
        if self.provider.remaining < TOP_UP // 2:
            self.provider.add(*[self.decide] * TOP_UP)

    def forget(self) -> None:
        """Drop the requests the provider keeps for tests (not what is measured)."""
        self.provider.requests.clear()
        self.provider.sent.clear()


def chat_runtime(
    store: HistoryStore | None, checkpoints: CheckpointStore | None = None
) -> tuple[Runtime, ChatModel]:
    """A runtime of :func:`build_program` over ``store`` (and ``checkpoints``), its model."""
    model = ChatModel(store)
    program = build_program(model.provider)
    if checkpoints is None:
        return Runtime(program), model
    return Runtime(program, checkpoints=checkpoints), model


async def chat_worker(
    runtime: Runtime,
    model: ChatModel,
    memory: MemoryStore,
    user: str,
    stop: asyncio.Event,
    *,
    turns_per_session: int = 10,
    pause: float = 0.0,
) -> None:
    """Chat as ``user`` until ``stop`` is set (see the module); ``pause`` between turns."""
    counts = model.counts
    while not stop.is_set():
        async with ChatSession(runtime, AGENT, user, store=memory) as session:
            for number in range(turns_per_session):
                if stop.is_set():
                    break
                model.top_up()
                turn = await session.send(f"Where is my order? ({number})")
                model.forget()
                if turn.result.error is not None:
                    counts.failures.append(f"{turn.result.error.code}: {turn.result.error.message}")
                else:
                    counts.turns += 1
                if pause:
                    await asyncio.sleep(pause)
            await session.end()


async def drop_tables(dsn: str, prefix: str) -> None:
    """Drop every table of the public schema whose name starts with ``prefix`` (a bench's
    own random prefix: its history, memory and checkpoint tables)."""
    import psycopg
    from psycopg import sql

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        rows = await (
            await conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
                " AND left(tablename, %s) = %s",
                (len(prefix), prefix),
            )
        ).fetchall()
        for (name,) in rows:
            await conn.execute(
                sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(sql.Identifier(name))
            )


async def drop_redis_keys(url: str, prefix: str) -> None:
    """Delete the keys under a bench's own ``prefix`` (never a FLUSH)."""
    import redis.asyncio as redis

    client = redis.Redis.from_url(url)
    try:
        batch = [key async for key in client.scan_iter(match=f"{prefix}*", count=500)]
        for start in range(0, len(batch), 500):
            await client.delete(*batch[start : start + 500])
    finally:
        await client.aclose()
