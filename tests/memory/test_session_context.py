"""Each stored turn records what its invocation was given (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.memory._chat import INSTRUCTIONS, Scripted, build_runtime, memory, open_store
from touba import ChatSession
from touba.history import HistoryConfig, MemoryHistoryStore, SummaryRequest
from touba.memory import KeyEventService, MemoryStore, owner_for
from touba.memory._key_events import render_key_events_block
from touba.memory._turn_context import describe_context, describe_windows
from touba.providers import ContextConfig
from touba.providers.anthropic import create_anthropic_decision_provider
from touba.runtime import MemoryCheckpointStore
from touba.testing import ScriptedProvider
from touba.testing.fakes import FakeAnthropicServer, anthropic_text


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
    assert "rebuilt_at_resume" not in record
    assert record["turns"] == [{"number": 1, "full_trace": True, "calls": 0}]
    # Both parts of the turn (before and after the approval) have their windows.
    assert [w["decision"] for w in record["windows"]] == [1, 2]


async def test_windows_record_trims_summaries_and_the_guards_count_end_to_end(
    store: MemoryStore,
) -> None:
    """The field names read from the trace are the ones the history and the guard emit."""

    async def summarize(request: SummaryRequest) -> str:
        return f"{len(request.turns)} earlier exchanges"

    scripted = ScriptedProvider(
        history=HistoryConfig(
            store=MemoryHistoryStore(), namespace="t", max_messages=2, summarize=summarize
        )
    )
    for order in ("A1", "B2", "C3"):
        scripted.add(ScriptedProvider.call("lookup_order", order_id=order))
    scripted.add(ScriptedProvider.final("All shipped."))
    session = ChatSession(build_runtime(scripted), "support", "u-1", "s-w", store=store)
    turn = await session.send("Where are A1, B2 and C3?")
    assert turn.stored is not None
    record: Any = turn.stored.context
    windows = record["windows"]
    assert [w["decision"] for w in windows] == [1, 2, 3, 4]
    assert "trimmed" not in windows[1]
    assert windows[2]["trimmed"] == {"exchanges": 1, "messages": 2, "bytes": 296}
    assert windows[3]["trimmed"]["exchanges"] == 2
    assert windows[3]["summary"] == {"covered_exchanges": 2, "bytes": 19, "new": True}
    assert (windows[3]["messages"], windows[3]["bytes"]) == (2, 296)

    with FakeAnthropicServer() as server:
        sdk = anthropic.AsyncAnthropic(base_url=server.base_url, api_key="sk-ant", max_retries=0)
        guarded = create_anthropic_decision_provider(
            model="claude-test",
            client=sdk,
            history=HistoryConfig(store=MemoryHistoryStore(), namespace="t"),
            context=ContextConfig(context_window_tokens=200_000),
            max_output_tokens=1024,
        )
        server.script_count(1000)
        server.script_response(anthropic_text("Hello."))
        chat = ChatSession(build_runtime(guarded), "support", "u-1", "s-g", store=store)
        said = await chat.send("hi")
        await sdk.close()
    assert said.stored is not None
    [window] = said.stored.context["windows"]  # type: ignore[index]
    assert window["guard"] == {
        "counts": 1,
        "tokens": 1000,
        "reserve": 1000 * 12 // 10 + 512 + 1024,
        "window": 200_000,
        "fits": True,
        "messages": 0,
        "bytes": 0,
        "prior_turns": 0,
    }
    assert isinstance(window["input_tokens"], int)


async def test_earlier_turns_the_guard_dropped_are_recorded(store: MemoryStore) -> None:
    """The guard drops earlier turns first when a request does not fit: the record says
    how many of the turns it was given were sent, and that is what the model got."""
    with FakeAnthropicServer() as server:  # counts ceil(len(body JSON) / 4) tokens
        sdk = anthropic.AsyncAnthropic(base_url=server.base_url, api_key="sk-ant", max_retries=0)
        guarded = create_anthropic_decision_provider(
            model="claude-test",
            client=sdk,
            history=HistoryConfig(store=MemoryHistoryStore(), namespace="t"),
            context=ContextConfig(context_window_tokens=3000),
            max_output_tokens=1024,
        )
        chat = ChatSession(build_runtime(guarded), "support", "u-1", "s-d", store=store)
        for n in range(4):
            server.script_response(anthropic_text(f"Noted {n}."))
            said = await chat.send(f"turn {n}: " + "x" * 1600)
        await sdk.close()
        sent = server.requests_to(server.generation_endpoint)[-1].body["messages"]
    assert said.stored is not None
    record: Any = said.stored.context
    assert [t["number"] for t in record["turns"]] == [1, 2, 3]
    [window] = record["windows"]
    kept = window["guard"]["prior_turns"]
    assert window["guard"]["fits"] is True
    assert 0 <= kept < 3
    users = [m for m in sent if m["role"] == "user" and "x" * 1600 in json.dumps(m)]
    assert len(users) == kept + 1  # the turns the guard kept, then this turn's message
    dropped = f"the guard dropped the oldest {3 - kept} of the 3 earlier turns given"
    assert dropped in " ".join(describe_windows(record))


async def test_settings_saved_equal_to_the_programs_are_recorded_as_saved(
    model: Scripted, store: MemoryStore
) -> None:
    runtime = build_runtime(model, config=memory(short_term_turns=5))
    session = ChatSession(runtime, "support", None, "s-4", store=store)
    model.say("one")
    await session.send("first")
    await store.save_memory_config("support", memory(short_term_turns=5), actor="billing-api")  # type: ignore[attr-defined]
    model.say("two")
    turn = await session.send("second")
    assert turn.stored is not None
    record: Any = turn.stored.context
    assert (record["settings"]["source"], record["settings"]["saved_by"]) == (
        "saved",
        "billing-api",
    )
    assert "saved by billing-api " in describe_context(record)


async def test_a_turn_resumed_by_another_process_says_its_record_was_built_again(
    model: Scripted, store: MemoryStore
) -> None:
    checkpoints = MemoryCheckpointStore()  # shared, as a SqliteCheckpointStore file would be
    runtime = build_runtime(model, approval=True, checkpoints=checkpoints)
    first = ChatSession(runtime, "support", "u-42", "s-5", store=store)
    model.call("refund", order_id="A1")
    paused = await first.send("Refund A1")
    later = ChatSession(runtime, "support", "u-42", "s-5", store=store)
    model.say("Refund refused.")
    turn = await later.resume({}, checkpoint_id=paused.result.checkpoint_id)
    assert turn.stored is not None
    record: Any = turn.stored.context
    assert record["rebuilt_at_resume"] is True
    assert describe_context(record).endswith("; built again when resumed by another process")
