"""``touba.data.copy_stores``: moving a SQLite deployment's histories to PostgreSQL.

A SQLite history file is filled with 10,000 conversations of 100 messages (50
exchanges of a capability call and its result, about 170 bytes each, as the
neutral model stores them), then copied into a fresh PostgreSQL table, then
verified (``verify_copy``: both sides read again, a digest per conversation).
Printed: conversations/s and MB/s (the canonical JSON the copy wrote) of the copy,
the time of a read-only pass over the source alone (what any copy must pay), the
copy's time as a ratio to it, and verify's. A rerun of the copy (everything
already there) is timed too: what resuming costs when there is nothing left to do.
Benchmarks are not tests: nothing here asserts a time.

    .venv/bin/python bench/copy_stores.py [--quick] [--conversations 10000] [--messages 100]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sqlite3
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from touba.data import Stores, copy_stores, verify_copy
from touba.history import ConversationIdentity
from touba.history._common import MiB
from touba.history._record import join_record, new_head
from touba.history.sqlite import SqliteHistoryStore

POSTGRES_DSN = os.environ.get("TOUBA_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
ROOM: dict[str, Any] = {
    "max_sessions": 1_000_000,
    "max_store_bytes": 64 * 1024 * MiB,
    "ttl_seconds": 30 * 86400,
}


def exchange(n: int, i: int) -> list[dict[str, Any]]:
    """A capability call and its result, as the neutral model stores them."""
    call: dict[str, Any] = {
        "kind": "call",
        "call_id": f"call-{n}-{i}",
        "name": "lookup_order",
        "arguments": {"order_id": f"A-{n:05d}-{i:03d}", "fields": ["status", "eta"]},
    }
    result: dict[str, Any] = {
        "kind": "result",
        "call_id": f"call-{n}-{i}",
        "status": "ok",
        "text": f"order A-{n:05d}-{i:03d} shipped, arriving Thursday between 9 and 12",
    }
    return [call, result]


def conversation(n: int, messages: int) -> dict[str, Any]:
    who = ConversationIdentity("bench", "openai", "gpt", "native", f"run-{n}", "inv", "agent")
    exchanges = [exchange(n, i)[: messages - 2 * i] for i in range((messages + 1) // 2)]
    return join_record(new_head(who), exchanges)


async def fill(path: Path, count: int, messages: int) -> None:
    """The source file, written fast (no fsync: the figures are the copy's, not this)."""
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=OFF")
    store = SqliteHistoryStore(database=conn, **ROOM)
    pending = list(range(count))

    async def writer() -> None:
        while pending:
            n = pending.pop()
            record = conversation(n, messages)

            async def put(_: Any, record: dict[str, Any] = record) -> tuple[Any, None]:
                return record, None

            await store.transact(f"conv-{n:05d}", put)

    await asyncio.gather(*(writer() for _ in range(4)))
    await store.close()
    conn.close()


def reachable(dsn: str) -> bool:
    parts = urlsplit(dsn)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5432), 1):
            return True
    except OSError:
        return False


async def main(count: int, messages: int) -> None:
    if not reachable(POSTGRES_DSN):
        print(f"(skipped: PostgreSQL unreachable at {POSTGRES_DSN}; set TOUBA_POSTGRES_DSN)")
        return
    import psycopg
    from psycopg import sql

    from touba.history.postgres import PostgresHistoryStore

    schema = f"bench_copy_{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="touba-bench-") as tmp:
        path = Path(tmp) / "source.sqlite"
        started = time.perf_counter()
        await fill(path, count, messages)
        print(
            f"source: {count:,} conversations of {messages} messages, "
            f"{path.stat().st_size / MiB:.0f} MiB of SQLite (filled in "
            f"{time.perf_counter() - started:.0f} s)"
        )
        async with await psycopg.AsyncConnection.connect(POSTGRES_DSN, autocommit=True) as conn:
            await conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        try:
            async with (
                SqliteHistoryStore(path, **ROOM) as source,
                PostgresHistoryStore(
                    POSTGRES_DSN, table=f"{schema}.touba_history", **ROOM
                ) as target,
            ):
                await report(source, target, count)
        finally:
            async with await psycopg.AsyncConnection.connect(POSTGRES_DSN, autocommit=True) as c:
                await c.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


async def report(source: SqliteHistoryStore, target: Any, count: int) -> None:
    pair = Stores(histories=[source]), Stores(histories=[target])

    started = time.perf_counter()
    for row in await source.list(purge=False):
        await source.read(row.key, purge=False)
    read_alone = time.perf_counter() - started

    started = time.perf_counter()
    copied = await copy_stores(*pair)
    copying = time.perf_counter() - started
    assert copied.copied == {"conversation": count}, copied.issues[:3]

    started = time.perf_counter()
    again = await copy_stores(*pair)
    rerun = time.perf_counter() - started
    assert again.already == {"conversation": count}

    started = time.perf_counter()
    verified = await verify_copy(*pair)
    verifying = time.perf_counter() - started
    assert verified.clean
    assert verified.matched == count

    megabytes = copied.bytes / 1e6
    print(f"{'SQLite -> PostgreSQL':<24}{'seconds':>10}{'conv/s':>10}{'MB/s':>10}{'ratio':>8}")
    rows = [
        ("read the source alone", read_alone),
        ("copy", copying),
        ("rerun (all already there)", rerun),
        ("verify", verifying),
    ]
    for label, seconds in rows:
        print(
            f"{label:<24}{seconds:>10.1f}{count / seconds:>10,.0f}"
            f"{megabytes / seconds:>10.1f}{seconds / read_alone:>7.1f}x"
        )
    print(f"copied {megabytes:.0f} MB of canonical JSON; ratio = time / reading the source alone")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="500 conversations")
    parser.add_argument("--conversations", type=int, default=10_000)
    parser.add_argument("--messages", type=int, default=100)
    args = parser.parse_args()
    total = 500 if args.quick else args.conversations
    sys.exit(asyncio.run(main(total, args.messages)))
