"""``RedisAdkBackend``: ADK sessions in Redis, shared by every worker and host.

Behaviour decisions:

- **One script per step.** Every method is one Lua script (``adk/lua/*.lua``, the
  shared ``_prelude.lua`` first), so each step is atomic and one round trip: a
  create with its capacity check, an append with its checks (absent, duplicate
  id, hold, stale, bounds) and every write it makes, a read of the session row,
  its three states and the events asked as one snapshot.
- **Layout.** Every key starts with ``prefix`` and one hash tag for the whole store
  (``{<10 hex of sha256(prefix)>}``), so the store lives in one cluster slot and a
  script may touch the app state, the user state and the session together (and
  count the store's sessions for ``max_sessions``). Apps, users and sessions are
  named by digests of their ids, so any character is safe in an id and never
  reaches a key name (the layout is in ``lua/_prelude.lua``).
- **Events** are a sorted set (id -> timestamp: ordered by timestamp, ties by id)
  beside a hash (id -> the event's JSON text): an append is a ZADD and an HSET,
  O(log N); ``read(recent=k)`` is one ZRANGE of k ids and one HMGET of their texts;
  ``after`` is a ZRANGEBYSCORE. State is a hash per scope (key -> JSON value), so
  a delta is an HSET of the keys it names, whatever the size of the state.
- **Listing** reads the app's (or the user's) index of sessions, sorted by update
  time, with each session's row and state and each listed user's state, in one
  script that answers one JSON text (the stored state values spliced in as they
  are): no event is read, and 5,000 sessions are one round trip and one parse.
- **Time.** Expiry and holds are judged by the caller's ``now``. Redis's own expiry
  backs it up: a session's keys expire ``ttl_seconds`` (plus a second of grace)
  after its last write, counted on Redis's clock, so an abandoned session leaves
  nothing behind even if nobody purges. The indexes keep an entry until a purge
  (every create purges a few expired sessions, ``purge_expired`` all of them); a
  listed entry whose keys Redis already removed is skipped. App and user state
  never expire.
- **Retries.** The client made from ``url`` sends a command again on a new
  connection when its connection failed (redis-py's retry, twice). That is safe:
  an append run twice finds its event id stored (``appended=False``), a create
  run twice finds its own token. After the retries, or with a ``client`` of
  yours, a failure is ``DecisionHistoryStoreUnavailable`` (retryable, redis-py's
  error chained), and the write is whole or absent.
- **Deadline.** Every step (one round trip, retries included) runs under
  ``deadline_seconds`` (:mod:`touba.history._redis_client`): a silent network fails
  it with ``DecisionHistoryStoreUnavailable`` within that time, whichever client
  is used. A step cut short may have run on the server (its reply was lost): run
  again, it finds its work done, as after a retry. A hold (``exclusive()``) whose
  release could not be sent expires as any hold does.
- **Eviction.** Run Redis with ``maxmemory-policy noeviction`` (as for any store of
  record): a write Redis refuses for memory changes nothing (the script fails at
  its first write, before any other), while a key evicted under another policy
  surfaces as ``DecisionHistoryRecordInvalid`` (an event id without its text) or
  as a session gone.
- **Cluster.** A ``redis.asyncio.RedisCluster`` client works as is: one slot per
  store means one node serves a store (sharding is by prefix, not by session).
- **Where ADK's own ``RedisSessionService`` differs** (``google.adk.integrations.redis``):
  it keeps a session as one JSON value, so ``get_session`` reads and parses every
  event and ``append_event`` reads, parses and rewrites all of them (in a WATCH
  transaction, with no stale check); it lists with a SCAN of the whole keyspace
  and one GET per session; its app and user state expire with its TTL (7 days by
  default). Here an append and a read of k events cost the same at any length,
  a list is one script over the app's index, stale copies are refused, and app
  and user state never expire (the protocol's rule on every touba store).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from importlib.resources import files
from typing import TYPE_CHECKING, Any, Final

from google.adk.errors import StaleSessionError

from touba.errors import (
    ConfigurationError,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStoreUnavailable,
)
from touba.history._deadline import STORE_DEADLINE_SECONDS, check_deadline
from touba.history._model import parse_json
from touba.history._redis_client import bounded, no_answer, redis_client, slot_base
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
    STALE_MESSAGE,
    already_exists,
    check_event_bytes,
    check_hold,
    check_hold_for,
    check_session_bytes,
    check_sessions,
    not_found,
)

try:
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError
except ImportError as e:  # pragma: no cover - exercised by the history store's test
    raise ImportError(
        'ToubaSessionService.redis needs redis-py; install it with: pip install "touba[redis]"'
    ) from e

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript

__all__ = ["RedisAdkBackend"]

GRACE_MS: Final = 1000  # Redis expires a session's keys this long after touba would
PURGE_BATCH: Final = 500  # most sessions one purge script drops
_SCRIPTS: Final = (
    "create",
    "read",
    "append",
    "list",
    "delete",
    "hold",
    "release",
    "recover",
    "purge",
)

Client = aioredis.Redis | aioredis.RedisCluster


@functools.cache
def _source(name: str) -> bytes:
    """``lua/<name>.lua`` after the prelude every script starts with, read once."""
    folder = files("touba.integrations.adk").joinpath("lua")
    prelude = folder.joinpath("_prelude.lua").read_text("utf-8")
    return (prelude + folder.joinpath(f"{name}.lua").read_text("utf-8")).encode("utf-8")


def _digest(*names: str) -> str:
    """32 hex naming a tuple of ids (unambiguous: the ids as one JSON array)."""
    text = json.dumps(names, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _number(value: float, field: str = "now") -> str:
    """A float as Lua and Redis parse it back exactly (Python's shortest repr);
    ConfigurationError naming ``field`` when it is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigurationError(f"{field} must be a finite number, got {value!r}")
    return repr(float(value))


def _optional(value: float | int | None) -> str:
    return "" if value is None else str(value)


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _damaged(what: str, key: str) -> DecisionHistoryRecordInvalid:
    return DecisionHistoryRecordInvalid(
        f"{what} of ADK session {key} in Redis is not what touba wrote; it was not "
        "modified. Inspect or delete the session"
    )


def _pairs(values: Mapping[str, JsonValue], what: str) -> list[str | int]:
    """A state mapping as a script's pair list: its length, then name, JSON text..."""
    out: list[str | int] = [len(values)]
    for name, value in values.items():
        if not isinstance(name, str):
            raise ConfigurationError(f"{what} keys must be str, got {name!r}")
        try:
            out += [name, json.dumps(value, ensure_ascii=False, allow_nan=False)]
        except (TypeError, ValueError) as e:
            raise ConfigurationError(
                f"{what}[{name!r}] is not a JSON value ({e}); nothing was written"
            ) from e
    return out


def _state(flat: Sequence[Any], what: str, key: str) -> dict[str, JsonValue]:
    """An HGETALL of a state hash (name, JSON text, ...) as a dict."""
    out: dict[str, JsonValue] = {}
    for i in range(0, len(flat), 2):
        try:
            out[_text(flat[i])] = parse_json(_text(flat[i + 1]))
        except (ValueError, UnicodeDecodeError):
            raise _damaged(f"a value of the {what}", key) from None
    return out


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("not a str")
    return value


def _object(value: Any) -> dict[str, JsonValue]:
    if not isinstance(value, dict):
        raise TypeError("not an object")
    return value


def _listed(app_name: str, row: Any, now: float) -> SessionRecord:
    """One session of list.lua's reply (raises ValueError/TypeError when damaged)."""
    user, session, created, updated, revision, count, size, expires, holder, until, state = row
    held = holder is not None and until is not None and float(until) > now
    return SessionRecord(
        key=SessionKey(app_name, _str(user), _str(session)),
        state=_object(state),
        create_time=float(created),
        update_time=float(updated),
        revision=int(revision),
        event_count=int(count),
        byte_count=int(size),
        expires_at=None if expires is None else float(expires),
        holder=_str(holder) if held else None,
    )


_AFTER: Final = (
    "Check the server and retry: the step was written whole or not at all (an append "
    "retried with the same event id is stored once)"
)


@asynccontextmanager
async def _driver_errors(what: str, seconds: float, client: Client) -> AsyncIterator[None]:
    """The one place where redis-py exceptions, and a deadline that expired, become
    touba errors: the body runs under a deadline of ``seconds``."""
    try:
        async with bounded(seconds, client):
            yield
    except RedisError as e:
        raise DecisionHistoryStoreUnavailable(
            f"Redis failed during {what} ({type(e).__name__}: {e}). {_AFTER}"
        ) from e
    except TimeoutError as e:
        raise DecisionHistoryStoreUnavailable(f"{no_answer(what, seconds)}. {_AFTER}") from e


class _Names:
    """The keys of one session, its app and its user (see ``lua/_prelude.lua``)."""

    __slots__ = ("app_index", "app_state", "member", "session", "user_index", "user_state")

    def __init__(self, base: str, key: SessionKey) -> None:
        aid = _digest(key.app_name)
        uid = _digest(key.app_name, key.user_id)
        sid = _digest(key.app_name, key.user_id, key.session_id)
        self.member = sid + aid + uid
        self.app_state = f"{base}a:{aid}:state"
        self.app_index = f"{base}a:{aid}:index"
        self.user_state = f"{base}u:{uid}:state"
        self.user_index = f"{base}u:{uid}:index"
        self.session = f"{base}s:{sid}"

    @property
    def session_keys(self) -> list[str]:
        s = self.session
        return [s, s + ":state", s + ":events", s + ":data"]


class RedisAdkBackend:
    """ADK sessions in Redis (an :class:`~touba.integrations.adk._backend.AdkBackend`).

    Give exactly one of ``url`` (the backend makes the client, which retries a
    command twice on a failed connection, and closes it) or ``client`` (a
    ``redis.asyncio.Redis`` or ``RedisCluster`` you own; ``close()`` leaves it
    open). Every key starts with ``prefix`` (no braces: the backend adds its own
    hash tag); two prefixes never see each other's data. Nothing connects before
    the first call. Needs Redis 5 or later. ``deadline_seconds`` bounds each step
    (see the module docstring).
    """

    def __init__(
        self,
        url: str | None = None,
        limits: AdkLimits | None = None,
        *,
        prefix: str = "touba:adk:",
        client: Client | None = None,
        deadline_seconds: float = STORE_DEADLINE_SECONDS,
    ) -> None:
        self._base = slot_base(prefix, owner="backend")
        if limits is not None and not isinstance(limits, AdkLimits):
            raise ConfigurationError(f"limits must be an AdkLimits, got {type(limits).__name__}")
        self.deadline_seconds = check_deadline(deadline_seconds, owner="RedisAdkBackend")
        self._client, self._owns_client = redis_client(
            url, client, owner="RedisAdkBackend", deadline=self.deadline_seconds
        )
        self.prefix = prefix
        self.limits = limits if limits is not None else AdkLimits()
        self._all = self._base + "all"
        self._scripts: dict[str, AsyncScript] = {
            name: self._client.register_script(_source(name)) for name in _SCRIPTS
        }
        self._closed = False

    async def close(self) -> None:
        """Close the client if this backend made it (from ``url``); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            async with _driver_errors("close", self.deadline_seconds, self._client):
                await self._client.aclose()

    # -- internals ---------------------------------------------------------------

    async def _run(
        self, name: str, keys: Sequence[str], args: Sequence[str | int | bytes], what: str
    ) -> Any:
        if self._closed:
            raise ConfigurationError("this RedisAdkBackend is closed; create a new one")
        try:
            async with _driver_errors(what, self.deadline_seconds, self._client):
                return await self._scripts[name](keys=keys, args=(self._base, *args))
        except UnicodeEncodeError as e:  # redis-py encodes every argument before sending
            raise ConfigurationError(
                f"{what}: a name or value is not valid UTF-8 text ({e.reason}: a lone "
                "surrogate?); nothing was sent"
            ) from e

    def _expiry(self, now: float) -> tuple[str, str]:
        """(expires_at, Redis's expiry in ms) of a write at ``now``; ('', '') without a TTL."""
        ttl = self.limits.ttl_seconds
        if ttl is None:
            return "", ""
        return _number(now + ttl), str(max(1, math.ceil(ttl * 1000)) + GRACE_MS)

    def _record(
        self, key: SessionKey, row: Sequence[Any], state: Sequence[Any], now: float
    ) -> SessionRecord:
        """A session row (the prelude's FIELDS) and its state as a SessionRecord."""
        where = busy_key(key)
        try:
            values = ["" if v is None else _text(v) for v in row]  # "": no such field
            _app, _user, _session, created, updated, revision, count, size = values[:8]
            expires, holder, hold_until = values[8:11]
            live = holder if holder and hold_until and float(hold_until) > now else None
            return SessionRecord(
                key=key,
                state=_state(state, "session state", where),
                create_time=float(created),
                update_time=float(updated),
                revision=int(revision),
                event_count=int(count),
                byte_count=int(size),
                expires_at=float(expires) if expires else None,
                holder=live,
            )
        except (ValueError, TypeError, UnicodeDecodeError):
            raise _damaged("the session row", where) from None

    # -- the protocol --------------------------------------------------------------

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
        """``AdkBackend.create``: create.lua, one round trip; run twice (a retry after a
        lost reply) it finds its own token and answers as the first run did."""
        names = _Names(self._base, key)
        expires_at, expire_ms = self._expiry(now)
        keys = (
            self._all,
            names.app_state,
            names.app_index,
            names.user_state,
            names.user_index,
            *names.session_keys[:2],
        )
        args = (
            _number(now),
            uuid.uuid4().hex,
            names.member,
            _number(create_time, "create_time"),
            expires_at,
            expire_ms,
            _optional(self.limits.max_sessions),
            key.app_name,
            key.user_id,
            key.session_id,
            *_pairs(state, "state"),
            *_pairs(app_delta, "app state"),
            *_pairs(user_delta, "user state"),
        )
        reply = await self._run("create", keys, args, "a create")
        status = _text(reply[0])
        if status == "exists":
            raise already_exists(key)
        if status == "full":
            check_sessions(self.limits, int(reply[1]))
            raise AssertionError("create.lua found the store full")  # pragma: no cover
        where = busy_key(key)
        record = SessionRecord(
            key=key,
            state=json.loads(json.dumps(dict(state))),  # detached, as stored
            create_time=float(create_time),
            update_time=float(create_time),
            revision=0,
            event_count=0,
            byte_count=0,
            expires_at=float(expires_at) if expires_at else None,
        )
        return SessionRead(
            record, _state(reply[1], "app state", where), _state(reply[2], "user state", where)
        )

    async def read(
        self, key: SessionKey, *, recent: int | None, after: float | None, now: float
    ) -> SessionRead | None:
        """``AdkBackend.read``: read.lua, one round trip reading only the events asked."""
        if recent is not None and (not isinstance(recent, int) or recent < 0):
            raise ConfigurationError(f"recent must be None or an int >= 0, got {recent!r}")
        names = _Names(self._base, key)
        keys = (*names.session_keys, names.app_state, names.user_state)
        args = (_number(now), _optional(recent), "" if after is None else _number(after, "after"))
        reply = await self._run("read", keys, args, "a read")
        if _text(reply[0]) != "found":
            return None
        _status, row, state, app, user, listed, data = reply
        where = busy_key(key)
        events = []
        try:
            for i, body in enumerate(data):
                if body is None:
                    raise ValueError("an event without its text")
                events.append(
                    StoredEvent(_text(listed[2 * i]), float(listed[2 * i + 1]), _text(body))
                )
        except (ValueError, UnicodeDecodeError):
            raise _damaged("an event", where) from None
        return SessionRead(
            self._record(key, row, state, now),
            _state(app, "app state", where),
            _state(user, "user state", where),
            events,
        )

    async def list_sessions(self, app_name: str, user_id: str | None, *, now: float) -> SessionList:
        """``AdkBackend.list_sessions``: list.lua, one round trip whose reply is one JSON
        text (parsed at C speed, whatever the number of sessions); no event is read."""
        probe = _Names(self._base, SessionKey(app_name, user_id or "", ""))
        index = probe.app_index if user_id is None else probe.user_index
        reply = await self._run("list", (index, probe.app_state), (_number(now),), "a list")
        try:
            listed = parse_json(_text(reply))
            sessions = [_listed(app_name, row, now) for row in listed["sessions"]]
            user_states = {_str(user): _object(state) for user, state in listed["users"]}
            app = _object(listed["app"])
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            raise _damaged("a listed session", f"{app_name}/*") from None
        sessions.sort(key=lambda s: (s.update_time, s.key.user_id, s.key.session_id))
        return SessionList(app, user_states, sessions)

    async def read_user_state(self, app_name: str, user_id: str) -> Mapping[str, JsonValue]:
        """``AdkBackend.read_user_state``: one HGETALL."""
        name = _Names(self._base, SessionKey(app_name, user_id, "")).user_state
        if self._closed:
            raise ConfigurationError("this RedisAdkBackend is closed; create a new one")
        async with _driver_errors("a read", self.deadline_seconds, self._client):
            flat = await self._client.hgetall(name)
        pairs = [v for item in flat.items() for v in item]
        return _state(pairs, "user state", f"{app_name}/{user_id}")

    async def append(self, key: SessionKey, request: AppendRequest) -> AppendResult:
        """``AdkBackend.append``: append.lua, one round trip, O(log N) in the events."""
        names = _Names(self._base, key)
        limits = self.limits
        event = request.event
        try:
            data = event.data.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ConfigurationError(
                f"event {event.event_id!r}: its JSON is not valid UTF-8 text ({e.reason}); "
                "nothing was written"
            ) from e
        expires_at, expire_ms = self._expiry(request.now)
        keys = (
            *names.session_keys,
            names.app_state,
            names.user_state,
            self._all,
            names.app_index,
            names.user_index,
        )
        args = (
            _number(request.now),
            names.member,
            event.event_id,
            _number(event.timestamp, "event.timestamp"),
            data,
            len(data),
            _number(request.update_time, "update_time"),
            expires_at,
            expire_ms,
            _optional(request.expected_revision),
            (
                ""
                if request.expected_update_time is None
                else _number(request.expected_update_time, "expected_update_time")
            ),
            request.owner or "",
            "1" if request.release else "0",
            _number(request.now + limits.hold_seconds),
            _optional(limits.max_event_bytes),
            _optional(limits.max_session_bytes),
            *_pairs(request.session_delta, "state"),
            *_pairs(request.app_delta, "app state"),
            *_pairs(request.user_delta, "user state"),
        )
        reply = await self._run("append", keys, args, "an append")
        status = _text(reply[0])
        if status == "missing":
            raise not_found(key)
        if status == "busy":
            check_hold(key, _text(reply[1]), float(_text(reply[2])), request)
        if status == "stale":
            raise StaleSessionError(STALE_MESSAGE)
        if status == "limit":
            check_event_bytes(limits, len(data))
            check_session_bytes(limits, int(reply[1]), len(data))
        if status not in ("ok", "dup"):  # each refusal above raised
            raise AssertionError(f"append.lua answered {status!r}")  # pragma: no cover
        try:
            return AppendResult(
                appended=status == "ok",
                revision=int(reply[1]),
                update_time=float(_text(reply[2])),
                event_count=int(reply[3]),
                byte_count=int(reply[4]),
            )
        except (ValueError, TypeError, UnicodeDecodeError):
            raise _damaged("the session row", busy_key(key)) from None

    async def delete(self, key: SessionKey) -> None:
        """``AdkBackend.delete``: delete.lua (a no-op for an unknown key)."""
        names = _Names(self._base, key)
        keys = (self._all, *names.session_keys, names.app_index, names.user_index)
        await self._run("delete", keys, ("0", names.member), "a delete")

    async def hold(self, key: SessionKey, owner: str, *, now: float) -> None:
        """``AdkBackend.hold``: hold.lua, one round trip (run twice: refreshed twice)."""
        if not isinstance(owner, str) or not owner:
            raise ConfigurationError(f"owner must be a non-empty str, got {owner!r}")
        session = _Names(self._base, key).session
        until = _number(now + self.limits.hold_seconds)
        reply = await self._run("hold", (session,), (_number(now), owner, until), "a hold")
        status = _text(reply[0])
        if status == "missing":
            raise not_found(key)
        if status == "busy":
            check_hold_for(key, _text(reply[1]), float(_text(reply[2])), owner, now)
            raise AssertionError("hold.lua found another holder")  # pragma: no cover

    async def release(self, key: SessionKey, owner: str) -> bool:
        """``AdkBackend.release``: release.lua; True when ``owner``'s hold was cleared."""
        session = _Names(self._base, key).session
        return int(await self._run("release", (session,), ("0", owner), "a release")) == 1

    async def recover(self, key: SessionKey) -> bool:
        """``AdkBackend.recover``: recover.lua; True when a hold was dropped."""
        names = _Names(self._base, key)
        return int(await self._run("recover", (names.session,), ("0",), "a recover")) == 1

    async def purge_expired(self, *, now: float) -> int:
        """``AdkBackend.purge_expired``: purge.lua, O(sessions purged), in scripts of at
        most ``PURGE_BATCH`` sessions each (Redis serves others in between)."""
        total = 0
        while True:
            args = (_number(now), PURGE_BATCH)
            purged = int(await self._run("purge", (self._all,), args, "a purge"))
            total += purged
            if purged < PURGE_BATCH:
                return total
