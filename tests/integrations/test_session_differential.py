"""ToubaSession on each durable store against the same session in RAM.

Random sequences of ``add_items``, ``get_items`` (with and without a limit) and
``pop_item``, each made through one of two store objects on the same data (two
processes, as far as their cached tails go), so that the optimistic paths are
taken, refused and taken again in every order: appends on a current tail and on
a stale one, reads peeked (each session starts with twelve exchanges, wider
than ``OPTIMISTIC_READ``) or saved, pops of a whole exchange or of part of one.
Every answer and the final state must be those of one ``MemoryHistoryStore``
given the same operations (which takes no optimistic path), and on SQLite and
PostgreSQL the recorded totals must be the rows' own.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integrations.conftest import Factory
from tests.integrations.test_optimistic_sessions import totals
from touba.history import MemoryHistoryStore
from touba.integrations.openai_agents import ToubaSession


def _user(n: int) -> dict[str, Any]:
    return {"role": "user", "content": f"u{n} " + "x" * (n % 7) * 30}


def _call(n: int) -> dict[str, Any]:
    return {"type": "function_call", "call_id": f"c{n}", "name": "f", "arguments": f'{{"n":{n}}}'}


def _output(n: int) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": f"c{n}", "output": "é" * (n % 5)}


def _assistant(n: int) -> dict[str, Any]:
    return {"role": "assistant", "content": f"a{n}"}


# Calls and outputs often in batches of their own, so that one store object adds
# to the exchange another one holds cached.
BATCHES = st.lists(
    st.sampled_from(["user", "call", "call", "output", "output", "pair", "assistant"]),
    min_size=1,
    max_size=3,
)
OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 1), BATCHES),
        st.tuples(st.just("get"), st.integers(0, 1), st.sampled_from([None, 1, 3, 20])),
        st.tuples(st.just("pop"), st.integers(0, 1), st.just(None)),
    ),
    min_size=1,
    max_size=20,
)


def _items(batch: list[str], counter: list[int], open_calls: list[int]) -> list[dict[str, Any]]:
    """The items a batch names; each call gets its own id, an output answers the
    newest call not yet answered, in this batch or an earlier one (or one no call
    made: an orphan)."""
    items: list[dict[str, Any]] = []
    for kind in batch:
        counter[0] += 1
        n = counter[0]
        if kind == "user":
            items.append(_user(n))
        elif kind == "assistant":
            items.append(_assistant(n))
        elif kind == "call":
            items.append(_call(n))
            open_calls.append(n)
        elif kind == "output":
            items.append(_output(open_calls.pop() if open_calls else n))
        else:
            items += [_call(n), _output(n)]
    return items


async def _answer(session: ToubaSession, operation: tuple[str, int, Any], items: Any) -> Any:
    kind, _, argument = operation
    try:
        if kind == "add":
            await session.add_items(items)
            return None
        if kind == "get":
            return await session.get_items(limit=argument)
        return await session.pop_item()
    except Exception as e:  # the same refusal, typed, on both sides
        return type(e).__name__


@pytest.mark.parametrize(
    "backend",
    [
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("redis", marks=pytest.mark.redis),
    ],
)
@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(operations=OPERATIONS)
def test_optimistic_sessions_answer_as_one_writer_in_ram(
    store_factory: Factory, backend: str, operations: list[tuple[str, int, Any]]
) -> None:
    async def run() -> None:
        async with store_factory() as first, store_factory() as second:
            name = f"s{id(operations)}"  # a session of its own per example
            sessions = [
                ToubaSession(name, store=first, namespace="ns"),
                ToubaSession(name, store=second, namespace="ns"),
            ]
            reference = ToubaSession(name, store=MemoryHistoryStore(), namespace="ns")
            seed: Any = [_user(1000 + n) for n in range(12)]  # reads wider than OPTIMISTIC_READ
            await reference.add_items(seed)
            await sessions[0].add_items(seed)
            counter: list[int] = [0]
            open_calls: list[int] = []
            for operation in operations:
                add = operation[0] == "add"
                items = _items(operation[2], counter, open_calls) if add else None
                expected = await _answer(reference, operation, items)
                assert await _answer(sessions[operation[1]], operation, items) == expected
            final = await reference.get_items()
            for session in sessions:
                assert await session.get_items() == final
            if backend != "redis" and final:
                for store in (first, second):
                    _messages, recorded, held = await totals(store, sessions[0].session_key)
                    assert recorded == held
            await sessions[0].clear_session()

    asyncio.run(run())
