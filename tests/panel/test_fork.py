"""The session page's "Fork from this turn": a new session of turns 1..k, the original kept."""

from __future__ import annotations

import re
from typing import Any

from fastapi.testclient import TestClient
from markupsafe import escape

from tests.panel._data import HOSTILE, seed_memory
from tests.panel.conftest import ORIGIN, csrf_of, post
from touba.memory import SqliteMemoryStore

_FORKS = re.compile(r'<form method="post" action="/session/fork" class="fork">')


async def _state(memory: SqliteMemoryStore, session_id: str) -> tuple[Any, ...]:
    return await memory.get_session(session_id), await memory.list_turns(session_id, limit=100)


async def test_each_turn_offers_a_fork_that_opens_the_new_session(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    await seed_memory(memory)
    page = client.get("/session?id=s-1")
    assert page.status_code == 200
    assert len(_FORKS.findall(page.text)) == 2  # one per turn
    assert 'name="turn" value="1"' in page.text
    assert 'name="turn" value="2"' in page.text
    before = await _state(memory, "s-1")

    response = post(client, "/session/fork", {"id": "s-1", "turn": "1"})
    assert response.status_code == 303
    location = response.headers["location"]
    assert location.startswith("/session?id=")
    new_id = location.removeprefix("/session?id=")
    assert new_id != "s-1"
    meta = await memory.get_session(new_id)
    assert meta is not None
    assert (meta.owner, meta.agent_ref, meta.mode, meta.turns) == (
        "user:alice",
        "support",
        "live",
        1,
    )
    [turn] = await memory.list_turns(new_id)
    [first, _second] = before[1]
    assert (turn.user, turn.replies, turn.trace) == (first.user, first.replies, first.trace)
    assert await _state(memory, "s-1") == before

    shown = client.get(location)
    assert shown.status_code == 200
    assert "Forked from turn 1 of session s-1" in shown.text
    assert str(escape(f"hi {HOSTILE}")) in shown.text
    assert HOSTILE not in shown.text
    assert len(_FORKS.findall(shown.text)) == 1


async def test_an_anonymous_session_forks_into_one_owned_by_itself(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    await seed_memory(memory)
    response = post(client, "/session/fork", {"id": "anon-1", "turn": "1"})
    new_id = response.headers["location"].removeprefix("/session?id=")
    meta = await memory.get_session(new_id)
    assert meta is not None
    assert meta.owner == f"session:{new_id}"


async def test_a_wrong_fork_changes_nothing(client: TestClient, memory: SqliteMemoryStore) -> None:
    await seed_memory(memory)
    sessions = await memory.count_sessions()
    for form in ({"id": "s-1", "turn": "3"}, {"id": "s-1", "turn": "x"}, {"id": "nope"}):
        response = post(client, "/session/fork", form)
        assert response.status_code == 303
        page = client.get(response.headers["location"])
        assert "Nothing done" in page.text or page.status_code == 404
    assert await memory.count_sessions() == sessions


async def test_a_fork_needs_the_csrf_token_and_a_login(
    client: TestClient, anonymous: TestClient, memory: SqliteMemoryStore
) -> None:
    await seed_memory(memory)
    sessions = await memory.count_sessions()
    refused = client.post("/session/fork", data={"id": "s-1", "turn": "1"}, headers=ORIGIN)
    assert refused.status_code == 403
    token = csrf_of(client)
    form = {"csrf": token, "id": "s-1", "turn": "1"}
    assert anonymous.post("/session/fork", data=form, headers=ORIGIN).status_code == 401
    assert await memory.count_sessions() == sessions
