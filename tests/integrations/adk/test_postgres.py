"""What only the PostgreSQL store of ToubaSessionService has to show (PostgresAdkBackend).

Locks: two connections appending from one snapshot (one wins, the other waits on
the session's row, then is stale), appends to eight sessions holding their
locks at once (none waits for another); what each call reads (the plan's rows
on the events table: ``recent=k`` visits k events, a list none, an append at
most one); round trips (a list of 5,000 sessions is one statement); the
driver's failures as touba's retryable error; the schema made once under
concurrent first use, a foreign table refused untouched; text PostgreSQL
cannot hold refused by name; the session count exact when creates race for the
last place.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from google.adk.errors import StaleSessionError

from tests._services import postgres_dsn
from tests.integrations._stores import create_schema, drop_schema
from touba.errors import (
    ConfigurationError,
    DecisionHistoryLimitExceeded,
    DecisionHistoryStoreUnavailable,
)
from touba.integrations.adk._backend import AdkLimits, AppendRequest, SessionKey, StoredEvent

psycopg = pytest.importorskip("psycopg")
from psycopg import sql  # noqa: E402
from psycopg.conninfo import make_conninfo  # noqa: E402

from touba.integrations.adk._postgres import PostgresAdkBackend  # noqa: E402

pytestmark = pytest.mark.postgres

T0 = 1_765_000_000.5
KEY = SessionKey("app", "alice", "s1")
WAIT = 30.0  # seconds a lock wait may take to show before the test calls it a hang
POLL = 0.02


def event(event_id: str, timestamp: float, text: str = "") -> StoredEvent:
    return StoredEvent(event_id, timestamp, json.dumps({"id": event_id, "text": text}))


def req(ev: StoredEvent, revision: int | None = None, **kw: Any) -> AppendRequest:
    return AppendRequest(
        event=ev, update_time=ev.timestamp, now=ev.timestamp, expected_revision=revision, **kw
    )


async def create(backend: PostgresAdkBackend, key: SessionKey = KEY, **state: Any) -> None:
    await backend.create(key, state=state, app_delta={}, user_delta={}, create_time=T0, now=T0)


@dataclass
class Pg:
    """The test's schema, its DSN (tagged with an application name to find its
    connections) and the backends it opened (closed at the end)."""

    dsn: str
    schema: str
    application: str
    opened: list[PostgresAdkBackend] = field(default_factory=list)

    def open(self, name: str = "adk", limits: AdkLimits | None = None) -> PostgresAdkBackend:
        backend = PostgresAdkBackend(self.tagged, limits, table_prefix=f"{self.schema}.{name}")
        self.opened.append(backend)
        return backend

    @property
    def tagged(self) -> str:
        """The backends' DSN: named, and a lock wait past WAIT fails instead of hanging."""
        return make_conninfo(
            self.dsn, application_name=self.application, options=f"-c lock_timeout={WAIT:g}s"
        )

    def table(self, name: str) -> sql.Identifier:
        return sql.Identifier(self.schema, name)

    async def connect(self, **kw: Any) -> Any:
        """A connection of the test's own (a transaction it holds open by default)."""
        return await psycopg.AsyncConnection.connect(self.dsn, **kw)

    async def waiting(self) -> int:
        """How many of the backends' connections wait for a lock now."""
        async with await self.connect(autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
                " AND wait_event_type = 'Lock'",
                (self.application,),
            )
            found = await cur.fetchone()
            assert found is not None
            return int(found[0])

    async def until_waiting(self, n: int) -> None:
        """Return once ``n`` of the backends' connections wait for a lock (fail after WAIT)."""
        for _ in range(int(WAIT / POLL)):
            if await self.waiting() >= n:
                return
            await asyncio.sleep(POLL)
        pytest.fail(f"fewer than {n} connections waited for a lock in {WAIT} s")


@pytest.fixture
async def pg() -> AsyncIterator[Pg]:
    dsn = postgres_dsn()
    name = uuid.uuid4().hex[:12]
    schema = f"touba_adkpg_{name}"
    create_schema(schema)
    state = Pg(dsn, schema, f"touba-adkpg-{name}")
    try:
        yield state
    finally:
        for backend in state.opened:
            await backend.close()
        drop_schema(schema)


# --- locks --------------------------------------------------------------------------------


@pytest.mark.parametrize("first_ends", ["commit", "rollback"])
async def test_two_connections_appending_from_one_snapshot_exactly_one_wins(
    pg: Pg, first_ends: str
) -> None:
    """The second append waits on the session's row while the first is uncommitted,
    then sees the first's revision (stale, nothing written) or, when the first rolled
    back, writes."""
    backend = pg.open()
    await create(backend)
    first = await pg.connect()
    try:
        verdict = await _append_in(first, backend, KEY, req(event("a", T0 + 1), 0))
        assert verdict == "ok"
        second = asyncio.create_task(backend.append(KEY, req(event("b", T0 + 1), 0)))
        await pg.until_waiting(1)  # on the row the first holds
        assert not second.done()
        await (first.commit() if first_ends == "commit" else first.rollback())
    finally:
        await first.close()
    got_second: Any
    try:
        got_second = await second
    except StaleSessionError as e:
        got_second = e
    stored = await backend.read(KEY, recent=None, after=None, now=T0 + 1)
    assert stored is not None
    if first_ends == "commit":
        assert isinstance(got_second, StaleSessionError)
        assert [e.event_id for e in stored.events] == ["a"]
    else:
        assert got_second.appended
        assert [e.event_id for e in stored.events] == ["b"]
    assert stored.session.revision == 1


@pytest.mark.parametrize("revision", [0, None], ids=["from-one-revision", "unchecked"])
async def test_two_appends_of_one_event_id_store_it_once(pg: Pg, revision: int | None) -> None:
    """The second append of an event id waits on the row while the first is
    uncommitted; once the first commits it answers appended=False (a repeated event,
    the protocol's check 2, before stale), nothing written."""
    backend = pg.open()
    await create(backend)
    first = await pg.connect()
    try:
        mine = req(event("same", T0 + 1, "first"), revision, session_delta={"k": 1})
        assert await _append_in(first, backend, KEY, mine) == "ok"
        again = req(event("same", T0 + 2, "second"), revision, session_delta={"k": 2})
        second = asyncio.create_task(backend.append(KEY, again))
        await pg.until_waiting(1)
        await first.commit()
    finally:
        await first.close()
    result = await second
    assert not result.appended
    assert (result.revision, result.event_count, result.update_time) == (1, 1, T0 + 1)
    stored = await backend.read(KEY, recent=None, after=None, now=T0 + 2)
    assert stored is not None
    assert [json.loads(e.data)["text"] for e in stored.events] == ["first"]
    assert dict(stored.session.state) == {"k": 1}


async def test_appends_to_eight_sessions_hold_their_locks_at_once_and_never_wait(
    pg: Pg,
) -> None:
    """Eight transactions each append to its own session (of one app; with a session
    and a user delta each) and stay open: none waits for another (a wait would time out
    on lock_timeout), and an append to a ninth session of the same user as the first
    goes through meanwhile. Only the session's row (and the user's row for a user
    delta) is locked: no counter, no app row, no table lock."""
    backend = pg.open()
    keys = [SessionKey("app", f"user{i}", f"s{i}") for i in range(8)]
    ninth = SessionKey("app", "user0", "s8")
    for key in [*keys, ninth]:
        await create(backend, key)
    held = [await pg.connect(options="-c lock_timeout=5s") for _ in keys]
    try:
        for conn, key in zip(held, keys, strict=True):
            request = req(
                event("e", T0 + 1), 0, session_delta={"n": key.session_id}, user_delta={"u": 1}
            )
            assert await _append_in(conn, backend, key, request) == "ok"
        assert (await backend.append(ninth, req(event("e", T0 + 2), 0))).appended
        assert await pg.waiting() == 0
        for conn in held:
            await conn.commit()
    finally:
        for conn in held:
            await conn.close()
    for key in keys:
        got = await backend.read(key, recent=None, after=None, now=T0 + 2)
        assert got is not None
        assert [e.event_id for e in got.events] == ["e"]
        assert dict(got.session.state) == {"n": key.session_id}
        assert dict(got.user_state) == {"u": 1}


async def test_an_app_delta_waits_only_for_another_app_delta_of_the_same_app(pg: Pg) -> None:
    """``app:`` state is one row per app (ADK's scope): an append with an app delta
    waits while another append with an app delta of that app is uncommitted; an
    append without one, or with another app's, does not."""
    backend = pg.open()
    keys = [SessionKey("app", "u", f"s{i}") for i in range(3)]
    other_app = SessionKey("other", "u", "s")
    for key in [*keys, other_app]:
        await create(backend, key)
    first = await pg.connect()
    try:
        holding = req(event("e", T0 + 1), 0, app_delta={"k": 1})
        assert await _append_in(first, backend, keys[0], holding) == "ok"
        assert (await backend.append(keys[1], req(event("e", T0 + 1), 0))).appended
        elsewhere = req(event("e", T0 + 1), 0, app_delta={"k": 3})
        assert (await backend.append(other_app, elsewhere)).appended
        blocked = asyncio.create_task(
            backend.append(keys[2], req(event("e", T0 + 1), 0, app_delta={"k": 2}))
        )
        await pg.until_waiting(1)
        assert not blocked.done()
        await first.commit()
    finally:
        await first.close()
    assert (await blocked).appended
    listed = await backend.list_sessions("app", None, now=T0 + 1)
    assert dict(listed.app_state) == {"k": 2}
    assert dict((await backend.list_sessions("other", None, now=T0 + 1)).app_state) == {"k": 3}


async def _append_in(
    conn: Any, backend: PostgresAdkBackend, key: SessionKey, r: AppendRequest
) -> str:
    """Run the backend's own append statement in ``conn``'s open transaction; its verdict."""
    cur = await conn.execute(backend._sql.append, backend.append_params(key, r))
    found = await cur.fetchone()
    assert found is not None
    return str(found[0])


# --- what each call reads --------------------------------------------------------------------


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


async def _event_rows_visited(pg: Pg, statement: bytes, params: dict[str, Any]) -> int:
    """Rows of the events table the plan of ``statement`` visited (returned or filtered
    out), run with EXPLAIN ANALYZE in a transaction rolled back."""
    async with await pg.connect() as conn:
        cur = await conn.execute(b"EXPLAIN (ANALYZE, FORMAT JSON) " + statement, params)
        found = await cur.fetchone()
        await conn.rollback()
    assert found is not None
    visited = 0
    for node in _nodes(found[0][0]["Plan"]):
        if str(node.get("Relation Name", "")).endswith("_events"):
            assert node["Node Type"] != "Seq Scan", node
            rows = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
            visited += rows * node["Actual Loops"]
    return visited


async def test_a_read_visits_only_the_events_it_returns(pg: Pg) -> None:
    backend = pg.open()
    other = SessionKey("app", "bob", "s1")
    for key in (KEY, other):
        await create(backend, key)
        for i in range(400):
            await backend.append(key, req(event(f"e{i:04d}", T0 + 1 + i), i))
    async with await pg.connect(autocommit=True) as conn:
        for name in ("adk_sessions", "adk_events"):
            await conn.execute(sql.SQL("ANALYZE {}").format(pg.table(name)))
    cases: list[tuple[int | None, float | None, int]] = [
        (20, None, 20),
        (0, None, 0),
        (None, T0 + 391, 10),
        (3, T0 + 391, 3),
        (50, T0 + 391, 10),
    ]
    for recent, after, expected in cases:
        params = {"app": "app", "user": "alice", "id": "s1", "now": T0}
        params.update(recent=recent, after=after)
        visited = await _event_rows_visited(pg, backend._sql.read, params)
        assert visited <= expected + 1, (recent, after, visited)
        got = await backend.read(KEY, recent=recent, after=after, now=T0)
        assert got is not None
        assert len(got.events) == expected
    listing = {"app": "app", "now": T0}
    assert await _event_rows_visited(pg, backend._sql.list_app, listing) == 0
    appending = backend.append_params(KEY, req(event("new", T0 + 500), 400))
    assert await _event_rows_visited(pg, backend._sql.append, appending) <= 1


async def test_a_list_of_5000_sessions_is_one_statement(
    pg: Pg, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = pg.open()
    await backend.create(
        SessionKey("app", "u0", "first"),
        state={"own": 1},
        app_delta={"a": 1},
        user_delta={"lang": "fr"},
        create_time=T0 - 1,
        now=T0 - 1,
    )
    async with await pg.connect(autocommit=True) as conn:  # the same rows 4,999 creates write
        await conn.execute(
            sql.SQL(
                "INSERT INTO {} (app_name, user_id, session_id, state, create_time, update_time)"
                " SELECT 'app', 'u' || (i %% 50), 's' || i, '{{}}'::jsonb, %s + i, %s + i"
                " FROM generate_series(1, 4999) AS i"
            ).format(pg.table("adk_sessions")),
            (T0, T0),
        )
    executed: list[object] = []
    real = psycopg.AsyncCursor.execute

    async def counted(self: Any, query: Any, *args: Any, **kw: Any) -> Any:
        executed.append(query)
        return await real(self, query, *args, **kw)

    monkeypatch.setattr(psycopg.AsyncCursor, "execute", counted)
    listed = await backend.list_sessions("app", None, now=T0)
    assert len(executed) == 1
    assert len(listed.sessions) == 5000
    assert listed.sessions[0].key.session_id == "first"
    assert [s.update_time for s in listed.sessions] == sorted(
        s.update_time for s in listed.sessions
    )
    assert dict(listed.app_state) == {"a": 1}
    assert dict(listed.user_states["u0"]) == {"lang": "fr"}
    assert dict(listed.sessions[0].state) == {"own": 1}
    executed.clear()
    mine = await backend.list_sessions("app", "u7", now=T0)
    assert len(executed) == 1
    assert len(mine.sessions) == 100


# --- failures and the schema -------------------------------------------------------------------


async def test_a_cut_connection_is_a_retryable_error_and_the_next_call_goes_on(pg: Pg) -> None:
    backend = pg.open()
    await create(backend)
    await backend.append(KEY, req(event("e1", T0 + 1), 0))
    async with await pg.connect(autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name = %s",
            (pg.application,),
        )
        found = await cur.fetchone()
        assert found is not None
        assert found[0] >= 1
    with pytest.raises(DecisionHistoryStoreUnavailable) as caught:
        await backend.append(KEY, req(event("lost", T0 + 2), 1))
    assert caught.value.retryable
    assert isinstance(caught.value.__cause__, psycopg.Error)
    assert (await backend.append(KEY, req(event("e2", T0 + 3), 1))).appended
    got = await backend.read(KEY, recent=None, after=None, now=T0 + 3)
    assert got is not None
    assert [e.event_id for e in got.events] == ["e1", "e2"]


async def test_concurrent_first_use_creates_the_tables_once(pg: Pg) -> None:
    backends = [pg.open("fresh") for _ in range(4)]
    await asyncio.gather(
        *(create(b, SessionKey("app", "u", f"s{i}")) for i, b in enumerate(backends))
    )
    listed = await backends[0].list_sessions("app", None, now=T0)
    assert sorted(s.key.session_id for s in listed.sessions) == ["s0", "s1", "s2", "s3"]


async def test_a_foreign_table_of_that_name_is_refused_untouched(pg: Pg) -> None:
    async with await pg.connect(autocommit=True) as conn:
        await conn.execute(sql.SQL("CREATE TABLE {} (id int)").format(pg.table("x_sessions")))
        await conn.execute(sql.SQL("INSERT INTO {} VALUES (7)").format(pg.table("x_sessions")))
    backend = pg.open("x")
    with pytest.raises(ConfigurationError, match="not a touba ADK session table"):
        await create(backend)
    async with await pg.connect(autocommit=True) as conn:
        cur = await conn.execute(sql.SQL("SELECT id FROM {}").format(pg.table("x_sessions")))
        assert await cur.fetchall() == [(7,)]
        cur = await conn.execute("SELECT to_regclass(%s)", (f"{pg.schema}.x_events",))
        assert await cur.fetchone() == (None,)


async def test_a_prefix_that_is_not_an_identifier_is_refused_at_construction() -> None:
    with pytest.raises(ConfigurationError, match="table_prefix"):
        PostgresAdkBackend("postgresql://localhost/x", table_prefix="bad-name; DROP")
    with pytest.raises(ConfigurationError, match="dsn"):
        PostgresAdkBackend("not a dsn = = =")


# --- values --------------------------------------------------------------------------------


async def test_text_postgresql_cannot_hold_is_refused_by_name_and_nothing_written(pg: Pg) -> None:
    backend = pg.open()
    await create(backend)
    with pytest.raises(ConfigurationError, match="session_id"):
        await create(backend, SessionKey("app", "alice", "a\x00b"))
    with pytest.raises(ConfigurationError, match="state delta key"):
        await backend.append(KEY, req(event("e1", T0 + 1), 0, session_delta={"k\x00": 1}))
    lone = StoredEvent("e1", T0 + 1, '{"text": "\ud800"}')
    with pytest.raises(ConfigurationError, match="event 'e1'"):
        await backend.append(KEY, req(lone, 0))
    got = await backend.read(KEY, recent=None, after=None, now=T0 + 1)
    assert got is not None
    assert (list(got.events), dict(got.session.state), got.session.revision) == ([], {}, 0)
    # a lone surrogate inside a value is kept, escaped, as JSON allows
    await backend.append(KEY, req(event("e1", T0 + 1), 0, session_delta={"k": "\ud800"}))
    got = await backend.read(KEY, recent=0, after=None, now=T0 + 1)
    assert got is not None
    assert got.session.state["k"] == "\ud800"


async def test_state_values_keep_their_json_type_where_jsonb_numbers_would_not(pg: Pg) -> None:
    backend = pg.open()
    values: dict[str, Any] = {"big_float": 1e20, "neg_zero": -0.0, "big_int": 2**80, "one": 1.0}
    await backend.create(
        KEY, state=values, app_delta=values, user_delta=values, create_time=T0, now=T0
    )
    got = await backend.read(KEY, recent=0, after=None, now=T0)
    assert got is not None
    for state in (got.session.state, got.app_state, got.user_state):
        assert state == values
        assert {k: type(v) for k, v in state.items()} == {k: type(v) for k, v in values.items()}
        assert math.copysign(1.0, state["neg_zero"]) == -1.0


async def test_creates_racing_for_the_last_place_one_wins(pg: Pg) -> None:
    limits = AdkLimits(max_sessions=3)
    backends = [pg.open(limits=limits) for _ in range(5)]
    for i in range(2):
        await create(backends[0], SessionKey("app", "u", f"kept{i}"))
    outcomes = await asyncio.gather(
        *(create(b, SessionKey("app", "u", f"new{i}")) for i, b in enumerate(backends)),
        return_exceptions=True,
    )
    refused = [o for o in outcomes if isinstance(o, DecisionHistoryLimitExceeded)]
    assert len(refused) == 4, outcomes
    assert all(o.limit == "max_sessions" for o in refused)
    listed = await backends[0].list_sessions("app", None, now=T0)
    assert len(listed.sessions) == 3
    await backends[0].delete(SessionKey("app", "u", "kept0"))
    await create(backends[1], SessionKey("app", "u", "after_delete"))  # the count went down
