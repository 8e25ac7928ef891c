"""Chat traffic on default settings: refusals, conversations held, turns per second.

Issue 8's target: 10,000 chat turns from 500 users, 50 sessions at a time,
on the default bounds of each history store (128 conversations), with
``ChatSession``'s default ``retain_decision_history=False``: no turn may be
refused, and the history store must never hold more conversations than
turns running at that moment. Every turn is one invocation of a support
agent that looks an order up, then answers (two decisions, one call), with
its memory in a SQLite memory store.

A sampler lists the history store while the traffic runs. Listing takes
time, so each sample is compared with the turns running when it started plus
those that started while it ran: an upper bound of the turns that could hold
a conversation at the listed moment.

    .venv/bin/python bench/chat_traffic.py [--turns 10000] [--users 500]
        [--concurrency 50] [--stores memory,sqlite,postgres]

``run_traffic`` is also what ``tests/memory/test_chat_traffic.py`` runs,
smaller.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from touba import ChatSession, MemoryConfig
from touba.errors import DecisionHistoryLimitExceeded
from touba.history import HistoryConfig, HistoryStore, MemoryHistoryStore
from touba.memory import SqliteMemoryStore
from touba.memory._store import MemoryStore
from touba.providers import DecisionRequest
from touba.runtime import Program, Runtime
from touba.testing import ScriptedProvider

NAMESPACE = "chat-traffic"


@dataclass
class TrafficReport:
    """What one run of chat traffic did to its history store."""

    store: str
    turns: int = 0
    completed: int = 0
    refusals: int = 0
    other_failures: list[str] = field(default_factory=list)
    retried: list[str] = field(default_factory=list)
    samples: int = 0
    max_conversations: int = 0
    max_running: int = 0
    over_running: int = 0  # samples holding more conversations than turns that could run
    seconds: float = 0.0
    generations: int = 0  # decisions the model was asked for

    @property
    def turns_per_second(self) -> float:
        return self.turns / self.seconds if self.seconds else 0.0


def _decide(request: DecisionRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    if request.observations:
        [seen] = request.observations
        return {"action": "final", "output": f"Order {seen.arguments['order_id']} has shipped."}
    order = f"A{len(request.prior_turns)}"
    return {"action": "call", "calls": [{"name": "lookup_order", "arguments": {"order_id": order}}]}


def _program(provider: ScriptedProvider) -> Program:
    program = Program()

    @program.capability
    async def lookup_order(order_id: str) -> dict[str, str]:
        """Find an order."""
        return {"order_id": order_id, "status": "shipped"}

    program.agent(
        "support",
        provider=provider,
        instructions="Answer about orders.",
        capabilities=("lookup_order",),
        memory=MemoryConfig(),  # the defaults: 30 turns as text, the last with its trace
    )
    return program


class _Counters:
    def __init__(self) -> None:
        self.running = 0
        self.started = 0


async def run_traffic(
    *,
    name: str,
    history_store: HistoryStore,
    memory_store: MemoryStore,
    turns: int,
    users: int,
    concurrency: int,
    retain_decision_history: bool = False,
    sample_every: float = 0.005,
) -> TrafficReport:
    """Run ``turns`` chat turns of ``users`` users, ``concurrency`` sessions at a time.

    Each user has two sessions (so key events and memory see returning
    users); a session's turns run one after the other, sessions in parallel.
    """
    provider = ScriptedProvider(
        *([_decide] * (2 * turns)),
        history=HistoryConfig(store=history_store, namespace=NAMESPACE),
    )
    runtime = Runtime(_program(provider))
    report = TrafficReport(store=name)
    counters = _Counters()
    sessions: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    per_session, extra = divmod(turns, 2 * users)
    for index in range(2 * users):
        count = per_session + (1 if index < extra else 0)
        if count:
            sessions.put_nowait((f"user-{index % users}", count))

    async def one_session(user: str, count: int) -> None:
        async with ChatSession(
            runtime,
            "support",
            user,
            store=memory_store,
            retain_decision_history=retain_decision_history,
        ) as session:
            for number in range(count):
                counters.running += 1
                counters.started += 1
                report.max_running = max(report.max_running, counters.running)
                try:
                    turn = await session.send(f"Where is my order? ({number})")
                finally:
                    counters.running -= 1
                if turn.result.checkpoint_id is not None and turn.status == "failed":
                    report.retried.append(f"{turn.result.error!r}")
                    turn = await session.resume()  # a retryable failure: retried, as an app does
                report.turns += 1
                report.generations += len(provider.sent)
                provider.requests.clear()  # the script's records are not what is measured
                provider.sent.clear()
                error = turn.result.error
                if isinstance(error, DecisionHistoryLimitExceeded):
                    report.refusals += 1
                elif error is not None:
                    report.other_failures.append(f"{error.code}: {error.message}")
                else:
                    report.completed += 1
            await session.end()

    async def worker() -> None:
        while True:
            try:
                user, count = sessions.get_nowait()
            except asyncio.QueueEmpty:
                return
            await one_session(user, count)

    list_store: Any = history_store

    async def sampler(stop: asyncio.Event) -> None:
        while not stop.is_set():
            running, started = counters.running, counters.started
            held = len(await list_store.list(NAMESPACE))
            bound = running + (counters.started - started)
            report.samples += 1
            report.max_conversations = max(report.max_conversations, held)
            if held > bound:
                report.over_running += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), sample_every)

    stop = asyncio.Event()
    began = time.perf_counter()
    watching = asyncio.create_task(sampler(stop))
    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(worker())
    finally:
        stop.set()
        await watching
    report.seconds = time.perf_counter() - began
    return report


@contextlib.asynccontextmanager
async def _stores(kind: str, directory: Path) -> AsyncIterator[tuple[HistoryStore, MemoryStore]]:
    memory = SqliteMemoryStore(directory / f"memory-{kind}.sqlite")
    try:
        if kind == "memory":
            yield MemoryHistoryStore(), memory
        elif kind == "sqlite":
            from touba.history.sqlite import SqliteHistoryStore

            async with SqliteHistoryStore(directory / "history.sqlite") as store:
                yield store, memory
        elif kind == "postgres":
            from touba.history.postgres import PostgresHistoryStore

            dsn = os.environ.get("TOUBA_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
            table = f"bench_traffic_{uuid.uuid4().hex[:8]}"
            async with PostgresHistoryStore(dsn, table=table) as store:
                try:
                    yield store, memory
                finally:
                    await drop_history_tables(dsn, table)
        else:
            raise SystemExit(f"unknown store {kind!r}: memory, sqlite or postgres")
    finally:
        await memory.close()


async def drop_history_tables(dsn: str, table: str) -> None:
    """Drop the tables of a PostgresHistoryStore named ``table``."""
    import psycopg
    from psycopg import sql

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for name in (table, f"{table}_messages", f"{table}_meta"):
            await conn.execute(
                sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(sql.Identifier(name))
            )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10_000)
    parser.add_argument("--users", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--stores", default="memory,sqlite,postgres")
    args = parser.parse_args()
    print(
        f"{args.turns} chat turns, {args.users} users, {args.concurrency} sessions at a time, "
        "default history bounds (128 conversations)"
    )
    print(
        f"{'store':<10} {'refused':>8} {'failed':>7} {'max held':>9} {'max running':>12} "
        f"{'held > running':>15} {'turns/s':>8}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "state"
        directory.mkdir(mode=0o700)
        for kind in args.stores.split(","):
            async with _stores(kind, directory) as (history, memory):
                report = await run_traffic(
                    name=kind,
                    history_store=history,
                    memory_store=memory,
                    turns=args.turns,
                    users=args.users,
                    concurrency=args.concurrency,
                )
            print(
                f"{kind:<10} {report.refusals:>8} {len(report.other_failures):>7} "
                f"{report.max_conversations:>9} {report.max_running:>12} "
                f"{report.over_running:>15} {report.turns_per_second:>8.0f}"
            )
            for line in sorted(set(report.retried + report.other_failures))[:5]:
                print("   ", line[:300])


if __name__ == "__main__":
    asyncio.run(main())
