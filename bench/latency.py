"""Decisions per second and round trips per decision with added network latency.

Each networked store is reached through ``tests/_netproxy.py``'s ``NetProxy`` (a
loopback TCP proxy), which adds 0, 1 or 5 ms to every round trip and counts the
round trips it relays; a Redis Cluster gets one proxy per master, and redis-py's
``RedisCluster(address_remap=...)`` reaches each node through its own. A
*decision* is ``DecisionHistory.step``, what the runtime calls for each model
decision: reserve the conversation, read its window (16 messages), call the model
(here a function returning a fixed decision at once), append the exchange, save.
Decisions run one after the other on one conversation, after a warm-up (prepared
statements, read-ahead hints), on a short conversation (10 exchanges retained) and
a long one (500): a decision's round trips must not grow with retained history.
SQLite and RAM run without a network, as a reference.

The round trips are the proxy's count divided by the decisions (a PostgreSQL
store purges expired rows at most once a minute, a transaction of its own, which
may show as a fraction; a row shows the most any of its runs counted).
decisions/s is one worker's (1 / the median decision's time, over three runs
alternating between the two conversations, so that a busy moment of the machine hits
both), so it is bounded by 1 / (round trips x added RTT).

The Redis cluster peek: a session's wide read (``ToubaSession.get_items``, 128
items of 1 KiB) is one script call on a cluster (``lua/peek_rows.lua``: it reads
without a reservation and brings the rows itself); without it the read takes the
reserved path: the claim, the LRANGE of the rows (a cluster client's pipelines
refuse scripts: a round trip of its own) and the commit. Both are timed side by
side at each added RTT, in alternating rounds.

``--chat`` adds a chat turn (``ChatSession.send``, a turn of two decisions and one
call, the scripted provider) with a ``PostgresMemoryStore`` and a
``PostgresHistoryStore``, each behind a proxy of its own.

    .venv/bin/python bench/latency.py [--rtt 0,1,5] [--decisions 40]
        [--stores postgres,redis,cluster,sqlite,memory] [--short 10] [--long 500]
        [--reads 30] [--chat]

``measure_decisions``, ``cluster_through_proxies`` and ``postgres_chat`` are what
``tests/history/test_round_trips.py`` runs, pinning the round trips.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests._netproxy import NetProxy, net_proxy
from tests._redis_cluster import missing, redis_cluster

from bench.history_cost import pending_record
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
from touba.history._model import ResultMessage, message_to_dict

__all__ = [
    "Chat",
    "Conversation",
    "Measured",
    "Reached",
    "cluster_history",
    "cluster_through_proxies",
    "conversation",
    "measure_decisions",
    "postgres_chat",
    "postgres_history",
    "redis_history",
]

POSTGRES_DSN = os.environ.get("TOUBA_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TOUBA_REDIS_URL", "redis://127.0.0.1:6379/0")
NAMESPACE = "latency"
WINDOW = 16  # max_messages of every decision's window
WARM_UP = 8  # decisions before counting (prepared statements, read-ahead hints)
LIMITS: dict[str, Any] = {"max_sessions": 64, "max_store_bytes": 256 * MiB}


# -- decisions ---------------------------------------------------------------------------


def _identity(name: str) -> ConversationIdentity:
    return ConversationIdentity(NAMESPACE, "bench", "m", "native", "run", name, "agent")


class Conversation:
    """One conversation, driven decision after decision through the history step."""

    def __init__(self, history: DecisionHistory, name: str) -> None:
        self.history = history
        self.identity = _identity(name)
        self.observations: list[Observation] = []
        self.step = 0

    async def decide(self) -> None:
        self.step += 1
        call = CapabilityCall(f"c{self.step}", "lookup_order", {"order_id": f"A{self.step:06d}"})

        async def generate(window: HistoryWindow) -> DecisionMessage:
            return DecisionMessage(text="checking the order", calls=(call,))

        await self.history.step(self.identity, self.observations, generate)
        result = {"status": "shipped", "n": self.step}
        self.observations = [Observation(call.call_id, call.name, call.arguments, "ok", result)]


async def conversation(store: HistoryStore, name: str, exchanges: int) -> Conversation:
    """A conversation that already holds ``exchanges`` complete exchanges and a pending
    call, written in one transaction (what the store holds after that many decisions)."""
    history = DecisionHistory(
        HistoryConfig(
            store=store,
            namespace=NAMESPACE,
            max_messages=WINDOW,
            max_retained_bytes=64 * MiB,
        )
    )
    talk = Conversation(history, name)
    record = pending_record(talk.identity, [_exchange(n) for n in range(exchanges)])

    async def put(_: dict[str, Any] | None) -> tuple[dict[str, Any], None]:
        return record, None

    await store.transact(talk.identity.key, put)
    talk.observations = [Observation("pending", "lookup_order", {"order_id": "P"}, "ok", {})]
    return talk


def _exchange(n: int) -> list[dict[str, Any]]:
    call = CapabilityCall(f"call-{n}", "lookup_order", {"order_id": f"A{n:06d}"})
    decision = DecisionMessage(text="checking the order", calls=(call,))
    result = ResultMessage(call.call_id, call.name, call.arguments, "ok", {"status": "shipped"})
    return [message_to_dict(decision), message_to_dict(result)]


@dataclass(frozen=True)
class Measured:
    """Decisions on one conversation at one added RTT."""

    times: list[float]  # seconds, one per decision
    round_trips: int | None  # None: no network

    @property
    def decisions(self) -> int:
        return len(self.times)

    @property
    def per_second(self) -> float:
        """One worker's decisions per second: 1 / the median decision's time."""
        return 1 / statistics.median(self.times)

    @property
    def trips(self) -> float | None:
        return None if self.round_trips is None else self.round_trips / self.decisions


async def measure_decisions(
    talk: Conversation, decisions: int, proxies: Sequence[NetProxy] = ()
) -> Measured:
    """``decisions`` decisions after a warm-up, each timed, and the round trips the
    ``proxies`` relayed meanwhile."""
    for _ in range(WARM_UP):
        await talk.decide()
    for proxy in proxies:
        proxy.reset_counts()
    times = []
    for _ in range(decisions):
        started = time.perf_counter()
        await talk.decide()
        times.append(time.perf_counter() - started)
    trips = sum(p.round_trips for p in proxies) if proxies else None
    return Measured(times, trips)


# -- the stores, through their proxies ---------------------------------------------------


@dataclass
class Reached:
    """A store and the proxies in front of its servers (none: no network)."""

    store: Any
    proxies: list[NetProxy]

    def delay(self, rtt_ms: float) -> None:
        for proxy in self.proxies:
            proxy.delay(rtt_ms)


def _host_port(url: str) -> tuple[str, int]:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 0


@contextlib.asynccontextmanager
async def postgres_history(dsn: str = POSTGRES_DSN) -> AsyncIterator[Reached]:
    """A ``PostgresHistoryStore`` on a table of its own, behind a proxy; dropped after."""
    from touba.history.postgres import PostgresHistoryStore

    host, port = _host_port(dsn)
    table = f"latency_{uuid.uuid4().hex[:12]}"
    with net_proxy(host, port or 5432) as proxy:
        async with PostgresHistoryStore(proxy.dsn(dsn), table=table, **LIMITS) as store:
            try:
                yield Reached(store, [proxy])
            finally:
                proxy.delay(0)
                await drop_tables(store, table, ("_messages", "_usage", "_meta", ""))


async def drop_tables(store: Any, table: str, suffixes: Sequence[str]) -> None:
    async with store._pg.transaction() as conn:
        for suffix in suffixes:
            await conn.execute(f"DROP TABLE IF EXISTS {table}{suffix} CASCADE")


@contextlib.asynccontextmanager
async def redis_history(url: str = REDIS_URL) -> AsyncIterator[Reached]:
    """A ``RedisHistoryStore`` on a prefix of its own, behind a proxy; deleted after."""
    from touba.history.redis import RedisHistoryStore

    host, port = _host_port(url)
    prefix = f"latency-{uuid.uuid4().hex[:12]}:"
    with net_proxy(host, port or 6379) as proxy:
        async with RedisHistoryStore(proxy.url(url), prefix=prefix, **LIMITS) as store:
            try:
                yield Reached(store, [proxy])
            finally:
                proxy.delay(0)
                await _delete_prefix(store._client, prefix)


async def _delete_prefix(client: Any, prefix: str) -> None:
    async for name in client.scan_iter(match=f"{prefix}*", count=500):
        await client.delete(name)


@contextlib.contextmanager
def cluster_through_proxies(root: Path) -> Iterator[tuple[list[NetProxy], Any]]:
    """A three-master Redis Cluster, a proxy per master, and the ``address_remap`` that
    sends a ``RedisCluster`` client to each node through its proxy."""
    with redis_cluster(root) as ports, contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(net_proxy("127.0.0.1", port)) for port in ports]
        through = {port: proxy.port for port, proxy in zip(ports, proxies, strict=True)}

        def remap(address: tuple[str, int]) -> tuple[str, int]:
            host, port = address
            return ("127.0.0.1", through[port]) if port in through else (host, port)

        yield proxies, remap


@contextlib.asynccontextmanager
async def cluster_history(proxies: list[NetProxy], remap: Any) -> AsyncIterator[Reached]:
    """A ``RedisHistoryStore`` on a cluster client that reaches every node by proxy."""
    from redis.asyncio import RedisCluster

    from touba.history.redis import RedisHistoryStore

    client = RedisCluster(host="127.0.0.1", port=proxies[0].port, address_remap=remap)
    try:
        prefix = f"latency-{uuid.uuid4().hex[:12]}:"
        store = RedisHistoryStore(client=client, prefix=prefix, **LIMITS)
        async with store:
            yield Reached(store, proxies)
    finally:
        for proxy in proxies:
            proxy.delay(0)
        await client.aclose()


@contextlib.asynccontextmanager
async def local_history(kind: str, directory: Path) -> AsyncIterator[Reached]:
    if kind == "memory":
        async with MemoryHistoryStore(**LIMITS) as store:
            yield Reached(store, [])
    else:
        from touba.history.sqlite import SqliteHistoryStore

        async with SqliteHistoryStore(directory / "latency.sqlite", **LIMITS) as store:
            yield Reached(store, [])


# -- the report --------------------------------------------------------------------------


def _row(label: str, history: str, rtt: float | None, measured: Measured) -> str:
    trips = "—" if measured.trips is None else f"{measured.trips:.2f}"
    added = "— (no network)" if rtt is None else f"{rtt:g} ms"
    return f"| {label} | {history} | {added} | {measured.per_second:,.0f} | {trips} |"


async def decisions_table(
    label: str,
    reached: Reached,
    rtts: Sequence[float],
    sizes: dict[str, int],
    decisions: int,
    report: Callable[[str], None],
    repeat: int = 3,
) -> None:
    """The rows of one store: each conversation size at each added RTT, over ``repeat``
    runs (decisions/s from the median decision; round trips: the most a run counted)."""
    talks = {
        name: await conversation(reached.store, f"{label}-{name}-{uuid.uuid4().hex[:6]}", n)
        for name, n in sizes.items()
    }
    for rtt in rtts if reached.proxies else [None]:
        reached.delay(rtt or 0)
        runs: dict[str, list[Measured]] = {name: [] for name in talks}
        for _ in range(repeat):  # alternating: a busy moment of the machine hits both
            for name, talk in talks.items():
                runs[name].append(await measure_decisions(talk, decisions, reached.proxies))
        for name, measured in runs.items():
            times = [t for m in measured for t in m.times]
            trips = [m.round_trips for m in measured if m.round_trips is not None]
            shown = Measured(times, max(trips) * repeat if trips else None)
            report(_row(label, f"{name} ({sizes[name]} exchanges)", rtt, shown))
    reached.delay(0)


# -- the cluster peek ----------------------------------------------------------------------


async def peek_table(
    reached: Reached, rtts: Sequence[float], reads: int, report: Callable[[str], None]
) -> None:
    """A wide session read on the cluster, peeked and reserved, side by side."""
    from touba.integrations.openai_agents import ToubaSession

    store = reached.store
    session = ToubaSession(f"peek-{uuid.uuid4().hex[:6]}", store=store, namespace=NAMESPACE)
    body = "x" * 1000
    for n in range(64):
        await session.add_items(
            [
                {"role": "user", "content": f"{n} {body}"},
                {"role": "assistant", "content": f"{n} {body}"},
            ]
        )
    backend = store._backend  # the peek's switch: without it the read reserves

    def peeking(on: bool) -> None:
        if on:
            backend.__dict__.pop("peek", None)
        else:
            backend.peek = None  # Reservations looks the primitive up: absent = no peek

    async def timed(on: bool) -> tuple[list[float], int]:
        peeking(on)
        for proxy in reached.proxies:
            proxy.reset_counts()
        times = []
        for _ in range(reads):
            started = time.perf_counter()
            items = await session.get_items(limit=128)
            times.append(time.perf_counter() - started)
            assert len(items) == 128
        return times, sum(p.round_trips for p in reached.proxies)

    for on in (True, False):  # warm up both paths (hints, the cache)
        peeking(on)
        for _ in range(3):
            await session.get_items(limit=128)
    report("")
    report("| added RTT | peek: ms per read | round trips | reserved: ms per read | round trips "
           "| peek / reserved |")  # fmt: skip
    report("| --- | --- | --- | --- | --- | --- |")
    for rtt in rtts:
        reached.delay(rtt)
        runs: dict[bool, list[tuple[list[float], int]]] = {True: [], False: []}
        for _ in range(3):  # alternating, to share the machine's drift
            for on in (True, False):
                runs[on].append(await timed(on))
        peek_ms = statistics.median(t for r in runs[True] for t in r[0]) * 1000
        reserved_ms = statistics.median(t for r in runs[False] for t in r[0]) * 1000
        peek_trips = max(r[1] for r in runs[True]) / reads
        reserved_trips = max(r[1] for r in runs[False]) / reads
        report(
            f"| {rtt:g} ms | {peek_ms:.2f} | {peek_trips:.2f} | {reserved_ms:.2f} | "
            f"{reserved_trips:.2f} | {peek_ms / reserved_ms:.2f} |"
        )
    peeking(True)
    reached.delay(0)


# -- a chat turn ---------------------------------------------------------------------------


@dataclass
class Chat:
    """A chat session on PostgreSQL whose memory and history stores are each reached
    through a proxy of their own."""

    session: Any
    provider: Any
    memory: NetProxy
    history: NetProxy

    @property
    def proxies(self) -> list[NetProxy]:
        return [self.memory, self.history]

    async def turn(self) -> None:
        """One chat turn (two decisions, one call), which must succeed."""
        turn = await self.session.send("Where is my order?")
        assert turn.result.error is None, turn.result.error
        self.provider.requests.clear()  # the script's records are not what is measured
        self.provider.sent.clear()


@contextlib.asynccontextmanager
async def postgres_chat(dsn: str = POSTGRES_DSN, turns: int = 1000) -> AsyncIterator[Chat]:
    """A ``ChatSession`` on a ``PostgresMemoryStore`` and a ``PostgresHistoryStore``
    (tables of their own, dropped after), for at most ``turns`` turns."""
    from touba import ChatSession, MemoryConfig
    from touba.memory import PostgresMemoryStore
    from touba.providers import DecisionRequest
    from touba.runtime import Program, Runtime
    from touba.testing import ScriptedProvider

    def decide(request: DecisionRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
        if request.observations:
            return {"action": "final", "output": "Order A1 has shipped."}
        return {"action": "call", "calls": [{"name": "lookup_order", "arguments": {"n": "A1"}}]}

    host, port = _host_port(dsn)
    prefix = f"latency_chat_{uuid.uuid4().hex[:10]}"
    async with contextlib.AsyncExitStack() as stack:
        history = await stack.enter_async_context(postgres_history(dsn))
        proxy = stack.enter_context(net_proxy(host, port or 5432))
        memory_store = await stack.enter_async_context(
            PostgresMemoryStore(proxy.dsn(dsn), prefix=prefix)
        )
        provider = ScriptedProvider(
            *([decide] * (2 * turns)),
            history=HistoryConfig(store=history.store, namespace=NAMESPACE),
        )
        program = Program()

        @program.capability
        async def lookup_order(n: str) -> dict[str, str]:
            """Find an order."""
            return {"order_id": n, "status": "shipped"}

        program.agent(
            "support",
            provider=provider,
            instructions="Answer about orders.",
            capabilities=("lookup_order",),
            memory=MemoryConfig(),
        )
        runtime = Runtime(program)
        try:
            async with ChatSession(runtime, "support", "user-1", store=memory_store) as session:
                yield Chat(session, provider, proxy, history.proxies[0])
        finally:
            proxy.delay(0)
            async with memory_store._pg.transaction() as conn:
                found = await conn.execute(
                    "SELECT tablename FROM pg_tables WHERE tablename LIKE %s", (f"{prefix}%",)
                )
                for (name,) in await found.fetchall():
                    await conn.execute(f"DROP TABLE IF EXISTS {name} CASCADE")


async def chat_table(rtts: Sequence[float], turns: int, report: Callable[[str], None]) -> None:
    """Chat turns on PostgreSQL (memory and history stores, a proxy each)."""
    async with postgres_chat(turns=(turns + WARM_UP) * (len(rtts) + 1)) as chat:
        for _ in range(WARM_UP):
            await chat.turn()
        report("")
        report("| added RTT | chat turns/s | round trips per turn: memory store | "
               "history store |")  # fmt: skip
        report("| --- | --- | --- | --- |")
        for rtt in rtts:
            for proxy in chat.proxies:
                proxy.delay(rtt)
                proxy.reset_counts()
            times = []
            for _ in range(turns):
                started = time.perf_counter()
                await chat.turn()
                times.append(time.perf_counter() - started)
            report(
                f"| {rtt:g} ms | {1 / statistics.median(times):,.1f} | "
                f"{chat.memory.round_trips / turns:.2f} | "
                f"{chat.history.round_trips / turns:.2f} |"
            )
        for proxy in chat.proxies:
            proxy.delay(0)


# -- main --------------------------------------------------------------------------------


async def run(args: argparse.Namespace, report: Callable[[str], None]) -> None:
    rtts = [float(v) for v in args.rtt.split(",")]
    sizes = {"short": args.short, "long": args.long}
    kinds = args.stores.split(",")
    report(f"{args.decisions} decisions per row, window {WINDOW} messages, one worker")
    report("")
    report("| store | conversation | added RTT | decisions/s | round trips per decision |")
    report("| --- | --- | --- | --- | --- |")
    opened: dict[str, Callable[[], contextlib.AbstractAsyncContextManager[Reached]]] = {
        "postgres": postgres_history,
        "redis": redis_history,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            if kind in opened:
                async with opened[kind]() as reached:
                    label = {"postgres": "PostgreSQL", "redis": "Redis"}[kind]
                    await decisions_table(label, reached, rtts, sizes, args.decisions, report)
            elif kind in ("sqlite", "memory"):
                async with local_history(kind, Path(tmp)) as reached:
                    label = {"sqlite": "SQLite", "memory": "RAM"}[kind]
                    await decisions_table(label, reached, rtts, sizes, args.decisions, report)
            elif kind == "cluster":
                reason = missing()
                if reason is not None:
                    report(f"| Redis Cluster | skipped: {reason} | | | |")
                    continue
                with cluster_through_proxies(Path(tmp)) as (proxies, remap):
                    async with cluster_history(proxies, remap) as reached:
                        label = "Redis Cluster (3 masters)"
                        await decisions_table(label, reached, rtts, sizes, args.decisions, report)
                        await peek_table(reached, rtts, args.reads, report)
            else:
                raise SystemExit(f"unknown store {kind!r}")
        if args.chat:
            await chat_table(rtts, args.turns, report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtt", default="0,1,5", help="added round-trip times, ms")
    parser.add_argument("--decisions", type=int, default=40, help="decisions per row")
    parser.add_argument("--stores", default="postgres,redis,cluster,sqlite,memory")
    parser.add_argument("--short", type=int, default=10, help="exchanges of the short one")
    parser.add_argument("--long", type=int, default=500, help="exchanges of the long one")
    parser.add_argument("--reads", type=int, default=30, help="cluster session reads per run")
    parser.add_argument("--chat", action="store_true", help="add PostgreSQL chat turns")
    parser.add_argument("--turns", type=int, default=20, help="chat turns per row")
    args = parser.parse_args()
    asyncio.run(run(args, print))


if __name__ == "__main__":
    main()
