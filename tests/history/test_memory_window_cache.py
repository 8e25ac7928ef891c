"""The RAM store's parsed window: shared between decisions, read-only, never stale."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from touba.errors import DecisionHistoryRecordInvalid
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
from touba.history._frozen import FrozenDict, FrozenList, freeze, thaw
from touba.history._model import message_to_dict

IDENTITY = ConversationIdentity("ns", "p", "m", "native", "run", "inv", "agent")


def test_frozen_values_refuse_changes_and_copy_to_plain_ones() -> None:
    value = freeze({"a": [1, {"b": 2}], "c": "x"})
    assert isinstance(value, FrozenDict)
    assert isinstance(value["a"], FrozenList)
    assert value == {"a": [1, {"b": 2}], "c": "x"}
    assert json.dumps(value) == '{"a": [1, {"b": 2}], "c": "x"}'
    for change in (
        lambda: value.__setitem__("c", "y"),
        lambda: value.update(c="y"),
        lambda: value["a"].append(3),
        lambda: value["a"][1].pop("b"),
        lambda: value["a"].sort(),
    ):
        with pytest.raises(TypeError, match="read-only"):
            change()
    plain = copy.deepcopy(value)
    assert type(plain) is dict
    assert type(plain["a"]) is list
    assert type(plain["a"][1]) is dict
    assert thaw(value) == plain
    assert type(copy.copy(value)) is dict


async def test_a_window_reader_cannot_change_what_the_next_decision_reads() -> None:
    async with MemoryHistoryStore() as store:
        history = DecisionHistory(HistoryConfig(store=store, namespace="ns", max_messages=8))
        seen: list[Any] = []
        pending = CapabilityCall("c0", "lookup", {"order": {"id": "A0"}})

        async def first(window: HistoryWindow) -> DecisionMessage:
            return DecisionMessage(calls=(pending,))

        await history.step(IDENTITY, [], first)
        for n in range(1, 6):
            call = CapabilityCall(f"c{n}", "lookup", {"order": {"id": f"A{n}"}})

            async def generate(window: HistoryWindow, call: CapabilityCall = call) -> Any:
                decisions = [m for ex in window.exchanges for m in ex if m.kind == "decision"]
                seen.append([dict(d.calls[0].arguments["order"]) for d in decisions])
                with pytest.raises(TypeError):
                    decisions[0].calls[0].arguments["order"]["id"] = "changed by a reader"
                return DecisionMessage(calls=(call,))

            observation = Observation(pending.call_id, "lookup", pending.arguments, "ok", {"n": n})
            await history.step(IDENTITY, [observation], generate)
            pending = call
        assert seen[-1] == [{"id": f"A{n}"} for n in range(1, 5)]  # 4 exchanges fit 8 messages
        record = await store.read(IDENTITY.key)
        assert record is not None
        assert record["exchanges"][0][0]["calls"][0]["arguments"] == {"order": {"id": "A0"}}
        assert record["exchanges"][-2][-1]["result"] == {"n": 5}  # the result appended last


async def test_a_rewritten_record_is_read_fresh() -> None:
    async with MemoryHistoryStore() as store:
        history = DecisionHistory(HistoryConfig(store=store, namespace="ns"))
        texts: list[list[str | None]] = []

        async def decide(window: HistoryWindow) -> DecisionMessage:
            texts.append([m.text for ex in window.exchanges for m in ex if m.kind == "decision"])
            return DecisionMessage(text="final", final=True)

        await history.step(IDENTITY, [], decide)
        await history.step(IDENTITY, [], decide)

        async def rewrite(record: Any) -> tuple[Any, None]:
            record["exchanges"][0][0]["text"] = "rewritten"
            return record, None

        await store.transact(IDENTITY.key, rewrite)
        await history.step(IDENTITY, [], decide)
        assert texts == [[], ["final"], ["rewritten", "final"]]


async def _tool_loop(history: DecisionHistory, decisions: int) -> None:
    pending: CapabilityCall | None = None
    for n in range(decisions):
        call = CapabilityCall(f"c{n}", "lookup", {"n": n})

        async def generate(window: HistoryWindow, call: CapabilityCall = call) -> Any:
            return DecisionMessage(calls=(call,))

        observations = (
            [] if pending is None else [Observation(pending.call_id, "lookup", {}, "ok", n)]
        )
        await history.step(IDENTITY, observations, generate)
        pending = call


async def test_exchanges_checked_once_are_not_checked_again_until_they_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from touba.history import _integrity

    checked: list[int] = []
    real = _integrity._exchange_problem

    def counting(exchange: Any) -> str | None:
        checked.append(len(exchange))
        return real(exchange)

    monkeypatch.setattr(_integrity, "_exchange_problem", counting)
    async with MemoryHistoryStore() as store:
        history = DecisionHistory(HistoryConfig(store=store, namespace="ns", max_messages=64))
        await _tool_loop(history, 10)
        checked.clear()
        await _tool_loop_more(history, 10)
        # A decision checks the exchange its result completes and the one the previous
        # decision completed (changed then, so not remembered), not the 8 before them.
        assert len(checked) == 2
        for n in range(11, 30):
            await _tool_loop_more(history, n)
        checked.clear()
        await _tool_loop_more(history, 30)
        assert len(checked) == 2  # the same with 30 exchanges in the window


async def _tool_loop_more(history: DecisionHistory, n: int) -> None:
    call = CapabilityCall(f"c{n}", "lookup", {"n": n})

    async def generate(window: HistoryWindow) -> DecisionMessage:
        return DecisionMessage(calls=(call,))

    await history.step(IDENTITY, [Observation(f"c{n - 1}", "lookup", {}, "ok", n)], generate)


async def test_a_record_rewritten_with_a_broken_pairing_is_refused_at_the_next_decision() -> None:
    async with MemoryHistoryStore() as store:
        history = DecisionHistory(HistoryConfig(store=store, namespace="ns", max_messages=64))
        await _tool_loop(history, 5)  # every exchange checked and remembered

        async def break_pairing(record: Any) -> tuple[Any, None]:
            record["exchanges"][1][1]["call_id"] = "forged"
            return record, None

        await store.transact(IDENTITY.key, break_pairing)
        with pytest.raises(DecisionHistoryRecordInvalid, match="damaged"):
            await _tool_loop_more(history, 5)


async def test_windows_that_narrow_and_widen_read_what_is_stored_and_cache_no_more() -> None:
    """The parsed cache forgets the exchanges a window left and builds them again when
    a wider window (another history on the same store) comes back to them."""
    async with MemoryHistoryStore() as store:
        narrow = DecisionHistory(HistoryConfig(store=store, namespace="ns", max_messages=4))
        wide = DecisionHistory(HistoryConfig(store=store, namespace="ns", max_messages=16))
        windows: list[tuple[int, list[Any]]] = []
        pending: CapabilityCall | None = None
        for n in range(24):
            call = CapabilityCall(f"c{n}", "lookup", {"n": n})

            async def generate(window: HistoryWindow, call: CapabilityCall = call) -> Any:
                windows.append((window.start, [list(ex) for ex in window.exchanges]))
                return DecisionMessage(calls=(call,))

            observations = (
                [] if pending is None else [Observation(pending.call_id, "lookup", {}, "ok", n)]
            )
            history = wide if n % 5 == 4 else narrow
            await history.step(IDENTITY, observations, generate)
            entry = store._entries[IDENTITY.key]
            start = windows[-1][0]
            assert all(index >= start for index in entry.parsed)  # what left the window went
            assert all(isinstance(ex, tuple) for ex in entry.parsed.values())
            pending = call
        record = await store.read(IDENTITY.key)
        assert record is not None
        stored = record["exchanges"]
        starts = [start for start, _ in windows]
        assert starts[19] < starts[18] < starts[20]  # a wide window went back, then narrow again
        for start, exchanges in windows:
            for offset, exchange in enumerate(exchanges[:-1]):  # the last one grew since
                assert [message_to_dict(m) for m in exchange] == stored[start + offset]
