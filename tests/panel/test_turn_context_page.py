"""The session page says, beside each turn, what its invocation was given."""

from __future__ import annotations

import html
import re
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from fastapi.testclient import TestClient

from tests.memory._chat import build_runtime
from tests.memory._chat import memory as memory_settings
from tests.panel._data import HOSTILE, seed_conversation
from touba import ChatSession
from touba.history import HistoryConfig
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import KeyEventService, MemoryConfig, SqliteMemoryStore, StoredTurn
from touba.memory._turn_context import NOT_RECORDED, UNKNOWN_FORMAT, given_context
from touba.panel._context_view import context_views
from touba.testing import ScriptedProvider


def _given(page: str) -> dict[int, str]:
    """Each turn's "given" block (by turn number), as the page's HTML."""
    found = re.findall(r'<div class="given" data-turn="(\d+)">(.*?)</div>', page, re.S)
    return {int(number): block for number, block in found}


def _text(block: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", block))


async def test_each_turn_says_what_it_was_given_and_links_its_history(
    client: TestClient, memory: SqliteMemoryStore, history: SqliteHistoryStore
) -> None:
    # A turn stored before this touba version: no record.
    await memory.open_session("s-1", owner="user:alice", agent_ref="support", mode="live")
    await memory.append_turn("s-1", user="old", replies=["old reply"])
    model = ScriptedProvider(history=HistoryConfig(store=history, namespace="panel-context"))
    runtime = build_runtime(model, config=memory_config())
    events = KeyEventService(memory, memory_config().key_events)
    event = await events.create("user:alice", "refund", HOSTILE, "details", "s-0")
    await memory.save_memory_config("support", memory_config(short_term_turns=1), actor="operator")
    saved = await memory.load_saved_memory_config("support")
    assert saved is not None
    async with ChatSession(
        runtime, "support", "alice", "s-1", store=memory, retain_decision_history=True
    ) as session:
        model.add(
            ScriptedProvider.call("lookup_order", order_id="A1"), ScriptedProvider.final("ok")
        )
        turn = await session.send("where is A1?")
    assert turn.stored is not None
    assert turn.stored.context is not None
    key = turn.stored.context["conversation_key"]
    assert isinstance(key, str)

    page = client.get("/session?id=s-1").text
    blocks = _given(page)
    old, new = blocks[1], blocks[2]
    assert NOT_RECORDED in old
    line = _text(new)
    when = saved.saved_at.strftime("%Y-%m-%d %H:%M UTC")
    assert (
        "given turn 1 (full trace, no tool call); short-term memory 1 turn (1 with full "
        f"trace), saved in the panel {when}; key events: {event.id} (open)"
    ) in line
    assert "decision 1: " in line
    assert "decision 2: " in line
    assert "system prompt " in line
    assert f"[refund] {HOSTILE} (open)" in line  # the title, as text...
    assert HOSTILE not in new  # ...escaped in the page
    assert f'href="/conversation?key={quote(key, safe="")}"' in new
    assert client.get(f"/conversation?key={quote(key, safe='')}").status_code == 200

    # Once the conversation is gone from the history store, the page says so.
    await history.delete(key)
    gone = _given(client.get("/session?id=s-1").text)[2]
    assert "no longer in the history store" in gone
    assert "/conversation?key=" not in gone


async def test_deleted_history_and_preview_turns_say_so(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    model = ScriptedProvider()
    runtime = build_runtime(model)
    async with ChatSession(runtime, "support", "bob", "s-2", store=memory) as session:
        model.add(ScriptedProvider.final("hello"))
        await session.send("hi")
    live = _given(client.get("/session?id=s-2").text)[1]
    assert "from the program" in live
    assert "decision history not kept (deleted when the turn was stored)" in live
    async with ChatSession(runtime, "support", "bob", "p-2", store=memory, mode="preview") as pv:
        model.add(ScriptedProvider.final("hello"))
        await pv.send("hi")
    preview = _given(client.get("/session?id=p-2").text)[1]
    assert "preview: blank memory" in preview


def memory_config(short_term_turns: int = 30) -> MemoryConfig:
    return memory_settings(short_term_turns=short_term_turns, full_context_turns=1)


async def test_where_the_history_is_said_for_every_case(history: SqliteHistoryStore) -> None:
    at = datetime(2026, 12, 7, 8, 20, tzinfo=UTC)
    base = given_context(mode="live", config=memory_config(), source="program")

    def turn(index: int, context: dict[str, Any] | None) -> StoredTurn:
        return StoredTurn("s", index, "u", ("r",), (), None, at, context)

    kept = await seed_conversation(history)
    turns = [
        turn(0, None),
        turn(1, {"given_turns": [2]}),  # not a record this touba reads
        turn(2, {**base, "conversation_key": None, "decision_history": "deleted"}),
        turn(3, {**base, "conversation_key": "th1:x", "decision_history": "deleted"}),
        turn(4, {**base, "conversation_key": "th1:gone", "decision_history": "retained"}),
        turn(5, {**base, "conversation_key": kept, "decision_history": "retained"}),
    ]
    views = await context_views(turns, history)
    assert views[0].line == NOT_RECORDED
    assert views[1].line == UNKNOWN_FORMAT
    assert (views[1].note, views[1].conversation) == (None, None)
    assert views[2].note == "no decision history (its provider keeps none)"
    assert views[3].note == "decision history not kept (deleted when the turn was stored)"
    assert views[4].note == "decision history no longer in the history store (expired or deleted)"
    assert (views[5].note, views[5].conversation) == (None, kept)
    without = await context_views(turns, None)  # a panel started without --history-db
    assert without[5].note == (
        "decision history kept, but the panel has no history store (--history-db)"
    )
    assert without[5].conversation is None
