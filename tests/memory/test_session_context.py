"""Each stored turn records what its invocation was given (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.memory._chat import INSTRUCTIONS, Scripted, build_runtime, memory, open_store
from touba import ChatSession
from touba.memory import KeyEventService, MemoryStore, owner_for
from touba.memory._key_events import render_key_events_block
from touba.memory._turn_context import describe_context


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store(request: pytest.FixtureRequest, private_dir: Path) -> AsyncIterator[MemoryStore]:
    pg = request.getfixturevalue("pg_prefix") if request.param == "postgres" else None
    async with open_store(request.param, private_dir, pg) as opened:
        yield opened


@pytest.fixture
def model() -> Scripted:
    return Scripted()


async def test_each_stored_turn_carries_what_its_invocation_was_given(
    model: Scripted, store: MemoryStore
) -> None:
    runtime = build_runtime(model, config=memory(short_term_turns=2, full_context_turns=1))
    session = ChatSession(runtime, "support", "u-42", "s-1", store=store)
    owner = owner_for("u-42", "s-1")
    events = KeyEventService(store, memory().key_events)
    event = await events.create(owner, "refund", "Refund for A1", "secret details", "s-0")
    model.say("Hello.")
    first = await session.send("hi")
    model.call("lookup_order", order_id="A1")
    model.say("A1 has shipped.")
    second = await session.send("Where is A1?")
    model.say("You're welcome.")
    third = await session.send("thanks")

    assert first.stored is not None
    assert second.stored is not None
    assert third.stored is not None
    assert first.stored.context is not None
    assert first.stored.context["turns"] == []
    record = third.stored.context
    assert record is not None
    assert record["version"] == 1
    assert record["mode"] == "live"
    assert record["settings"] == {
        "short_term_turns": 2,
        "full_context_turns": 1,
        "key_events": {"enabled": True, "types": ["refund", "account issue"]},
        "source": "program",
        "saved_at": None,
        "saved_by": None,
    }
    assert record["turns"] == [
        {"number": 1, "full_trace": False, "calls": 0},
        {"number": 2, "full_trace": True, "calls": 1},
    ]
    assert record["key_events"] == [
        {"id": event.id, "type": "refund", "title": "Refund for A1", "status": "open"}
    ]
    block = render_key_events_block(await events.open_for_prompt(owner))
    assert record["system_prompt"] == {
        "bytes": len(f"{INSTRUCTIONS}\n\n{block}".encode()),
        "agent_bytes": len(INSTRUCTIONS.encode()),
        "key_events_bytes": len(block.encode()),
    }
    # The second turn ran two decisions: one window each, read from its trace.
    second_record = second.stored.context
    assert second_record is not None
    windows = second_record["windows"]
    assert isinstance(windows, list)
    assert [w["decision"] for w in windows] == [1, 2]
    # The history window holds the invocation's own exchanges (the first one none yet).
    assert [(w["messages"], w["bytes"] > 0) for w in windows] == [(0, False), (2, True)]
    key = second_record["conversation_key"]
    assert isinstance(key, str)
    assert key.startswith("th1:")
    assert second_record["decision_history"] == "deleted"
    # What the model was sent agrees with the record.
    assert len(model.requests[-1].prior_turns) == 2
    assert [bool(t.trace) for t in model.requests[-1].prior_turns] == [False, True]
    # Stored: read back whole, never with content.
    [*_, stored] = await store.recent_turns("s-1", 1)
    assert stored.context == record
    assert "secret details" not in json.dumps(record)
    assert "Where is A1" not in json.dumps(record)
    assert describe_context(stored.context) == (
        "given turns 1 (text only), 2 (full trace); short-term memory 2 turns (1 with full "
        f"trace), from the program; key events: {event.id} (open)"
    )


async def test_settings_saved_by_an_operator_are_recorded_with_their_time(
    model: Scripted, store: MemoryStore
) -> None:
    runtime = build_runtime(model, config=memory(short_term_turns=5))
    session = ChatSession(runtime, "support", None, "s-2", store=store)
    model.say("one")
    await session.send("first")
    await store.save_memory_config(  # type: ignore[attr-defined]
        "support", memory(short_term_turns=1, full_context_turns=0), actor="operator"
    )
    saved = await store.load_saved_memory_config("support")  # type: ignore[attr-defined]
    model.say("two")
    await session.send("second")
    model.say("three")
    turn = await session.send("third")
    assert turn.stored is not None
    record = turn.stored.context
    assert record is not None
    settings = record["settings"]
    assert isinstance(settings, dict)
    assert (settings["short_term_turns"], settings["source"], settings["saved_by"]) == (
        1,
        "saved",
        "operator",
    )
    assert settings["saved_at"] == saved.saved_at.isoformat()
    assert record["turns"] == [{"number": 2, "full_trace": False, "calls": 0}]
    assert "saved in the panel " in describe_context(record)
    # Reset: the program's settings apply again, and the next record says so.
    await store.reset_memory_config("support", actor="operator")  # type: ignore[attr-defined]
    model.say("four")
    after = await session.send("fourth")
    assert after.stored is not None
    assert after.stored.context is not None
    assert after.stored.context["settings"]["source"] == "program"
    assert [t["number"] for t in after.stored.context["turns"]] == [1, 2, 3]


async def test_a_preview_turn_records_blank_memory(model: Scripted, store: MemoryStore) -> None:
    runtime = build_runtime(model)
    session = ChatSession(runtime, "support", "u-42", "p-1", store=store, mode="preview")
    model.say("one")
    await session.send("first")
    model.say("two")
    turn = await session.send("second")
    assert turn.stored is not None
    record = turn.stored.context
    assert record is not None
    assert (record["mode"], record["turns"], record["key_events"]) == ("preview", [], [])
    assert describe_context(record).startswith("preview: blank memory")


async def test_a_resumed_turn_keeps_the_record_it_started_with(
    model: Scripted, store: MemoryStore
) -> None:
    runtime = build_runtime(model, approval=True, config=memory(short_term_turns=3))
    session = ChatSession(runtime, "support", "u-42", "s-3", store=store)
    model.say("hello")
    await session.send("hi")
    model.call("refund", order_id="A1")
    paused = await session.send("Refund A1")
    [pending] = paused.result.pending
    # Settings change while the turn awaits approval: its record does not.
    await store.save_memory_config("support", memory(short_term_turns=0), actor="operator")  # type: ignore[attr-defined]
    model.say("Refunded.")
    turn = await session.resume({pending.call_id: True})
    assert turn.stored is not None
    record: Any = turn.stored.context
    assert record["settings"]["short_term_turns"] == 3
    assert record["settings"]["source"] == "program"
    assert record["turns"] == [{"number": 1, "full_trace": True, "calls": 0}]
    # Both parts of the turn (before and after the approval) have their windows.
    assert [w["decision"] for w in record["windows"]] == [1, 2]
