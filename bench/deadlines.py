"""How long each Redis store and each provider takes to fail when the network goes silent.

Every store and provider is reached through the loopback proxy of ``tests/_netproxy.py``
with ``deadline_seconds=--deadline``; the proxy then black-holes the traffic (packets
dropped, nothing closed) and the next operation is timed until it raises. Each row is
``--rounds`` runs: the median and the slowest time to the typed error, and whether the
operation after the network came back succeeded every time. Rows:

- Redis: a decision (``DecisionHistory.step``) whose claim meets the silence, on the
  store's own client and on a host's client with no timeout; a decision whose model
  call starts the silence (the save and its release meet it; the conversation is then
  recovered); an ADK append; a LangGraph saver put.
- Providers (their loopback fakes, a host client with no timeout): a decision, whole
  and streamed, and a count of the context guard.

Benchmarks are not tests: nothing here asserts a time.

    .venv/bin/python bench/deadlines.py [--deadline 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

if __package__ in (None, ""):  # run as a script: bench/ is a package of the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests._netproxy import NetProxy, net_proxy
from tests._providers import fake_server
from tests.history.test_redis_deadlines import IDENTITY, Decisions, bare_client, texts
from tests.integrations._stores import delete_keys
from tests.providers.test_deadlines import REQUEST, nothing, provider_on
from tests.providers.test_streaming import _script_calls

from touba.errors import ToubaError
from touba.history import MemoryHistoryStore
from touba.history.redis import RedisHistoryStore
from touba.providers import ContextConfig

URL = "redis://127.0.0.1:6379/0"
Step = Callable[[], Awaitable[Any]]


async def timed(step: Step) -> tuple[float, str]:
    """Seconds until ``step`` raised, and the error's class (or "answered")."""
    started = time.monotonic()
    try:
        await step()
    except ToubaError as e:
        return time.monotonic() - started, type(e).__name__
    return time.monotonic() - started, "answered"


class Row:
    def __init__(self, name: str) -> None:
        self.name = name
        self.times: list[float] = []
        self.errors: set[str] = set()
        self.recovered = 0

    def show(self, deadline: float) -> str:
        median = statistics.median(self.times)
        return (
            f"{self.name:<48} {median:6.2f} {max(self.times):6.2f} "
            f"{max(self.times) / deadline:5.2f}x  {','.join(sorted(self.errors)):<34} "
            f"{self.recovered}/{len(self.times)}"
        )


async def redis_rows(deadline: float, rounds: int) -> list[Row]:
    parts = urlsplit(URL)
    rows = {
        name: Row(name)
        for name in (
            "redis decision, claim (store's client)",
            "redis decision, claim (host client, no timeout)",
            "redis decision, save (then recover)",
            "redis ADK append",
            "redis LangGraph saver put",
        )
    }
    for _ in range(rounds):
        for name, row in rows.items():
            prefix = f"touba-bench-deadline:{uuid.uuid4().hex[:12]}:"
            with net_proxy(parts.hostname or "127.0.0.1", parts.port or 6379) as proxy:
                try:
                    await _redis_one(name, row, proxy, prefix, deadline)
                finally:
                    delete_keys(prefix)
    return list(rows.values())


async def _redis_one(name: str, row: Row, proxy: NetProxy, prefix: str, deadline: float) -> None:
    url = proxy.url(URL)
    if name.startswith("redis decision"):
        host = bare_client(url) if "host client" in name else None
        store = (
            RedisHistoryStore(client=host, prefix=prefix, deadline_seconds=deadline)
            if host is not None
            else RedisHistoryStore(url, prefix=prefix, deadline_seconds=deadline)
        )
        async with store:
            decisions = Decisions(store)
            await decisions.decide("first")
            if "save" in name:
                seconds, error = await timed(lambda: decisions.decide("lost", proxy.black_hole))
            else:
                proxy.black_hole()
                seconds, error = await timed(lambda: decisions.decide("lost"))
            proxy.restore()
            if "save" in name:
                await store.recover(IDENTITY.key, worker_stopped=True)
            await decisions.decide("next")
            row.recovered += texts(await store.read(IDENTITY.key)) == ["first", "next"]
        if host is not None:
            await host.aclose()
    elif name.endswith("ADK append"):
        from touba.integrations.adk._backend import AppendRequest, SessionKey, StoredEvent
        from touba.integrations.adk._redis import RedisAdkBackend

        key, t0 = SessionKey("app", "u", "s"), 1_765_000_000.0

        def request(n: int) -> AppendRequest:
            event = StoredEvent(f"e{n}", t0 + n, json.dumps({"id": f"e{n}"}))
            return AppendRequest(event=event, update_time=t0 + n, expected_revision=None, now=t0)

        backend = RedisAdkBackend(url, prefix=prefix, deadline_seconds=deadline)
        try:
            await backend.create(key, state={}, app_delta={}, user_delta={}, create_time=t0, now=t0)
            proxy.black_hole()
            seconds, error = await timed(lambda: backend.append(key, request(1)))
            proxy.restore()
            await backend.append(key, request(2))
            read = await backend.read(key, recent=None, after=None, now=t0)
            row.recovered += read is not None and [e.event_id for e in read.events] == ["e2"]
        finally:
            await backend.close()
    else:
        from tests.history.test_redis_deadlines import request as put_request
        from tests.history.test_redis_deadlines import texts_of

        from touba.integrations.langgraph._redis import RedisSaverBackend

        saver = RedisSaverBackend(url, prefix=prefix, deadline_seconds=deadline)
        try:
            spans = (await saver.put(put_request("0001", texts=("a",)))).spans["messages"]
            proxy.black_hole()
            seconds, error = await timed(
                lambda: saver.put(put_request("0002", parent_id="0001", base=spans, texts=("x",)))
            )
            proxy.restore()
            await saver.put(put_request("0002", parent_id="0001", base=spans, texts=("b",)))
            row.recovered += texts_of(await saver.get("t", "", None, {})) == ["a", "b"]
        finally:
            await saver.close()
    row.times.append(seconds)
    row.errors.add(error)


async def provider_rows(deadline: float, rounds: int) -> list[Row]:
    rows = []
    for vendor in ("openai", "compatible", "anthropic", "gemini"):
        for what in ("whole", "streamed", "count"):
            if what == "count" and vendor == "compatible":
                continue
            row = Row(f"{vendor} {'guard count' if what == 'count' else what + ' decision'}")
            for _ in range(rounds):
                await _provider_one(vendor, what, row, deadline)
            rows.append(row)
    return rows


async def _provider_one(vendor: str, what: str, row: Row, deadline: float) -> None:
    options: dict[str, Any] = {"deadline_seconds": deadline}
    if what == "count":
        options |= {"context": ContextConfig(context_window_tokens=100_000)}
        options |= {"max_output_tokens": 1000}
    with fake_server(vendor) as srv:
        parts = urlsplit(srv.base_url)
        with net_proxy(parts.hostname or "127.0.0.1", parts.port or 80) as proxy:
            async with provider_on(
                vendor, proxy.url(srv.base_url), MemoryHistoryStore(), **options
            ) as provider:
                sink = nothing if what == "streamed" else None
                _script_calls(vendor, srv)
                proxy.black_hole()
                seconds, error = await timed(lambda: provider.decide(REQUEST, sink=sink))
                proxy.restore()
                decision = await provider.decide(REQUEST, sink=sink)
                row.recovered += len(decision.calls) == 2
    row.times.append(seconds)
    row.errors.add(error)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deadline", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"deadline_seconds={args.deadline:g}, {args.rounds} rounds; seconds to the typed error")
    print(f"{'operation':<48} {'median':>6} {'max':>6} {'/dl':>6}  {'error':<34} next ok")
    for row in await redis_rows(args.deadline, args.rounds):
        print(row.show(args.deadline))
    for row in await provider_rows(args.deadline, args.rounds):
        print(row.show(args.deadline))


if __name__ == "__main__":
    asyncio.run(main())
