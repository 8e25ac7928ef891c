"""Capacity is refused before anything is paid, on every built-in store.

A decision the store would refuse (``max_sessions``, ``max_store_bytes``) or
the conversation would refuse (``max_retained_bytes``) is refused before the
provider is called: the OpenAI provider with its context guard, against the
fake server, sends no count request and no generation, and the store keeps its
previous state. Reserving a new key claims its place (two racing reservations
of the last place: one wins, also across processes); ``usage()`` reports the
figures; ``history_store_pressure`` goes out over 80 %, once a minute per store.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.history._clock import Clock
from tests.history._stores import LOOKUP, Stores, holding, state
from tests.providers._requests import decision_request
from touba.errors import DecisionHistoryLimitExceeded
from touba.history import (
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryEvent,
    HistoryStore,
    HistoryWindow,
    MemoryHistoryStore,
    StoreUsage,
)
from touba.history._engine import event_observer
from touba.history._pressure import STORE_PRESSURE, PressureGate, under_pressure
from touba.providers import ContextConfig, DecisionRequest, Observation
from touba.providers.openai import create_openai_decision_provider
from touba.testing.fakes import FakeOpenAIServer, openai_function_call, openai_text

NS = "capacity"


# -- the provider ------------------------------------------------------------------------


def guarded(openai_client: openai.AsyncOpenAI, store: HistoryStore, **config: Any) -> Any:
    return create_openai_decision_provider(
        model="gpt-test",
        client=openai_client,
        history=HistoryConfig(store=store, namespace=NS, **config),
        context=ContextConfig(context_window_tokens=100_000),
        max_output_tokens=100,
    )


def request(invocation: str = "i1", **fields: Any) -> DecisionRequest:
    return decision_request(LOOKUP, invocation_id=invocation, **fields)


def answer(decision: Any, result: Any) -> tuple[Observation, ...]:
    (call,) = decision.calls
    return (Observation(call.call_id, call.name, call.arguments, "ok", result),)


async def expect_refused_unpaid(
    openai_server: FakeOpenAIServer, store: Any, provider: Any, req: DecisionRequest, limit: str
) -> None:
    """``req`` is refused with ``limit``: no request of any kind, the store unchanged."""
    sent, before = len(openai_server.requests), await state(store)
    openai_server.script_response(openai_text("never generated"))
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        await provider.decide(req)
    assert caught.value.limit == limit
    assert len(openai_server.requests) == sent  # no count request, no generation
    assert openai_server.pending("responses") == 1
    assert await state(store) == before  # nothing written, no reservation left


async def test_max_sessions_is_refused_before_the_provider_is_called(
    stores: Stores, openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    store = stores(max_sessions=1)
    provider = guarded(openai_client, store)
    openai_server.script_response(openai_text("done"))
    await provider.decide(request("i1"))
    assert [r.endpoint for r in openai_server.requests] == ["input_tokens", "responses"]
    await expect_refused_unpaid(openai_server, store, provider, request("i2"), "max_sessions")
    assert (await store.usage()).sessions == 1


async def test_max_store_bytes_is_refused_before_the_provider_is_called(
    stores: Stores, openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    store = stores(max_store_bytes=4000)
    provider = guarded(openai_client, store)
    openai_server.script_response(openai_function_call("lookup_order", {"order_id": "A1"}))
    decision = await provider.decide(request())
    assert (await store.usage()).bytes < 2000  # room for the model's reply, not for this:
    big = answer(decision, {"order": "x" * 4000})
    await expect_refused_unpaid(
        openai_server, store, provider, request(observations=big), "max_store_bytes"
    )
    # The key was not left reserved; the reply scripted for the refused decision,
    # still queued, answers this one.
    final = await provider.decide(request(observations=answer(decision, {"order": "A1"})))
    assert final.output == "never generated"


async def test_a_new_conversation_whose_head_cannot_fit_is_refused_unpaid(
    stores: Stores, openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    store = stores(max_store_bytes=200)  # less than any record head
    await expect_refused_unpaid(
        openai_server, store, guarded(openai_client, store), request(), "max_store_bytes"
    )
    assert await store.usage() == StoreUsage(0, 128, 0, 200)


async def test_max_retained_bytes_is_refused_before_the_provider_is_called(
    stores: Stores, openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    store = stores()
    provider = guarded(openai_client, store, max_retained_bytes=2000)
    openai_server.script_response(openai_function_call("lookup_order", {"order_id": "A1"}))
    decision = await provider.decide(request())
    big = answer(decision, {"order": "x" * 2000})
    await expect_refused_unpaid(
        openai_server, store, provider, request(observations=big), "max_retained_bytes"
    )


async def test_a_reply_too_big_for_the_store_is_refused_at_save(
    stores: Stores, openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    """The documented limit of the pre-check: the decision's own bytes are unknown."""
    store = stores(max_store_bytes=4000)
    provider = guarded(openai_client, store)
    openai_server.script_response(openai_text("y" * 5000))
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        await provider.decide(request())
    assert caught.value.limit == "max_store_bytes"
    assert [r.endpoint for r in openai_server.requests] == ["input_tokens", "responses"]  # paid
    assert await state(store) == []


# -- a new key claims its place when reserved ------------------------------------------


def identity(invocation: str) -> ConversationIdentity:
    return ConversationIdentity(
        namespace=NS,
        provider="openai",
        model="gpt-test",
        decision_interface="native",
        run_id="r1",
        invocation_id=invocation,
        agent_ref="support",
    )


async def final(window: HistoryWindow) -> DecisionMessage:
    return DecisionMessage(text="done", output="done", final=True)


async def test_two_new_keys_racing_for_the_last_place_one_wins(stores: Stores) -> None:
    # Two workers: two store objects on the same data (one object for the RAM store).
    workers = [stores("race", max_sessions=2) for _ in range(2)]
    histories = [DecisionHistory(HistoryConfig(store=s, namespace=NS)) for s in workers]
    await histories[0].step(identity("existing"), (), final)
    generated: list[str] = []
    release = asyncio.Event()

    def holding(name: str) -> Callable[[HistoryWindow], Any]:
        async def generate(window: HistoryWindow) -> DecisionMessage:
            generated.append(name)
            await release.wait()  # hold the reservation while the other one tries
            return await final(window)

        return generate

    tasks = [
        asyncio.create_task(history.step(identity(name), (), holding(name)))
        for history, name in zip(histories, ("x", "y"), strict=True)
    ]
    await asyncio.wait(tasks, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    release.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    refused = [r for r in results if isinstance(r, DecisionHistoryLimitExceeded)]
    assert len(refused) == 1, results
    assert refused[0].limit == "max_sessions"
    assert len(generated) == 1  # the loser never reached the provider
    assert len(await workers[0].list()) == 2
    assert (await workers[1].usage()).sessions == 2


CHILD = """
import asyncio, json, sys
from tests.history._stores import build
from touba.errors import DecisionHistoryLimitExceeded

async def main(kind, key, limit, value, record, *where):
    loop = asyncio.get_running_loop()
    store = build(kind, *where, **{limit: int(value)})
    await store.usage()  # connected and ready
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)

    async def hold(snapshot):
        print("in", flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
        return json.loads(record), None

    try:
        await store.transact(key, hold)
        print("saved", flush=True)
    except DecisionHistoryLimitExceeded as e:
        print("refused", e.limit, flush=True)
    await store.close()

asyncio.run(main(*sys.argv[1:]))
"""


@contextlib.asynccontextmanager
async def children_ready(
    durable: Stores, where: tuple[str, ...], limit: tuple[str, int], records: dict[str, Any]
) -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """One CHILD process per key of ``records`` (under ``limit``, a store option and its
    value), each ready to reserve its key and then save its record when told; killed on the
    way out if still running."""
    children = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CHILD,
            durable.kind,
            key,
            limit[0],
            str(limit[1]),
            json.dumps(record),
            *where,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=Path(__file__).parents[2],
        )
        for key, record in records.items()
    ]
    try:
        for child in children:
            assert child.stdout is not None
            assert await asyncio.wait_for(child.stdout.readline(), 30) == b"ready\n"
        yield children
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()


async def say_and_read(children: list[asyncio.subprocess.Process], word: bytes) -> list[str]:
    """Tells every child ``word`` at once (as close together as two writes get) and reads
    each one's answer line."""
    for child in children:
        assert child.stdin is not None
        child.stdin.write(word)
    await asyncio.gather(*(child.stdin.drain() for child in children if child.stdin))
    lines = []
    for child in children:
        assert child.stdout is not None
        lines.append((await asyncio.wait_for(child.stdout.readline(), 30)).decode().strip())
    return lines


async def test_the_last_place_has_one_winner_across_processes(durable: Stores) -> None:
    where = durable.location("shared")
    store = durable("shared", max_sessions=1)
    await store.usage()  # create the tables first, once
    records = {key: {"saved": key} for key in ("x", "y")}
    async with children_ready(durable, where, ("max_sessions", 1), records) as children:
        lines = await say_and_read(children, b"go\n")
        assert sorted(lines) == ["in", "refused max_sessions"], lines
        winner = children[lines.index("in")]
        assert (await store.usage()).sessions == 1  # the winner's reservation holds it
        await winner.communicate(b"save\n")
        for child in children:
            await child.wait()
            assert child.returncode == 0
        key = "xy"[lines.index("in")]
        assert await store.read(key) == {"saved": key}
        assert [row.key for row in await store.list()] == [key]


@pytest.mark.parametrize("both_fit", [False, True])
async def test_the_last_bytes_have_one_winner_across_processes(
    durable: Stores, both_fit: bool
) -> None:
    """Two processes save at once into what is left of max_store_bytes: when only one
    record fits, exactly one is saved; when both fit, neither is refused. On
    PostgreSQL the two keys are counted in different shards, so the race is between
    two shards' rooms."""
    limit, first = 10_000, 9_000 - 10  # {"pad": "a" * n} is n + 10 bytes
    size = 400 if both_fit else 600  # 1,000 bytes free: two of 410, or one of 610
    where = durable.location("bytes")
    store = durable("bytes", max_store_bytes=limit)
    await store.transact("first", lambda _: _put({"pad": "a" * first}))
    assert (await store.usage()).bytes == 9_000
    keys = ("x", "y")
    if durable.kind == "postgres":
        shards = await _shards(durable, keys)
        assert len(set(shards)) == 2, shards
    records = {key: {"pad": "a" * size} for key in keys}
    async with children_ready(durable, where, ("max_store_bytes", limit), records) as children:
        assert await say_and_read(children, b"go\n") == ["in", "in"]  # both hold a reservation
        outcomes = await say_and_read(
            children, b"save\n"
        )  # then save as close together as they get
        for child in children:
            await child.wait()
            assert child.returncode == 0
    saved = [key for key, outcome in zip(keys, outcomes, strict=True) if outcome == "saved"]
    if both_fit:
        assert outcomes == ["saved", "saved"]
    else:
        assert sorted(outcomes) == ["refused max_store_bytes", "saved"], outcomes
    usage = await store.usage()
    assert usage.bytes == 9_000 + len(saved) * (size + 10) <= limit
    assert sorted(row.key for row in await store.list()) == sorted(["first", *saved])


async def _put(record: dict[str, Any]) -> tuple[dict[str, Any], None]:
    return record, None


async def _shards(durable: Stores, keys: tuple[str, ...]) -> list[int]:
    """The usage shard each key is counted in (PostgreSQL)."""
    import psycopg

    async with await psycopg.AsyncConnection.connect(durable.location("bytes")[0]) as conn:
        query = "SELECT hashtext(k) & 63 FROM unnest(%s::text[]) AS k"
        cur = await conn.execute(query, [list(keys)])
        return [row[0] for row in await cur.fetchall()]


# -- usage ---------------------------------------------------------------------------------


async def test_usage_counts_records_and_reservations_of_new_keys(stores: Stores) -> None:
    store = stores(max_sessions=10, max_store_bytes=10_000)
    assert await store.usage() == StoreUsage(0, 10, 0, 10_000)

    async def put(snapshot: Any) -> tuple[Any, None]:
        return {"pad": "a" * 100}, None

    await store.transact("a", put)
    await store.transact("b", put)
    usage = await store.usage()
    assert (usage.sessions, usage.bytes) == (2, 2 * len(json.dumps({"pad": "a" * 100})) - 2)
    assert usage.bytes == sum(row.bytes for row in await store.list())

    def give_up(snapshot: Any) -> tuple[Any, None]:
        raise RuntimeError("given up")

    held, leave = await holding(store, "new", give_up)
    assert await store.usage() == StoreUsage(3, 10, usage.bytes, 10_000)
    leave.set()
    with pytest.raises(RuntimeError):
        await held
    assert await store.usage() == usage  # released: its place is free again
    await store.delete("a")
    assert (await store.usage()).sessions == 1


# -- pressure --------------------------------------------------------------------------


def pressure(events: list[HistoryEvent]) -> list[HistoryEvent]:
    return [e for e in events if e.kind == "history_store_pressure"]


async def test_pressure_is_reported_over_80_percent_once_a_minute_per_store(
    stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock(1000.0)
    monkeypatch.setattr(STORE_PRESSURE, "clock", clock)
    store = stores(max_sessions=5)
    events: list[HistoryEvent] = []
    traced: list[HistoryEvent] = []
    one, two = (
        DecisionHistory(HistoryConfig(store=store, namespace=NS, on_event=events.append))
        for _ in range(2)
    )
    for i in range(4):  # 4 of 5 places: 80 %, not over
        await one.step(identity(f"c{i}"), (), final)
    assert pressure(events) == []
    four = await store.usage()

    observed = event_observer.set(traced.append)  # as the runtime does for its trace
    try:
        await one.step(identity("c4"), (), final)  # the fifth place: 100 %
    finally:
        event_observer.reset(observed)
    [event] = pressure(events)
    assert traced.count(event) == 1
    assert event.to_dict() == {
        "kind": "history_store_pressure",
        "session_key": identity("c4").key,
        "message_count": 0,
        "bytes": 0,
        "used_sessions": 5,
        "max_sessions": 5,
        "used_bytes": four.bytes,  # as reserved: before c4's record was saved
        "max_store_bytes": four.max_store_bytes,
    }

    clock.now += 59
    await two.step(identity("c0"), (), final)  # another history on the same store
    await one.step(identity("c1"), (), final)
    assert len(pressure(events)) == 1
    clock.now += 2
    await two.step(identity("c2"), (), final)
    assert len(pressure(events)) == 2
    assert pressure(events)[1].session_key == identity("c2").key


async def test_a_custom_adapter_reports_no_usage_and_no_pressure() -> None:
    class Plain:  # transact only: the plain contract
        def __init__(self) -> None:
            self.inner = MemoryHistoryStore(max_sessions=1)

        async def transact(self, key: str, operation: Any) -> Any:
            return await self.inner.transact(key, operation)

    events: list[HistoryEvent] = []
    history = DecisionHistory(HistoryConfig(store=Plain(), namespace=NS, on_event=events.append))
    await history.step(identity("a"), (), final)  # 1 of 1 place, yet no usage to report
    assert pressure(events) == []


def test_pressure_is_over_80_percent_of_either_limit_exactly() -> None:
    assert not under_pressure(StoreUsage(4, 5, 0, 100))
    assert under_pressure(StoreUsage(5, 5, 0, 100))
    assert not under_pressure(StoreUsage(0, 5, 80, 100))
    assert under_pressure(StoreUsage(0, 5, 81, 100))
    assert not under_pressure(StoreUsage(80, 100, 0, 1))


def test_the_gate_admits_once_per_interval_per_store_and_forgets_dropped_stores() -> None:
    clock = Clock(1000.0)
    gate = PressureGate(clock=clock, interval=60)
    a, b = MemoryHistoryStore(), MemoryHistoryStore()
    assert gate.admit(a)
    clock.now += 30
    assert gate.admit(b)
    assert not gate.admit(a)
    clock.now += 30
    assert gate.admit(a)
    assert not gate.admit(b)
    del a
    gc.collect()
    assert len(gate._last) == 1  # a store that is gone is forgotten
    assert not gate.admit([])  # what cannot be remembered is never admitted
