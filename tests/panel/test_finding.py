"""Finding things in the panel (issue 25, item 5), through HTTP: users with or without
``user:``, key events across owners, preview sessions apart, turns newest first, one
format for times, sizes and counts, a page per extraction job."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.panel._data import HOSTILE, seed_conversation, seed_memory
from touba.errors import AgentDecisionProviderSchemaViolation
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import (
    CreateEventOp,
    ExtractionJob,
    ExtractionQueue,
    KeyEventsConfig,
    KeyEventService,
    SqliteMemoryStore,
    UpdateEventOp,
)
from touba.memory._model import ExtractedOp
from touba.panel._format import count_of, size, when

PARIS = timezone(timedelta(hours=1))
TIME = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d(:\d\d)?[^<]{0,12}")
CONFIG = KeyEventsConfig(enabled=True, types=("refund", "bug"))


class Clock:
    """An aware clock in UTC+1 (the panel shows its times in UTC), moved by hand."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 5, 10, 0, tzinfo=PARIS)

    def __call__(self) -> datetime:
        self.now += timedelta(milliseconds=1)  # every write a distinct time
        return self.now


@pytest.fixture
async def memory(private_dir: Path) -> AsyncIterator[SqliteMemoryStore]:
    async with SqliteMemoryStore(private_dir / "memory.sqlite", clock=Clock()) as store:
        yield store


def _titles(html: str) -> list[str]:
    return re.findall(r'<a href="/event\?owner=[^"]+">([^<]*)</a>', html)


# -- users ---------------------------------------------------------------------------------


async def test_a_user_is_found_with_or_without_the_prefix(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    await seed_memory(memory)
    found = client.get("/user?owner=alice")
    assert found.status_code == 303
    assert found.headers["location"] == "/user?owner=user%3Aalice"
    assert client.get("/user?owner=%20alice%20&mode=live").headers["location"] == (
        "/user?owner=user%3Aalice&mode=live"
    )
    page = client.get("/user?owner=user:alice")
    assert page.status_code == 200
    assert 'href="/session?id=s-1"' in page.text
    # An anonymous session's owner by its session id alone.
    assert client.get("/user?owner=anon-1").headers["location"] == "/user?owner=session%3Aanon-1"
    # An owner with key events and no session left is still found.
    await KeyEventService(memory, CONFIG).create("user:bob", "bug", "Login loop", "", "s-9")
    assert client.get("/user?owner=bob").headers["location"] == "/user?owner=user%3Abob"
    # The key events page takes the id alone too.
    events = client.get("/events?owner=alice")
    assert events.status_code == 200
    assert "Key events of <code>user:alice</code>" in events.text
    assert _titles(events.text) == ["&lt;script&gt;alert(1)&lt;/script&gt;"]


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("ghost", "<code>user:ghost</code> and <code>session:ghost</code>"),
        ("user:ghost", "<code>user:ghost</code> has"),
        ("Alice", "<code>user:Alice</code>"),  # ids match exactly
        (HOSTILE, "&lt;script&gt;"),
        ("a\x00b", "no chat session and no key event"),
    ],
)
async def test_an_unknown_user_gets_a_clear_no_such_user_page(
    client: TestClient, memory: SqliteMemoryStore, raw: str, shown: str
) -> None:
    await seed_memory(memory)
    for path in ("/user", "/events"):
        response = client.get(path, params={"owner": raw})
        assert response.status_code == 404, path
        assert "<h1>No such user</h1>" in response.text
        assert "no chat session and no key event" in response.text
        assert shown in response.text
        assert "<script>" not in response.text
    assert client.get("/user?owner=").headers["location"] == "/users"


# -- key events across owners ----------------------------------------------------------------


async def _two_owners(memory: SqliteMemoryStore) -> None:
    service = KeyEventService(memory, CONFIG)
    await service.create("user:alice", "refund", "Refund order A1", "asked twice", "s-1")
    await service.create("user:bob", "refund", "Refund for B7", "", "s-2")
    await service.create("user:bob", "bug", "App crashes", "on the refund screen", "s-2")
    done = await service.create("session:anon-1", "bug", "Old matter", "refund done", "a-1")
    await service.update("session:anon-1", done.id, status="closed", session_id="a-1")


async def test_key_events_are_searched_across_owners_by_text_type_and_status(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    await _two_owners(memory)
    html = client.get("/events?text=REFUND").text
    assert _titles(html) == ["App crashes", "Refund for B7", "Refund order A1"]
    assert "3 found across every user" in html
    # Each row links to its owner's page.
    assert html.count('<td class="owner"><a href="/user?owner=user%3Abob">user:bob</a>') == 2
    assert '<td class="owner"><a href="/user?owner=user%3Aalice">user:alice</a>' in html
    assert _titles(client.get("/events?type=refund").text) == ["Refund for B7", "Refund order A1"]
    assert _titles(client.get("/events?type=Refund").text) == []  # types match exactly
    assert _titles(client.get("/events?text=refund&status=closed").text) == ["Old matter"]
    assert _titles(client.get("/events?text=refund&closed=1").text) == [
        "Old matter",
        "App crashes",
        "Refund for B7",
        "Refund order A1",
    ]
    assert _titles(client.get("/events?type=bug&text=crash").text) == ["App crashes"]
    assert _titles(client.get("/events?status=nonsense").text) == [  # ignored: not closed
        "App crashes",
        "Refund for B7",
        "Refund order A1",
    ]
    # One owner's, as before.
    assert _titles(client.get("/events?owner=user:bob&text=refund").text) == [
        "App crashes",
        "Refund for B7",
    ]


async def test_the_search_escapes_odd_input(client: TestClient, memory: SqliteMemoryStore) -> None:
    service = KeyEventService(memory, CONFIG)
    for owner, title in (
        ("user:a", "100% off"),
        ("user:b", "a_b"),
        ("user:c", "back\\slash"),
        ("user:d", HOSTILE),
        ("user:e", "it's"),
    ):
        await service.create(owner, "bug", title, "", "s-1")
    assert _titles(client.get("/events", params={"text": "%"}).text) == ["100% off"]
    assert _titles(client.get("/events", params={"text": "_"}).text) == ["a_b"]
    assert _titles(client.get("/events", params={"text": "\\"}).text) == ["back\\slash"]
    assert _titles(client.get("/events", params={"text": "'"}).text) == ["it&#39;s"]
    hostile = client.get("/events", params={"text": "<script>"})
    assert _titles(hostile.text) == ["&lt;script&gt;alert(1)&lt;/script&gt;"]
    assert "<script>" not in hostile.text
    assert 'value="&lt;script&gt;"' in hostile.text  # the filter shown back, escaped
    refused = client.get("/events", params={"text": "a\x00b"})
    assert refused.status_code == 400
    assert "text must not contain a NUL character" in refused.text


async def test_the_search_is_paged(client: TestClient, memory: SqliteMemoryStore) -> None:
    service = KeyEventService(memory, CONFIG)
    for index in range(120):
        await service.create(f"user:u{index % 4}", "bug", f"case {index}", "", "s-1")
    first = client.get("/events?type=bug").text
    assert _titles(first) == [f"case {i}" for i in range(119, 69, -1)]
    assert "120 found across every user" in first
    assert "page 1 of 3" in first
    assert 'rel="next" href="http://127.0.0.1:8765/events?type=bug&amp;page=2"' in first
    last = client.get("/events?type=bug&page=3").text
    assert _titles(last) == [f"case {i}" for i in range(19, -1, -1)]
    assert 'rel="next"' not in last
    assert 'rel="prev"' in last


# -- preview sessions apart ----------------------------------------------------------------


async def test_preview_sessions_are_kept_apart_by_a_filter(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    await seed_memory(memory)
    # Newer than every live session: the panel's own preview box.
    await memory.open_session(
        "preview-1", owner="session:preview-1", agent_ref="support", mode="preview"
    )
    await memory.open_session("p-alice", owner="user:alice", agent_ref="support", mode="preview")
    owners = re.compile(r'<td><a href="/user\?owner=[^"]+">([^<]+)</a>')
    live = client.get("/users").text
    assert owners.findall(live) == ["session:anon-1", "user:alice"]
    assert "2 owners" in live
    assert 'class="here" aria-current="page">live (real users)' in live
    assert owners.findall(client.get("/users?mode=live").text) == owners.findall(live)
    preview = client.get("/users?mode=preview").text
    assert owners.findall(preview) == ["user:alice", "session:preview-1", "session:p-1"]
    every = client.get("/users?mode=all").text
    assert owners.findall(every) == [
        "user:alice",
        "session:preview-1",
        "session:p-1",
        "session:anon-1",
    ]
    assert owners.findall(client.get("/users?mode=bogus").text) == owners.findall(live)
    # One user's sessions, by mode.
    sessions = re.compile(r'href="/session\?id=([^"]+)"')
    assert sessions.findall(client.get("/user?owner=user:alice").text) == ["p-alice", "s-1"]
    assert sessions.findall(client.get("/user?owner=user:alice&mode=live").text) == ["s-1"]
    assert sessions.findall(client.get("/user?owner=user:alice&mode=preview").text) == ["p-alice"]


# -- a session's turns ---------------------------------------------------------------------


async def test_turns_are_newest_first_with_a_jump_to_the_last(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    await memory.open_session("long", owner="user:alice", agent_ref="support", mode="live")
    for index in range(120):
        await memory.append_turn("long", user=f"message {index + 1}", replies=["ok"])
    turn_ids = re.compile(r'<li class="turn" id="turn-(\d+)">')
    first = client.get("/session?id=long").text
    assert turn_ids.findall(first) == [str(n) for n in range(120, 70, -1)]
    assert '<ol class="turns" reversed start="120">' in first
    assert first.index("message 120") < first.index("message 119")
    jump = 'href="/session?id=long#turn-120" id="jump-last">Jump to the last turn (turn 120)</a>'
    assert jump in first
    assert 'href="/session?id=long&amp;page=3#turn-1">the first turn</a>' in first
    assert "page 1 of 3" in first
    second = client.get("/session?id=long&page=2").text
    assert turn_ids.findall(second) == [str(n) for n in range(70, 20, -1)]
    assert jump in second  # from any page, back to the last turn
    assert '<ol class="turns" reversed start="70">' in second
    last = client.get("/session?id=long&page=3").text
    assert turn_ids.findall(last) == [str(n) for n in range(20, 0, -1)]
    await memory.open_session("empty", owner="user:alice", agent_ref="support", mode="live")
    empty = client.get("/session?id=empty").text
    assert "jump-last" not in empty
    assert "No turn stored." in empty


# -- times, sizes, counts --------------------------------------------------------------------


def test_one_format_for_times_with_their_zone() -> None:
    assert when(datetime(2026, 1, 5, 10, 0, 7, 999, tzinfo=PARIS)) == "2026-01-05 09:00:07 UTC"
    assert when(datetime(2026, 1, 5, 9, 0, tzinfo=UTC)) == "2026-01-05 09:00:00 UTC"
    assert when(datetime(2026, 1, 5, 9, 0)) == "2026-01-05 09:00:00 UTC"  # naive: taken as UTC
    assert when("2026-01-05T10:00:00+01:00") == "2026-01-05 09:00:00 UTC"  # history's ISO text
    assert when(None) == "-"
    assert when("") == "-"
    assert when("not a time") == "not a time"


def test_sizes_are_human_readable_and_counts_carry_the_right_noun() -> None:
    assert [size(n) for n in (0, 1, 1023, 1024, 1536, 10 * 1024, 32 * 1024**2, 5 * 1024**3)] == [
        "0 B",
        "1 B",
        "1023 B",
        "1 KiB",
        "1.5 KiB",
        "10 KiB",
        "32 MiB",
        "5 GiB",
    ]
    assert size(None) == "-"
    assert [count_of(n, "turn") for n in (0, 1, 2, 1234)] == [
        "0 turns",
        "1 turn",
        "2 turns",
        "1,234 turns",
    ]
    assert count_of(1, "key event") == "1 key event"
    assert count_of(2, "key event") == "2 key events"
    assert count_of(2, "summary") == "2 summaries"
    assert count_of(2, "day") == "2 days"
    assert count_of(2, "match") == "2 matches"
    assert count_of(3, "person", "people") == "3 people"
    assert count_of(None, "turn") == "-"


def _shown_times(html: str) -> list[str]:
    """Every date-and-time written on the page, outside the tags' attributes."""
    text = re.sub(r"<[^>]*>", " ", html)
    return [m.group(0).strip() for m in TIME.finditer(text)]


async def test_every_page_writes_times_in_one_format_with_the_zone(
    client: TestClient, memory: SqliteMemoryStore, history: SqliteHistoryStore
) -> None:
    seeded = await seed_memory(memory)
    key = await seed_conversation(history)
    job = await _done_job(memory)
    pages = (
        "/users",
        "/user?owner=user:alice",
        "/session?id=s-1",
        "/events",
        f"/event?owner=user:alice&id={seeded['event'].id}",
        "/jobs",
        f"/job?id={job.id}",
        "/conversations",
        f"/conversation?key={key}",
    )
    for path in pages:
        html = client.get(path).text
        shown = _shown_times(html)
        assert shown, path
        for moment in shown:
            assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", moment[:23]), (path, moment)
    # The store's clock runs in UTC+1: the session started at 09:00 UTC.
    assert "2026-01-05 09:00:00 UTC" in client.get("/session?id=s-1").text


async def test_sizes_and_counts_read_right_on_the_pages(
    client: TestClient, memory: SqliteMemoryStore, history: SqliteHistoryStore
) -> None:
    await seed_memory(memory)
    key = await seed_conversation(history)
    conversations = client.get("/conversations").text
    assert "of 32 MiB" in conversations
    assert "of 128 conversations" in conversations
    assert re.search(r"<td>\d(\.\d)? KiB</td>", conversations)
    conversation = client.get(f"/conversation?key={key}").text
    assert re.search(r"<dd>\d+ messages, \d(\.\d)? KiB</dd>", conversation)
    assert "The last 6 decisions" in conversation
    one = client.get("/session?id=anon-1").text
    assert "<dd>1 turn</dd>" in one
    assert "<dd>2 turns</dd>" in client.get("/session?id=s-1").text
    alice = client.get("/user?owner=user:alice").text
    assert "1 open key event</a> (1 key event with the closed ones)" in alice
    assert "1 session, newest first" in alice
    assert "0 open key events</a>" in client.get("/user?owner=session:anon-1").text
    assert "2 owners)" in client.get("/users").text
    assert "(1 owner)" in client.get("/users?mode=preview").text


# -- extraction jobs -------------------------------------------------------------------------


async def _run_job(
    memory: SqliteMemoryStore,
    session_id: str,
    ops: Sequence[ExtractedOp] | Exception,
    max_attempts: int = 3,
) -> ExtractionJob:
    queue = ExtractionQueue(memory, max_attempts=max_attempts)
    await queue.enqueue(session_id, "user:alice", "assistant", f"{session_id}@2")
    claimed = await queue.claim("worker-1")
    assert claimed is not None

    async def extract(job: ExtractionJob) -> Sequence[ExtractedOp]:
        if isinstance(ops, Exception):
            raise ops
        return ops

    return await queue.process(claimed, extract, KeyEventService(memory, CONFIG))


async def _done_job(memory: SqliteMemoryStore) -> ExtractionJob:
    existing = await KeyEventService(memory, CONFIG).create(
        "user:alice", "bug", "Login loop", "", "s-0"
    )
    ops = (
        CreateEventOp("refund", "Refund order A1", "DETAILS-FROM-THE-MODEL"),
        CreateEventOp("Refund", "wrong type", ""),
        UpdateEventOp(existing.id, status="closed"),
    )
    job = await _run_job(memory, "s-done", ops)
    assert job.status == "done"
    return job


async def test_a_done_jobs_page_shows_its_ops_and_what_they_became(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    job = await _done_job(memory)
    listed = client.get("/jobs").text
    assert f'<a href="/job?id={job.id}"><code>{job.id}</code></a>' in listed
    assert '<a href="/user?owner=user%3Aalice">user:alice</a>' in listed  # the owner
    assert "<td>1/3</td>" in listed  # attempts
    response = client.get(f"/job?id={job.id}")
    assert response.status_code == 200
    html = response.text
    assert '<span class="status done">done</span>' in html
    assert "<dd>1 of 3 attempts</dd>" in html
    assert "<dd>none (done)</dd>" in html  # no next attempt
    assert "3 ops extracted" in html
    [created] = job.result["created"]
    [updated] = job.result["updated"]
    assert f'created <a href="/event?owner=user%3Aalice&amp;id={created}">' in html
    assert f'updated <a href="/event?owner=user%3Aalice&amp;id={updated}">' in html
    rejected = "rejected</span> the type given (a str of 6 characters) is not a configured"
    assert rejected in html
    assert "status closed;" in html
    assert "details (22 characters)" in html
    assert "DETAILS-FROM-THE-MODEL" not in html  # the event holds the text
    assert "error code" not in html
    claimed_token = re.compile(r"[0-9a-f]{32}")
    assert not claimed_token.search(html)  # never a lease token


async def test_a_failed_jobs_page_shows_its_error_code_and_requeues(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    raw = AgentDecisionProviderSchemaViolation(
        "the model answered RAW-MODEL-OUTPUT", provider_error_code="invalid_json"
    )
    job = await _run_job(memory, "s-failed", raw, max_attempts=1)
    assert job.status == "failed"
    html = client.get(f"/job?id={job.id}").text
    assert '<code class="error-code">AgentDecisionProviderSchemaViolation</code>' in html
    assert "provider_error_code=invalid_json" in html
    assert "RAW-MODEL-OUTPUT" not in html
    assert "No op recorded yet" in html
    assert "<dd>none (failed)</dd>" in html
    # A pending one after a failed attempt: its next attempt.
    again = await _run_job(memory, "s-retry", raw, max_attempts=3)
    assert again.status == "pending"
    pending = client.get(f"/job?id={again.id}").text
    assert f"<dd>{when(again.next_attempt_at)}</dd>" in pending
    assert "Last attempt failed" in pending
    assert f"<td>{when(again.next_attempt_at)}</td>" in client.get("/jobs").text
    # Requeue from the job's page comes back to it.
    from tests.panel.conftest import post

    response = post(client, "/jobs/requeue", {"id": job.id, "back": "job"})
    assert response.status_code == 303
    assert response.headers["location"] == f"/job?id={job.id}"
    assert "is pending again" in client.get(f"/job?id={job.id}").text


@pytest.mark.parametrize("path", ["/job?id=xj_nope", "/job?id=", "/job", f"/job?id={HOSTILE}"])
async def test_an_unknown_job_is_404_with_a_message(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 404
    assert "No such extraction job" in response.text
    assert "<script>" not in response.text
