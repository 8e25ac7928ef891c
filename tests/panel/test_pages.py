"""Every page renders what the stores hold, escaped, paginated, marked for what it is."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from tests.panel._data import HOSTILE, HOSTILE_IMG, seed_conversation, seed_memory
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import KeyEventsConfig, KeyEventService, SqliteMemoryStore

SHOWN = {HOSTILE: "&lt;script&gt;alert(1)&lt;/script&gt;", HOSTILE_IMG: "&lt;img src=x onerror="}


def _escaped(html: str, text: str) -> None:
    """``text`` is on the page as text: escaped in the HTML, never as markup."""
    assert text not in html
    assert SHOWN[text] in html


async def test_hostile_content_is_escaped_on_every_page(
    client: TestClient, memory: SqliteMemoryStore, history: SqliteHistoryStore
) -> None:
    seeded = await seed_memory(memory)
    key = await seed_conversation(history)
    event = seeded["event"]
    pages = {
        "/session?id=s-1": (HOSTILE, HOSTILE_IMG),
        "/events?owner=user:alice": (HOSTILE,),
        f"/event?owner=user:alice&id={event.id}": (HOSTILE, HOSTILE_IMG),
        "/conversations": (),
        f"/conversation?key={key}": (HOSTILE,),
    }
    for path, texts in pages.items():
        response = client.get(path)
        assert response.status_code == 200, (path, response.text[:500])
        assert "<script>alert" not in response.text
        assert "<img" not in response.text
        for text in texts:
            _escaped(response.text, text)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in client.get("/events?owner=user:alice").text


async def test_the_overview_lists_agents_with_their_settings_and_counts(
    client: TestClient, memory: SqliteMemoryStore, history: SqliteHistoryStore
) -> None:
    await seed_memory(memory)
    await seed_conversation(history)
    html = client.get("/").text
    assert "/agents/support" in html
    assert "/agents/assistant" in html
    assert "LoopAgent" in html
    assert "last 30 turns" in html
    assert "last 1 turn<" in html  # singular
    assert "from the program" in html
    assert "3 chat sessions</strong> of <strong>3 owners" in html
    assert "1/128 conversations</strong>" in html
    assert "of 32 MiB" in html  # the history store's limit, human-readable


async def test_sessions_show_turns_traces_preview_and_anonymous_marks(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    await seed_memory(memory)
    users = client.get("/users").text
    assert "user:alice" in users
    assert "session:anon-1" in users
    assert "anonymous" in users
    assert "session:p-1" not in users  # preview sessions are kept apart (a filter)
    previews = client.get("/users?mode=preview").text
    assert "session:p-1" in previews
    assert "1 preview" in previews
    session = client.get("/session?id=s-1").text
    assert "tool trace: 1 call in 1 decision" in session
    assert "lookup_order" in session
    anonymous = client.get("/session?id=anon-1").text
    assert "will not find them" in anonymous  # the seed's explanation
    preview = client.get("/session?id=p-1").text
    assert 'badge">preview' in preview
    assert "blank memory" in preview
    assert client.get("/session?id=nope").status_code == 404


async def test_lists_are_paginated(client: TestClient, memory: SqliteMemoryStore) -> None:
    for index in range(120):
        await memory.open_session(
            f"s-{index:03}", owner="user:bob", agent_ref="support", mode="live"
        )
    first = client.get("/user?owner=user:bob").text
    assert first.count('href="/session?id=s-') == 50
    assert "page 1 of 3" in first
    assert 'rel="next"' in first
    assert 'rel="prev"' not in first
    last = client.get("/user?owner=user:bob&page=3").text
    assert last.count('href="/session?id=s-') == 20
    assert 'rel="next"' not in last
    assert 'rel="prev"' in last
    beyond = client.get("/user?owner=user:bob&page=9").text
    assert beyond.count('href="/session?id=s-') == 0
    assert client.get("/user?owner=user:bob&page=-1").status_code == 200  # page 1


async def test_key_events_filter_by_type_status_and_text_newest_first(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    service = KeyEventService(memory, KeyEventsConfig(enabled=True, types=("refund", "bug")))
    made = [
        await service.create("user:eve", "refund" if i % 2 else "bug", f"case {i}", "d", "s-9")
        for i in range(60)
    ]
    await service.update("user:eve", made[0].id, status="closed", session_id="s-9")
    page = client.get("/events?owner=user:eve").text
    titles = re.findall(r">case (\d+)</a>", page)
    assert titles[:3] == ["59", "58", "57"]  # most recently updated first
    assert len(titles) == 50
    assert "59 found" in page
    assert 'rel="next"' in page
    refunds = client.get("/events?owner=user:eve&type=refund").text
    assert "30 found" in refunds
    assert client.get("/events?owner=user:eve&text=CASE 1").text.count(">case 1") == 11
    closed = client.get("/events?owner=user:eve&status=closed").text
    assert re.findall(r">case (\d+)</a>", closed) == ["0"]
    everything = client.get("/events?owner=user:eve&closed=1").text
    assert "60 found" in everything


async def test_a_conversation_page_plots_each_decision(
    client: TestClient, history: SqliteHistoryStore
) -> None:
    key = await seed_conversation(history)
    html = client.get(f"/conversation?key={key}").text
    assert "<svg" in html
    assert "</svg>" in html
    assert html.count('class="plot-hit"') == 2 * 6  # two charts, six decisions
    assert 'class="plot-trim"' in html
    assert 'class="plot-summary"' in html
    assert "context guard" not in html  # no guard ran
    assert "exchange 0" in html
    assert "page 1 of 1" not in html
    record = await history.read(key)
    assert record is not None
    assert len(record["plot"]["points"]) == 6
