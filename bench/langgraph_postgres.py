"""ToubaSaver on PostgreSQL against LangGraph's AsyncPostgresSaver and InMemorySaver.

The tool loop of ``bench/langgraph_saver.py`` (a scripted model calling a tool once per
question, LangGraph's ``ToolNode``, then an answer) runs on a thread that already holds N
messages of about 1 KB (10, 1,000, 5,000), with each saver in turn, interleaved. A "step"
is one super-step: an ``ainvoke`` divided by the checkpoints it made (4 per question).
Printed per N: ms per step for each saver (median of the rounds) and ToubaSaver's ratios.
Both PostgreSQL savers use the same server, each in a schema of its own, dropped at the
end; every commit waits for the server's WAL flush (``synchronous_commit`` as the server
has it), which dominates a step's time on a slow disk.

Then the bytes: the size of each saver's tables (``pg_total_relation_size``: rows,
TOAST and indexes) after 60 steps on a thread of 1,000 messages, and the WAL one
ToubaSaver put writes for a step adding two ~1 KB messages to threads of 1,000 and
5,000, against the bytes the step hands the store: the WAL position's advance across the
put's statement (run in a transaction rolled back, five times, the least kept: other
sessions' writes in the same moments only add to it). PostgreSQL compresses a
value stored out of line (pglz), which favours a saver rewriting one large, repetitive
blob: so these threads are filled with messages of varied words (about as compressible
as prose), not the repeated sentence of ``bench/langgraph_saver.py``. Benchmarks are not
tests: nothing here asserts.

    .venv/bin/python bench/langgraph_postgres.py [--quick] [--rounds 5]
"""

from __future__ import annotations

import os
import random
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver
from psycopg import sql
from psycopg.conninfo import make_conninfo

from bench.langgraph_saver import graph_with, question, run, side_by_side
from touba.integrations.langgraph import ToubaSaver
from touba.integrations.langgraph._backend import ChannelBlob, LogAppend, PutCheckpoint
from touba.integrations.langgraph._postgres import PostgresSaverBackend, _appends, _put_params

DSN = os.environ.get("TOUBA_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")

WORDS = [f"w{i:x}" for i in range(4096)]


def conversation(n: int) -> list[AnyMessage]:
    """n messages of about 1 KB of varied words (the same ones for every saver)."""
    rng = random.Random(n)
    out: list[AnyMessage] = []
    for i in range(n):
        kind = HumanMessage if i % 2 == 0 else AIMessage
        text = " ".join(rng.choice(WORDS) for _ in range(220))[:1000]
        out.append(kind(f"{i} {text}", id=f"p{i}"))
    return out


async def prefill(graph: Any, config: RunnableConfig, n: int) -> None:
    await graph.aupdate_state(config, {"messages": conversation(n)})


Opener = Callable[[str], AbstractAsyncContextManager[BaseCheckpointSaver[Any]]]


@asynccontextmanager
async def touba(schema: str) -> AsyncIterator[BaseCheckpointSaver[Any]]:
    async with ToubaSaver.postgres(DSN, table_prefix=f"{schema}.lg") as saver:
        yield saver


@asynccontextmanager
async def langgraph_postgres(schema: str) -> AsyncIterator[BaseCheckpointSaver[Any]]:
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    dsn = make_conninfo(DSN, options=f"-csearch_path={schema}")
    async with AsyncPostgresSaver.from_conn_string(dsn) as saver:
        await saver.setup()
        yield saver


@asynccontextmanager
async def in_memory(schema: str) -> AsyncIterator[BaseCheckpointSaver[Any]]:
    yield InMemorySaver()


SAVERS: dict[str, Opener] = {
    "touba": touba,
    "postgres": langgraph_postgres,
    "memory": in_memory,
}


@asynccontextmanager
async def schemas(names: list[str]) -> AsyncIterator[dict[str, str]]:
    """A new schema per name, dropped afterwards."""
    made = {name: f"bench_lg_{name}_{uuid.uuid4().hex[:8]}" for name in names}
    async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
        for schema in made.values():
            await conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    try:
        yield made
    finally:
        async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
            for schema in made.values():
                await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


async def schema_bytes(schema: str) -> int:
    async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relkind = 'r'",
            (schema,),
        )
        found = await cur.fetchone()
        return 0 if found is None else int(found[0])


async def step_times(n: int, rounds: int) -> dict[str, float]:
    """ms per super-step for each saver at n messages (median over rounds)."""
    async with schemas(list(SAVERS)) as made, AsyncExitStack() as stack:
        savers = {
            name: await stack.enter_async_context(opener(made[name]))
            for name, opener in SAVERS.items()
        }
        return await side_by_side(savers, n, rounds, prefill)


async def sizes_after(n: int, steps: int) -> dict[str, int]:
    """Each PostgreSQL saver's table bytes after ``steps`` steps on a thread of n."""
    names = ["touba", "postgres"]
    sizes: dict[str, int] = {}
    async with schemas(names) as made:
        for name in names:
            async with SAVERS[name](made[name]) as saver:
                graph = graph_with(saver)
                config: RunnableConfig = {"configurable": {"thread_id": "bytes"}}
                await prefill(graph, config, n)
                done = i = 0
                while done < steps:
                    done += await question(graph, config, i)
                    i += 1
            sizes[name] = await schema_bytes(made[name])
    return sizes


def step_request(n: int, base: Any, items: tuple[tuple[str, bytes], ...]) -> PutCheckpoint:
    return PutCheckpoint(
        thread_id="wal",
        checkpoint_ns="",
        checkpoint_id=f"{n:08d}",
        parent_id=None if n == 0 else f"{n - 1:08d}",
        checkpoint=("msgpack", b"c" * 300),
        metadata=("msgpack", b"m" * 60),
        metadata_json='{"source": "loop", "step": 1}',
        run_id="run",
        versions={"step": str(n)},
        blobs=(ChannelBlob("step", str(n), ("msgpack", b"1")),),
        logs=(LogAppend("messages", base, items),),
    )


async def wal_per_put(n: int) -> tuple[int, int]:
    """WAL bytes of one put adding two ~1 KB messages to a thread of n, and the bytes the
    put hands the store."""
    rng = random.Random(n)

    def item() -> tuple[str, bytes]:
        return ("msgpack", " ".join(rng.choice(WORDS) for _ in range(220)).encode()[:1000])

    async with schemas(["wal"]) as made:
        backend = PostgresSaverBackend(DSN, table_prefix=f"{made['wal']}.lg")
        try:
            first = await backend.put(step_request(0, (), tuple(item() for _ in range(n))))
            step = step_request(1, first.spans["messages"], (item(), item()))
            handed = (
                len(step.checkpoint[1])
                + len(step.metadata[1])
                + len(step.metadata_json)
                + sum(len(d) for a in step.logs for _, d in a.items)
                + 1
            )
            params = _put_params(step, _appends(step), backend._lock(step.thread_id))
            advances: list[int] = []
            async with await psycopg.AsyncConnection.connect(DSN) as conn:
                for _ in range(5):
                    cur = await conn.execute("SELECT pg_current_wal_insert_lsn()")
                    before = await cur.fetchone()
                    await conn.execute(backend._sql.put, params)
                    cur = await conn.execute(
                        "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)",
                        (None if before is None else before[0],),
                    )
                    found = await cur.fetchone()
                    advances.append(0 if found is None else int(found[0]))
                    await conn.rollback()
        finally:
            await backend.close()
    return min(advances), handed


async def main(quick: bool, rounds: int) -> None:
    sizes_n = [10, 1000] if quick else [10, 1000, 5000]
    print("LangGraph tool loop on PostgreSQL, ms per super-step (median), N messages of ~1 KB")
    print(
        f"{'N':>6}{'touba pg':>10}{'AsyncPostgres':>15}{'InMemorySaver':>15}"
        f"{'touba/pg':>10}{'touba/memory':>14}"
    )
    for n in sizes_n:
        t = await step_times(n, rounds if n < 5000 else max(2, rounds // 2))
        print(
            f"{n:>6}{t['touba']:>10.2f}{t['postgres']:>15.2f}{t['memory']:>15.2f}"
            f"{t['touba'] / t['postgres']:>10.2f}{t['touba'] / t['memory']:>14.2f}"
        )
    steps = 20 if quick else 60
    sizes = await sizes_after(1000, steps)
    print(f"\ntable bytes after {steps} steps on a thread of 1,000 messages:")
    print(f"  ToubaSaver (PostgreSQL):   {sizes['touba'] / 1e6:8.2f} MB")
    print(f"  AsyncPostgresSaver:        {sizes['postgres'] / 1e6:8.2f} MB")
    print(f"  ratio touba / postgres:    {sizes['touba'] / sizes['postgres']:8.3f}")
    print("\nWAL of one ToubaSaver put adding two ~1 KB messages:")
    for n in (1000, 5000):
        wal, handed = await wal_per_put(n)
        print(
            f"  thread of {n:>5}: {wal:>7,} WAL bytes for {handed:,} handed ({wal / handed:.2f}x)"
        )


if __name__ == "__main__":
    run(main, __doc__)
