"""Every action of the panel, through HTTP: settings, key-event edits, jobs, conversations,
recovery after a SIGKILLed worker, preview."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from markupsafe import escape

from tests.panel._data import crashed_reservation, seed_conversation, seed_memory
from tests.panel.conftest import post
from touba.errors import ConfigurationError, DecisionHistoryBusy
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import KeyEventsConfig, MemoryConfig, SqliteMemoryStore

GOOD = {
    "short_term_on": "on",
    "short_term_turns": "12",
    "full_context_turns": "2",
    "key_events_on": "on",
    "types": "refund\naccount issue\n",
}


async def test_settings_are_saved_in_the_memory_store(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    response = post(client, "/agents/support/memory", GOOD)
    assert response.status_code == 303
    assert response.headers["location"] == "/agents/support"
    expected = MemoryConfig(
        short_term_turns=12,
        full_context_turns=2,
        key_events=KeyEventsConfig(enabled=True, types=("refund", "account issue")),
    )
    assert await memory.load_memory_config("support") == expected
    assert await memory.load_memory_config("assistant") is None
    page = client.get("/agents/support").text
    assert "Saved. Sessions of support use these settings from their next turn." in page
    assert 'value="12"' in page
    assert "saved in the panel" in page
    assert "saved in the panel" in client.get("/").text


async def test_switches_off_save_zero_turns_and_no_key_events(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    form = {"short_term_turns": "12", "full_context_turns": "0", "types": " refund  "}
    assert post(client, "/agents/support/memory", form).status_code == 303
    saved = await memory.load_memory_config("support")
    assert saved == MemoryConfig(
        short_term_turns=0,
        full_context_turns=0,
        key_events=KeyEventsConfig(enabled=False, types=(" refund  ",)),  # kept exactly
    )
    page = client.get("/").text
    assert '<span class="off">off</span>' in page


def _message(**fields: object) -> str:
    """The message MemoryConfig (or KeyEventsConfig) itself gives, as the page escapes it."""
    build: Any = (
        (lambda: KeyEventsConfig(enabled=True, types=fields["types"]))  # type: ignore[arg-type]
        if "types" in fields
        else (lambda: MemoryConfig(**fields))  # type: ignore[arg-type]
    )
    with pytest.raises(ConfigurationError) as caught:
        build()
    return str(escape(str(caught.value)))


@pytest.mark.parametrize(
    ("field", "typed", "expected"),
    [
        ("short_term_turns", "-1", {"short_term_turns": -1}),
        ("short_term_turns", "abc", {"short_term_turns": "abc"}),
        ("full_context_turns", "6", {"full_context_turns": 6}),
        ("full_context_turns", "-1", {"full_context_turns": -1}),
        ("full_context_turns", "1.5", {"full_context_turns": "1.5"}),
        ("types", "refund\nrefund", {"types": ("refund", "refund")}),
        ("types", "refund\n   \n", {"types": ("refund", "   ")}),
    ],
)
async def test_invalid_settings_show_memoryconfigs_own_message_next_to_the_field(
    client: TestClient,
    memory: SqliteMemoryStore,
    field: str,
    typed: str,
    expected: dict[str, object],
) -> None:
    response = post(client, "/agents/support/memory", {**GOOD, field: typed})
    assert response.status_code == 400
    message = _message(**expected)
    assert f'<p class="field-error" id="{field}-error">{message}</p>' in response.text
    assert f'id="{field}"' in response.text
    assert 'aria-invalid="true"' in response.text
    assert response.text.count('class="field-error"') == 1
    assert await memory.load_memory_config("support") is None  # nothing saved


async def test_an_unknown_agent_is_not_found(client: TestClient) -> None:
    assert client.get("/agents/nobody").status_code == 404
    assert post(client, "/agents/nobody/memory", GOOD).status_code == 404


async def test_the_operator_edits_a_key_event_and_the_history_says_so(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    event = (await seed_memory(memory))["event"]
    form = {
        "owner": "user:alice",
        "id": event.id,
        "status": "in_progress",
        "title": "Refund approved",
        "details": "line 1\r\nline 2",
    }
    response = post(client, "/event/edit", form)
    assert response.status_code == 303
    found = await memory.get_event("user:alice", event.id)
    assert found is not None
    assert found.history is not None
    assert (found.status, found.title, found.details) == (
        "in_progress",
        "Refund approved",
        "line 1\nline 2",
    )
    [update] = found.history
    assert (update.actor, update.session_id) == ("operator", "panel")
    assert [c.field for c in update.changes] == ["status", "title", "details"]
    page = client.get(f"/event?owner=user:alice&id={event.id}").text
    assert 'class="badge op">operator' in page
    assert "recorded as made by the operator" in page


async def test_a_bad_key_event_edit_is_refused_with_the_reason_next_to_the_field(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    event = (await seed_memory(memory))["event"]
    base = {"owner": "user:alice", "id": event.id, "status": "open", "details": "d"}
    response = post(client, "/event/edit", {**base, "title": "two\nlines"})
    assert response.status_code == 400
    assert "title must not contain line breaks or control characters" in response.text
    response = post(client, "/event/edit", {**base, "title": "x", "status": "lost"})
    assert response.status_code == 400
    assert "the status given (a str of 4 characters) is not valid" in response.text
    other = {**base, "owner": "user:mallory", "title": "x"}
    assert post(client, "/event/edit", other).status_code == 404  # another owner's id
    found = await memory.get_event("user:alice", event.id)
    assert found is not None
    assert found.history == ()


async def test_a_failed_extraction_job_is_requeued(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    job, _ = await memory.enqueue_job(
        session_id="s-1",
        owner="user:alice",
        agent_ref="assistant",
        transcript_ref="s-1@1",
        max_attempts=1,
    )
    claimed = await memory.claim_job("w", 30)
    assert claimed is not None
    assert claimed.lease_token is not None
    await memory.fail_job(job.id, claimed.lease_token, "model <down>", None)
    page = client.get("/jobs?status=failed").text
    assert "model &lt;down&gt;" in page
    assert "Requeue" in page
    response = post(client, "/jobs/requeue", {"id": job.id, "status": "failed"})
    assert response.status_code == 303
    again = await memory.get_job(job.id)
    assert again is not None
    assert again.status == "pending"
    assert again.attempts == 0
    assert "is pending again" in client.get("/jobs").text
    post(client, "/jobs/requeue", {"id": job.id})
    assert "only a failed job can be requeued" in client.get("/jobs").text


async def test_an_inactive_conversation_is_deleted(
    client: TestClient, history: SqliteHistoryStore
) -> None:
    key = await seed_conversation(history)
    response = post(client, "/conversation/delete", {"key": key})
    assert response.status_code == 303
    assert response.headers["location"] == "/conversations"
    assert await history.read(key) is None
    assert "Deleted." in client.get("/conversations").text


async def test_a_reservation_left_by_a_sigkilled_worker_is_recovered_after_confirmation(
    client: TestClient, history: SqliteHistoryStore, private_dir: Path
) -> None:
    key = await crashed_reservation(private_dir / "history.sqlite")
    [row] = [r for r in await history.list() if r.key == key]
    assert row.active
    assert row.reservation is not None
    with pytest.raises(DecisionHistoryBusy):
        await history.read(key)
    page = client.get(f"/conversation?key={key}").text
    assert f"<dd>{row.reservation['pid']}</dd>" in page
    assert "Recover the reservation" in page
    confirm = client.get(f"/conversation/recover?key={key}").text
    assert "Stop the worker that holds it and check that it is gone" in confirm
    assert "frees the storage only" in confirm
    assert "uncertain" in confirm
    refused = post(client, "/conversation/recover", {"key": key})  # not confirmed
    assert refused.status_code == 303
    assert (await history.list())[0].active
    assert post(client, "/conversation/delete", {"key": key}).status_code == 303
    assert "is active (reserved); it was not deleted" in client.get(f"/conversation?key={key}").text
    done = post(client, "/conversation/recover", {"key": key, "worker_stopped": "yes"})
    assert done.status_code == 303
    assert "Reservation freed" in client.get(f"/conversation?key={key}").text
    record = await history.read(key)
    assert record is not None
    assert record["stats"]["exchanges"] == 1


async def test_the_preview_chat_runs_with_blank_memory_and_writes_no_key_event(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    for text in ("Where is A1?", "I want a refund for D4"):
        response = post(client, "/agents/support/preview", {"message": text})
        assert response.status_code == 303
    page = client.get("/agents/support").text
    assert "order A1 is shipped" in page
    assert "I was given 0 earlier turn(s)" not in page  # the second turn made calls
    assert await memory.query_events("user:alice", include_closed=True) == []
    [meta] = [s for s in await memory.list_sessions() if s.mode == "preview"]
    assert meta.turns == 2
    assert meta.owner.startswith("session:preview-")
    turns = await memory.list_turns(meta.session_id)
    assert [t.trace[0][0].name for t in turns] == ["lookup_order", "lookup_order"]  # no tool
    fetched = post(
        client, "/agents/support/preview", {"message": "hello"}, **{"X-Touba-Fetch": "1"}
    )
    assert fetched.status_code == 200
    assert "<html" not in fetched.text
    assert "I was given 0 earlier turn(s)" in fetched.text  # blank memory each turn
    reset = post(client, "/agents/support/preview", {"reset": "1"})
    assert reset.status_code == 303
    assert "No preview turn yet." in client.get("/agents/support").text
