"""Encryption at rest of the memory stores (SQLite and PostgreSQL): round trips through
ChatSession and the store's API, no plaintext on disk or in the tables, every kind of
tampering refused, rotation interrupted and resumed, bounds counted on the plaintext."""

from __future__ import annotations

import base64
import sqlite3
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.memory._chat import Scripted, build_runtime
from tests.memory.conftest import FakeClock
from touba import ChatSession, Encryption
from touba.errors import DecisionHistoryRecordInvalid, KeyEventInvalid
from touba.memory import KeyEventsConfig, KeyEventService
from touba.memory._sql import SqlMemoryStore
from touba.memory.sqlite import SqliteMemoryStore

MARKER = "ZebraQuokka7319"
K1, K2 = b"1" * 32, b"2" * 32
TABLES = ("sessions", "turns", "events", "history", "jobs", "configs", "config_changes")


def enc(current: str = "k1", **keys: bytes) -> Encryption:
    return Encryption(keys=keys or {"k1": K1}, current=current)


class Place:
    """One place (a SQLite file, or PostgreSQL tables): stores opened on it, raw SQL on it."""

    def __init__(self, kind: str, directory: Path, pg: tuple[str, str] | None, clock: FakeClock):
        self.kind, self.directory, self.pg, self.clock = kind, directory, pg, clock
        self.opened: list[SqlMemoryStore] = []

    def open(self, encryption: Encryption | None) -> SqlMemoryStore:
        if self.kind == "sqlite":
            store: SqlMemoryStore = SqliteMemoryStore(
                self.directory / "memory.db", clock=self.clock, encryption=encryption
            )
        else:
            from touba.memory.postgres import PostgresMemoryStore

            assert self.pg is not None
            dsn, prefix = self.pg
            store = PostgresMemoryStore(dsn, prefix=prefix, clock=self.clock, encryption=encryption)
        self.opened.append(store)
        return store

    def table(self, name: str) -> str:
        return f"touba_memory_{name}" if self.pg is None else f"{self.pg[1]}_{name}"

    @contextmanager
    def raw(self) -> Iterator[Callable[..., list[Any]]]:
        """Run SQL (``?`` placeholders, ``{turns}``-style table names) outside the store."""
        names = {t: self.table(t) for t in TABLES}
        if self.pg is None:
            conn = sqlite3.connect(self.directory / "memory.db")
            try:

                def sql(text: str, *params: Any) -> list[Any]:
                    return conn.execute(text.format(**names), params).fetchall()

                yield sql
                conn.commit()
            finally:
                conn.close()
            return
        import psycopg

        with psycopg.connect(self.pg[0], autocommit=True) as pg:

            def pgsql(text: str, *params: Any) -> list[Any]:
                cursor = pg.execute(text.format(**names).replace("?", "%s"), params)
                return cursor.fetchall() if cursor.description else []

            yield pgsql

    def everything(self) -> str:
        """Every byte of the SQLite files, or every row of the PostgreSQL tables, as text."""
        if self.pg is None:
            return "".join(
                p.read_bytes().decode("latin-1") for p in self.directory.glob("memory.db*")
            )
        with self.raw() as sql:
            return "".join(
                str(r)
                for t in TABLES
                for r in sql(f"SELECT t::text FROM {self.table(t)} t")  # noqa: S608 - our table names
            )


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def place(
    request: pytest.FixtureRequest, private_dir: Path, clock: FakeClock
) -> AsyncIterator[Place]:
    pg = request.getfixturevalue("pg_prefix") if request.param == "postgres" else None
    made = Place(request.param, private_dir, pg, clock)
    yield made
    for store in made.opened:
        await store.close()


async def fill(store: SqlMemoryStore, session: str = "s-1") -> tuple[str, str]:
    """Two turns, two events (one updated twice), a job with ops and a result."""
    await store.open_session(session, owner="u-1", agent_ref="support", mode="live")
    for i in range(2):
        await store.append_turn(
            session,
            user=f"{MARKER} question {i}",
            replies=[f"{MARKER} answer {i}"],
            context={"note": f"{MARKER} ctx {i}"},
        )
    first = await store.create_event(
        owner="u-1", type="refund", title=f"{MARKER} A1", details=f"{MARKER} d", session_id=session
    )
    second = await store.create_event(
        owner="u-1", type="refund", title=f"{MARKER} B2", details="", session_id=session
    )
    await store.update_event("u-1", first.id, {"title": f"{MARKER} A1 v2"}, session_id=session)
    await store.update_event("u-1", first.id, {"details": f"{MARKER} d2"}, session_id=session)
    job, _ = await store.enqueue_job(
        session_id=session, owner="u-1", agent_ref="support", transcript_ref="t", max_attempts=3
    )
    claimed = await store.claim_job("w", 30)
    assert claimed is not None
    assert claimed.lease_token is not None
    await store.complete_job(job.id, claimed.lease_token, {"summary": f"{MARKER} result"})
    return first.id, second.id


# -- round trips ------------------------------------------------------------------------


async def test_a_chat_session_round_trips_through_an_encrypted_store_leaving_no_plaintext(
    place: Place,
) -> None:
    store = place.open(enc())
    model = Scripted()
    model.call("lookup_order", order_id=f"{MARKER}-A1")
    model.call("create_key_event", type="refund", title=f"{MARKER} refund", details="damaged")
    model.say(f"{MARKER} done.")
    session = ChatSession(build_runtime(model), "support", "u-42", "s-1", store=store)
    turn = await session.send(f"{MARKER} where is my order?")
    await session.close()
    assert turn.stored is not None
    [stored] = await store.recent_turns("s-1", 10)
    assert stored == turn.stored
    assert stored.user == f"{MARKER} where is my order?"
    assert stored.trace[0][0].arguments == {"order_id": f"{MARKER}-A1"}
    [event] = await store.query_all_events(text=MARKER.lower())
    assert event.title == f"{MARKER} refund"
    assert MARKER not in place.everything()
    assert "tbe1.k1." in place.everything()  # sealed, not missing


async def test_turns_events_history_and_jobs_round_trip(place: Place) -> None:
    store = place.open(enc())
    first, _second = await fill(store)
    turns = await store.recent_turns("s-1", 10)
    assert [t.user for t in turns] == [f"{MARKER} question 0", f"{MARKER} question 1"]
    assert turns[1].context == {"note": f"{MARKER} ctx 1"}
    assert await store.list_turns("s-1", newest_first=True) == turns[::-1]
    event = await store.get_event("u-1", first)
    assert event is not None
    assert event.history is not None
    assert (event.title, event.details) == (f"{MARKER} A1 v2", f"{MARKER} d2")
    assert [c.new for u in event.history for c in u.changes] == [f"{MARKER} A1 v2", f"{MARKER} d2"]
    [job] = await store.list_jobs()
    assert job.result == {"summary": f"{MARKER} result"}
    assert MARKER not in place.everything()
    # a turn without context still reads as None
    await store.append_turn("s-1", user="plain", replies=[])
    assert (await store.recent_turns("s-1", 1))[0].context is None


async def test_the_text_filter_runs_after_opening_with_the_same_answers(place: Place) -> None:
    store = place.open(enc())
    await store.open_session("s-1", owner="u-1", agent_ref="a", mode="live")
    await store.open_session("s-2", owner="u-2", agent_ref="a", mode="live")
    for i in range(7):
        owner = "u-1" if i % 2 else "u-2"
        await store.create_event(
            owner=owner,
            type="refund" if i < 5 else "account issue",
            title=f"Ticket {i} ÉCLAIR" if i % 3 == 0 else f"Ticket {i}",
            details="needle inside" if i == 4 else "",
            session_id="s-1" if owner == "u-1" else "s-2",
        )
    found = await store.query_all_events(text="éclair")
    assert [e.title for e in found] == ["Ticket 6 ÉCLAIR", "Ticket 3 ÉCLAIR", "Ticket 0 ÉCLAIR"]
    assert await store.count_all_events(text="éclair") == 3
    assert [e.title for e in await store.query_all_events(text="éclair", limit=1, offset=1)] == [
        "Ticket 3 ÉCLAIR"
    ]
    assert [e.title for e in await store.query_all_events(text="éclair", type="refund")] == [
        "Ticket 3 ÉCLAIR",
        "Ticket 0 ÉCLAIR",
    ]
    assert [e.title for e in await store.query_events("u-2", text="NEEDLE")] == ["Ticket 4"]
    assert await store.count_events("u-1", text="ticket") == 3
    assert await store.query_events("u-1", text="absent") == []


async def test_the_search_pages_through_more_rows_than_one_read(place: Place) -> None:
    from touba.memory import _sql

    store = place.open(enc())
    await store.open_session("s-1", owner="u-1", agent_ref="a", mode="live")
    for i in range(_sql._SEARCH_PAGE + 3):
        title = "hit" if i in (0, _sql._SEARCH_PAGE + 1) else "miss"
        await store.create_event(owner="u-1", type="t", title=title, details="", session_id="s-1")
    assert await store.count_events("u-1", text="HIT") == 2
    assert len(await store.query_all_events(text="hit", limit=5)) == 2


# -- fail closed --------------------------------------------------------------------------


def _flip(token: str) -> str:
    head, _, body = token.rpartition(".")
    raw = bytearray(base64.urlsafe_b64decode(body))
    raw[-1] ^= 1
    return f"{head}.{base64.urlsafe_b64encode(bytes(raw)).decode()}"


TAMPER: dict[str, Callable[[str, str], str]] = {
    "swapped": lambda mine, other: other,
    "truncated": lambda mine, other: mine[:-8],
    "bit-flipped": lambda mine, other: _flip(mine),
    "plaintext": lambda mine, other: '"hello"',
}


@pytest.mark.parametrize("how", TAMPER)
async def test_a_tampered_turn_is_refused(place: Place, how: str) -> None:
    store = place.open(enc())
    await fill(store, "s-1")
    await fill(store, "s-2")
    with place.raw() as sql:
        rows = sql("SELECT session_id, idx, user_text FROM {turns} ORDER BY session_id, idx")
        values = {(r[0], r[1]): r[2] for r in rows}
        # s-1 turn 0 gets a value of its own session's turn 1 or of s-2's turn 0
        other = values[("s-1", 1)] if how == "swapped" else values[("s-2", 0)]
        sql(
            "UPDATE {turns} SET user_text = ? WHERE session_id = 's-1' AND idx = 0",
            TAMPER[how](values[("s-1", 0)], other),
        )
    with pytest.raises(DecisionHistoryRecordInvalid) as caught:
        await store.recent_turns("s-1", 10)
    assert MARKER not in str(caught.value)
    assert "hello" not in str(caught.value)
    assert len(await store.recent_turns("s-2", 10)) == 2  # the rest still reads


async def test_a_turn_moved_to_another_session_is_refused(place: Place) -> None:
    store = place.open(enc())
    await fill(store, "s-1")
    await fill(store, "s-2")
    with place.raw() as sql:
        [(user,)] = sql("SELECT user_text FROM {turns} WHERE session_id = 's-2' AND idx = 1")
        sql("UPDATE {turns} SET user_text = ? WHERE session_id = 's-1' AND idx = 1", user)
    with pytest.raises(DecisionHistoryRecordInvalid):
        await store.list_turns("s-1")


@pytest.mark.parametrize("how", TAMPER)
async def test_a_tampered_key_event_history_or_job_is_refused(place: Place, how: str) -> None:
    store = place.open(enc())
    first, second = await fill(store)
    with place.raw() as sql:
        [(a,)] = sql("SELECT title FROM {events} WHERE id = ?", first)
        [(b,)] = sql("SELECT title FROM {events} WHERE id = ?", second)
        sql("UPDATE {events} SET title = ? WHERE id = ?", TAMPER[how](b, a), second)
        h1, h2 = (r[0] for r in sql("SELECT changes FROM {history} ORDER BY seq"))
        sql("UPDATE {history} SET changes = ? WHERE changes = ?", TAMPER[how](h1, h2), h1)
        [(result,)] = sql("SELECT result FROM {jobs}")
        [(ops,)] = sql("SELECT ops FROM {jobs}") if how != "swapped" else [("x",)]
        del ops
        [(title_a,)] = sql("SELECT title FROM {events} WHERE id = ?", first)
        sql("UPDATE {jobs} SET result = ?", TAMPER[how](result, title_a))
    with pytest.raises(DecisionHistoryRecordInvalid):
        await store.get_event("u-1", second)
    with pytest.raises(DecisionHistoryRecordInvalid):
        await store.query_events("u-1")
    with pytest.raises(DecisionHistoryRecordInvalid):
        await store.query_all_events(text="x")
    with pytest.raises(DecisionHistoryRecordInvalid):
        await store.get_event("u-1", first)  # its history row
    with pytest.raises(DecisionHistoryRecordInvalid):
        await store.list_jobs()


async def test_an_event_moved_to_another_owner_is_refused(place: Place) -> None:
    store = place.open(enc())
    first, _ = await fill(store)
    with place.raw() as sql:
        sql("UPDATE {events} SET owner = 'u-2' WHERE id = ?", first)
    with pytest.raises(DecisionHistoryRecordInvalid):
        await store.query_events("u-2")


async def test_plaintext_rows_and_sealed_rows_are_refused_by_the_other_kind_of_store(
    place: Place,
) -> None:
    plain = place.open(None)
    await fill(plain, "s-plain")
    sealed = place.open(enc())
    with pytest.raises(DecisionHistoryRecordInvalid):
        await sealed.recent_turns("s-plain", 10)
    with pytest.raises(DecisionHistoryRecordInvalid):
        await sealed.query_events("u-1")
    with pytest.raises(DecisionHistoryRecordInvalid):
        await sealed.list_jobs()
    await fill(sealed, "s-sealed")
    with pytest.raises(DecisionHistoryRecordInvalid):
        await plain.recent_turns("s-sealed", 10)
    with pytest.raises(DecisionHistoryRecordInvalid):
        await plain.query_events("u-1")
    with pytest.raises(DecisionHistoryRecordInvalid):
        await plain.get_job((await sealed.list_jobs(limit=1))[0].id)
    # a store with another key set refuses too, naming the key id only
    other = place.open(Encryption(keys={"k9": K2}, current="k9"))
    with pytest.raises(DecisionHistoryRecordInvalid, match="'k1'") as caught:
        await other.recent_turns("s-sealed", 10)
    assert MARKER not in str(caught.value)


async def test_a_plain_store_keeps_titles_that_look_like_tokens(place: Place) -> None:
    plain = place.open(None)
    await plain.open_session("s-1", owner="u-1", agent_ref="a", mode="live")
    event = await plain.create_event(
        owner="u-1", type="t", title="tbe1.k1.short", details="", session_id="s-1"
    )
    assert (await plain.query_events("u-1"))[0] == event


# -- rotation -----------------------------------------------------------------------------


async def test_rotation_interrupted_after_one_batch_resumes_to_the_end(place: Place) -> None:
    old = place.open(enc())
    first, _ = await fill(old, "s-1")
    await fill(old, "s-2")
    before_turns = await old.recent_turns("s-1", 10)
    before_event = await old.get_event("u-1", first)
    both = Encryption(keys={"k1": K1, "k2": K2}, current="k2")
    rotating = place.open(both)
    assert await rotating.rekey(batch=3) == 3
    # interrupted: a new process takes over; old and new keys both read meanwhile
    resumed = place.open(both)
    assert await resumed.recent_turns("s-1", 10) == before_turns
    total = 3 + await resumed.rekey(batch=4)
    # meanwhile a process still on the old key writes rows behind the rotation's cursor
    await fill(old, "s-0")
    while done := await resumed.rekey(batch=4):
        assert done <= 4
        total += done
    # 4 turns, 4 events, 4 history rows, 2 jobs; then 2 turns, 2 events, 2 history rows, 1 job
    assert total == 14 + 7
    assert await resumed.rekey() == 0
    with place.raw() as sql:  # old tokens may linger in free pages, never in a row
        for table, column in (("turns", "user_text"), ("turns", "context"), ("events", "title")):
            for (value,) in sql(f"SELECT {column} FROM {{{table}}}"):  # noqa: S608
                assert value.startswith("tbe1.k2.")
        for ops, result in sql("SELECT ops, result FROM {jobs}"):
            assert ops is None
            assert result.startswith("tbe1.k2.")
    only_new = place.open(Encryption(keys={"k2": K2}, current="k2"))
    assert await only_new.recent_turns("s-1", 10) == before_turns
    assert await only_new.get_event("u-1", first) == before_event
    assert len(await only_new.list_jobs()) == 3
    with pytest.raises(DecisionHistoryRecordInvalid):
        await old.recent_turns("s-1", 10)


async def test_rekey_needs_encryption_and_a_positive_batch(place: Place) -> None:
    from touba.errors import ConfigurationError

    with pytest.raises(ConfigurationError):
        await place.open(None).rekey()
    with pytest.raises(ConfigurationError):
        await place.open(enc()).rekey(batch=0)


# -- bounds count plaintext ---------------------------------------------------------------


@pytest.mark.parametrize("encrypted", [False, True])
async def test_key_event_limits_count_the_plaintext(place: Place, encrypted: bool) -> None:
    store = place.open(enc() if encrypted else None)
    await store.open_session("s-1", owner="u-1", agent_ref="a", mode="live")
    service = KeyEventService(store, KeyEventsConfig(types=("refund",)), max_title_chars=20)
    made = await service.create(
        "user:u-1", type="refund", title="é" * 20, details="x", session_id="s-1"
    )
    assert (await service.get("user:u-1", made.id)).title == "é" * 20
    with pytest.raises(KeyEventInvalid):
        await service.create(
            "user:u-1", type="refund", title="é" * 21, details="", session_id="s-1"
        )
