"""What a store supplies to :class:`ToubaSessionService`, and the plain data it exchanges.

The service (:mod:`touba.integrations.adk._service`) owns everything ADK-specific:
ids, the state scopes, ``temp:``, events to and from JSON, stale markers. A
backend stores and reads; it never imports ADK's pydantic models, only ADK's
error classes. One backend per store:

- ``touba.integrations.adk._memory.MemoryAdkBackend(limits)``
- ``touba.integrations.adk._sqlite.SqliteAdkBackend(path, limits)``
- ``touba.integrations.adk._postgres.PostgresAdkBackend(dsn, table_prefix="touba_adk", limits=...)``
  (``table_prefix`` may be schema-qualified: ``"myschema.adk"`` -> ``myschema.adk_sessions``...)
- ``touba.integrations.adk._redis.RedisAdkBackend(url, prefix="touba:adk:", limits=...)``

(``limits`` is keyword-or-positional after the location, an :class:`AdkLimits`.)
A backend opens lazily on its first call and is closed by ``await close()``.

**What is stored.** Per session ``(app_name, user_id, session_id)``: its
session-scope state (unprefixed keys, a JSON object), ``create_time``,
``update_time`` (epoch float seconds, returned exactly as given: within 1e-6),
``revision`` (0 at create, +1 at every committed append), ``event_count``,
``byte_count`` (sum of the events' UTF-8 data lengths), ``expires_at`` (None
without a TTL), and the hold (owner, until). Per app: app state (keys stored
without ``app:``). Per ``(app, user)``: user state (keys without ``user:``).
Events: an append-only log per session of :class:`StoredEvent` (id, timestamp,
data = the Event's JSON text), ordered by ``(timestamp, event_id)`` (ADK's
database services order by timestamp; upstream breaks ties by id), unique by
``event_id`` within the session. State values are JSON values (dict, list,
str, int, float, bool, None) and must come back equal and of the same type
(``False`` stays ``False``, ``1.0`` stays a float, ``None`` is stored as null).
A delta replaces each key's value whole (no deep merge).

**Time.** Every call that can see expiry takes ``now`` (epoch seconds, the
service's clock); a backend compares expiry with that ``now``, never its own
clock (it may also let the store delete natively at ``expires_at``, e.g. Redis
``PEXPIREAT``, since ``now`` is the wall clock in production). A session is
*expired* when ``expires_at is not None and expires_at <= now``: it is
invisible to every read, a create of the same key succeeds (replacing it), an
append to it raises ``SessionNotFoundError``, and it is purged (with its
events) at the latest by :meth:`AdkBackend.purge_expired` or by a create that
needs its place under ``max_sessions``. ``expires_at = now + ttl_seconds`` at
create and at every committed append. App and user state never expire.

**Bounds** (:class:`AdkLimits`): refused with
``DecisionHistoryLimitExceeded(limit=...)``, nothing written:
``"max_bytes"`` (one event's data over ``max_event_bytes``),
``"max_retained_bytes"`` (a session's ``byte_count`` would exceed
``max_session_bytes``), ``"max_sessions"`` (a create when the store, i.e. this
prefix/file, already holds ``max_sessions`` unexpired sessions).

**One writer.** A session may be *held* by an owner (the service's
``exclusive()`` token) until a time: taken by :meth:`AdkBackend.hold`, or by an
append that carries that ``owner``; each append of the owner refreshes it to
``now + hold_seconds``; cleared by :meth:`AdkBackend.release`, by an append of
the owner with ``release=True``, or by :meth:`AdkBackend.recover` (a crashed
run's). While a hold of another owner is live, an append (with any other
owner, or none) raises ``DecisionHistoryBusy``, nothing written. A hold whose
time has passed is no hold.

**Errors.** ADK's ``AlreadyExistsError``, ``SessionNotFoundError``,
``StaleSessionError`` (``google.adk.errors``) where said; touba's
``DecisionHistoryLimitExceeded`` and ``DecisionHistoryBusy`` (session_key =
``"app/user/session"``); the store's failures as its own typed errors (SQLite:
``DecisionHistoryStoreUnavailable``; PostgreSQL/Redis: the same class, driver
exception chained), the previous state kept; a stored value this code cannot
read as ``DecisionHistoryRecordInvalid``. Misuse (a negative ``recent``) is
``ConfigurationError``; the service validates before calling.

**Cost.** Every method is one atomic step on the store (one transaction, one
Lua script, one lock hold) and reads only what it returns: ``append`` is O(1)
in the number of stored events (plus O(log N) index work), ``read`` with
``recent=k`` is O(k + size of the three states) as one indexed range read,
``list_sessions`` is O(sessions returned + their states), never touching
events. Namespaces (PostgreSQL ``table_prefix``, Redis ``prefix``, SQLite
file) never see each other's data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "AdkBackend",
    "AdkLimits",
    "AppendRequest",
    "AppendResult",
    "JsonValue",
    "SessionKey",
    "SessionList",
    "SessionRead",
    "SessionRecord",
    "StoredEvent",
    "busy_key",
]

JsonValue = Any
"""A JSON value as :func:`json.loads` gives it (dict, list, str, int, float, bool, None)."""


@dataclass(frozen=True, slots=True)
class AdkLimits:
    """touba's bounds on an ADK session store; ``None`` means unbounded.

    - ``max_event_bytes``: UTF-8 length of one event's JSON (``"max_bytes"``).
    - ``max_session_bytes``: a session's total event bytes (``"max_retained_bytes"``).
    - ``max_sessions``: unexpired sessions in the store (``"max_sessions"``).
    - ``ttl_seconds``: a session expires this long after its last write (create or
      append); None: never.
    - ``hold_seconds``: how long an owner's hold lasts after its last append.
    """

    max_event_bytes: int | None = 1_048_576
    max_session_bytes: int | None = 256 * 1_048_576
    max_sessions: int | None = None
    ttl_seconds: float | None = None
    hold_seconds: float = 300.0


@dataclass(frozen=True, slots=True)
class SessionKey:
    """A session's identity, ids already normalised by the service."""

    app_name: str
    user_id: str
    session_id: str


def busy_key(key: SessionKey) -> str:
    """The ``session_key`` a :class:`DecisionHistoryBusy` for ``key`` carries."""
    return f"{key.app_name}/{key.user_id}/{key.session_id}"


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """One event of the log: ADK's ``Event.id``, ``Event.timestamp``, and its JSON text."""

    event_id: str
    timestamp: float
    data: str


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """A stored session without its events (its state is the session scope only).

    ``holder`` is the owner of a live hold as of the call's ``now``, else None.
    """

    key: SessionKey
    state: Mapping[str, JsonValue]
    create_time: float
    update_time: float
    revision: int
    event_count: int
    byte_count: int
    expires_at: float | None = None
    holder: str | None = None


@dataclass(frozen=True, slots=True)
class SessionRead:
    """A session with its app state, its user state and the events asked for (oldest first)."""

    session: SessionRecord
    app_state: Mapping[str, JsonValue]
    user_state: Mapping[str, JsonValue]
    events: Sequence[StoredEvent] = ()


@dataclass(frozen=True, slots=True)
class SessionList:
    """Sessions without events, least recently updated first (ties by user id, session id).

    ``user_states`` maps each listed session's user id to that user's state.
    """

    app_state: Mapping[str, JsonValue]
    user_states: Mapping[str, Mapping[str, JsonValue]]
    sessions: Sequence[SessionRecord]


@dataclass(frozen=True, slots=True)
class AppendRequest:
    """One event to append, with the deltas it applies and the checks it must pass.

    - ``app_delta`` / ``user_delta`` / ``session_delta``: keys without prefix,
      each value replaces the stored one (``None`` is stored).
    - ``expected_revision``: stale unless the stored revision equals it.
    - ``expected_update_time`` (used only when ``expected_revision`` is None):
      stale when the stored update_time is greater than it (ADK's own check for a
      copy without a storage marker). Both None: no stale check.
    - ``update_time``: the session's new update_time (ADK: the event's timestamp).
    - ``now``: the clock for expiry and holds.
    - ``owner`` / ``release``: see "One writer" in the module docstring.
    """

    event: StoredEvent
    update_time: float
    now: float
    app_delta: Mapping[str, JsonValue] = field(default_factory=dict)
    user_delta: Mapping[str, JsonValue] = field(default_factory=dict)
    session_delta: Mapping[str, JsonValue] = field(default_factory=dict)
    expected_revision: int | None = None
    expected_update_time: float | None = None
    owner: str | None = None
    release: bool = False


@dataclass(frozen=True, slots=True)
class AppendResult:
    """The session as the append left it.

    ``appended`` is False when the event's id was already stored in the session:
    nothing was written (an idempotent retry) and the other fields describe the
    session as stored.
    """

    appended: bool
    revision: int
    update_time: float
    event_count: int
    byte_count: int


@runtime_checkable
class AdkBackend(Protocol):
    """A store for ADK sessions (see the module docstring for the data and the rules)."""

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
        """Create ``key`` with session-scope ``state``, applying the app and user deltas.

        One atomic step: if an unexpired session ``key`` exists, raise
        ``AlreadyExistsError`` and change nothing. If an expired one exists it is
        replaced (its events deleted). When ``max_sessions`` unexpired sessions
        are stored, purge expired sessions; if still full raise
        ``DecisionHistoryLimitExceeded(limit="max_sessions")``, nothing written.
        Store revision 0, ``create_time`` as both create and update time,
        ``expires_at = now + ttl_seconds``, no events, no hold; apply
        ``app_delta``/``user_delta`` (replace per key). Return the session with
        the app and user state after the deltas, no events. O(size of the states).
        """
        ...

    async def read(
        self,
        key: SessionKey,
        *,
        recent: int | None,
        after: float | None,
        now: float,
    ) -> SessionRead | None:
        """The session with its app/user state and only the events asked, or None.

        None when ``key`` is absent or expired. Events, oldest first in
        ``(timestamp, event_id)`` order: those with ``timestamp >= after`` (all
        when ``after`` is None), of which the newest ``recent`` (all when None;
        none when 0; ``recent`` is never negative). One consistent snapshot (the
        session row, states and events as of one moment). O(events returned +
        size of the states), one indexed range read of events; ``recent=0``
        reads no event.
        """
        ...

    async def list_sessions(self, app_name: str, user_id: str | None, *, now: float) -> SessionList:
        """The unexpired sessions of ``app_name`` (of ``user_id`` only, when given), no events.

        Ordered by ``update_time`` ascending, ties by ``user_id`` then
        ``session_id`` (as ADK's database services order them). With the app
        state and the user state of every user listed.
        Unknown app/user: an empty list (app_state may still be non-empty).
        O(sessions returned + their states); reads no event.
        """
        ...

    async def read_user_state(self, app_name: str, user_id: str) -> Mapping[str, JsonValue]:
        """The user state of ``(app_name, user_id)``, keys without prefix; ``{}`` if none.

        O(size of that state).
        """
        ...

    async def append(self, key: SessionKey, request: AppendRequest) -> AppendResult:
        """Append one event and apply its deltas, atomically, after the checks in this order.

        1. ``key`` absent or expired: ``SessionNotFoundError``, nothing written.
        2. ``request.event.event_id`` already stored in this session: return
           ``AppendResult(appended=False, ...)``, nothing written (no other check).
        3. A live hold of another owner (``request.owner`` differs or is None):
           ``DecisionHistoryBusy``, nothing written.
        4. Stale (see :class:`AppendRequest`): ``StaleSessionError`` (message
           containing "modified in storage"), nothing written.
        5. The event's UTF-8 data over ``max_event_bytes``
           (``limit="max_bytes"``) or ``byte_count`` + it over
           ``max_session_bytes`` (``limit="max_retained_bytes"``):
           ``DecisionHistoryLimitExceeded``, nothing written.
        6. Insert the event; apply app/user/session deltas (replace per key);
           revision += 1; update_time = ``request.update_time``; event_count += 1;
           byte_count += the event's bytes; ``expires_at = now + ttl``; the hold:
           with ``owner`` set, held by it until ``now + hold_seconds``, or cleared
           when ``release``; without ``owner``, unchanged (no live hold exists).

        Two concurrent appends with the same ``expected_revision``: exactly one
        succeeds. O(1) in the stored events (an index insert), O(size of deltas).
        """
        ...

    async def delete(self, key: SessionKey) -> None:
        """Delete ``key`` with its events and its hold; an unknown key is a no-op.

        Scoped to exactly ``(app, user, session)``; app and user state stay.
        Atomic. O(events of the session).
        """
        ...

    async def hold(self, key: SessionKey, owner: str, *, now: float) -> None:
        """Hold ``key`` for ``owner`` until ``now + hold_seconds`` (added after the first commit).

        One atomic step: ``key`` absent or expired: ``SessionNotFoundError``; a
        live hold of another owner: ``DecisionHistoryBusy``; else the hold is
        set (taken, or refreshed when ``owner`` already holds it). Changes
        nothing else (no revision, update time or expiry change). O(1).
        """
        ...

    async def release(self, key: SessionKey, owner: str) -> bool:
        """Clear ``key``'s hold if ``owner`` holds it (live or not); True when cleared.

        Added after the first commit. Another owner's hold, no hold, an unknown
        key: False, nothing changed. O(1).
        """
        ...

    async def recover(self, key: SessionKey) -> bool:
        """Drop ``key``'s hold (a crashed run's); True when a hold, live or not, was dropped.

        O(1); an unknown key: False.
        """
        ...

    async def purge_expired(self, *, now: float) -> int:
        """Delete every session expired as of ``now``, with its events; return how many.

        O(sessions purged + their events).
        """
        ...

    async def close(self) -> None:
        """Release connections and threads; idempotent.

        A call after close raises ``ConfigurationError``.
        """
        ...
