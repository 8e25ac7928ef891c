"""ToubaSession under ``Runner.run_streamed``, on SQLite, PostgreSQL and Redis.

The model is the SDK's own test model (``agents.testing.ScriptedModel``), which
streams each scripted response as Responses API events. The peers' bugs these
tests keep out: the tool calls of a streamed run not saved, so the tools run
again (openai-agents #2426), and items lost or half saved when the consumer
stops reading (#1658).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from typing import Any

import pytest
from agents import Agent, RunConfig, Runner, function_tool
from agents.testing import ScriptedModel, assistant_message, function_call

from touba.integrations.openai_agents import ToubaSession

CONFIG = RunConfig(tracing_disabled=True)


async def stored(session: ToubaSession) -> list[dict[str, Any]]:
    """Every stored item, incomplete exchanges included (read through a copy of the record)."""
    items: list[dict[str, Any]] = []

    async def read(record: Any) -> tuple[Any, None]:
        items.extend(session._items(record))
        return record, None

    await session.store.transact(session.session_key, read)
    return items


def kinds(items: list[dict[str, Any]]) -> Counter[tuple[str, str | None]]:
    return Counter((str(i.get("type") or i.get("role")), i.get("call_id")) for i in items)


def lookup_tool(ran: list[str]) -> Any:
    @function_tool
    def lookup_order(order_id: str) -> str:
        """Look up an order."""
        ran.append(order_id)
        return json.dumps({"order_id": order_id, "status": "shipped"})

    return lookup_order


async def test_a_streamed_run_with_tool_calls_saves_every_item_once(store: Any) -> None:
    ran: list[str] = []
    model = ScriptedModel(
        [
            [
                function_call("lookup_order", {"order_id": "A1"}, call_id="c1"),
                function_call("lookup_order", {"order_id": "A2"}, call_id="c2"),
            ],
            [function_call("lookup_order", {"order_id": "A3"}, call_id="c3")],
            [assistant_message("All three shipped.")],
            [assistant_message("You're welcome.")],
        ]
    )
    agent = Agent(name="Support", model=model, tools=[lookup_tool(ran)])
    session = ToubaSession("user-42", store=store, namespace="support")

    result = Runner.run_streamed(agent, "Check A1 to A3", session=session, run_config=CONFIG)
    events = [event.type async for event in result.stream_events()]
    assert "run_item_stream_event" in events
    assert result.final_output == "All three shipped."
    items = await stored(session)
    assert kinds(items) == Counter(
        {
            ("user", None): 1,
            ("function_call", "c1"): 1,
            ("function_call_output", "c1"): 1,
            ("function_call", "c2"): 1,
            ("function_call_output", "c2"): 1,
            ("function_call", "c3"): 1,
            ("function_call_output", "c3"): 1,
            ("message", None): 1,
        }
    )
    assert await session.get_items() == items  # every exchange complete: all returned

    again = Runner.run_streamed(agent, "Thanks!", session=session, run_config=CONFIG)
    async for _ in again.stream_events():
        pass
    assert again.final_output == "You're welcome."
    assert ran == ["A1", "A2", "A3"]  # no tool ran twice
    sent = model.calls[-1].input
    assert isinstance(sent, list)
    assert [i.get("call_id") for i in sent if i.get("type") == "function_call"] == [
        "c1",
        "c2",
        "c3",
    ]
    assert len(await stored(session)) == len(items) + 2  # the new request and reply, once


async def _slow_tool_agent(
    started: asyncio.Event, release: asyncio.Event, ran: list[str]
) -> Agent[Any]:
    @function_tool
    async def slow_lookup(order_id: str) -> str:
        """Look up an order, slowly."""
        started.set()
        await release.wait()
        return "shipped"

    model = ScriptedModel(
        [
            [function_call("lookup_order", {"order_id": "A0"}, call_id="c0")],
            [function_call("slow_lookup", {"order_id": "A1"}, call_id="c1")],
            [assistant_message("Hello again.")],
        ]
    )
    return Agent(name="Support", model=model, tools=[lookup_tool(ran), slow_lookup])


def assert_whole(items: list[dict[str, Any]]) -> None:
    """No call without its output, no output without its call."""
    found = kinds(items)
    calls = {c for (t, c) in found if t == "function_call"}
    outputs = {c for (t, c) in found if t == "function_call_output"}
    assert calls == outputs, items
    assert all(n == 1 for (t, c), n in found.items() if c is not None), found  # none twice


@pytest.mark.parametrize("how", ["break", "cancel-task", "cancel-immediate"])
async def test_a_consumer_that_stops_early_loses_nothing_and_half_saves_nothing(
    store: Any, how: str
) -> None:
    started, release, ran = asyncio.Event(), asyncio.Event(), list[str]()
    agent = await _slow_tool_agent(started, release, ran)
    session = ToubaSession("user-7", store=store, namespace="support")
    result = Runner.run_streamed(agent, "Where is A1?", session=session, run_config=CONFIG)

    async def consume() -> None:
        async for event in result.stream_events():
            raw = getattr(getattr(event, "item", None), "raw_item", None)
            called = getattr(event, "name", None) == "tool_called"
            if called and getattr(raw, "call_id", None) == "c1" and how != "cancel-task":
                # the second call is out, its (slow) tool about to run
                if how == "cancel-immediate":
                    result.cancel()
                break

    consumer = asyncio.create_task(consume())
    if how != "cancel-immediate":  # (cancelled at the call, the tool never starts)
        await asyncio.wait_for(started.wait(), 5)
    if how == "cancel-task":
        consumer.cancel()
    await asyncio.sleep(0.05)
    release.set()  # (the SDK's stream cleanup waits for the running tool)
    with pytest.raises(asyncio.CancelledError) if how == "cancel-task" else _nothing():
        await asyncio.wait_for(consumer, 5)
    if not result.is_complete:
        result.cancel()
    await asyncio.wait_for(_settled(result), 5)

    # The request and the finished exchange are kept; of the interrupted call, nothing.
    items = await stored(session)
    assert [(i.get("type") or i.get("role"), i.get("call_id")) for i in items] == [
        ("user", None),
        ("function_call", "c0"),
        ("function_call_output", "c0"),
    ]
    assert await session.get_items() == items
    assert ran == ["A0"]

    follow = Runner.run_streamed(agent, "Hello?", session=session, run_config=CONFIG)
    async for _ in follow.stream_events():
        pass
    assert follow.final_output == "Hello again."
    assert_whole(await stored(session))
    assert ran == ["A0"]  # the finished call is not run again


async def test_a_streamed_run_cancelled_inside_exclusive_saves_nothing_and_frees_the_session(
    store: Any,
) -> None:
    """``exclusive()`` makes the run one atomic save: a consumer cancelled mid-tool ends the
    block with the cancellation, so nothing of the run is stored (the request and the
    finished call neither), and the reservation is released for the next run."""
    started, release, ran = asyncio.Event(), asyncio.Event(), list[str]()
    agent = await _slow_tool_agent(started, release, ran)
    session = ToubaSession("user-8", store=store, namespace="support")

    async def consume() -> None:
        async with session.exclusive():
            result = Runner.run_streamed(agent, "Where?", session=session, run_config=CONFIG)
            async for _ in result.stream_events():
                pass

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await stored(session) == []
    assert ran == ["A0"]
    async with session.exclusive():  # not left reserved
        follow = Runner.run_streamed(agent, "Hello?", session=session, run_config=CONFIG)
        async for _ in follow.stream_events():
            pass
    assert follow.final_output == "Hello again."
    assert [i.get("role") for i in await stored(session)] == ["user", "assistant"]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


async def _settled(result: Any) -> None:
    while not result.is_complete:  # noqa: ASYNC110 - the SDK's result offers no event to wait on
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("path", ["optimistic", "reserved"])
async def test_add_items_cancelled_at_any_point_saves_all_or_nothing(
    store: Any, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream that ends cancels the SDK's save where it stands (#1658): whatever the point,
    the items are saved whole or not at all, once, and the session is free for the next run.
    (As with the SDK's SQLiteSession, a cancel that lands after the commit still propagates.)"""
    if path == "reserved":  # every operation through a reservation (transact_log)
        monkeypatch.setattr(store, "transact_log_optimistic", None, raising=False)
    session = ToubaSession("user-9", store=store, namespace="support")
    await session.add_items([{"role": "user", "content": "hello"}])
    # Cancelled after k loop iterations (before it starts, then at every await of the
    # operation), then after growing real delays (the last one lets it finish).
    waits = [*range(60), 0.001, 0.003, 0.01, 0.03, 0.1, 1.0]
    saved = 0
    for k, wait in enumerate(waits):
        pair: list[Any] = [
            {"role": "user", "content": f"m{k}"},
            {"type": "message", "role": "assistant", "content": f"r{k}"},
        ]
        task = asyncio.create_task(session.add_items(pair))
        if isinstance(wait, float):
            await asyncio.sleep(wait)
        for _ in range(wait if isinstance(wait, int) else 0):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        items: list[Any] = await session.get_items()  # never DecisionHistoryBusy: not reserved
        assert items[0] == {"role": "user", "content": "hello"}
        texts = [str(i["content"]) for i in items[1:]]
        pairs = [(int(u[1:]), int(r[1:])) for u, r in zip(texts[::2], texts[1::2], strict=True)]
        assert all(u == r for u, r in pairs), texts  # whole pairs only
        numbers = [u for u, _ in pairs]
        assert numbers == sorted(set(numbers)), texts  # none twice, in order
        assert numbers[-1:] in ([], [k]) or numbers[-1] < k
        saved += numbers[-1:] == [k]
    assert 0 < saved < len(waits)  # some saves landed before their cancel, others not
