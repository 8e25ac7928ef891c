"""An ADK session service on touba's stores: :class:`ToubaSessionService`.

```python
from google.adk.runners import Runner
from touba.integrations.adk import ToubaSessionService

async with ToubaSessionService.sqlite(".touba/adk.sqlite", ttl_seconds=30 * 86400) as sessions:
    runner = Runner(agent=agent, app_name="support", session_service=sessions)
    async with sessions.exclusive(app_name="support", user_id="u1", session_id="s1"):
        async for event in runner.run_async(user_id="u1", session_id="s1", new_message=msg):
            ...
```

Behaviour decisions (where ADK is silent, touba does what ADK's own services do;
every deliberate difference is listed here):

- **Storage.** A session's events are an append-only log in the store
  (:mod:`touba.integrations.adk._backend`): ``append_event`` writes one event
  row and the session's row in one atomic step, whatever the number of events
  already stored; ``get_session(config=GetSessionConfig(num_recent_events=k))``
  reads k events as one indexed range read, never the rest; ``list_sessions``
  reads no event. ADK's SQL services have no index on an event's timestamp:
  to find the newest k they sort all of the session's events. A whole-session
  read decodes every event into ADK's ``Event``, as theirs do, with a copy of
  ADK's validator that leaves out three Python hooks which do nothing to JSON
  that touba wrote (twice as fast, the result identical: see
  :mod:`._events`); by default no decoded event is cached.
- **Shared events (opt-in, never the default).** With ``share_events=True``
  (every constructor), a whole-session ``get_session`` hands out the same
  ``Event`` objects an earlier read of this service object decoded, as long as
  the store returns each with the same id and the same JSON text (so what is
  handed out is always what the store holds), for the most recently read
  sessions, up to 32 Mi characters of their JSON. As ADK's
  ``InMemorySessionService`` under its ``IN_MEMORY_SESSION_SERVICE_LIGHT_COPY``
  flag: each returned ``Session``, its ``events`` list and its ``state`` are
  the caller's own, but its events are shared with other reads. A caller must
  not change an event it read (its content, parts, actions, metadata): that
  change would show in later reads of this service object, and not in the
  store. A whole read then costs the store read and a comparison of texts,
  not decoding (nor the new objects the collector would have to visit).
- **Ids and scopes, as ADK.** A session id is stripped of surrounding
  whitespace on create, get and delete (``DatabaseSessionService`` 2.13.0 keeps
  it padded: a known ADK divergence); no id (or a blank one) gets a uuid4.
  ``app:`` keys are shared per app, ``user:`` keys per (app, user), others
  belong to their session; every read returns the merged state with the
  prefixes. ``temp:`` keys are applied to the in-memory ``session.state`` by
  ``append_event``, removed from ``event.actions.state_delta`` and never stored
  (also when passed to ``create_session``). A delta value replaces the stored
  one (no deep merge); ``None`` is stored as null.
- **Values must round-trip, or the write is refused.** State values (in
  ``create_session(state=...)`` and in events' state deltas) must be JSON
  values (dict with str keys, list, str, int, finite float, bool, None);
  anything else (a tuple, a set, a datetime, an object) is refused with
  ``ConfigurationError`` naming the key (``event.actions.state_delta['k']``),
  nothing written, the session and the event untouched. An event whose JSON
  (ADK's ``model_dump_json(exclude_none=True)``) does not read back equal is
  refused the same way, naming the field (``event.custom_metadata``). ADK's
  database services instead store a lossy string form with a warning.
- **Stale copies.** Each session object this service returns or appends to
  carries the store's revision in ADK's private ``_storage_update_marker``
  (as ``DatabaseSessionService`` does); an append from a copy whose revision
  is not the stored one raises ``StaleSessionError`` ("modified in storage"),
  nothing written. A copy without a marker (built by hand) is stale when the
  stored ``last_update_time`` is newer than its own (``SqliteSessionService``'s
  rule). The check and the write are one atomic step, so of two concurrent
  appends from one snapshot exactly one wins (``SqliteSessionService`` 2.13.0
  lets both land).
- **A refused append changes nothing.** On any error (stale, not found,
  busy, a bound, bad input) the passed ``session`` and ``event`` are left as
  they were; ADK's services apply ``temp:`` keys to the session before they
  check. A successful append mutates both as ADK's do: the event is appended
  to ``session.events``, the delta applied to ``session.state``, and
  ``session.last_update_time = event.timestamp``.
- **An event id already stored** in the session is not stored again and the
  call returns the event without touching the session, as
  ``InMemorySessionService`` does for a repeated event (the database
  services fail on their primary key instead).
- **Order.** Events come back ordered by ``(timestamp, id)``: append order
  for events stamped by ADK; ties broken by id, as upstream ADK now expects
  (``SqliteSessionService`` 2.13.0 breaks them by insertion order).
  ``list_sessions`` is least recently updated first, ties by user id then
  session id, as ADK's.
- **One writer per session (touba's guarantee).** ``async with
  service.exclusive(app_name=..., user_id=..., session_id=...)`` holds the
  session for the appends made inside the block (the current asyncio task and
  the tasks it starts): any other append to it, from another run, task or
  process, is refused with ``DecisionHistoryBusy`` at once, before that run
  calls its model; another ``exclusive()`` on it is refused the same way. The
  hold lasts ``hold_seconds`` (default 300) after its last append and is
  released when the block ends; a process that dies inside leaves the session
  held until then, or until ``service.recover(...)``. Without
  ``exclusive()``, concurrent runs are kept apart by the stale check only
  (the loser gets ``StaleSessionError``, perhaps after its model call).
- **Bounds and expiry** (keyword arguments of every constructor):
  ``max_event_bytes`` (1 MiB), ``max_session_bytes`` (256 MiB of events),
  ``max_sessions`` (None), each refused with ``DecisionHistoryLimitExceeded``
  before anything is written; ``ttl_seconds`` (None): a session not written for
  that long is gone (reads return None, appends raise
  ``SessionNotFoundError``); expired sessions are purged at most once a minute
  by ``create_session`` and by ``purge_expired()``. App and user state never
  expire.
- **Capacity before cost.** A ``Runner`` appends the user's message before it
  calls the model, so a session over ``max_session_bytes``, a session held by
  another run, or one gone stale is refused at that first append: the run
  stops before it costs a model call.
- **Files and tenants.** SQLite files are private (0600, in a directory only
  their owner may enter, symlinks refused); PostgreSQL tables live under their
  ``table_prefix`` and Redis keys under their ``prefix``: two prefixes never
  see each other's sessions or state.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import math
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import fields
from typing import Any

from google.adk.events.event import Event
from google.adk.platform import uuid as platform_uuid
from google.adk.sessions import BaseSessionService, Session
from google.adk.sessions.base_session_service import GetSessionConfig, ListSessionsResponse
from google.adk.sessions.state import State

from touba._closing import AsyncClosing
from touba.errors import ConfigurationError
from touba.history._deadline import STORE_DEADLINE_SECONDS
from touba.integrations.adk._backend import (
    AdkBackend,
    AdkLimits,
    AppendRequest,
    SessionKey,
    SessionRead,
    SessionRecord,
    StoredEvent,
)
from touba.integrations.adk._events import SharedEvents, decode_all, encode

__all__ = ["ToubaSessionService"]

PURGE_EVERY_SECONDS = 60.0
_LIMIT_NAMES = frozenset(f.name for f in fields(AdkLimits))

# (service, key, owner token) of the exclusive() block the current task runs in.
_EXCLUSIVE: contextvars.ContextVar[tuple[int, SessionKey, str] | None] = contextvars.ContextVar(
    "touba_adk_exclusive", default=None
)


def _limits(given: Mapping[str, Any]) -> AdkLimits:
    unknown = sorted(set(given) - _LIMIT_NAMES)
    if unknown:
        raise ConfigurationError(
            f"unknown ToubaSessionService option(s) {', '.join(unknown)}; the bounds are "
            f"{', '.join(sorted(_LIMIT_NAMES))}"
        )
    for name, value in given.items():
        if name == "hold_seconds" and value is None:
            raise ConfigurationError("hold_seconds must be a positive number of seconds")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigurationError(f"{name} must be a number or None, got {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise ConfigurationError(f"{name} must be positive, got {value!r}")
        if name.startswith("max_") and not isinstance(value, int):
            raise ConfigurationError(f"{name} must be an int, got {value!r}")
    return AdkLimits(**given)


def _text(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise ConfigurationError(f"{field} must be a str, got {type(value).__name__}")
    return value


def _optional_text(value: object, field: str) -> str | None:
    return None if value is None else _text(value, field)


def _check_json(value: object, where: str) -> None:
    """Refuse a value that JSON would not give back as it is (type included)."""
    if value is None or isinstance(value, str | bool | int):
        return
    if isinstance(value, float):
        if math.isfinite(value):
            return
        problem = f"the float {value!r} (JSON has no NaN or infinity)"
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]")
        return
    elif isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise ConfigurationError(
                    f"{where} has the key {k!r} ({type(k).__name__}); JSON object keys are "
                    "strings. Nothing was written"
                )
            _check_json(item, f"{where}[{k!r}]")
        return
    else:
        problem = f"a {type(value).__name__}"
    raise ConfigurationError(
        f"{where} is {problem}, which would not read back as it is from JSON; store JSON "
        "values only (dict, list, str, int, float, bool, None). Nothing was written"
    )


def _split(state: Mapping[str, Any], where: str) -> tuple[dict[str, Any], ...]:
    """(app, user, session) deltas of ``state`` without their prefixes; ``temp:`` dropped."""
    app: dict[str, Any] = {}
    user: dict[str, Any] = {}
    session: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise ConfigurationError(f"{where} has the key {key!r}; state keys are strings")
        if key.startswith(State.TEMP_PREFIX):
            continue
        _check_json(value, f"{where}[{key!r}]")
        if key.startswith(State.APP_PREFIX):
            app[key.removeprefix(State.APP_PREFIX)] = value
        elif key.startswith(State.USER_PREFIX):
            user[key.removeprefix(State.USER_PREFIX)] = value
        else:
            session[key] = value
    return app, user, session


def _merged(
    record: SessionRecord, app: Mapping[str, Any], user: Mapping[str, Any]
) -> dict[str, Any]:
    state = dict(record.state)
    state.update({State.APP_PREFIX + k: v for k, v in app.items()})
    state.update({State.USER_PREFIX + k: v for k, v in user.items()})
    return state


def _marker(session: Session, revision: int) -> None:
    session._storage_update_marker = str(revision)


class ToubaSessionService(AsyncClosing, BaseSessionService):
    """An ADK ``BaseSessionService`` on touba's stores (see the module docstring).

    Make one with :meth:`memory`, :meth:`sqlite`, :meth:`postgres` or
    :meth:`redis`; the store opens on first use and closes with :meth:`close`
    (or ``async with``).
    """

    def __init__(
        self,
        backend: AdkBackend,
        *,
        clock: Callable[[], float] = time.time,
        share_events: bool = False,
    ) -> None:
        """Serve sessions from ``backend`` (an ``AdkBackend``); ``clock`` gives epoch seconds.

        ``share_events=True``: whole-session reads share Event objects (see the module).
        """
        if not isinstance(share_events, bool):
            raise ConfigurationError(f"share_events must be a bool, got {share_events!r}")
        self._backend = backend
        self._clock = clock
        self._last_purge = -math.inf
        self._shared = SharedEvents() if share_events else None

    # --- constructors ---

    @classmethod
    def memory(cls, *, share_events: bool = False, **limits: Any) -> ToubaSessionService:
        """Sessions in this process's memory (tests, development). ``limits``: see the module."""
        from touba.integrations.adk._memory import MemoryAdkBackend

        return cls(MemoryAdkBackend(_limits(limits)), share_events=share_events)

    @classmethod
    def sqlite(
        cls, path: str | os.PathLike[str], *, share_events: bool = False, **limits: Any
    ) -> ToubaSessionService:
        """Sessions in a private SQLite file at ``path`` (0600, WAL), opened on first use.

        Raises ``ConfigurationError`` for an unknown or invalid bound; an unsafe
        location is refused (``DecisionHistoryStorageUnsafe``) when the file opens.
        """
        from touba.integrations.adk._sqlite import SqliteAdkBackend

        return cls(SqliteAdkBackend(path, _limits(limits)), share_events=share_events)

    @classmethod
    def postgres(
        cls,
        dsn: str,
        *,
        table_prefix: str = "touba_adk",
        share_events: bool = False,
        deadline_seconds: float = STORE_DEADLINE_SECONDS,
        **limits: Any,
    ) -> ToubaSessionService:
        """Sessions in PostgreSQL tables named ``<table_prefix>_...``, opened on first use.

        ``table_prefix`` may be schema-qualified (``"myschema.adk"``).
        ``deadline_seconds`` bounds each store call (a silent network fails it with
        the retryable ``DecisionHistoryStoreUnavailable`` within that time). Needs
        ``pip install "touba[postgres]"``.
        """
        module = importlib.import_module("touba.integrations.adk._postgres")
        backend: AdkBackend = module.PostgresAdkBackend(
            dsn,
            table_prefix=table_prefix,
            limits=_limits(limits),
            deadline_seconds=deadline_seconds,
        )
        return cls(backend, share_events=share_events)

    @classmethod
    def redis(
        cls,
        url: str,
        *,
        prefix: str = "touba:adk:",
        share_events: bool = False,
        deadline_seconds: float = STORE_DEADLINE_SECONDS,
        **limits: Any,
    ) -> ToubaSessionService:
        """Sessions in Redis under keys starting with ``prefix``, connected on first use.

        ``deadline_seconds`` (default 10) bounds each round trip: past it the call
        fails with the retryable ``DecisionHistoryStoreUnavailable``. Needs
        ``pip install "touba[redis]"``.
        """
        module = importlib.import_module("touba.integrations.adk._redis")
        backend: AdkBackend = module.RedisAdkBackend(
            url, prefix=prefix, limits=_limits(limits), deadline_seconds=deadline_seconds
        )
        return cls(backend, share_events=share_events)

    # --- lifecycle ---

    async def close(self) -> None:
        """Close the store; idempotent. Later calls raise ``ConfigurationError``."""
        await self._backend.close()

    # --- ADK's interface ---

    async def create_session(
        self,
        *,
        app_name: str,
        user_id: str,
        state: dict[str, Any] | None = None,
        session_id: str | None = None,
    ) -> Session:
        """Create a session (see ADK); ``AlreadyExistsError`` for a stored id.

        ``state`` keys go to their scope (``temp:`` ones are dropped); values must
        be JSON values (else ``ConfigurationError``, nothing written).
        ``DecisionHistoryLimitExceeded`` when ``max_sessions`` are stored.
        """
        _text(app_name, "app_name")
        _text(user_id, "user_id")
        given = _optional_text(session_id, "session_id")
        if state is not None and not isinstance(state, dict):
            raise ConfigurationError(f"state must be a dict, got {type(state).__name__}")
        app, user, own = _split(state or {}, "state")
        key = SessionKey(app_name, user_id, (given or "").strip() or platform_uuid.new_uuid())
        now = self._clock()
        await self._purge_now_and_then(now)
        read = await self._backend.create(
            key, state=own, app_delta=app, user_delta=user, create_time=now, now=now
        )
        return self._session(read, [])

    async def get_session(
        self,
        *,
        app_name: str,
        user_id: str,
        session_id: str,
        config: GetSessionConfig | None = None,
    ) -> Session | None:
        """The session with the events ``config`` asks for (all by default), or None.

        Reads only those events: the newest ``num_recent_events`` (0: none) of
        those with ``timestamp >= after_timestamp``.
        """
        key = self._key(app_name, user_id, session_id)
        recent = config.num_recent_events if config is not None else None
        after = config.after_timestamp if config is not None else None
        read = await self._backend.read(key, recent=recent, after=after, now=self._clock())
        if read is None:
            return None
        if self._shared is None:
            events = decode_all([e.data for e in read.events], key.session_id)
        else:
            events = self._shared.events(
                key,
                [(e.event_id, e.data) for e in read.events],
                key.session_id,
                whole=recent is None and after is None,
            )
        return self._session(read, events)

    async def list_sessions(
        self, *, app_name: str, user_id: str | None = None
    ) -> ListSessionsResponse:
        """The sessions of the app (of ``user_id`` only, when given), without events.

        Least recently updated first, each with its merged state.
        """
        _text(app_name, "app_name")
        _optional_text(user_id, "user_id")
        listed = await self._backend.list_sessions(app_name, user_id, now=self._clock())
        # Each listed session is a copy of one validated template with its own fields
        # (pydantic's model_copy, no validation: the fields are a backend's str, float and
        # fresh dict and list), and each user's prefixed app and user state is built once:
        # the same sessions as one Session(...) each, in about 60% of the time.
        app_state = {State.APP_PREFIX + k: v for k, v in listed.app_state.items()}
        shared: dict[str, dict[str, Any]] = {}
        template = Session(id="", app_name=app_name, user_id="", state={}, events=[])
        sessions = []
        for record in listed.sessions:
            user_id_ = record.key.user_id
            prefixed = shared.get(user_id_)
            if prefixed is None:
                user_state = listed.user_states.get(user_id_, {})
                prefixed = shared[user_id_] = {
                    **app_state,
                    **{State.USER_PREFIX + k: v for k, v in user_state.items()},
                }
            session = template.model_copy(
                update={
                    "id": record.key.session_id,
                    "app_name": record.key.app_name,
                    "user_id": user_id_,
                    "state": {**record.state, **prefixed},
                    "events": [],
                    "last_update_time": float(record.update_time),
                }
            )
            _marker(session, record.revision)
            sessions.append(session)
        return ListSessionsResponse(sessions=sessions)

    async def delete_session(self, *, app_name: str, user_id: str, session_id: str) -> None:
        """Delete the session and its events; an unknown id is a no-op."""
        key = self._key(app_name, user_id, session_id)
        await self._backend.delete(key)
        if self._shared is not None:
            self._shared.forget(key)

    async def get_user_state(self, *, app_name: str, user_id: str) -> dict[str, Any]:
        """The user's state, keys without ``user:``; ``{}`` when none."""
        _text(app_name, "app_name")
        _text(user_id, "user_id")
        return dict(await self._backend.read_user_state(app_name, user_id))

    async def append_event(self, session: Session, event: Event) -> Event:
        """Store ``event`` in ``session`` and apply it to the passed ``session`` object.

        A partial event is returned unstored. Raises ``SessionNotFoundError``
        (absent, deleted, expired), ``StaleSessionError`` (an outdated copy),
        ``DecisionHistoryBusy`` (held by another run's ``exclusive()``),
        ``DecisionHistoryLimitExceeded`` (a bound), ``ConfigurationError`` (a value
        that would not round-trip, named); on any of them nothing is written and
        ``session`` and ``event`` are left as they were.
        """
        if not isinstance(session, Session):
            raise ConfigurationError(
                f"session must be an ADK Session, got {type(session).__name__}"
            )
        if not isinstance(event, Event):
            raise ConfigurationError(f"event must be an ADK Event, got {type(event).__name__}")
        if event.partial:
            return event
        key = self._key(session.app_name, session.user_id, session.id)
        delta = dict(event.actions.state_delta) if event.actions.state_delta else {}
        kept = {k: v for k, v in delta.items() if not k.startswith(State.TEMP_PREFIX)}
        app, user, own = _split(kept, "event.actions.state_delta")
        stored = event.model_copy(
            update={"actions": event.actions.model_copy(update={"state_delta": kept})}
        )
        data = encode(stored)
        expected_revision, expected_time = self._expected(session)
        exclusive = _EXCLUSIVE.get()
        owner = exclusive[2] if exclusive is not None and exclusive[:2] == (id(self), key) else None
        result = await self._backend.append(
            key,
            AppendRequest(
                event=StoredEvent(event.id, event.timestamp, data),
                update_time=event.timestamp,
                now=self._clock(),
                app_delta=app,
                user_delta=user,
                session_delta=own,
                expected_revision=expected_revision,
                expected_update_time=expected_time,
                owner=owner,
            ),
        )
        if not result.appended:
            return event
        self._apply_temp_state(session, event)
        event.actions.state_delta = kept
        self._commit_event_to_session(session, event)
        session.last_update_time = result.update_time
        _marker(session, result.revision)
        return event

    # --- touba's additions ---

    @contextlib.asynccontextmanager
    async def exclusive(
        self, *, app_name: str, user_id: str, session_id: str
    ) -> AsyncIterator[None]:
        """Hold the session for the appends made inside the block (see "One writer").

        Raises ``SessionNotFoundError`` for an unknown session and
        ``DecisionHistoryBusy`` when another run holds it, before the block runs.
        """
        key = self._key(app_name, user_id, session_id)
        current = _EXCLUSIVE.get()
        if current is not None and current[:2] == (id(self), key):
            raise ConfigurationError("this task already holds the session with exclusive()")
        owner = secrets.token_hex(16)
        await self._backend.hold(key, owner, now=self._clock())
        token = _EXCLUSIVE.set((id(self), key, owner))
        try:
            yield
        except BaseException:
            _EXCLUSIVE.reset(token)
            # the block's error is the one to see; a hold left by a failed release
            # expires after hold_seconds (or recover() drops it)
            with contextlib.suppress(Exception):
                await self._backend.release(key, owner)
            raise
        _EXCLUSIVE.reset(token)
        await self._backend.release(key, owner)

    async def recover(self, *, app_name: str, user_id: str, session_id: str) -> bool:
        """Drop the session's hold (left by a run that crashed); True when there was one."""
        return await self._backend.recover(self._key(app_name, user_id, session_id))

    async def purge_expired(self) -> int:
        """Delete the sessions past their ``ttl_seconds`` now; return how many."""
        now = self._clock()
        self._last_purge = now
        return await self._backend.purge_expired(now=now)

    # --- helpers ---

    async def _purge_now_and_then(self, now: float) -> None:
        if now - self._last_purge >= PURGE_EVERY_SECONDS:
            self._last_purge = now
            await self._backend.purge_expired(now=now)

    @staticmethod
    def _key(app_name: object, user_id: object, session_id: object) -> SessionKey:
        return SessionKey(
            _text(app_name, "app_name"),
            _text(user_id, "user_id"),
            _text(session_id, "session_id").strip(),
        )

    @staticmethod
    def _expected(session: Session) -> tuple[int | None, float | None]:
        marker = session._storage_update_marker
        if marker is not None:
            with contextlib.suppress(ValueError):
                return int(marker), None
        return None, session.last_update_time

    @staticmethod
    def _session(read: SessionRead, events: list[Event]) -> Session:
        record = read.session
        session = Session(
            id=record.key.session_id,
            app_name=record.key.app_name,
            user_id=record.key.user_id,
            state=_merged(record, read.app_state, read.user_state),
            events=[],
            last_update_time=record.update_time,
        )
        # the decoded events are ADK Events already: assigned, not validated again as a list
        session.events = events
        _marker(session, record.revision)
        return session
