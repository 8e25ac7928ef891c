"""The RAM backend of ToubaSessionService: nothing survives the process.

Each call runs to its end without awaiting, so it is atomic on the event loop.
State values are kept as their JSON text and decoded on read, so what comes
back is a detached copy with the same JSON types a durable store gives (a tuple
reads back as a list, as it does from SQLite). A session's events are kept in
``(timestamp, event_id)`` order with a parallel key list for bisection: an
append in order is O(1) amortised, a read of the newest k or of those after a
timestamp is O(k + log N).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from touba.errors import ConfigurationError
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
    hold_after,
    is_expired,
    is_held,
    not_found,
)

__all__ = ["MemoryAdkBackend"]

_State = dict[str, str]  # key -> the value's JSON text


def _encode(delta: Mapping[str, JsonValue]) -> _State:
    return {k: json.dumps(v, ensure_ascii=False, allow_nan=False) for k, v in delta.items()}


def _decode(state: _State) -> dict[str, JsonValue]:
    return {k: json.loads(v) for k, v in state.items()}


@dataclass(slots=True)
class _Session:
    state: _State
    create_time: float
    update_time: float
    expires_at: float | None
    revision: int = 0
    byte_count: int = 0
    holder: str | None = None
    hold_until: float | None = None
    keys: list[tuple[float, str]] = field(default_factory=list)
    events: list[StoredEvent] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)

    def record(self, key: SessionKey, now: float) -> SessionRecord:
        live = is_held(self.holder, self.hold_until, now)
        return SessionRecord(
            key=key,
            state=_decode(self.state),
            create_time=self.create_time,
            update_time=self.update_time,
            revision=self.revision,
            event_count=len(self.events),
            byte_count=self.byte_count,
            expires_at=self.expires_at,
            holder=self.holder if live else None,
        )


class MemoryAdkBackend:
    """ADK sessions in this process's memory (see the module docstring)."""

    def __init__(self, limits: AdkLimits | None = None) -> None:
        self._limits = limits if limits is not None else AdkLimits()
        self._sessions: dict[SessionKey, _Session] = {}
        self._apps: dict[str, _State] = {}
        self._users: dict[tuple[str, str], _State] = {}
        self._closed = False

    def _open(self) -> None:
        if self._closed:
            raise ConfigurationError("this ADK session backend is closed; create a new one")

    def _live(self, key: SessionKey, now: float) -> _Session | None:
        session = self._sessions.get(key)
        if session is None or is_expired(session.expires_at, now):
            return None
        return session

    def _read(self, key: SessionKey, session: _Session, now: float) -> SessionRead:
        return SessionRead(
            session=session.record(key, now),
            app_state=_decode(self._apps.get(key.app_name, {})),
            user_state=_decode(self._users.get((key.app_name, key.user_id), {})),
        )

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
        """See :meth:`AdkBackend.create`."""
        self._open()
        if self._live(key, now) is not None:
            raise already_exists(key)
        encoded = (_encode(state), _encode(app_delta), _encode(user_delta))  # may raise: first
        if self._limits.max_sessions is not None:
            live = sum(1 for s in self._sessions.values() if not is_expired(s.expires_at, now))
            if live >= self._limits.max_sessions:
                self._purge(now)
            check_sessions(self._limits, live)
        session = _Session(
            state=encoded[0],
            create_time=create_time,
            update_time=create_time,
            expires_at=expires_at(self._limits, now),
        )
        self._sessions[key] = session
        if encoded[1]:
            self._apps.setdefault(key.app_name, {}).update(encoded[1])
        if encoded[2]:
            self._users.setdefault((key.app_name, key.user_id), {}).update(encoded[2])
        return self._read(key, session, now)

    async def read(
        self, key: SessionKey, *, recent: int | None, after: float | None, now: float
    ) -> SessionRead | None:
        """See :meth:`AdkBackend.read`."""
        self._open()
        session = self._live(key, now)
        if session is None:
            return None
        start = 0 if after is None else bisect.bisect_left(session.keys, (after, ""))
        end = len(session.events)
        if recent is not None:
            start = max(start, end - recent)
        read = self._read(key, session, now)
        return SessionRead(read.session, read.app_state, read.user_state, session.events[start:])

    async def list_sessions(self, app_name: str, user_id: str | None, *, now: float) -> SessionList:
        """See :meth:`AdkBackend.list_sessions`."""
        self._open()
        found = [
            (key, s)
            for key, s in self._sessions.items()
            if key.app_name == app_name
            and (user_id is None or key.user_id == user_id)
            and not is_expired(s.expires_at, now)
        ]
        found.sort(key=lambda ks: (ks[1].update_time, ks[0].user_id, ks[0].session_id))
        users = {key.user_id for key, _ in found}
        return SessionList(
            app_state=_decode(self._apps.get(app_name, {})),
            user_states={u: _decode(self._users.get((app_name, u), {})) for u in users},
            sessions=[s.record(key, now) for key, s in found],
        )

    async def read_user_state(self, app_name: str, user_id: str) -> Mapping[str, JsonValue]:
        """See :meth:`AdkBackend.read_user_state`."""
        self._open()
        return _decode(self._users.get((app_name, user_id), {}))

    async def append(self, key: SessionKey, request: AppendRequest) -> AppendResult:
        """See :meth:`AdkBackend.append`."""
        self._open()
        session = self._live(key, request.now)
        if session is None:
            raise not_found(key)
        ev = request.event
        if ev.event_id in session.ids:
            return self._result(session, appended=False)
        check_hold(key, session.holder, session.hold_until, request)
        check_stale(session.revision, session.update_time, request)
        size = len(ev.data.encode())
        check_event_bytes(self._limits, size)
        check_session_bytes(self._limits, session.byte_count, size)
        deltas = (
            _encode(request.app_delta),
            _encode(request.user_delta),
            _encode(request.session_delta),
        )
        position = (ev.timestamp, ev.event_id)
        if not session.keys or session.keys[-1] < position:
            session.keys.append(position)
            session.events.append(ev)
        else:
            at = bisect.bisect_left(session.keys, position)
            session.keys.insert(at, position)
            session.events.insert(at, ev)
        session.ids.add(ev.event_id)
        if deltas[0]:
            self._apps.setdefault(key.app_name, {}).update(deltas[0])
        if deltas[1]:
            self._users.setdefault((key.app_name, key.user_id), {}).update(deltas[1])
        session.state.update(deltas[2])
        session.revision += 1
        session.update_time = request.update_time
        session.byte_count += size
        session.expires_at = expires_at(self._limits, request.now)
        session.holder, session.hold_until = hold_after(
            self._limits, session.holder, session.hold_until, request
        )
        return self._result(session, appended=True)

    @staticmethod
    def _result(session: _Session, *, appended: bool) -> AppendResult:
        return AppendResult(
            appended=appended,
            revision=session.revision,
            update_time=session.update_time,
            event_count=len(session.events),
            byte_count=session.byte_count,
        )

    async def delete(self, key: SessionKey) -> None:
        """See :meth:`AdkBackend.delete`."""
        self._open()
        self._sessions.pop(key, None)

    async def hold(self, key: SessionKey, owner: str, *, now: float) -> None:
        """See :meth:`AdkBackend.hold`."""
        self._open()
        session = self._live(key, now)
        if session is None:
            raise not_found(key)
        check_hold_for(key, session.holder, session.hold_until, owner, now)
        session.holder, session.hold_until = owner, now + self._limits.hold_seconds

    async def release(self, key: SessionKey, owner: str) -> bool:
        """See :meth:`AdkBackend.release`."""
        self._open()
        session = self._sessions.get(key)
        if session is None or session.holder != owner:
            return False
        session.holder = session.hold_until = None
        return True

    async def recover(self, key: SessionKey) -> bool:
        """See :meth:`AdkBackend.recover`."""
        self._open()
        session = self._sessions.get(key)
        if session is None or session.holder is None:
            return False
        session.holder = session.hold_until = None
        return True

    async def purge_expired(self, *, now: float) -> int:
        """See :meth:`AdkBackend.purge_expired`."""
        self._open()
        return self._purge(now)

    def _purge(self, now: float) -> int:
        gone = [k for k, s in self._sessions.items() if is_expired(s.expires_at, now)]
        for key in gone:
            del self._sessions[key]
        return len(gone)

    async def close(self) -> None:
        """Forget everything; idempotent. Later calls raise ConfigurationError."""
        self._closed = True
        self._sessions.clear()
        self._apps.clear()
        self._users.clear()
