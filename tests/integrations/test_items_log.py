"""ToubaSession's append-only layout: the same answers as the whole list, from the tail only."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from touba.errors import DecisionHistoryLimitExceeded
from touba.history import MemoryHistoryStore
from touba.history._store import LogSnapshot, LogStore
from touba.history.sqlite import SqliteHistoryStore
from touba.integrations._cut import UNBOUNDED
from touba.integrations._responses_items import select_items
from touba.integrations.openai_agents import ToubaSession


def user(text: str) -> Any:
    return {"role": "user", "content": text}


def call(call_id: str) -> Any:
    return {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"}


def output(call_id: str) -> Any:
    return {"type": "function_call_output", "call_id": call_id, "output": "ok"}


def reasoning() -> Any:
    return {"type": "reasoning", "id": "r", "summary": []}


def said(text: str) -> Any:
    return {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
    }


ITEMS = st.one_of(
    st.sampled_from(["a", "b", "c"]).map(user),
    st.sampled_from(["c1", "c2", "c3"]).map(call),
    st.sampled_from(["c1", "c2", "c3"]).map(output),
    st.just(reasoning()),
    st.sampled_from(["x", "yy"]).map(said),
)
STEPS = st.lists(
    st.one_of(st.lists(ITEMS, min_size=1, max_size=4), st.just("pop")), min_size=1, max_size=12
)
READS = st.tuples(
    st.one_of(st.none(), st.integers(0, 6)),
    st.one_of(st.none(), st.integers(1, 6)),
    st.one_of(st.none(), st.integers(40, 400)),
)


def expected(items: list[Any], limit: int | None, messages: int | None, size: int | None) -> Any:
    try:
        return select_items(
            items,
            limit=limit,
            max_messages=messages or UNBOUNDED,
            max_bytes=size or UNBOUNDED,
        )
    except DecisionHistoryLimitExceeded as e:
        return e.limit


async def answer(session: ToubaSession, limit: int | None) -> Any:
    try:
        return await session.get_items(limit)
    except DecisionHistoryLimitExceeded as e:
        return e.limit


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=STEPS, read=READS)
def test_log_answers_like_the_whole_list(steps: list[Any], read: Any, tmp_path: Path) -> None:
    limit, messages, size = read

    async def run() -> None:
        directory = tmp_path / f"s{id(steps)}"
        directory.mkdir(mode=0o700, exist_ok=True)
        async with (
            MemoryHistoryStore() as memory,
            SqliteHistoryStore(directory / "h.sqlite") as sqlite,
        ):
            for store in (memory, sqlite):
                session = ToubaSession(
                    "s", store=store, namespace="ns", max_messages=messages, max_bytes=size
                )
                await session.clear_session()
                reference: list[Any] = []
                for step in steps:
                    if step == "pop":
                        popped = await session.pop_item()
                        assert popped == (reference.pop() if reference else None)
                    else:
                        await session.add_items(step)
                        reference.extend(step)
                    assert await answer(session, limit) == expected(
                        reference, limit, messages, size
                    )
                whole = ToubaSession("s", store=store, namespace="ns")
                assert await whole.get_items() == expected(reference, None, None, None)

    asyncio.run(run())


class Counting(MemoryHistoryStore):
    """Records which exchanges each log transaction loads."""

    loaded: list[tuple[int, int]]
    sized: list[int]

    async def transact_log(self, key: str, operation: Any) -> Any:
        loaded, sized = self.loaded, self.sized

        class Spy:
            def __init__(self, inner: LogSnapshot) -> None:
                self.inner = inner

            @property
            def head(self) -> Any:
                return self.inner.head

            @property
            def exchange_count(self) -> int:
                return self.inner.exchange_count

            async def sizes(self, start: int) -> Any:
                sized.append(start)
                return await self.inner.sizes(start)

            async def exchanges(self, start: int, stop: int) -> Any:
                loaded.append((start, stop))
                return await self.inner.exchanges(start, stop)

        async def spied(snapshot: Any, usage: Any) -> Any:
            return await operation(None if snapshot is None else Spy(snapshot), usage)

        return await super().transact_log(key, spied)


@pytest.fixture
async def counting() -> AsyncIterator[Counting]:
    async with Counting() as store:
        store.loaded = []
        store.sized = []
        yield store


async def test_operations_load_the_tail_only(counting: Counting) -> None:
    assert isinstance(counting, LogStore)
    session = ToubaSession("s", store=counting, namespace="ns")
    for n in range(50):
        await session.add_items([user(f"q{n}"), call(f"c{n}"), output(f"c{n}"), said("done")])
    # each turn is three exchanges: the question, the call with its output, the answer
    assert counting.loaded[-1] == (146, 147)  # add_items read only the last exchange
    counting.loaded.clear()
    assert await session.get_items(limit=3) == [call("c49"), output("c49"), said("done")]
    assert counting.loaded == [(148, 150)]
    counting.loaded.clear()
    assert await session.pop_item() == said("done")
    assert counting.loaded == [(149, 150)]
    assert await session.get_items(limit=3) == [user("q49"), call("c49"), output("c49")]
    assert await session.pop_item() == output("c49")
    assert await session.get_items(limit=3) == [said("done"), user("q49")]  # the open call: out


async def test_a_read_bounded_by_bytes_alone_weighs_back_only_as_far_as_it_reaches(
    counting: Counting,
) -> None:
    items = [item for n in range(200) for item in (call(f"c{n:03d}"), output(f"c{n:03d}"))]
    await ToubaSession("s", store=counting, namespace="ns").add_items(items)
    pair = sum(len(json.dumps(i, separators=(",", ":"))) for i in items[:2])
    for pairs, sized in ((10, [200 - 32]), (60, [168, 72]), (150, [168, 72, 0])):
        counting.sized.clear()
        session = ToubaSession("s", store=counting, namespace="ns", max_bytes=pairs * pair + 5)
        got = await session.get_items()
        assert got == expected(items, None, None, pairs * pair + 5)
        assert len(got) == 2 * pairs
        assert counting.sized == sized  # 32 exchanges back, then 4 times as many, while all fit


async def test_the_stored_layout_is_exchanges_and_a_version_1_record_is_rewritten() -> None:
    async with MemoryHistoryStore() as store:
        await _version_1_rewritten(store)


async def test_a_version_1_record_is_rewritten_on_each_durable_store(store: Any) -> None:
    await _version_1_rewritten(store)


async def _version_1_rewritten(store: Any) -> None:
    session = ToubaSession("s", store=store, namespace="ns")
    v1 = {
        "kind": "touba.openai_agents.session",
        "version": 1,
        "namespace": "ns",
        "conversation_id": "s",
        "items": [user("old"), call("c1")],
        "bytes": 0,
        "created_at": "2024-01-01T00:00:00+00:00",
        "updated_at": "2024-01-01T00:00:00+00:00",
    }

    async def put(_: Any) -> tuple[Any, None]:
        return v1, None

    await store.transact(session.session_key, put)
    assert await session.get_items() == [user("old")]
    await session.add_items([output("c1")])
    record = await store.read(session.session_key)
    assert record is not None
    assert record["version"] == 2
    assert record["exchanges"] == [[user("old")], [call("c1"), output("c1")]]
    assert record["incomplete"] == []
    assert record["created_at"] == v1["created_at"]
    assert await session.get_items() == [user("old"), call("c1"), output("c1")]
    assert await session.pop_item() == output("c1")
    assert (await store.read(session.session_key))["incomplete"] == [1]
