"""The PostgreSQL store of :class:`ToubaSessionService`: :class:`PostgresAdkBackend`.

Implements :class:`touba.integrations.adk._backend.AdkBackend` (read its module
docstring first: the data, the checks and their order, the costs) with psycopg 3
and a pool of 1 to 4 connections made from ``dsn``, the pool, the schema check and
the error conversion every touba PostgreSQL store shares
(:mod:`touba.history._pg`).

Behaviour decisions:

- **Tables**, every name derived from ``table_prefix`` (``name`` or
  ``schema.name``) and quoted with ``psycopg.sql.Identifier``:
  ``<prefix>_sessions`` (a row per session: its ids, its session-scope state,
  times, revision, counts, expiry and hold, and a surrogate ``sid``),
  ``<prefix>_events`` (the append-only log: a row per event, keyed by ``(sid,
  event_id)`` and indexed by ``(sid, ts, event_id)``), ``<prefix>_app_states``,
  ``<prefix>_user_states``, ``<prefix>_usage`` (one counter row: the stored
  sessions, kept exact by statement triggers on the sessions table) and
  ``<prefix>_meta`` (the schema version). They are created on first use under
  a transaction-level advisory lock, so concurrent first users create them once;
  a ``<prefix>_sessions`` table that is not touba's, or of another schema
  version, is refused untouched. The schema must exist (the store never creates
  one).
- **State** is a ``jsonb`` object whose values are each value's JSON text (a
  string), so a delta is merged by ``||`` in the statement that appends (replace
  per key, ``None`` kept as ``null``) and every value comes back exactly as it
  was given: ``jsonb`` numbers would turn ``1e+20`` or ``-0.0`` into integers.
- **Ids and text.** Every id is ``COLLATE "C"``: events tied on timestamp and
  sessions tied on update time sort by code point, as Python and the other
  stores sort them. PostgreSQL text cannot hold NUL or a lone surrogate: an id,
  a state key or an event holding one is refused with ``ConfigurationError``
  naming it, nothing written (the RAM, SQLite and Redis stores keep such text;
  this store cannot).
- **What each call costs** (one round trip unless said). ``append`` is one
  statement, a transaction by itself: it locks the session's row, decides in the
  order of the protocol (missing, duplicate id, hold, stale, bounds), then
  inserts the event (two index entries), updates the row and merges the app
  and user deltas, each only when the verdict is to write. Nothing else is
  locked: appends to different sessions never wait for each other, except on
  the app's row when both carry an ``app:`` delta (and on a user's row for two
  ``user:`` deltas of one user), which ADK's state scopes make shared. ``read``
  is one statement (one snapshot): the session row, the two states and the
  newest ``recent`` events at or after ``after``, read backwards on
  ``(sid, ts, event_id)`` (``recent=0``: no event row is touched).
  ``list_sessions`` is one statement: the app's sessions (the app and user
  prefix of the unique key), the app state and the states of the users listed;
  no event row. ``create`` is one transaction of two or three statements (an
  expired session of that key deleted, the insert with the state deltas, the
  count checked when ``max_sessions`` is set); creates and deletes take the
  counter row's lock for their transaction, appends never do. ``hold`` (the
  row locked, then set only if no other owner's hold is live), ``release``,
  ``recover``, ``read_user_state`` and ``delete`` (its events by ``ON DELETE
  CASCADE``) are one statement each; ``purge_expired`` one statement on a
  partial index of ``expires_at``. The statements are rendered to bytes once
  per prefix and prepared by psycopg after a few uses; their generic plans
  keep these index paths.
- **Concurrency.** READ COMMITTED. Two appends from one revision: the second
  waits for the first's row lock, then sees its revision and raises
  ``StaleSessionError``; two appends of one event id: the second writes nothing
  and answers ``appended=False``. (A statement that waited decides on the row as
  the first left it but cannot see the first's event: the unique index stops its
  insert, or it decided a refusal; either way it runs once more, and then sees
  the event. So a refused append costs two round trips, a write one.)
- **Errors.** A server gone, a broken connection or a pool timeout during use is
  ``DecisionHistoryStoreUnavailable`` (retryable, the driver's error chained),
  nothing committed unless the link failed during the commit; while opening,
  ``ConfigurationError``. A value out of PostgreSQL's range (a revision past
  64 bits) is ``ConfigurationError``; a stored value this code cannot read, or
  tables altered behind its back, ``DecisionHistoryRecordInvalid``.
- **Time** is the service's ``now`` (epoch seconds, stored as ``float8``, which
  keeps Python floats exactly); the server's clock is never used.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final, LiteralString

try:
    import psycopg
    from psycopg import errors as pg_errors
    from psycopg import sql
    from psycopg.rows import tuple_row
    from psycopg.types.json import Jsonb
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the PostgreSQL store of ToubaSessionService needs psycopg 3 and psycopg-pool: "
        'pip install "touba[adk,postgres]"'
    ) from e

from touba.errors import (
    ConfigurationError,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStoreUnavailable,
)
from touba.history._deadline import STORE_DEADLINE_SECONDS
from touba.history._pg import Conn, OwnedPool, Schema, lock_key, table_parts
from touba.integrations.adk._backend import (
    AdkLimits,
    AppendRequest,
    AppendResult,
    JsonValue,
    SessionKey,
    SessionList,
    SessionRead,
    SessionRecord,
    StoredEvent,
    busy_key,
)
from touba.integrations.adk._checks import (
    already_exists,
    check_event_bytes,
    check_hold,
    check_hold_for,
    check_session_bytes,
    check_sessions,
    check_stale,
    expires_at,
    is_expired,
    not_found,
)

__all__ = ["PostgresAdkBackend"]

SCHEMA_VERSION: Final = 1
_OWNER: Final = "PostgresAdkBackend"

# -- the schema --------------------------------------------------------------------------

TABLES: Final[tuple[LiteralString, ...]] = (
    "CREATE TABLE {s} ("
    " sid bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
    ' app_name text COLLATE "C" NOT NULL,'
    ' user_id text COLLATE "C" NOT NULL,'
    ' session_id text COLLATE "C" NOT NULL,'
    " state jsonb NOT NULL,"
    " create_time float8 NOT NULL,"
    " update_time float8 NOT NULL,"
    " revision bigint NOT NULL DEFAULT 0,"
    " event_count bigint NOT NULL DEFAULT 0,"
    " byte_count bigint NOT NULL DEFAULT 0,"
    " expires_at float8,"
    " holder text,"
    " hold_until float8,"
    " CONSTRAINT {s_key} UNIQUE (app_name, user_id, session_id))",
    "CREATE INDEX {s_exp} ON {s} (expires_at) WHERE expires_at IS NOT NULL",
    "CREATE TABLE {e} ("
    " sid bigint NOT NULL REFERENCES {s} (sid) ON DELETE CASCADE,"
    ' event_id text COLLATE "C" NOT NULL,'
    " ts float8 NOT NULL,"
    " data text NOT NULL,"
    " CONSTRAINT {e_key} PRIMARY KEY (sid, event_id))",
    "CREATE INDEX {e_order} ON {e} (sid, ts, event_id)",
    'CREATE TABLE {a} (app_name text COLLATE "C" PRIMARY KEY, state jsonb NOT NULL)',
    "CREATE TABLE {u} ("
    ' app_name text COLLATE "C" NOT NULL,'
    ' user_id text COLLATE "C" NOT NULL,'
    " state jsonb NOT NULL,"
    " PRIMARY KEY (app_name, user_id))",
    # The stored sessions (expired ones included until purged), kept exact by
    # the triggers below in the transaction of every statement that inserts or
    # deletes sessions; a statement that changes none leaves the row unlocked.
    "CREATE TABLE {c} (one boolean PRIMARY KEY DEFAULT true CHECK (one), sessions bigint NOT NULL)",
    "INSERT INTO {c} (sessions) VALUES (0)",
    "CREATE FUNCTION {count}() RETURNS trigger LANGUAGE plpgsql AS $touba$"
    " BEGIN"
    "  IF TG_OP = 'INSERT' THEN"
    "   UPDATE {c} SET sessions = sessions + d.n"
    "    FROM (SELECT count(*) AS n FROM new_rows) AS d WHERE d.n > 0;"
    "  ELSE"
    "   UPDATE {c} SET sessions = sessions - d.n"
    "    FROM (SELECT count(*) AS n FROM old_rows) AS d WHERE d.n > 0;"
    "  END IF;"
    "  RETURN NULL;"
    " END $touba$",
    "CREATE TRIGGER {tr_ins} AFTER INSERT ON {s} REFERENCING NEW TABLE AS new_rows"
    " FOR EACH STATEMENT EXECUTE FUNCTION {count}()",
    "CREATE TRIGGER {tr_del} AFTER DELETE ON {s} REFERENCING OLD TABLE AS old_rows"
    " FOR EACH STATEMENT EXECUTE FUNCTION {count}()",
)

# -- the statements ----------------------------------------------------------------------

_KEY: Final = "app_name = %(app)s AND user_id = %(user)s AND session_id = %(id)s"
_LIVE: Final = "(expires_at IS NULL OR expires_at > %(now)s)"

# An expired session of the key, deleted before a create takes the key.
PURGE_KEY: Final = "DELETE FROM {s} WHERE {key} AND expires_at <= %(now)s"
# The session inserted (none if the key is taken), then the app and user deltas
# merged, each only when there is one and the session was inserted (the user's
# after the app's: one lock order with APPEND). Returns (inserted, app state,
# user state): the states after the deltas.
CREATE: Final = (
    "WITH ins AS (INSERT INTO {s} (app_name, user_id, session_id, state, create_time,"
    "  update_time, expires_at)"
    "  VALUES (%(app)s, %(user)s, %(id)s, %(state)s, %(time)s, %(time)s, %(expires)s)"
    "  ON CONFLICT ON CONSTRAINT {s_key} DO NOTHING RETURNING sid),"
    " ap AS (INSERT INTO {a} AS a (app_name, state)"
    "  SELECT %(app)s, %(app_delta)s::jsonb WHERE %(app_delta)s::jsonb IS NOT NULL"
    "  AND EXISTS (SELECT FROM ins)"
    "  ON CONFLICT (app_name) DO UPDATE SET state = a.state || EXCLUDED.state"
    "  RETURNING state),"
    " us AS (INSERT INTO {u} AS u (app_name, user_id, state)"
    "  SELECT %(app)s, %(user)s, %(user_delta)s::jsonb"
    "  WHERE %(user_delta)s::jsonb IS NOT NULL AND EXISTS (SELECT FROM ins)"
    "  AND (SELECT count(*) FROM ap) >= 0"
    "  ON CONFLICT (app_name, user_id) DO UPDATE SET state = u.state || EXCLUDED.state"
    "  RETURNING state)"
    " SELECT (SELECT count(*) FROM ins),"
    "  nullif(coalesce((SELECT state FROM ap),"
    "   (SELECT state FROM {a} WHERE app_name = %(app)s))::text, {empty}),"
    "  nullif(coalesce((SELECT state FROM us),"
    "   (SELECT state FROM {u} WHERE app_name = %(app)s AND user_id = %(user)s))::text,"
    "   {empty})"
)
COUNT: Final = "SELECT sessions FROM {c}"
PURGE: Final = "DELETE FROM {s} WHERE expires_at <= %(now)s"

# One append, a transaction by itself: the session's row locked (``s``), the
# verdict decided in the protocol's order (``v``; a NULL parameter skips its
# check), then, only when it is 'ok', the event inserted, the row updated and
# the app and user deltas merged (the user's after the app's). The hold
# after a write: none without an owner (another's live hold refused it, so
# any hold left had passed), cleared by ``release``, else the owner's until
# ``hold_until``. Returns the verdict, the session's (revision, update_time,
# event_count, byte_count) after the statement and the hold it found; no row
# when the session does not exist.
APPEND: Final = (
    "WITH s AS (SELECT sid, revision, update_time, event_count, byte_count, expires_at,"
    "  holder, hold_until FROM {s} WHERE {key} FOR UPDATE),"
    " v AS (SELECT s.*, CASE"
    "  WHEN s.expires_at IS NOT NULL AND s.expires_at <= %(now)s THEN 'missing'"
    "  WHEN EXISTS (SELECT FROM {e} AS e WHERE e.sid = s.sid"
    "   AND e.event_id = %(event_id)s) THEN 'duplicate'"
    "  WHEN s.holder IS NOT NULL AND s.hold_until > %(now)s"
    "   AND s.holder IS DISTINCT FROM %(owner)s::text THEN 'busy'"
    "  WHEN s.revision <> %(revision)s::bigint THEN 'stale'"
    "  WHEN s.update_time > %(seen)s::float8 THEN 'stale'"
    "  WHEN %(bytes)s::bigint > %(max_event)s::bigint THEN 'max_bytes'"
    "  WHEN s.byte_count + %(bytes)s::bigint > %(max_session)s::bigint"
    "   THEN 'max_retained_bytes'"
    "  ELSE 'ok' END AS verdict FROM s),"
    " ev AS (INSERT INTO {e} (sid, event_id, ts, data)"
    "  SELECT sid, %(event_id)s, %(ts)s, %(data)s FROM v WHERE verdict = 'ok'),"
    " up AS (UPDATE {s} AS t SET revision = t.revision + 1,"
    "  update_time = %(update_time)s, event_count = t.event_count + 1,"
    "  byte_count = t.byte_count + %(bytes)s::bigint, expires_at = %(expires)s::float8,"
    "  state = CASE WHEN %(session_delta)s::jsonb IS NULL THEN t.state"
    "   ELSE t.state || %(session_delta)s::jsonb END,"
    "  holder = CASE WHEN %(release)s THEN NULL ELSE %(owner)s::text END,"
    "  hold_until = CASE WHEN %(release)s OR %(owner)s::text IS NULL THEN NULL"
    "   ELSE %(hold_until)s::float8 END"
    "  FROM v WHERE t.sid = v.sid AND v.verdict = 'ok'"
    "  RETURNING t.revision, t.update_time, t.event_count, t.byte_count),"
    " ap AS (INSERT INTO {a} AS a (app_name, state)"
    "  SELECT %(app)s, %(app_delta)s::jsonb FROM v"
    "  WHERE v.verdict = 'ok' AND %(app_delta)s::jsonb IS NOT NULL"
    "  ON CONFLICT (app_name) DO UPDATE SET state = a.state || EXCLUDED.state"
    "  RETURNING 1),"
    " us AS (INSERT INTO {u} AS u (app_name, user_id, state)"
    "  SELECT %(app)s, %(user)s, %(user_delta)s::jsonb FROM v"
    "  WHERE v.verdict = 'ok' AND %(user_delta)s::jsonb IS NOT NULL"
    "  AND (SELECT count(*) FROM ap) >= 0"
    "  ON CONFLICT (app_name, user_id) DO UPDATE SET state = u.state || EXCLUDED.state"
    "  RETURNING 1)"
    " SELECT v.verdict, coalesce(up.revision, v.revision),"
    "  coalesce(up.update_time, v.update_time), coalesce(up.event_count, v.event_count),"
    "  coalesce(up.byte_count, v.byte_count), v.holder, v.hold_until,"
    "  (SELECT count(*) FROM us)"
    " FROM v LEFT JOIN up ON true"
)

# One read, one snapshot: part 0 the live session with both states, part 1
# its newest ``recent`` events at or after ``after``, newest first (read
# backwards on (sid, ts, event_id); LIMIT NULL is no limit, LIMIT 0 reads none).
_ROW_COLUMNS: Final = (
    "nullif(s.state::text, '{}'), s.create_time, s.update_time, s.revision,"
    " s.event_count, s.byte_count, s.expires_at, CASE WHEN s.hold_until > %(now)s THEN s.holder END"
)
READ: Final = (
    "WITH s AS (SELECT * FROM {s} WHERE {key} AND {live})"
    " SELECT 0, NULL::text, NULL::float8, NULL::text, {row},"
    "  (SELECT nullif(state::text, {empty}) FROM {a} WHERE app_name = %(app)s),"
    "  (SELECT nullif(state::text, {empty}) FROM {u}"
    "   WHERE app_name = %(app)s AND user_id = %(user)s)"
    " FROM s"
    " UNION ALL"
    " SELECT 1, e.event_id, e.ts, e.data, NULL, NULL, NULL, NULL, NULL, NULL, NULL,"
    "  NULL, NULL, NULL"
    " FROM s CROSS JOIN LATERAL (SELECT event_id, ts, data FROM {e}"
    "  WHERE sid = s.sid AND ts >= coalesce(%(after)s::float8, '-infinity')"
    "  ORDER BY ts DESC, event_id DESC LIMIT %(recent)s::bigint) AS e"
)

# One list, one snapshot: part 0 the live sessions (in the app, or of one
# user), part 1 the app state, part 2 the states of the users listed;
# sessions least recently updated first, ties by user id then session id.
_LIST: Final = (
    "WITH s AS (SELECT * FROM {s} WHERE app_name = %(app)s{which} AND {live})"
    " SELECT 0, s.user_id, s.session_id, {row} FROM s"
    " UNION ALL"
    " SELECT 1, NULL, NULL, nullif(state::text, {empty}),"
    "  NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM {a} WHERE app_name = %(app)s"
    " UNION ALL"
    " SELECT 2, u.user_id, NULL, nullif(u.state::text, {empty}),"
    "  NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM {u} AS u"
    "  WHERE u.app_name = %(app)s AND u.user_id IN (SELECT user_id FROM s)"
    " ORDER BY 1, 6, 2, 3"
)
LIST_APP: Final = _LIST.replace("{which}", "")
LIST_USER: Final = _LIST.replace("{which}", " AND user_id = %(user)s")
# A hold taken or refreshed: the row locked, then updated only when the session
# is live and no other owner's hold is. Returns (expires_at, holder,
# hold_until) as found and whether it was held; no row when absent.
HOLD: Final = (
    "WITH s AS (SELECT sid, expires_at, holder, hold_until FROM {s} WHERE {key} FOR UPDATE),"
    " up AS (UPDATE {s} AS t SET holder = %(owner)s, hold_until = %(hold_until)s"
    "  FROM s WHERE t.sid = s.sid AND coalesce(s.expires_at > %(now)s, true)"
    "  AND (s.holder IS NULL OR s.holder = %(owner)s OR coalesce(s.hold_until <= %(now)s, true))"
    "  RETURNING 1)"
    " SELECT s.expires_at, s.holder, s.hold_until, (SELECT count(*) FROM up) FROM s"
)
RELEASE: Final = (
    "UPDATE {s} SET holder = NULL, hold_until = NULL WHERE {key} AND holder = %(owner)s"
)
USER_STATE: Final = (
    "SELECT nullif(state::text, {empty}) FROM {u} WHERE app_name = %(app)s AND user_id = %(user)s"
)
DELETE: Final = "DELETE FROM {s} WHERE {key}"
RECOVER: Final = (
    "UPDATE {s} SET holder = NULL, hold_until = NULL WHERE {key} AND holder IS NOT NULL"
)


class Statements:
    """Every statement of one table prefix, composed from its identifiers once."""

    def __init__(self, parts: tuple[str, ...]) -> None:
        *schema, name = parts
        self.sessions = sql.Identifier(*schema, f"{name}_sessions")
        self.meta = sql.Identifier(*schema, f"{name}_meta")
        names: dict[str, sql.Composable] = {
            "s": self.sessions,
            "e": sql.Identifier(*schema, f"{name}_events"),
            "a": sql.Identifier(*schema, f"{name}_app_states"),
            "u": sql.Identifier(*schema, f"{name}_user_states"),
            "c": sql.Identifier(*schema, f"{name}_usage"),
            "count": sql.Identifier(*schema, f"{name}_usage_count"),
            "s_key": sql.Identifier(f"{name}_sessions_key"),
            "s_exp": sql.Identifier(f"{name}_sessions_exp"),
            "e_key": sql.Identifier(f"{name}_events_pkey"),
            "e_order": sql.Identifier(f"{name}_events_order"),
            "tr_ins": sql.Identifier(f"{name}_usage_ins"),
            "tr_del": sql.Identifier(f"{name}_usage_del"),
            "key": sql.SQL(_KEY),
            "live": sql.SQL(_LIVE),
            "row": sql.SQL(_ROW_COLUMNS),
            "empty": sql.Literal("{}"),
        }

        def q(text: LiteralString) -> bytes:
            # Rendered once: names are plain identifiers (table_parts), so quoting
            # needs no connection, and psycopg caches each statement's parse by its bytes.
            return sql.SQL(text).format(**names).as_bytes(None)

        self.create_tables = tuple(sql.SQL(text).format(**names) for text in TABLES)
        self.purge_key = q(PURGE_KEY)
        self.create = q(CREATE)
        self.count = q(COUNT)
        self.purge = q(PURGE)
        self.append = q(APPEND)
        self.read = q(READ)
        self.list_app = q(LIST_APP)
        self.list_user = q(LIST_USER)
        self.user_state = q(USER_STATE)
        self.delete = q(DELETE)
        self.recover = q(RECOVER)
        self.hold = q(HOLD)
        self.release = q(RELEASE)


@functools.cache
def statements(parts: tuple[str, ...]) -> Statements:
    """The statements of ``parts`` (checked by ``table_parts``), shared by every backend."""
    return Statements(parts)


# -- running them -----------------------------------------------------------------------

Params = Mapping[str, Any]


async def _rows(conn: Conn, query: bytes, params: Params | None = None) -> list[tuple[Any, ...]]:
    """Every row ``query`` returns."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(query, params)
        return await cur.fetchall()


async def _row(conn: Conn, query: bytes, params: Params | None = None) -> tuple[Any, ...] | None:
    """The first row ``query`` returns, or None."""
    found = await _rows(conn, query, params)
    return found[0] if found else None


async def _run(conn: Conn, query: bytes, params: Params | None = None) -> int:
    """Execute ``query``; the number of rows it touched."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(query, params)
        return cur.rowcount


# -- values in and out -------------------------------------------------------------------


def _text(value: str, what: str) -> str:
    """``value`` if PostgreSQL text keeps it exactly, else ConfigurationError naming ``what``."""
    if "\x00" in value:
        raise ConfigurationError(f"{what} contains NUL, which PostgreSQL text cannot store")
    try:
        value.encode()
    except UnicodeEncodeError as e:
        raise ConfigurationError(
            f"{what} is not valid Unicode text (a lone surrogate at {e.start}); "
            "PostgreSQL text cannot store it"
        ) from None
    return value


def _key_params(key: SessionKey) -> dict[str, Any]:
    return {
        "app": _text(key.app_name, "app_name"),
        "user": _text(key.user_id, "user_id"),
        "id": _text(key.session_id, "session_id"),
    }


def _encode_state(state: Mapping[str, JsonValue], what: str) -> dict[str, str]:
    """A state or delta as stored: each key to its value's JSON text."""
    out: dict[str, str] = {}
    for name, value in state.items():
        if not isinstance(name, str):
            raise ConfigurationError(f"{what}: a key must be a str, got {type(name).__name__}")
        _text(name, f"{what} key {name!r}")
        try:
            # ASCII: a lone surrogate in a value is kept escaped, as JSON allows.
            out[name] = json.dumps(value)
        except (TypeError, ValueError) as e:
            raise ConfigurationError(f"{what} key {name!r}: its value is not JSON ({e})") from e
    return out


def _delta(delta: Mapping[str, JsonValue], what: str) -> Jsonb | None:
    """A delta as a jsonb parameter; None (no write) when it is empty."""
    return Jsonb(_encode_state(delta, what)) if delta else None


def _decode_state(stored: str | None, what: str, of: SessionKey | str) -> dict[str, JsonValue]:
    """A stored state, as its ``jsonb`` text (None: none stored, or empty), as the JSON
    values it holds; ``what`` and ``of`` name it in an error."""
    if stored is None:
        return {}
    try:
        texts = json.loads(stored)
    except ValueError as e:
        raise DecisionHistoryRecordInvalid(f"the stored {_named(what, of)} is not JSON") from e
    return _decode_values(texts, what, of)


def _decode_values(texts: object, what: str, of: SessionKey | str) -> dict[str, JsonValue]:
    """A state's values from their JSON texts."""
    if not isinstance(texts, dict):
        raise DecisionHistoryRecordInvalid(f"the stored {_named(what, of)} is not a JSON object")
    try:
        return {name: json.loads(text) for name, text in texts.items()}
    except (TypeError, ValueError) as e:
        raise DecisionHistoryRecordInvalid(
            f"the stored {_named(what, of)} holds a value that is not JSON text ({e})"
        ) from e


def _named(what: str, of: SessionKey | str) -> str:
    return f"{what} of {busy_key(of) if isinstance(of, SessionKey) else of!r}"


def _record(key: SessionKey, row: Sequence[Any]) -> SessionRecord:
    """A SessionRecord from ``_ROW_COLUMNS`` (psycopg gives float8 as float, bigint as int)."""
    state, create_time, update_time, revision, events, size, expires, holder = row
    return SessionRecord(
        key,
        {} if state is None else _decode_state(state, "state", key),
        create_time,
        update_time,
        revision,
        events,
        size,
        expires,
        holder,
    )


def _unavailable(e: Exception) -> DecisionHistoryStoreUnavailable:
    return DecisionHistoryStoreUnavailable(
        f"PostgreSQL failed ({type(e).__name__}: {e}). Check the server and retry; "
        "nothing was written unless the connection failed during the commit"
    )


def _invalid(e: psycopg.Error) -> Exception:
    """The typed error of a driver error met during use that is not a failure of the
    server or the link: a value out of PostgreSQL's range is the caller's; anything
    else means the tables are not as this code made them."""
    if isinstance(e, psycopg.DataError):
        return ConfigurationError(f"PostgreSQL cannot store a value of this call: {e}")
    return DecisionHistoryRecordInvalid(
        f"the ADK session tables do not hold what this touba expects ({type(e).__name__}: "
        f"{e}); nothing was written"
    )


# -- the backend -------------------------------------------------------------------------


class PostgresAdkBackend:
    """ADK sessions in PostgreSQL, shared by every worker using the same tables.

    ``dsn`` is a libpq connection string; the backend makes, opens (lazily, on
    its first call) and closes its own pool of 1 to 4 connections. ``limits``
    are touba's bounds (:class:`AdkLimits`). ``table_prefix`` names the tables
    (``"myschema.adk"``: ``myschema.adk_sessions``, ...; the schema must exist).
    ``deadline_seconds`` bounds each call, waiting for a connection included: a
    network that goes silent fails it with ``DecisionHistoryStoreUnavailable``
    (retryable) within that time. See the module docstring for what each call
    does and costs.
    """

    def __init__(
        self,
        dsn: str,
        limits: AdkLimits | None = None,
        *,
        table_prefix: str = "touba_adk",
        deadline_seconds: float = STORE_DEADLINE_SECONDS,
    ) -> None:
        parts = table_parts(table_prefix, example="touba_adk", argument="table_prefix")
        self.table_prefix = table_prefix
        self.limits = limits if limits is not None else AdkLimits()
        self._sql = statements(parts)
        self._pg = OwnedPool(
            _OWNER,
            dsn=dsn,
            pool=None,
            schema=Schema(
                table=table_prefix,
                main=self._sql.sessions,
                meta=self._sql.meta,
                create=self._sql.create_tables,
                version=SCHEMA_VERSION,
                what="ADK session",
                lock=lock_key(f"touba.adk.postgres:schema:{table_prefix}"),
                mismatch=DecisionHistoryRecordInvalid,
            ),
            unavailable=_unavailable,
            deadline=deadline_seconds,
        )

    # -- lifecycle ------------------------------------------------------------------------

    async def open(self) -> None:
        """Connect and create (or check) the tables; idempotent, also done on first use.

        ConfigurationError when the server cannot be reached (the driver's error
        chained) or the tables are not touba's; DecisionHistoryRecordInvalid for
        tables of another schema version."""
        await self._pg.open()

    async def close(self) -> None:
        """Refuse new calls, let running ones finish, close the pool; idempotent."""
        await self._pg.close()

    @asynccontextmanager
    async def _connection(self, *, transaction: bool = False) -> AsyncIterator[Conn]:
        """A pooled connection for one statement that is a transaction by itself, or
        for one ``transaction``; a driver error that is not the server's or the
        link's failure (those are DecisionHistoryStoreUnavailable) becomes
        :func:`_invalid`'s."""
        try:
            opened = self._pg.transaction() if transaction else self._pg.statement()
            async with opened as conn:
                yield conn
        except psycopg.Error as e:
            raise _invalid(e) from e

    def _expires(self, now: float) -> float | None:
        return expires_at(self.limits, now)

    # -- the protocol ---------------------------------------------------------------------

    async def create(
        self,
        key: SessionKey,
        *,
        state: Mapping[str, JsonValue],
        app_delta: Mapping[str, JsonValue],
        user_delta: Mapping[str, JsonValue],
        create_time: float,
        now: float,
    ) -> SessionRead:
        """See ``AdkBackend.create``: one transaction (an expired session of ``key``
        replaced, the session inserted with the deltas, ``max_sessions`` checked)."""
        params = {
            **_key_params(key),
            "state": Jsonb(_encode_state(state, "state")),
            "app_delta": _delta(app_delta, "app state delta"),
            "user_delta": _delta(user_delta, "user state delta"),
            "time": create_time,
            "expires": self._expires(now),
            "now": now,
        }
        s = self._sql
        async with self._pg.using(), self._connection(transaction=True) as conn:
            await _run(conn, s.purge_key, params)
            found = await _row(conn, s.create, params)
            assert found is not None
            inserted, app_state, user_state = found
            if not inserted:
                raise already_exists(key)
            if self.limits.max_sessions is not None:
                await self._check_sessions(conn, now, self.limits.max_sessions)
        return SessionRead(
            session=SessionRecord(
                key=key,
                state=_decode_values(params["state"].obj, "state", key),
                create_time=create_time,
                update_time=create_time,
                revision=0,
                event_count=0,
                byte_count=0,
                expires_at=params["expires"],
            ),
            app_state=_decode_state(app_state, "app state", key.app_name),
            user_state=_decode_state(user_state, "user state", key),
        )

    async def _check_sessions(self, conn: Conn, now: float, most: int) -> None:
        """Refuse (the transaction then rolls back) when more than ``most`` sessions
        are stored with the new one, after purging the expired ones if needed."""
        found = await _row(conn, self._sql.count)
        assert found is not None
        if int(found[0]) <= most:  # the new one counted
            return
        await _run(conn, self._sql.purge, {"now": now})
        found = await _row(conn, self._sql.count)
        assert found is not None
        check_sessions(self.limits, int(found[0]) - 1)  # the new one is counted

    async def read(
        self, key: SessionKey, *, recent: int | None, after: float | None, now: float
    ) -> SessionRead | None:
        """See ``AdkBackend.read``: one statement, one snapshot."""
        if recent is not None and recent < 0:
            raise ConfigurationError(f"recent must be None or >= 0, got {recent}")
        params = {**_key_params(key), "now": now, "after": after, "recent": recent}
        async with self._pg.using(), self._connection() as conn:
            found = await _rows(conn, self._sql.read, params)
        head = next((r for r in found if r[0] == 0), None)
        if head is None:
            return None
        events = [StoredEvent(r[1], float(r[2]), r[3]) for r in found if r[0] == 1]
        events.reverse()  # read newest first
        return SessionRead(
            session=_record(key, head[4:12]),
            app_state=_decode_state(head[12], "app state", key.app_name),
            user_state=_decode_state(head[13], "user state", key),
            events=events,
        )

    async def list_sessions(self, app_name: str, user_id: str | None, *, now: float) -> SessionList:
        """See ``AdkBackend.list_sessions``: one statement, no event read."""
        params: dict[str, Any] = {"app": _text(app_name, "app_name"), "now": now}
        statement = self._sql.list_app
        if user_id is not None:
            params["user"] = _text(user_id, "user_id")
            statement = self._sql.list_user
        async with self._pg.using(), self._connection() as conn:
            found = await _rows(conn, statement, params)
        sessions: list[SessionRecord] = []
        app_state: dict[str, JsonValue] = {}
        user_states: dict[str, dict[str, JsonValue]] = {}
        for found_row in found:
            part, user = found_row[0], found_row[1]
            if part == 0:
                sessions.append(_record(SessionKey(app_name, user, found_row[2]), found_row[3:]))
            elif part == 1:
                app_state = _decode_state(found_row[3], "app state", app_name)
            else:
                user_states[user] = _decode_state(found_row[3], "user state", f"{app_name}/{user}")
        return SessionList(app_state=app_state, user_states=user_states, sessions=sessions)

    async def read_user_state(self, app_name: str, user_id: str) -> Mapping[str, JsonValue]:
        """See ``AdkBackend.read_user_state``: one indexed row."""
        params = {"app": _text(app_name, "app_name"), "user": _text(user_id, "user_id")}
        async with self._pg.using(), self._connection() as conn:
            found = await _row(conn, self._sql.user_state, params)
        stored = None if found is None else found[0]
        return _decode_state(stored, "user state", f"{app_name}/{user_id}")

    async def append(self, key: SessionKey, request: AppendRequest) -> AppendResult:
        """See ``AdkBackend.append``: one statement, a transaction by itself, that
        locks the session's row only (and the app's or user's row for their deltas)."""
        params = self.append_params(key, request)
        async with self._pg.using():
            found = await self._append(params)
        if found is None:
            raise not_found(key)
        verdict, revision, update_time, events, size, holder, hold_until, _ = found
        result = AppendResult(
            appended=verdict == "ok",
            revision=int(revision),
            update_time=float(update_time),
            event_count=int(events),
            byte_count=int(size),
        )
        if verdict in ("ok", "duplicate"):
            return result
        # Refused, nothing written: the same errors as every store's, from what it found.
        if verdict == "missing":
            raise not_found(key)
        check_hold(key, holder, hold_until, request)
        check_stale(result.revision, result.update_time, request)
        check_event_bytes(self.limits, params["bytes"])
        check_session_bytes(self.limits, result.byte_count, params["bytes"])
        raise AssertionError(f"the append statement refused with {verdict!r} for no reason")

    def append_params(self, key: SessionKey, request: AppendRequest) -> dict[str, Any]:
        """The parameters of the append statement (``Statements.append``) for ``request``;
        ConfigurationError naming a value PostgreSQL cannot store."""
        event, limits = request.event, self.limits
        _text(event.event_id, "event id")
        data = _text(event.data, f"event {event.event_id!r}")
        return {
            **_key_params(key),
            "now": request.now,
            "event_id": event.event_id,
            "ts": event.timestamp,
            "data": data,
            "bytes": len(data.encode()),
            "owner": None if request.owner is None else _text(request.owner, "owner"),
            "release": request.release,
            "hold_until": request.now + limits.hold_seconds,
            "revision": request.expected_revision,
            "seen": request.expected_update_time if request.expected_revision is None else None,
            "max_event": limits.max_event_bytes,
            "max_session": limits.max_session_bytes,
            "update_time": request.update_time,
            "expires": self._expires(request.now),
            "app_delta": _delta(request.app_delta, "app state delta"),
            "user_delta": _delta(request.user_delta, "user state delta"),
            "session_delta": _delta(request.session_delta, "session state delta"),
        }

    async def _append(self, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """Run the append statement; once more when it may have decided on a snapshot
        older than the row it locked.

        The statement's snapshot is taken when it begins; when it waits for the
        session's row, it decides on the row as the other writer left it but
        cannot see that writer's event. If that event had this event's id, the
        insert meets it in the unique index, or a refusal (stale, busy, a bound)
        was decided before the duplicate was seen: run again, the statement sees
        the event and answers ``duplicate`` (the protocol's check 2 comes first).
        A refusal costs one more round trip; a write, none.
        """
        found: tuple[Any, ...] | None = None
        for attempt in (1, 2):
            try:
                async with self._pg.statement() as conn:
                    found = await _row(conn, self._sql.append, params)
            except pg_errors.UniqueViolation as e:
                if attempt == 2:
                    raise _invalid(e) from e
                continue
            except psycopg.Error as e:
                raise _invalid(e) from e
            if found is None or found[0] in ("ok", "duplicate", "missing"):
                return found
        return found

    async def delete(self, key: SessionKey) -> None:
        """See ``AdkBackend.delete``: one statement (the events go by cascade)."""
        params = _key_params(key)
        async with self._pg.using(), self._connection() as conn:
            await _run(conn, self._sql.delete, params)

    async def recover(self, key: SessionKey) -> bool:
        """See ``AdkBackend.recover``: one statement."""
        params = _key_params(key)
        async with self._pg.using(), self._connection() as conn:
            return await _run(conn, self._sql.recover, params) > 0

    async def hold(self, key: SessionKey, owner: str, *, now: float) -> None:
        """See ``AdkBackend.hold``: one statement locking the session's row."""
        params = {
            **_key_params(key),
            "owner": _text(owner, "owner"),
            "now": now,
            "hold_until": now + self.limits.hold_seconds,
        }
        async with self._pg.using(), self._connection() as conn:
            found = await _row(conn, self._sql.hold, params)
        if found is None or is_expired(found[0], now):
            raise not_found(key)
        if not found[3]:
            check_hold_for(key, found[1], found[2], owner, now)
            raise AssertionError("the hold statement refused for no reason")

    async def release(self, key: SessionKey, owner: str) -> bool:
        """See ``AdkBackend.release``: one statement."""
        params = {**_key_params(key), "owner": _text(owner, "owner")}
        async with self._pg.using(), self._connection() as conn:
            return await _run(conn, self._sql.release, params) > 0

    async def purge_expired(self, *, now: float) -> int:
        """See ``AdkBackend.purge_expired``: one statement on the expiry index."""
        async with self._pg.using(), self._connection() as conn:
            return await _run(conn, self._sql.purge, {"now": now})
