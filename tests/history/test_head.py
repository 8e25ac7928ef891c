"""The head held between decisions (``touba.history._head``).

Each store object keeps the head it last wrote, so that a decision neither
parses the stored head again nor encodes its whole plot ring: only the new
point. These tests hold that to what it must stay: the text is byte-identical
to ``canonical_json`` of the head whatever it holds, a bad head is refused as
before, the held head is shared read-only, and a head someone else stored is
read, never served from the held copy.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.history._stores import WHO, Stores
from tests.history._strategies import json_values
from touba.errors import DecisionHistoryRecordInvalid
from touba.history import (
    CapabilityCall,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
    Observation,
    _head,
    _memory,
    _snapshot,
)
from touba.history._common import encode_checked_json
from touba.history._frozen import FrozenDict, FrozenList
from touba.history._head import HeldHead, encode_head, parse_head
from touba.history._model import canonical_json
from touba.history._plot import PLOT_POINTS, DecisionPoint, add_point

values = json_values(
    text=st.text(max_size=8),
    keys=st.text(max_size=5),
    integers=st.integers(-(2**70), 2**70),
    items=3,
)
# Points of the documented shape mostly, and now and then anything at all.
points = st.lists(st.integers(0, 10**6) | st.booleans() | st.none(), min_size=14, max_size=14)
odd_points = points | values


def point(n: int) -> DecisionPoint:
    return DecisionPoint(n, 1_700_000_000 + n, 2 * n, 2000 * n, 9, 9000, 0, 0, n % 2 == 0, 0)


def decide(held: HeldHead | None, head: dict[str, Any], n: int) -> tuple[HeldHead, dict[str, Any]]:
    """One decision's head work: read the stored head, add a point, encode it."""
    current = held.copy() if held is not None else parse_head(canonical_json(head))
    assert current is not None
    add_point(current, point(n))
    current["stats"] = {"exchanges": n, "messages": 2 * n, "bytes": 2000 * n}
    return encode_head(current, held), current


# -- the text is canonical_json's -----------------------------------------------------------


@settings(max_examples=300, deadline=None)
@example(extra={}, ring=[None, [[]]], decisions=0, cold=[False] * 5 + [True])  # found once
@example(extra={}, ring=[[1], [2, [3]], "a", [[]]], decisions=3, cold=[True] * 6)
@given(
    extra=st.dictionaries(st.text(max_size=6), values, max_size=4),
    ring=st.lists(odd_points, max_size=PLOT_POINTS + 2),
    decisions=st.integers(0, 80),
    cold=st.lists(st.booleans(), min_size=6, max_size=6),
)
def test_the_text_is_canonical_json_of_the_head_whatever_it_holds(
    extra: dict[str, Any], ring: list[Any], decisions: int, cold: list[bool]
) -> None:
    head: dict[str, Any] = {"kind": "touba.decision_history", **extra}
    head["plot"] = {"decisions": decisions, "points": ring}
    held = encode_head(head, None)
    assert held.text == canonical_json(head)
    for n, start_cold in enumerate(cold):
        held, head = decide(None if start_cold else held, head, decisions + n + 1)
        assert held.text == canonical_json(head)
        assert held.size == len(held.text.encode("utf-8"))
        assert parse_head(held.text) == head
        assert held.head == head


def test_a_full_ring_reuses_the_text_of_every_point_it_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    head: dict[str, Any] = {"kind": "touba.decision_history", "stats": {}}
    held: HeldHead | None = None
    for n in range(PLOT_POINTS + 10):
        held, head = decide(held, head, n)
    assert held is not None
    assert held.points is not None
    encoded: list[Any] = []

    def counting(value: Any) -> str:
        encoded.append(value)
        return canonical_json(value)

    monkeypatch.setattr(_head, "canonical_json", counting)
    held, head = decide(held, head, PLOT_POINTS + 10)
    assert held.text == canonical_json(head)
    # The one new point, then the head without its ring: not the 63 others.
    assert len(encoded) == 2
    assert encoded[0] == list(head["plot"]["points"][-1])
    assert encoded[1]["plot"] == _head._MARK


def test_a_value_holding_the_plot_mark_is_encoded_whole_and_right() -> None:
    mark = _head._MARK
    head = {"kind": "k", "identity": {"plot": mark}, "plot": {"decisions": 1, "points": [[1]]}}
    held = encode_head(head, None)
    assert held.text == canonical_json(head)
    assert parse_head(held.text) == head


def test_what_json_dumps_accepts_it_encodes_the_same() -> None:
    head = {"kind": "k", "stats": {1: 2}, "plot": {"decisions": 1, "points": [(1, 2), [3]]}}
    assert encode_head(head, None).text == canonical_json(head)


@pytest.mark.parametrize(
    "bad",
    [
        {"plot": {"decisions": 1, "points": [[1, math.nan]]}},
        {"plot": {"decisions": 1, "points": [[1]]}, "note": "\ud800"},
        {"plot": {"decisions": 1, "points": [[1, {"k": "\udfff"}]]}},
        {"plot": {"decisions": 1, "points": [[object()]]}},
    ],
    ids=["nan-in-a-point", "surrogate", "surrogate-in-a-point", "object"],
)
def test_a_head_that_cannot_be_stored_is_refused_as_before(bad: dict[str, Any]) -> None:
    with pytest.raises(DecisionHistoryRecordInvalid) as before:
        encode_checked_json(bad, "head")
    with pytest.raises(DecisionHistoryRecordInvalid) as now:
        encode_head(bad, None)
    assert str(now.value) == str(before.value)  # the same path named


# -- shared, read-only ------------------------------------------------------------------


def test_the_held_head_is_shared_read_only_and_each_copy_is_the_callers() -> None:
    head: dict[str, Any] = {"kind": "k", "stats": {"bytes": 1}}
    held, head = decide(encode_head(head, None), head, 1)
    one, two = held.copy(), held.copy()
    assert type(one) is dict
    assert isinstance(one["stats"], FrozenDict)
    assert isinstance(one["plot"]["points"], FrozenList)
    with pytest.raises(TypeError, match="read-only"):
        one["stats"]["bytes"] = 2
    with pytest.raises(TypeError, match="read-only"):
        one["plot"]["points"].append([1])
    one["stats"] = {"bytes": 3}  # the top level is the caller's own
    assert two["stats"] == {"exchanges": 1, "messages": 2, "bytes": 2000}
    assert held.holds(held.text)
    assert held.holds("".join(held.text))
    assert not held.holds(held.text.replace('"k"', '"j"'))
    assert parse_head("[1]") is None
    assert parse_head("{") is None


# -- through the stores -----------------------------------------------------------------


class Agent:
    def __init__(self, store: Any) -> None:
        self.history = DecisionHistory(HistoryConfig(store=store, namespace="n", max_messages=8))
        self.observations: list[Observation] = []

    async def decide(self, n: int) -> None:
        async def generate(window: HistoryWindow) -> DecisionMessage:
            return DecisionMessage(text=f"d{n}", calls=(CapabilityCall(f"c{n}", "f", {}),))

        await self.history.step(WHO, self.observations, generate)
        self.observations = [Observation(f"c{n}", "f", {}, "ok", {"n": n})]


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The head texts parsed by the stores (the RAM store's and the durable ones')."""
    seen: list[str] = []

    def counting(text: str) -> dict[str, Any] | None:
        seen.append(text)
        return parse_head(text)

    monkeypatch.setattr(_snapshot, "parse_head", counting)
    monkeypatch.setattr(_memory, "parse_head", counting)
    return seen


async def test_a_store_reads_the_head_it_wrote_without_parsing_it(
    stores: Stores, parses: list[str]
) -> None:
    store = stores()
    agent = Agent(store)
    for n in range(PLOT_POINTS + 5):
        await agent.decide(n)
    assert parses == []  # the first decision created the record; each later one held it
    record = await store.read(WHO.key)
    assert record["plot"]["decisions"] == PLOT_POINTS + 5
    assert len(record["plot"]["points"]) == PLOT_POINTS


async def test_a_head_stored_by_another_worker_is_read_not_served_held(
    durable: Stores, parses: list[str]
) -> None:
    one, two = durable("shared"), durable("shared")
    agent = Agent(one)
    for n in range(3):
        await agent.decide(n)

    async def backdate(record: dict[str, Any] | None) -> tuple[dict[str, Any], None]:
        assert record is not None
        return {**record, "created_at": "1999-01-01T00:00:00Z"}, None

    await two.transact(WHO.key, backdate)
    await agent.decide(3)
    assert len(parses) == 1
    assert "1999-01-01" in parses[0]
    record = await one.read(WHO.key)
    assert record["created_at"] == "1999-01-01T00:00:00Z"  # not the held head written back
    assert record["plot"]["decisions"] == 4
