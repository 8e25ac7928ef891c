"""The seed's FAQ and edge cases (seed 004), end to end, on each backend.

Every case runs through a ChatSession and the runtime, with the scripted
provider and with the official OpenAI and Anthropic SDKs against the fake
servers. What a model would have seen is read from the generation requests
as sent; the fakes' validators must accept every one of them (no partial
turn, no orphan call or result).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.memory._chat import (
    BACKENDS,
    Model,
    Scripted,
    build_runtime,
    memory,
    open_model,
    open_store,
)
from touba import ChatSession
from touba.memory import KeyEventService, MemoryStore, owner_for
from touba.providers import Turn


@pytest.fixture(params=BACKENDS)
async def model(request: pytest.FixtureRequest) -> AsyncIterator[Model]:
    async with open_model(request.param) as opened:
        yield opened


@pytest.fixture
async def store(private_dir: Path) -> AsyncIterator[MemoryStore]:
    async with open_store("sqlite", private_dir) as opened:
        yield opened


@pytest.mark.parametrize("short_term_turns", [0, 30])
async def test_faq_the_agent_does_not_remember_the_previous_turn_when_short_term_is_off(
    model: Model, store: MemoryStore, short_term_turns: int
) -> None:
    """« ne se souvient pas du tour précédent »: check short_term_turns first."""
    runtime = build_runtime(model, config=memory(short_term_turns=short_term_turns))
    session = ChatSession(runtime, "support", "u-42", store=store)
    model.say("Hello Ada, noted.")
    await session.send("My name is Ada Lovelace.")
    model.say("Your name is Ada.")
    await session.send("What is my name?")
    latest = model.bodies()[-1]
    remembered = short_term_turns > 0
    assert ("My name is Ada Lovelace." in latest) is remembered
    assert ("Hello Ada, noted." in latest) is remembered
    assert "What is my name?" in latest
    if isinstance(model, Scripted):
        expected = (Turn("My name is Ada Lovelace.", ("Hello Ada, noted.",)),)
        assert model.requests[-1].prior_turns == (expected if remembered else ())
    assert model.accepted()


@pytest.mark.parametrize("full_context_turns", [0, 1])
async def test_faq_full_context_carries_the_whole_tool_trace_of_the_last_turn_or_none(
    model: Model, store: MemoryStore, full_context_turns: int
) -> None:
    """« ne se souvient pas de quel outil il a appelé ni des paramètres »: full context."""
    config = memory(full_context_turns=full_context_turns)
    session = ChatSession(build_runtime(model, config=config), "support", "u-42", store=store)
    model.call("lookup_order", order_id="ZX-9071")
    model.calls(("lookup_order", {"order_id": "ZX-9072"}), ("refund", {"order_id": "ZX-9072"}))
    model.say("Both parcels are on their way.")
    turn = await session.send("Where are my two parcels?")
    assert turn.stored is not None
    assert [len(group) for group in turn.stored.trace] == [1, 2]
    model.say("You asked about two parcels.")
    await session.send("Which tool did you use, with which numbers?")
    latest = model.bodies()[-1]
    assert "Where are my two parcels?" in latest  # the text always stays
    assert "Both parcels are on their way." in latest
    for argument in ("ZX-9071", "ZX-9072"):
        assert (argument in latest) is bool(full_context_turns)  # the whole turn or none
    assert model.accepted()


async def test_full_context_lies_within_the_short_term_window(
    model: Model, store: MemoryStore
) -> None:
    config = memory(short_term_turns=2, full_context_turns=1)
    session = ChatSession(build_runtime(model, config=config), "support", "u-42", store=store)
    for number in ("ZX-1", "ZX-2", "ZX-3"):
        model.call("lookup_order", order_id=number)
        model.say("On its way.")
        await session.send(f"Parcel number {number[-1]}?")
    model.say("Three parcels.")
    await session.send("Summary please")
    latest = model.bodies()[-1]
    assert "Parcel number 1?" not in latest  # out of the short-term window
    assert "Parcel number 2?" in latest
    assert "ZX-2" not in latest  # text only
    assert "ZX-3" in latest  # the last turn with its trace
    assert model.accepted()


async def test_faq_a_wrong_event_type_returns_a_parameter_error_naming_the_allowed_types(
    model: Model, store: MemoryStore
) -> None:
    """« La création d'un événement renvoie une erreur de paramètre »: exact type names."""
    session = ChatSession(build_runtime(model), "support", "u-42", store=store)
    model.call("create_key_event", type="Refund ", title="Refund ZX-1", details="broken")
    model.call("create_key_event", type="refund", title="Refund ZX-1", details="broken")
    model.say("Your refund case is open.")
    turn = await session.send("I want a refund for ZX-1")
    assert turn.stored is not None
    [[wrong], [right]] = turn.stored.trace
    assert wrong.status == "error"
    error = wrong.error or ""
    # The model's value is described, never echoed (it is content); the near type is named.
    assert "the type given (a str of 7 characters) is not a configured key-event type" in error
    assert "(did you mean 'refund'?)" in error
    assert "'refund', 'account issue'" in error
    assert "case and spaces" in error
    assert right.status == "ok"
    assert "is not a configured key-event type" in model.bodies()[1]  # the model received it
    events = await store.query_events("user:u-42")
    assert [(e.type, e.title) for e in events] == [("refund", "Refund ZX-1")]
    assert model.accepted()


async def test_faq_created_but_not_found_on_a_new_visit_without_a_user_id(
    model: Model, store: MemoryStore
) -> None:
    """« Créé mais introuvable lors d'une nouvelle visite »: the identity was not resolved."""
    runtime = build_runtime(model)

    async def visit(user_id: str | None, session_id: str, *, create: str | None) -> str:
        if create is not None:
            model.call("create_key_event", type="refund", title=create, details="")
        model.say("Done.")
        session = ChatSession(runtime, "support", user_id, session_id, store=store)
        await session.send("Hello")
        await session.end()
        return model.bodies()[-1 if create is None else -2]

    await visit(None, "anon-1", create="Anonymous refund")
    assert [e.owner for e in await store.query_events("session:anon-1")] == ["session:anon-1"]
    later_anonymous = await visit(None, "anon-2", create=None)
    assert "Anonymous refund" not in later_anonymous  # another session does not find it
    await visit("u-42", "s-1", create="Known refund")
    later_known = await visit("u-42", "s-2", create=None)
    assert "Known refund" in later_known  # the user's later session sees it
    assert "Anonymous refund" not in later_known
    assert model.accepted()


async def test_switch_on_without_types_offers_no_tool_injects_nothing_and_is_no_error(
    model: Model, store: MemoryStore
) -> None:
    """« Interrupteur activé mais aucun type d'événement »: not a malfunction."""
    await store.create_event(
        owner="user:u-42", type="refund", title="Old refund", details="", session_id="s-0"
    )
    config = memory(enabled=True, types=())
    session = ChatSession(build_runtime(model, config=config), "support", "u-42", store=store)
    model.say("Hello.")
    turn = await session.send("Hi")
    assert turn.status == "completed"
    sent = model.bodies()[-1]
    assert "create_key_event" not in sent
    assert "query_key_events" not in sent
    assert "Old refund" not in sent
    assert "key events on record" not in sent
    if isinstance(model, Scripted):
        assert [c.name for c in model.requests[-1].capabilities] == ["lookup_order", "refund"]
    assert model.accepted()


async def test_preview_mode_has_a_blank_memory_every_turn_and_writes_no_key_event(
    model: Model, store: MemoryStore
) -> None:
    """« En mode débogage / prévisualisation, la mémoire est toujours vide »: normal."""
    runtime = build_runtime(model)
    live = ChatSession(runtime, "support", "u-42", "live-1", store=store)
    model.call("create_key_event", type="refund", title="Live refund", details="")
    model.say("Opened.")
    await live.send("Refund ZX-1 please")
    before = await KeyEventService(store, memory().key_events).query("user:u-42")
    preview = ChatSession(runtime, "support", "u-42", store=store, mode="preview")
    model.say("Hello Ada.")
    first = await preview.send("I am Ada.")
    model.say("I do not know your name.")
    second = await preview.send("What is my name?")
    for sent in model.bodies()[-2:]:
        assert "Live refund" not in sent  # no key-event injection
        assert "create_key_event" not in sent  # no key-event tool
        assert "Refund ZX-1 please" not in sent  # nothing of the live session
    assert "I am Ada." not in model.bodies()[-1]  # blank context each turn
    if isinstance(model, Scripted):
        assert model.requests[-1].prior_turns == ()
    assert await store.query_events("user:u-42") == before  # nothing written
    assert first.stored is not None
    assert second.stored is not None
    assert first.stored.session_id == preview.session_id != "live-1"  # its own session
    meta = await store.get_session(preview.session_id)
    assert meta is not None
    assert meta.mode == "preview"
    assert [t.user for t in await store.recent_turns("live-1", 10)] == ["Refund ZX-1 please"]
    assert await preview.end() is None
    assert model.accepted()


async def test_key_events_are_the_users_across_sessions_and_editable_from_each(
    model: Model, store: MemoryStore
) -> None:
    runtime = build_runtime(model)
    first = ChatSession(runtime, "support", "u-42", "s-1", store=store)
    model.call("create_key_event", type="account issue", title="Locked out", details="")
    model.say("Opened.")
    created = await first.send("I am locked out")
    assert created.stored is not None
    event_id = created.stored.trace[0][0].result["created"]["id"]
    await first.end()
    second = ChatSession(runtime, "support", "u-42", "s-2", store=store)
    model.call("update_key_event", event_id=event_id, status="closed")
    model.say("Closed.")
    await second.send("It works again, thanks")
    assert event_id in model.bodies()[-2]  # injected in the second session's prompt
    event = await KeyEventService(store, memory().key_events).get(
        owner_for("u-42", "s-2"), event_id
    )
    assert event.status == "closed"
    assert event.history is not None
    assert [(u.session_id, u.changes[0].new) for u in event.history] == [("s-2", "closed")]
    assert model.accepted()
