"""Values that are not JSON data are refused, typed and by path, before anything is written.

``DecisionHistory.step`` refuses observations holding a set, bytes, an object,
a tuple-keyed dict, NaN, ±Infinity, a lone surrogate or nesting deep enough to
hit Python's recursion limit, with a ``ConfigurationError`` naming the path of
the bad value, before it reserves the conversation; a decision holding NaN is
bad JSON from the provider. Every store refuses such a record
(``DecisionHistoryRecordInvalid``) and refuses to read back ``NaN`` written by
an older touba.
"""

from __future__ import annotations

import re
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from touba.errors import (
    AgentDecisionProviderSchemaViolation,
    ConfigurationError,
    DecisionHistoryRecordInvalid,
)
from touba.history import (
    CapabilityCall,
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
    MemoryHistoryStore,
    Observation,
)
from touba.history._model import (
    MAX_JSON_DEPTH,
    _walk_problem,
    canonical_json,
    json_problem,
    parse_json,
)
from touba.history.sqlite import SqliteHistoryStore


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


class Opaque:
    pass


# (result value, the path and words the error must carry)
BAD_RESULTS: list[tuple[Any, str]] = [
    ({"a": [0, 1, 2, {1, 2}]}, "observations[0].result[key 0][3] is a set"),
    ({"a": [0, 1, 2, b"raw"]}, "observations[0].result[key 0][3] is a bytes"),
    ({"a": [0, 1, 2, Opaque()]}, "observations[0].result[key 0][3] is a Opaque"),
    ({"a": {("x", "y"): 1}}, "observations[0].result[key 0][key 0] has a key of type tuple"),
    ({"a": {1: "one"}}, "observations[0].result[key 0][key 0] has a key of type int"),
    ({"a": [0, 1, 2, float("nan")]}, "observations[0].result[key 0][3] is nan"),
    ({"a": [0, 1, 2, float("inf")]}, "[3] is inf (a number beyond a 64-bit float's range)"),
    ({"a": [0, 1, 2, float("-inf")]}, "observations[0].result[key 0][3] is -inf"),
    ({"a": [0, 1, 2, 1e999]}, "[3] is inf (a number beyond a 64-bit float's range)"),
    ({"a": [0, 1, 2, "\ud800"]}, "observations[0].result[key 0][3] is a str with a lone surrogate"),
    ({"a": nested(990)}, "observations[0].result[key 0][0][0]"),
    ({"a": nested(5000)}, f"more than {MAX_JSON_DEPTH} levels deep"),
]


def identity() -> ConversationIdentity:
    return ConversationIdentity("ns", "openai", "m", "native", "run-1", "inv-1", "agent")


class Provider:
    def __init__(self, *decisions: DecisionMessage) -> None:
        self.decisions = list(decisions)
        self.calls = 0

    async def __call__(self, window: HistoryWindow) -> DecisionMessage:
        self.calls += 1
        return self.decisions.pop(0)


@pytest.fixture(params=["memory", "sqlite"])
async def history(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "memory":
        store: Any = MemoryHistoryStore()
    else:
        store = SqliteHistoryStore(tmp_path / "h.sqlite")
    yield DecisionHistory(HistoryConfig(store=store, namespace="ns"))
    await store.close()


CALL = CapabilityCall("c1", "lookup", {"id": "A1"})


async def _started(history: DecisionHistory) -> Any:
    """A conversation awaiting the result of CALL; returns what the store holds."""
    await history.step(identity(), [], Provider(DecisionMessage(calls=(CALL,))))
    return await history.store.read(identity().key)  # type: ignore[attr-defined]


BAD_IDS = [
    "set",
    "bytes",
    "object",
    "tuple-key",
    "int-key",
    "nan",
    "inf",
    "-inf",
    "1e999",
    "surrogate",
]


@pytest.mark.parametrize(("result", "expected"), BAD_RESULTS, ids=[*BAD_IDS, "990", "5000"])
async def test_step_refuses_non_json_results_by_path_before_writing(
    history: DecisionHistory, result: Any, expected: str
) -> None:
    before = await _started(history)
    provider = Provider(DecisionMessage(text="never", final=True))
    observation = Observation("c1", "lookup", {"id": "A1"}, "ok", result)
    with pytest.raises(ConfigurationError) as caught:
        await history.step(identity(), [observation], provider)
    assert expected in str(caught.value)
    assert isinstance(caught.value, ValueError)  # the caller's mistake, as ValueError
    assert provider.calls == 0
    assert await history.store.read(identity().key) == before  # type: ignore[attr-defined]
    # The key is free: the right observation goes through.
    fixed = Observation("c1", "lookup", {"id": "A1"}, "ok", {"a": [0, 1, 2, 3]})
    await history.step(identity(), [fixed], provider)
    assert provider.calls == 1


@pytest.mark.parametrize(
    ("observation", "expected"),
    [
        (Observation("c1", "lookup", {"id": {1, 2}}, "ok"), "observations[0].arguments[key 0]"),
        (Observation("c1", "lookup", {}, "error", error=b"x"), "observations[0].error"),  # type: ignore[arg-type]
        (Observation("c1", "lookup", {}, "fine"), "observations[0].status"),  # type: ignore[arg-type]
        (Observation(1, "lookup", {}, "ok"), "observations[0].call_id"),  # type: ignore[arg-type]
        ({"call_id": "c1"}, "observations[0] is a dict, not a touba Observation"),
    ],
    ids=["arguments", "error", "status", "call_id", "not-an-observation"],
)
async def test_step_refuses_malformed_observations(
    history: DecisionHistory, observation: Any, expected: str
) -> None:
    before = await _started(history)
    provider = Provider()
    with pytest.raises(ConfigurationError) as caught:
        await history.step(identity(), [observation], provider)
    assert expected in str(caught.value)
    assert provider.calls == 0
    assert await history.store.read(identity().key) == before  # type: ignore[attr-defined]


async def test_step_refuses_non_json_data_observations(history: DecisionHistory) -> None:
    provider = Provider()
    data = [Observation("d1", "step", {}, "ok", {"when": float("nan")})]
    with pytest.raises(ConfigurationError, match=r"data\[0\]\.result\[key 0\] is nan"):
        await history.step(identity(), [], provider, data=data)
    assert provider.calls == 0
    assert await history.store.read(identity().key) is None  # type: ignore[attr-defined]


async def test_a_decision_holding_nan_is_bad_json_and_is_not_stored(
    history: DecisionHistory,
) -> None:
    bad = DecisionMessage(calls=(CapabilityCall("c1", "lookup", {"amount": float("nan")}),))
    with pytest.raises(AgentDecisionProviderSchemaViolation) as caught:
        await history.step(identity(), [], Provider(bad))
    assert caught.value.provider_error_code == "invalid_json"
    assert 'decision["calls"][0]["arguments"][key 0] is nan' in str(caught.value)
    assert await history.store.read(identity().key) is None  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "record",
    [{"x": float("nan")}, {"x": float("-inf")}, {"x": {1, 2}}, {"x": nested(1000)}],
    ids=["nan", "-inf", "set", "deep"],
)
async def test_stores_refuse_records_that_are_not_json(
    history: DecisionHistory, record: Any
) -> None:
    store: Any = history.store

    async def put(snapshot: Any) -> tuple[Any, None]:
        return record, None

    with pytest.raises(DecisionHistoryRecordInvalid, match=r"record\[key 0\]"):
        await store.transact("k", put)
    assert await store.read("k") is None
    assert await store.list() == []


async def test_nan_written_by_an_older_touba_is_refused_on_read(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite"
    async with SqliteHistoryStore(path) as store:

        async def put(snapshot: Any) -> tuple[Any, None]:
            return {"x": 1.5}, None

        await store.transact("k", put)
    with sqlite3.connect(path) as conn:  # as Python's json.dumps used to write it
        conn.execute("UPDATE touba_history_sessions SET head = ? WHERE key = 'k'", ('{"x":NaN}',))
    async with SqliteHistoryStore(path) as store:
        with pytest.raises(DecisionHistoryRecordInvalid, match="not a JSON object"):
            await store.read("k")


def test_canonical_json_is_strict_and_parse_json_too() -> None:
    for value in (float("nan"), float("inf"), [float("-inf")]):
        with pytest.raises(ValueError, match="JSON compliant"):
            canonical_json(value)
    for text in ("NaN", "[Infinity]", '{"a": -Infinity}', "[" * 100_000):
        with pytest.raises(ValueError):
            parse_json(text)
    assert parse_json('{"a":[1,2.5,"x",null,true]}') == {"a": [1, 2.5, "x", None, True]}


def test_json_problem_accepts_json_data_and_tuples() -> None:
    assert json_problem({"a": [1, 2.5, "é", None, True, (1, 2)], "b": {}}, "v") is None
    assert json_problem(nested(MAX_JSON_DEPTH - 1), "v") is None
    assert json_problem(nested(MAX_JSON_DEPTH + 1), "v") is not None
    assert json_problem(10**5000, "v") == "v is an int too large to write as JSON"


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"a": [1, float("nan")]}, "message[key 0][1]"),
        ({"a": {1, 2}}, "message[key 0]"),
        ({"a": "\ud800"}, "message[key 0]"),
    ],
)
def test_the_log_path_encoder_refuses_by_path_what_it_cannot_store(
    value: object, named: str
) -> None:
    """The fast encoder of checked log writes still refuses, typed and by path."""
    from touba.errors import DecisionHistoryRecordInvalid
    from touba.history._common import encode_checked_json, encode_json

    with pytest.raises(DecisionHistoryRecordInvalid, match=re.escape(named)):
        encode_checked_json(value, "message")
    assert encode_checked_json({"a": [1, 2.5, "é"]}, "m") == encode_json({"a": [1, 2.5, "é"]}, "m")


class Text(str):
    pass


class Number(int):
    pass


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.builds(pow, st.just(10), st.just(5000)),  # too large to write
    st.floats(),  # NaN and ±Infinity included
    st.text(),
    st.sampled_from(["\ud800", "é\udfff", Text("sub"), Number(3), b"raw", {1}, Opaque()]),
)
_keys = st.one_of(st.text(max_size=3), st.sampled_from(["\ud800", 1, Text("k")]))
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(_keys, inner, max_size=4),
    ),
    max_leaves=20,
)


@given(value=_values, depth=st.integers(0, 5))
def test_the_quick_check_answers_what_the_walk_answers(value: Any, depth: int) -> None:
    """json_problem's quick check of plain values never accepts what the walk refuses,
    and a refusal is always the walk's, named by path."""
    assert json_problem(value, "v", max_depth=depth) == _walk_problem(value, "v", depth)


def test_a_deep_value_checked_near_the_recursion_limit_is_still_walked() -> None:
    def deep_call(levels: int) -> str | None:
        if levels:
            return deep_call(levels - 1)
        return json_problem(nested(MAX_JSON_DEPTH - 1), "v")

    assert deep_call(sys.getrecursionlimit() - 200) is None
