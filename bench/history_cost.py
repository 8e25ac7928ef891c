"""Per-decision cost of the history layer against retained history size.

For each built-in store, conversations holding 10, 100, 1,000 and 10,000
retained exchanges are prepared, then decisions are run on all of them in
interleaved rounds (side by side, in one process) through the real history
step: reservation, record check, tail sizes, window selection, loading the
window, appending the results and the new decision, commit. The model is a
function returning a fixed decision, so only touba's own cost is measured.

Printed: median microseconds per decision and the ratio to the 10-exchange
conversation. A window bound of 16 messages keeps the window identical at
every size, so the ratio shows growth with *retained* history alone.

    .venv/bin/python bench/history_cost.py [--rounds 200] [--stores memory,sqlite,postgres,redis]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from touba.history import (
    CapabilityCall,
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryStore,
    HistoryWindow,
    MemoryHistoryStore,
    Observation,
)
from touba.history._common import MiB
from touba.history._model import ResultMessage, message_bytes, message_to_dict
from touba.history._record import join_record, new_head

SIZES = (10, 100, 1_000, 10_000)
POSTGRES_DSN = os.environ.get("TOUBA_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TOUBA_REDIS_URL", "redis://127.0.0.1:6379/0")
NAMESPACE = "bench"


def _identity(size: int) -> ConversationIdentity:
    return ConversationIdentity(NAMESPACE, "bench", "m", "native", "run", f"inv-{size}", "agent")


def _exchange(n: int) -> list[dict[str, Any]]:
    call = CapabilityCall(f"call-{n}", "lookup_order", {"order_id": f"A{n:06d}"})
    decision = DecisionMessage(text="checking the order", calls=(call,))
    result = ResultMessage(call.call_id, call.name, call.arguments, "ok", {"status": "shipped"})
    return [message_to_dict(decision), message_to_dict(result)]


def pending_record(
    identity: ConversationIdentity, exchanges: list[list[dict[str, Any]]]
) -> dict[str, Any]:
    """A stored record of ``exchanges`` (complete ones, as message dicts), then one pending
    ``lookup_order`` call, with the head and totals a store would have written."""
    pending = CapabilityCall("pending", "lookup_order", {"order_id": "P"})
    rows = [*exchanges, [message_to_dict(DecisionMessage(calls=(pending,)))]]
    head = new_head(identity)
    head["pending"] = [{"call_id": "pending", "name": "lookup_order"}]
    size = sum(message_bytes(m) for ex in rows for m in ex)
    messages = sum(len(ex) for ex in rows)
    head["stats"] = {"exchanges": len(rows), "messages": messages, "bytes": size}
    return join_record(head, rows)


def _seed_record(identity: ConversationIdentity, exchanges: int) -> dict[str, Any]:
    """A conversation with ``exchanges`` complete exchanges, then one pending call."""
    return pending_record(identity, [_exchange(n) for n in range(exchanges)])


async def _seed(store: HistoryStore, identity: ConversationIdentity, exchanges: int) -> None:
    record = _seed_record(identity, exchanges)

    async def put(_: dict[str, Any] | None) -> tuple[dict[str, Any], None]:
        return record, None

    await store.transact(identity.key, put)


class _Conversation:
    """Drives one conversation decision after decision."""

    def __init__(self, history: DecisionHistory, identity: ConversationIdentity) -> None:
        self.history = history
        self.identity = identity
        self.pending = CapabilityCall("pending", "lookup_order", {"order_id": "P"})
        self.step = 0
        self.window_messages = 0

    async def decide(self) -> float:
        observation = Observation(
            self.pending.call_id, self.pending.name, self.pending.arguments, "ok", {"n": self.step}
        )
        self.step += 1
        call = CapabilityCall(f"b{self.step}", "lookup_order", {"order_id": f"B{self.step}"})

        async def generate(window: HistoryWindow) -> DecisionMessage:
            self.window_messages = len(window.messages)
            return DecisionMessage(text="next", calls=(call,))

        started = time.perf_counter()
        await self.history.step(self.identity, [observation], generate)
        elapsed = time.perf_counter() - started
        self.pending = call
        return elapsed


@contextlib.asynccontextmanager
async def open_store(kind: str, directory: Path) -> AsyncIterator[Any]:
    """A store of ``kind`` (memory, sqlite, postgres, redis) for a benchmark, on its
    own file, table or prefix, dropped afterwards (PostgreSQL)."""
    limits: dict[str, Any] = {"max_sessions": 16, "max_store_bytes": 512 * MiB}
    if kind == "memory":
        async with MemoryHistoryStore(**limits) as store:
            yield store
    elif kind == "sqlite":
        from touba.history.sqlite import SqliteHistoryStore

        async with SqliteHistoryStore(directory / "bench.sqlite", **limits) as store:
            yield store
    elif kind == "postgres":
        import uuid

        from touba.history.postgres import PostgresHistoryStore

        table = f"bench_{uuid.uuid4().hex[:12]}"
        async with PostgresHistoryStore(POSTGRES_DSN, table=table, **limits) as store:
            try:
                yield store
            finally:
                await _drop_tables(store, table)
    elif kind == "redis":
        import uuid

        from touba.history.redis import RedisHistoryStore

        prefix = f"bench-{uuid.uuid4().hex[:12]}:"
        async with RedisHistoryStore(REDIS_URL, prefix=prefix, **limits) as store:
            yield store
    else:
        raise SystemExit(f"unknown store {kind!r}")


async def _drop_tables(store: Any, table: str) -> None:
    async with store._pg.transaction() as conn:
        for suffix in ("_messages", "_usage", "_meta", ""):
            await conn.execute(f"DROP TABLE IF EXISTS {table}{suffix} CASCADE")


class _Counted:
    """Counts the transactions a PostgreSQL store opens: its two doors, ``transaction``
    (a transaction of several statements) and ``statement`` (one statement that is a
    whole transaction, autocommit on the store's own pool)."""

    def __init__(self, store: Any) -> None:
        self.count = 0
        pool = getattr(store, "_pg", None)
        if pool is None:
            return
        for door in ("transaction", "statement"):
            setattr(pool, door, self._counted(getattr(pool, door)))

    def _counted(self, door: Callable[[], Any]) -> Callable[[], Any]:
        def counted() -> Any:
            self.count += 1
            return door()

        return counted


async def _run(kind: str, rounds: int, max_messages: int, report: Callable[[str], None]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with open_store(kind, Path(tmp)) as store:
            config = HistoryConfig(
                store=store,
                namespace=NAMESPACE,
                max_messages=max_messages,
                max_retained_bytes=256 * MiB,
            )
            history = DecisionHistory(config)
            conversations = {}
            for size in SIZES:
                await _seed(store, _identity(size), size)
                conversations[size] = _Conversation(history, _identity(size))
            for conversation in conversations.values():  # warm up
                for _ in range(5):
                    await conversation.decide()
            timings: dict[int, list[float]] = {size: [] for size in SIZES}
            counted = _Counted(store)
            for _ in range(rounds):
                for size, conversation in conversations.items():
                    timings[size].append(await conversation.decide())
    base = statistics.median(timings[SIZES[0]])
    report(f"\n{kind} store, max_messages={max_messages}, {rounds} decisions per size")
    report(f"{'retained exchanges':>20} {'window msgs':>12} {'median µs':>10} {'ratio':>7}")
    for size in SIZES:
        median = statistics.median(timings[size])
        window = conversations[size].window_messages
        report(f"{size:>20,} {window:>12} {median * 1e6:>10.0f} {median / base:>7.2f}")
    if counted.count:
        per = counted.count / (rounds * len(SIZES))
        report(f"transactions per decision: {per:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--stores", default="memory,sqlite")
    parser.add_argument("--max-messages", type=int, default=16)
    args = parser.parse_args()
    for kind in args.stores.split(","):
        asyncio.run(_run(kind, args.rounds, args.max_messages, print))


if __name__ == "__main__":
    main()
