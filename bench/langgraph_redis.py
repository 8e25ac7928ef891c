"""ToubaSaver on Redis against LangGraph's InMemorySaver, side by side.

The tool loop of ``bench/langgraph_saver.py`` (a scripted model, LangGraph's ``ToolNode``)
runs on a thread that already holds N messages of about 1 KB (10, 1,000, 5,000), with
each saver in turn, interleaved. A "step" is one super-step (one ``aput`` and its
``aput_writes``); its time is an ``ainvoke`` divided by the checkpoints it made. Printed per
N: ms per step (median of the rounds) for each and ToubaSaver's ratio to InMemorySaver.

Then the backend alone, flat in the log's length: a put adding one ~1 KB item and a warm
get (the caller holds the log) on a thread whose log holds 100, 5,000 and 50,000 entries,
ms per call (median of 5 batches of 100).

Then the bytes at 1,000 messages over 60 steps: what ToubaSaver hands the Redis backend per
step and what the client sends Redis over the wire (counted by a loopback relay in front
of the server: commands, arguments, key names, protocol) against the bytes of the
messages the step added, and the memory Redis holds for the
thread afterwards (``MEMORY USAGE`` of every key under the saver's prefix) against the
serialized size of the thread's messages. Needs the Redis server of ``TOUBA_REDIS_URL``
(default ``redis://127.0.0.1:6379/0``); keys go under a fresh prefix, deleted afterwards.
Benchmarks are not tests: nothing here asserts.

    .venv/bin/python bench/langgraph_redis.py [--quick] [--rounds 5]
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.langgraph_saver import (
    graph_with,
    prefill,
    put_bytes,
    question,
    run,
    side_by_side,
    writes_bytes,
)
from touba.integrations.langgraph import ToubaSaver
from touba.integrations.langgraph._backend import PutCheckpoint, PutResult, WriteRecord
from touba.integrations.langgraph._redis import RedisSaverBackend

URL = os.environ.get("TOUBA_REDIS_URL", "redis://127.0.0.1:6379/0")


class Counting(RedisSaverBackend):
    """The Redis backend, counting the bytes ToubaSaver hands it."""

    handed = 0

    async def put(self, request: PutCheckpoint) -> PutResult:
        Counting.handed += put_bytes(request)
        return await super().put(request)

    async def put_writes(
        self, thread_id: str, checkpoint_ns: str, checkpoint_id: str, writes: Sequence[WriteRecord]
    ) -> None:
        Counting.handed += writes_bytes(writes)
        await super().put_writes(thread_id, checkpoint_ns, checkpoint_id, writes)


def held(prefix: str) -> int:
    """Bytes Redis holds for every key under ``prefix``."""
    with redis.Redis.from_url(URL) as client:
        return sum(
            int(client.memory_usage(k, samples=0) or 0)
            for k in client.scan_iter(match=prefix + "*", count=1000)
        )


def drop(prefix: str) -> None:
    with redis.Redis.from_url(URL) as client:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)


async def step_times(n: int, rounds: int) -> dict[str, float]:
    """ms per super-step for each saver at n messages (median over rounds)."""
    prefix = f"touba-bench-lg:{uuid.uuid4().hex[:8]}:"
    try:
        async with ToubaSaver(RedisSaverBackend(URL, prefix=prefix)) as touba:
            return await side_by_side({"touba": touba, "memory": InMemorySaver()}, n, rounds)
    finally:
        drop(prefix)


async def backend_calls(n: int) -> tuple[float, float]:
    """ms per put of one item and per warm get, on a log of n entries."""
    from touba.integrations.langgraph._backend import ChannelBlob, HeldLog, LogAppend

    prefix = f"touba-bench-lg:{uuid.uuid4().hex[:8]}:"
    body = ("json", b"z" * 1000)

    def put(cid: str, parent: str | None, base: Any, items: Any) -> PutCheckpoint:
        meta = b'{"step": 1}'
        return PutCheckpoint(
            "t", "", cid, parent, ("msgpack", b"c" * 300), ("json", meta), meta.decode(), None,
            {"tool_state": cid}, (ChannelBlob("tool_state", cid, ("json", b"v" * 100)),),
            (LogAppend("messages", base, items),),
        )  # fmt: skip

    backend = RedisSaverBackend(URL, prefix=prefix)
    try:
        spans: Any = ()
        parent = None
        result = None
        for k in range(0, n, 1000):
            cid = f"a{k:08d}"
            items = (body,) * min(1000, n - k)
            result = await backend.put(put(cid, parent, spans, items))
            spans, parent = result.spans["messages"], cid
        puts: list[float] = []
        gets: list[float] = []
        for batch in range(5):
            started = time.perf_counter()
            for i in range(100):
                cid = f"b{batch:02d}{i:04d}"
                result = await backend.put(put(cid, parent, spans, (body,)))
                spans, parent = result.spans["messages"], cid
            puts.append((time.perf_counter() - started) * 10)
            assert result is not None
            state = result.logs["messages"]
            held = {"messages": HeldLog(state.token, state.length)}
            started = time.perf_counter()
            for _ in range(100):
                await backend.get("t", "", None, held)
            gets.append((time.perf_counter() - started) * 10)
        return statistics.median(puts), statistics.median(gets)
    finally:
        await backend.close()
        drop(prefix)


class Relay:
    """A loopback relay to the Redis server counting the bytes clients send it."""

    def __init__(self) -> None:
        parts = urlsplit(URL)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self.sent = 0
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Relay:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = urlsplit(URL)._replace(netloc=f"127.0.0.1:{port}").geturl()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)

        async def back() -> None:
            while chunk := await up_reader.read(65536):
                writer.write(chunk)
                await writer.drain()

        task = asyncio.create_task(back())
        try:
            while chunk := await reader.read(65536):
                self.sent += len(chunk)
                up_writer.write(chunk)
                await up_writer.drain()
        except ConnectionError:
            pass
        finally:
            up_writer.close()
            writer.close()
            task.cancel()


async def bytes_per_step(n: int, steps: int) -> tuple[float, float, float, int, int]:
    """Bytes handed per step, bytes sent to Redis per step, bytes the step's messages
    weigh, Redis memory held after, serialized bytes of the thread's messages."""
    from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

    serde = JsonPlusSerializer()
    prefix = f"touba-bench-lg:{uuid.uuid4().hex[:8]}:"
    try:
        async with Relay() as relay, ToubaSaver(Counting(relay.url, prefix=prefix)) as saver:
            graph: Any = graph_with(saver)
            config: RunnableConfig = {"configurable": {"thread_id": "bytes"}}
            await prefill(graph, config, n)
            count = len((await graph.aget_state(config)).values["messages"])
            Counting.handed = 0
            relay.sent = 0
            made = i = 0
            while made < steps:
                made += await question(graph, config, i)
                i += 1
            sent = relay.sent / made
            messages = (await graph.aget_state(config)).values["messages"]
            added = sum(len(serde.dumps_typed(m)[1]) for m in messages[count:]) / made
            total = sum(len(serde.dumps_typed(m)[1]) for m in messages)
            return Counting.handed / made, sent, added, held(prefix), total
    finally:
        drop(prefix)


async def main(quick: bool, rounds: int) -> None:
    sizes_n = [10, 1000] if quick else [10, 1000, 5000]
    print("LangGraph tool loop on Redis, ms per super-step (median), N messages of ~1 KB")
    print(f"{'N':>6}{'touba redis':>13}{'InMemorySaver':>15}{'touba/memory':>14}")
    for n in sizes_n:
        t = await step_times(n, rounds if n < 5000 else max(2, rounds // 2))
        print(f"{n:>6}{t['touba']:>13.2f}{t['memory']:>15.2f}{t['touba'] / t['memory']:>14.2f}")
    print("\nthe Redis backend alone, ms per call on a log of N entries (median)")
    print(f"{'N':>7}{'put 1 item':>12}{'warm get':>10}")
    for n in [100, 5000] if quick else [100, 5000, 50000]:
        put_ms, get_ms = await backend_calls(n)
        print(f"{n:>7}{put_ms:>12.3f}{get_ms:>10.3f}")
    steps = 20 if quick else 60
    handed, sent, added, memory, total = await bytes_per_step(1000, steps)
    print(f"\nbytes per step at 1,000 messages ({steps} steps):")
    print(f"  messages the step added (serialized): {added:,.0f}")
    print(f"  ToubaSaver handed the Redis backend:  {handed:,.0f}  ({handed / added:.2f}x added)")
    print(f"  the client sent Redis (on the wire):  {sent:,.0f}  ({sent / added:.2f}x added)")
    print(f"Redis memory for the thread after {steps} steps: {memory / 1e6:.2f} MB")
    print(f"  its messages, serialized once:        {total / 1e6:.2f} MB")


if __name__ == "__main__":
    run(main, __doc__)
