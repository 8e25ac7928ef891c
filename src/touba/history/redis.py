"""``RedisHistoryStore``: conversations in Redis, shared by many workers and hosts.

Layout. Every key starts with ``prefix`` followed by one hash tag for the whole
store (``{<10 hex of sha256(prefix)>}``), so the store lives in one cluster
slot: capacity is a store-wide bound checked atomically, which a Lua script can
only do over keys of one slot. A conversation is named by the sha256 of its
session key (``<id>``), so any character (braces, colons, NUL, unicode) is safe
in a session key and never reaches a key name::

    P = prefix + "{tag}:"
    P + "sessions"              HASH  id -> bytes of its record (one field per record,
                                      "0" for a reserved key that has no record yet)
    P + "bytes"                 STR   total bytes of all records
    P + "expiry"                ZSET  id -> expires_at (ms, server clock); lazy purge
    P + "held"                  ZSET  id -> since (ms): reserved conversations
    P + "c:<id>:head"           HASH  key (JSON), head (JSON), split, messages, bytes,
                                      updated_at, expires_at, identity, namespace,
                                      last_token (the record's version: the token
                                      of the reservation that saved it); while
                                      reserved: token, worker_id, pid, host, since
    P + "c:<id>:messages"       LIST  one row per message: "[exchange,bytes,message]"
    P + "c:<id>:exchanges"      LIST  one entry per exchange: "first:count:bytes"

A touba record keeps its head in the head hash and its messages as rows; a
decision appends rows (RPUSH) and reads only the tail it needs. The claim
script returns, with the reservation, the entries of the last exchanges the
history layer weighed lately, and an LRANGE pipelined after it (same round
trip) the last rows of the window it read lately plus what a decision
appends; a read further back costs a round trip. So a decision is two round
trips, claim and commit, and what the claim carries is bounded by the window,
not by how far back anything was read. Any other JSON dict is kept whole in
``head``. A record's version changes on every save and never repeats (a
deleted and re-created key included): a claim given the version a client
holds returns neither entries nor rows when it is still current.

Every mutation is one Lua script, so it is atomic: claim (refuses at once when
held; a key without a record takes its place among ``max_sessions`` in
``sessions`` there, or is refused when they are all held), commit (token still
ours, capacity, save, clear the reservation), release, recover, delete and the
purge of expired, unreserved conversations that every script but
release/recover runs first. Time is Redis's ``TIME``, so workers on hosts with
skewed clocks agree on expiry. Redis's own key expiry is a backstop only: a
conversation's keys expire a minute after its ``expires_at`` and the store's
own keys a minute after the last conversation's (neither while a key is
reserved), so an abandoned prefix leaves nothing behind; the scripts tolerate
keys it removed. Claim and commit are idempotent (same token), so a command
that redis-py retries after a timeout is harmless.
Needs Redis 5 or later (scripts that read ``TIME`` and then write).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Self, TypeVar

from touba.errors import (
    ConfigurationError,
    DecisionHistoryLimitExceeded,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStoreUnavailable,
    ToubaError,
)
from touba.history._common import (
    MiB,
    Reservation,
    busy,
    check_capacity,
    check_key,
    check_limits_config,
    check_sessions,
    encode_checked_json,
    encode_json,
    encode_record,
    iso,
    recovered,
    require_worker_stopped,
)
from touba.history._model import parse_json
from touba.history._record import join_record
from touba.history._store import (
    LogOperation,
    LogWrite,
    Operation,
    Record,
    StoredConversation,
    StoreUsage,
    check_appends,
)
from touba.history._window import ExchangeSize

try:
    import redis.asyncio as aioredis
    from redis.exceptions import NoScriptError, RedisError
except ImportError as e:  # pragma: no cover - exercised by a test that hides redis
    raise ImportError(
        'touba.history.redis needs redis-py; install it with: pip install "touba[redis]"'
    ) from e

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript

__all__ = ["RedisHistoryStore"]

MAX_TAIL: Final = 1024  # most exchange entries read ahead with a claim
MAX_ROWS: Final = 1024  # most messages read ahead with a claim

T = TypeVar("T")
logger = logging.getLogger("touba.history")

Client = aioredis.Redis | aioredis.RedisCluster


# -- Lua ---------------------------------------------------------------------------
# KEYS of every store script: sessions, bytes, expiry, held, then (for scripts on
# one conversation) head, messages, exchanges. ARGV[1] is the key prefix P,
# ARGV[2] the conversation id. Checks come before the first write, so a refusal
# (or Redis refusing the first write when out of memory) changes nothing.

_PRELUDE: Final = """
local P = ARGV[1]
local SESSIONS, BYTES, EXPIRY, HELD = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local GRACE = 60000
local RECORD = {'head', 'split', 'messages', 'bytes', 'updated_at', 'expires_at',
                'identity', 'namespace', 'last_token'}
local HOLDER = {'token', 'worker_id', 'pid', 'host', 'since'}

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function conv(id)
  local c = P .. 'c:' .. id .. ':'
  return c .. 'head', c .. 'messages', c .. 'exchanges'
end

-- Forget the record of id, keeping its reservation if it has one.
local function drop(id)
  local h, m, x = conv(id)
  local size = redis.call('HGET', SESSIONS, id)
  if size then
    redis.call('DECRBY', BYTES, size)
    redis.call('HDEL', SESSIONS, id)
  end
  redis.call('ZREM', EXPIRY, id)
  redis.call('DEL', m, x)
  if redis.call('HEXISTS', h, 'token') == 1 then
    redis.call('HDEL', h, unpack(RECORD))
  else
    redis.call('DEL', h)
  end
end

-- Lazy purge: expired records go, unless a worker holds them.
local function purge(now)
  local n = 0
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', EXPIRY, '-inf', now)) do
    local h = conv(id)
    if redis.call('HEXISTS', h, 'token') == 0 then
      drop(id)
      n = n + 1
    end
  end
  return n
end

-- Places held (records and reserved new keys) and bytes retained.
local function usage()
  return {redis.call('HLEN', SESSIONS), tonumber(redis.call('GET', BYTES) or '0')}
end

local function holder(h)
  local v = redis.call('HMGET', h, 'worker_id', 'pid', 'host', 'since')
  return {'busy', v[1], v[2], v[3], v[4]}
end

-- The store's own keys follow the backstop too: kept while a key is held, else
-- expiring a grace after the last record does, so an abandoned prefix vanishes.
local function store_backstop()
  if redis.call('ZCARD', HELD) > 0 then
    for _, k in ipairs({SESSIONS, BYTES, EXPIRY, HELD}) do redis.call('PERSIST', k) end
    return
  end
  local last = redis.call('ZRANGE', EXPIRY, -1, -1, 'WITHSCORES')
  if #last == 0 then
    redis.call('DEL', SESSIONS, BYTES, EXPIRY)
    return
  end
  local at = string.format('%d', tonumber(last[2]) + GRACE)
  for _, k in ipairs({SESSIONS, BYTES, EXPIRY}) do redis.call('PEXPIREAT', k, at) end
end

-- Clear the reservation of id; restore the backstop expiry of its record
-- (``saved``: the expires_at a commit just wrote, in the future).
local function finish(id, saved)
  local h, m, x = conv(id)
  redis.call('HDEL', h, unpack(HOLDER))
  redis.call('ZREM', HELD, id)
  local expires = saved or redis.call('HGET', h, 'expires_at')
  if not expires then
    redis.call('DEL', h)
    redis.call('HDEL', SESSIONS, id)  -- the place a new key held
  elseif not saved and tonumber(expires) <= now_ms() then
    drop(id)
  else
    local at = string.format('%d', tonumber(expires) + GRACE)
    for _, k in ipairs({h, m, x}) do redis.call('PEXPIREAT', k, at) end
  end
  store_backstop()
end
"""

# ARGV: P, id, key_json, token, worker_id, pid, host, entries ("all" for the whole
# record, else how many trailing exchange entries), max_sessions, known version ("").
# Replies: busy + holder | limit, sessions | new, sessions, bytes |
# found, sessions, bytes, head, split, exchange count, version, row count, then
# (transact_log, unless the version is the known one) the entry count and the
# entries as one JSON array of first,count,bytes triples. The rows themselves
# never pass through Lua (copying them into Lua and back costs more than the
# whole read): the client reads them with an LRANGE pipelined after the claim,
# which sees the lists the claim saw since they stay as they are while reserved.
_CLAIM: Final = (
    _PRELUDE
    + """
local id = ARGV[2]
local h, m, x = KEYS[5], KEYS[6], KEYS[7]
local now = now_ms()
purge(now)
local stored = redis.call('HMGET', h, 'token', 'head', 'split', 'last_token')
local token, head = stored[1], stored[2]
if token and token ~= ARGV[4] then
  return holder(h)
end
if not token then
  if not head then  -- a new conversation claims its place now
    local sessions = redis.call('HLEN', SESSIONS)
    if sessions >= tonumber(ARGV[9]) then return {'limit', sessions} end
    redis.call('HSET', SESSIONS, id, '0')
  end
  redis.call('HSET', h, 'key', ARGV[3], 'token', ARGV[4], 'worker_id', ARGV[5],
             'pid', ARGV[6], 'host', ARGV[7], 'since', string.format('%d', now))
  redis.call('ZADD', HELD, now, id)
  for _, k in ipairs({h, m, x}) do redis.call('PERSIST', k) end
  store_backstop()
end
local used = usage()
if not head then
  return {'new', used[1], used[2]}
end
local version = stored[4] or ''
local reply = {'found', used[1], used[2], head, stored[3], redis.call('LLEN', x), version,
               redis.call('LLEN', m)}
if ARGV[8] == 'all' or (version ~= '' and ARGV[10] == version) then return reply end
local entries = {}
local tail = tonumber(ARGV[8])
if tail > 0 then entries = redis.call('LRANGE', x, -tail, -1) end
reply[9], reply[10] = #entries, '[' .. string.gsub(table.concat(entries, ','), ':', ',') .. ']'
return reply
"""
)

# ARGV: P, id, token, max_sessions, max_store_bytes, ttl_ms, mode, head, identity,
# namespace, then by mode:
#   put:    split, messages, bytes, n_exchanges, exchange entries..., rows...
#   append: n, then (exchange, bytes, row) per message
#   delete: nothing
_COMMIT: Final = (
    _PRELUDE
    + """
local id, token, mode = ARGV[2], ARGV[3], ARGV[7]
local h, m, x = KEYS[5], KEYS[6], KEYS[7]
local held = redis.call('HMGET', h, 'token', 'last_token', 'messages')
if held[1] ~= token then
  if held[2] == token then return {'ok'} end
  return {'stale'}
end
local now = now_ms()
purge(now)
if mode == 'delete' then
  drop(id)
  finish(id)
  return {'ok'}
end

local old = redis.call('HGET', SESSIONS, id)
local old_bytes = tonumber(old or '0')
local new_bytes, messages, split
local count = redis.call('LLEN', x)
local n = 0
if mode == 'put' then
  split, messages, new_bytes = ARGV[11], tonumber(ARGV[12]), tonumber(ARGV[13])
else
  n = tonumber(ARGV[11])
  local added, c = 0, count
  for i = 0, n - 1 do
    local index = tonumber(ARGV[12 + 3 * i])
    if index == c then
      c = c + 1
    elseif index ~= c - 1 or index < 0 then
      return {'bad_append', index, count}
    end
    added = added + tonumber(ARGV[13 + 3 * i])
  end
  split = '1'
  messages = tonumber(held[3] or '0') + n
  new_bytes = old_bytes - redis.call('HSTRLEN', h, 'head') + #ARGV[8] + added
end

local sessions = redis.call('HLEN', SESSIONS)
local total = tonumber(redis.call('GET', BYTES) or '0') - old_bytes + new_bytes
local is_new = old and 0 or 1
if (not old and sessions >= tonumber(ARGV[4])) or total > tonumber(ARGV[5]) then
  return {'limit', is_new, sessions, total}
end

if mode == 'put' then
  redis.call('DEL', m, x)
  local n_ex = tonumber(ARGV[14])
  local first, last = 15, 14 + n_ex
  for i = first, last, 1000 do
    redis.call('RPUSH', x, unpack(ARGV, i, math.min(i + 999, last)))
  end
  for i = last + 1, #ARGV, 1000 do
    redis.call('RPUSH', m, unpack(ARGV, i, math.min(i + 999, #ARGV)))
  end
else  -- messages into the last stored exchange, then into the ones this opens
  local nmsg = redis.call('LLEN', m)
  local grown, grown_bytes, opened, rows = 0, 0, {}, {}
  for i = 0, n - 1 do
    local index, size = tonumber(ARGV[12 + 3 * i]), tonumber(ARGV[13 + 3 * i])
    if index == count then
      opened[#opened + 1] = {nmsg + #rows, 1, size}
      count = count + 1
    elseif #opened > 0 then
      local e = opened[#opened]
      e[2], e[3] = e[2] + 1, e[3] + size
    else
      grown, grown_bytes = grown + 1, grown_bytes + size
    end
    rows[#rows + 1] = ARGV[14 + 3 * i]
  end
  if grown > 0 then
    local f, k, b = string.match(redis.call('LINDEX', x, -1), '^(%d+):(%d+):(%d+)$')
    redis.call('LSET', x, -1, string.format('%d:%d:%d', tonumber(f), tonumber(k) + grown,
                                            tonumber(b) + grown_bytes))
  end
  for i, e in ipairs(opened) do opened[i] = string.format('%d:%d:%d', e[1], e[2], e[3]) end
  for i = 1, #opened, 1000 do
    redis.call('RPUSH', x, unpack(opened, i, math.min(i + 999, #opened)))
  end
  for i = 1, #rows, 1000 do
    redis.call('RPUSH', m, unpack(rows, i, math.min(i + 999, #rows)))
  end
end

local expires = now + tonumber(ARGV[6])
redis.call('HSET', h, 'head', ARGV[8], 'split', split,
           'messages', string.format('%d', messages), 'bytes', string.format('%d', new_bytes),
           'updated_at', string.format('%d', now), 'expires_at', string.format('%d', expires),
           'identity', ARGV[9], 'namespace', ARGV[10], 'last_token', token)
redis.call('HSET', SESSIONS, id, string.format('%d', new_bytes))
redis.call('INCRBY', BYTES, string.format('%d', new_bytes - old_bytes))
redis.call('ZADD', EXPIRY, expires, id)
finish(id, expires)
return {'ok'}
"""
)

# ARGV: P, id, token (empty: whoever holds it, for recover)
_RELEASE: Final = (
    _PRELUDE
    + """
local token = redis.call('HGET', KEYS[5], 'token')
if not token or (ARGV[3] ~= '' and token ~= ARGV[3]) then return 0 end
finish(ARGV[2])
return 1
"""
)

# ARGV: P, id
_READ: Final = (
    _PRELUDE
    + """
local h, m = KEYS[5], KEYS[6]
purge(now_ms())
if redis.call('HEXISTS', h, 'token') == 1 then return holder(h) end
local head = redis.call('HGET', h, 'head')
if not head then return {'absent'} end
local reply = {'found', head, redis.call('HGET', h, 'split')}
for _, row in ipairs(redis.call('LRANGE', m, 0, -1)) do reply[#reply + 1] = row end
return reply
"""
)

# ARGV: P, id
_DELETE: Final = (
    _PRELUDE
    + """
local h = KEYS[5]
purge(now_ms())
if redis.call('HEXISTS', h, 'token') == 1 then return holder(h) end
if redis.call('HEXISTS', h, 'head') == 0 then return {'absent'} end
drop(ARGV[2])
store_backstop()
return {'deleted'}
"""
)

# ARGV: P. Returns sessions, bytes.
_USAGE: Final = (
    _PRELUDE
    + """
if purge(now_ms()) > 0 then store_backstop() end
return usage()
"""
)

# ARGV: P
_PURGE: Final = (
    _PRELUDE
    + """
local n = purge(now_ms())
if n > 0 then store_backstop() end
return n
"""
)

_LIST_FIELDS: Final = (
    "key",
    "identity",
    "messages",
    "bytes",
    "updated_at",
    "expires_at",
    "split",
    "worker_id",
    "pid",
    "host",
    "since",
)

# ARGV: P. Returns flat rows of _LIST_FIELDS plus an active flag.
_LIST: Final = (
    _PRELUDE
    + """
purge(now_ms())
local seen, reply = {}, {}
local ids = redis.call('ZRANGE', EXPIRY, 0, -1)
for _, id in ipairs(redis.call('ZRANGE', HELD, 0, -1)) do ids[#ids + 1] = id end
for _, id in ipairs(ids) do
  if not seen[id] then
    seen[id] = true
    local h = conv(id)
    if redis.call('EXISTS', h) == 1 then
      for _, v in ipairs(redis.call('HMGET', h, FIELDS)) do reply[#reply + 1] = v end
      reply[#reply + 1] = redis.call('HEXISTS', h, 'token')
    end
  end
end
return reply
"""
).replace("FIELDS", ", ".join(f"'{f}'" for f in _LIST_FIELDS))

# KEYS: messages, exchanges. ARGV: start, stop. Rows of exchanges start..stop-1.
_EXCHANGES: Final = """
local entries = redis.call('LRANGE', KEYS[2], ARGV[1], tonumber(ARGV[2]) - 1)
if #entries == 0 then return {} end
local first = tonumber(string.match(entries[1], '^(%d+):'))
local f, k = string.match(entries[#entries], '^(%d+):(%d+):')
return redis.call('LRANGE', KEYS[1], first, tonumber(f) + tonumber(k) - 1)
"""


# -- Python side -------------------------------------------------------------------


@contextmanager
def _driver_errors(what: str) -> Iterator[None]:
    """The one place where redis-py exceptions become touba errors."""
    try:
        yield
    except RedisError as e:
        raise DecisionHistoryStoreUnavailable(
            f"Redis failed during {what} ({type(e).__name__}: {e}). Check the server and "
            "retry; a conversation whose reservation could not be released answers "
            "DecisionHistoryBusy until store.recover(key, worker_stopped=True)"
        ) from e


def _text(value: Any) -> str:
    """A reply as text, whether or not the client decodes responses."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return str(value)


def _opt_text(value: Any) -> str | None:
    return None if value is None else _text(value)


def _damaged(what: str) -> DecisionHistoryRecordInvalid:
    return DecisionHistoryRecordInvalid(
        f"{what} of this conversation in Redis is damaged; it was not modified. Inspect it "
        "with `touba history show` or delete the conversation"
    )


def _loads(value: Any) -> Any:
    try:
        return parse_json(_text(value))
    except (ValueError, UnicodeDecodeError) as e:
        raise _damaged("a stored value (not valid JSON)") from e


def _object(value: Any) -> Record:
    """A stored head: always a JSON object (a record is a dict), else it was tampered with."""
    parsed = _loads(value)
    if not isinstance(parsed, dict):
        raise _damaged(f"the stored head (a JSON {type(parsed).__name__}, not an object)")
    return parsed


def _parse_rows(raw: Sequence[Any]) -> list[Any]:
    """Rows ``[exchange, bytes, message]`` as stored: parsed in one go when every
    one is a JSON value of its own, else each one (so that only a damaged row
    raises, when it is the one asked for)."""
    if not raw:
        return []
    bulk = isinstance(raw[0], bytes)  # else a client that decodes responses
    text = b"[" + b",".join(raw) + b"]" if bulk else "[" + ",".join(raw) + "]"
    try:
        rows = parse_json(text)
    except (ValueError, UnicodeDecodeError):
        rows = None
    if isinstance(rows, list) and len(rows) == len(raw):
        return rows
    return [_Unparsed(row) for row in raw]


@dataclass(frozen=True, slots=True)
class _Unparsed:
    """A row left as stored because rows around it could not be parsed together."""

    raw: Any


def _group(rows: Sequence[Any], start: int = 0) -> list[list[Record]]:
    """Messages of parsed rows ``[exchange, bytes, message]``, grouped by exchange."""
    exchanges: list[list[Record]] = []
    stop = start + len(rows)
    for row in rows:
        if type(row) is _Unparsed:
            row = _loads(row.raw)
        if (
            type(row) is not list
            or len(row) != 3
            or type(row[0]) is not int
            or not start <= row[0] < stop
            or type(row[2]) is not dict
        ):
            raise _damaged("a stored message row")
        position = row[0] - start
        while len(exchanges) <= position:
            exchanges.append([])
        exchanges[position].append(row[2])
    return exchanges


def _row(index: int, message: str) -> tuple[int, str]:
    size = len(message.encode("utf-8"))
    return size, f"[{index},{size},{message}]"


def _ms_iso(value: Any) -> str | None:
    return None if value is None else iso(int(_text(value)) / 1000)


def _identity(head: Record) -> Record | None:
    identity = head.get("identity")
    return identity if isinstance(identity, dict) else None


def _identity_fields(identity: Record | None) -> tuple[str, str]:
    """The identity JSON and namespace kept beside a record for ``list``."""
    if identity is None:
        return "", ""
    namespace = identity.get("namespace")
    return encode_json(identity, "identity"), (namespace if isinstance(namespace, str) else "")


@dataclass(frozen=True, slots=True)
class _Keys:
    """Names of one conversation's keys, in the order the scripts expect."""

    id: str
    all: tuple[str, ...]

    @property
    def messages(self) -> str:
        return self.all[5]

    @property
    def exchanges(self) -> str:
        return self.all[6]


@dataclass(frozen=True, slots=True)
class _Claim:
    key: str
    keys: _Keys
    token: str
    found: bool
    head: str = ""
    split: bool = False
    exchange_count: int = 0
    version: str = ""  # the token of the save that wrote the record ("" for none)
    row_count: int = 0  # rows the conversation holds
    rows: Sequence[Any] = ()  # parsed: every row (transact), or the last rows (transact_log)
    entries: Sequence[int] = ()  # transact_log: first, count, bytes of the last exchanges
    cached: bool = False  # transact_log: the known version was current; no entries, no rows
    usage: StoreUsage | None = None

    def record(self) -> Record | None:
        if not self.found:
            return None
        head = _object(self.head)
        return join_record(head, _group(self.rows)) if self.split else head


class _Snapshot:
    """A conversation inside one transaction: reads only the tail it is asked for.

    The claim brought the entries (first row, messages, bytes) of the last
    exchanges and the last rows; a read outside them costs a round trip. The
    lists cannot change under it: the reservation is held until commit.
    """

    def __init__(self, store: RedisHistoryStore, claim: _Claim) -> None:
        self._store = store
        self._claim = claim
        self._head = _object(claim.head)
        count = claim.exchange_count
        entries = self._entries = claim.entries
        self._sized = count - len(entries) // 3  # the first exchange with an entry here
        # The rows held are the list's last ones, from row ``_offset``; the first
        # exchange all of whose rows are held is ``_loaded``.
        self._offset = claim.row_count - len(claim.rows)
        loaded = count
        at = len(entries) - 3
        while at >= 0 and entries[at] >= self._offset:
            loaded -= 1
            at -= 3
        self._loaded = loaded

    def _learn(self, start: int, rows: int | None = None) -> None:
        """Remember how far back the history layer reads, for the next claims.

        Entries: as many exchanges as read, plus one (a conversation shorter than
        its window is read from its start, one exchange further back each
        decision). Rows: only a read that reaches the last exchange counts, i.e.
        the window; a look-back (a summary's exchanges) costs a round trip and
        leaves the hint alone, so the claim stays bounded by the window.
        """
        store = self._store
        depth = self._claim.exchange_count - start + 1
        store._entries_hint = min(MAX_TAIL, max(store._entries_hint, depth))
        if rows is not None:
            store._rows_hint = min(MAX_ROWS, max(store._rows_hint, rows))

    @property
    def head(self) -> Record:
        return self._head

    @property
    def exchange_count(self) -> int:
        return self._claim.exchange_count

    async def sizes(self, start: int) -> list[ExchangeSize]:
        count = self._claim.exchange_count
        if start >= count:
            return []
        self._learn(start)
        if start >= self._sized:
            e = self._entries
            at = 3 * (start - self._sized)
            return [ExchangeSize(e[i + 1], e[i + 2]) for i in range(at, len(e), 3)]
        entries = await self._store._lrange(self._claim.keys.exchanges, start, count - 1)
        sizes = []
        for entry in entries:
            _first, messages, size = _text(entry).split(":")
            sizes.append(ExchangeSize(int(messages), int(size)))
        return sizes

    async def exchanges(self, start: int, stop: int) -> list[list[Record]]:
        count = self._claim.exchange_count
        stop = min(stop, count)
        if start >= stop:
            return []
        loaded = self._loaded
        rows: list[Any] = []
        if start < loaded:  # what the claim did not bring: one round trip
            keys = self._claim.keys
            raw = await self._store._run(
                self._store._exchanges,
                (keys.messages, keys.exchanges),
                (start, min(stop, loaded)),
                "a read",
            )
            rows = _parse_rows(raw)
        if stop > loaded:
            e, sized, offset = self._entries, self._sized, self._offset
            first = e[3 * (max(start, loaded) - sized)] - offset
            last = 3 * (stop - 1 - sized)
            rows += self._claim.rows[first : e[last] + e[last + 1] - offset]
        if stop == count:
            self._learn(start, len(rows))
        return _group(rows, start)


class RedisHistoryStore:
    """Durable store in Redis: bounded, expiring, refusing when full, crash-safe.

    Give exactly one of ``url`` (the store creates the client and closes it) or
    ``client`` (a ``redis.asyncio.Redis`` you own; ``close()`` leaves it open).
    Defaults: 128 conversations, 32 MiB, 24 hours of inactivity. A transaction
    reserves its conversation durably; after a crash the conversation answers
    :class:`~touba.errors.DecisionHistoryBusy` until
    ``recover(key, worker_stopped=True)``. Reserving a key that has no record
    claims its place among ``max_sessions`` at once; when every place is held
    (records and such reservations), it raises ``DecisionHistoryLimitExceeded``
    before the operation runs.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        client: Client | None = None,
        prefix: str = "touba:",
        max_sessions: int = 128,
        max_store_bytes: int = 32 * MiB,
        ttl_seconds: float = 86400,
        worker_id: str | None = None,
    ) -> None:
        check_limits_config(
            max_sessions=max_sessions, max_store_bytes=max_store_bytes, ttl_seconds=ttl_seconds
        )
        if (url is None) == (client is None):
            raise ConfigurationError(
                "RedisHistoryStore needs exactly one of url= (e.g. 'redis://127.0.0.1:6379/0') "
                "or client= (a redis.asyncio.Redis you own)"
            )
        if not isinstance(prefix, str) or not prefix or "{" in prefix or "}" in prefix:
            raise ConfigurationError(
                f"prefix must be a non-empty str without braces, got {prefix!r}: the store "
                "adds its own hash tag so that all its keys share one cluster slot"
            )
        if worker_id is not None and not isinstance(worker_id, str):
            raise ConfigurationError(f"worker_id must be a str or None, got {worker_id!r}")
        if client is not None:
            if not isinstance(client, aioredis.Redis | aioredis.RedisCluster):
                raise ConfigurationError(
                    f"client must be a redis.asyncio.Redis, got {type(client).__name__} "
                    "(the synchronous redis.Redis is not supported)"
                )
            self._client: Client = client
            self._owns_client = False
        else:
            if not isinstance(url, str):
                raise ConfigurationError(f"url must be a str, got {type(url).__name__}")
            try:
                self._client = aioredis.Redis.from_url(url)
            except ValueError as e:
                raise ConfigurationError(f"invalid Redis url ({e})") from e
            self._owns_client = True
        self.prefix = prefix
        self.max_sessions = max_sessions
        self.max_store_bytes = max_store_bytes
        self.ttl_seconds = ttl_seconds
        self.worker_id = worker_id
        # How far back the history layer read lately (exchanges for their sizes,
        # messages of the window): a claim reads that much ahead, in the same script.
        self._entries_hint = 0
        self._rows_hint = 0
        self._appended_hint = 0  # most messages one transact_log appended
        self._ttl_ms = max(1, round(ttl_seconds * 1000))
        tag = hashlib.sha256(prefix.encode("utf-8", "surrogatepass")).hexdigest()[:10]
        self._base = f"{prefix}{{{tag}}}:"
        self._store_keys = tuple(self._base + n for n in ("sessions", "bytes", "expiry", "held"))
        register = self._client.register_script
        self._claim_script = register(_CLAIM)
        self._commit_script = register(_COMMIT)
        self._release_script = register(_RELEASE)
        self._read_script = register(_READ)
        self._delete_script = register(_DELETE)
        self._purge_script = register(_PURGE)
        self._usage_script = register(_USAGE)
        self._list_script = register(_LIST)
        self._exchanges = register(_EXCHANGES)
        self._closed = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the client if this store created it (from ``url``)."""
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            with _driver_errors("close"):
                await self._client.aclose()

    # -- internals ------------------------------------------------------------------

    def _keys(self, key: str) -> _Keys:
        check_key(key)
        cid = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        conv = f"{self._base}c:{cid}:"
        return _Keys(cid, (*self._store_keys, conv + "head", conv + "messages", conv + "exchanges"))

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError("this RedisHistoryStore is closed; create a new one")

    async def _run(
        self,
        script: AsyncScript,
        keys: Sequence[str],
        args: Sequence[str | int],
        what: str,
        rows: tuple[str, int, int] | None = None,
    ) -> Any:
        """One round trip: ``script``; with ``rows`` (list, start, stop), an LRANGE
        pipelined after it, and the reply is ``(script reply, rows)``."""
        self._check_open()
        with _driver_errors(what):
            if rows is None:
                return await script(keys=keys, args=args)
            for attempt in (1, 2):
                async with self._client.pipeline(transaction=False) as pipe:
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                    pipe.lrange(*rows)
                    reply, listed = await pipe.execute(raise_on_error=False)
                if isinstance(reply, NoScriptError) and attempt == 1:
                    await self._client.script_load(script.script)  # e.g. after a restart
                    continue
                for outcome in (reply, listed):
                    if isinstance(outcome, Exception):
                        raise outcome
                return reply, listed
            raise AssertionError("unreachable")  # pragma: no cover

    async def _lrange(self, name: str, start: int, stop: int) -> list[Any]:
        self._check_open()
        with _driver_errors("a read"):
            return list(await self._client.lrange(name, start, stop))

    async def _conv(
        self,
        script: AsyncScript,
        keys: _Keys,
        args: Sequence[str | int],
        what: str,
        rows: tuple[str, int, int] | None = None,
    ) -> Any:
        return await self._run(script, keys.all, (self._base, keys.id, *args), what, rows)

    def _busy(self, key: str, reply: Sequence[Any]) -> ToubaError:
        worker, pid, host, since = (_opt_text(v) for v in reply[1:5])
        held = f" (held by worker {worker}, pid {pid} on {host} since {_ms_iso(since)})"
        return busy(key, held)

    async def _claim(self, key: str, *, full: bool, known: str = "") -> _Claim:
        """Reserve ``key`` and bring its head with every row (``full``), or with the
        tail the history layer reads: the entries of its last exchanges and rows
        enough for the window (none of either when ``known`` is the stored version)."""
        keys = self._keys(key)
        worker = self.worker_id or f"{socket.gethostname()}:{os.getpid()}"
        reservation = Reservation.new(worker)
        args = (
            json.dumps(key),
            reservation.token,
            reservation.worker_id,
            reservation.pid,
            reservation.host,
            "all" if full else str(self._entries_hint),
            self.max_sessions,
            known,
        )
        # The window read last, plus what a decision appends since (none for a
        # caller that holds the rows of version ``known``).
        tail = 0 if known else min(MAX_ROWS, self._rows_hint + self._appended_hint)
        rows = (keys.messages, 0, -1) if full else (keys.messages, -tail, -1) if tail else None
        try:
            reply = await self._conv(self._claim_script, keys, args, "a reservation", rows)
        except DecisionHistoryStoreUnavailable:  # it may have run: do not leave the key held
            await self._release(_Claim(key, keys, reservation.token, found=False))
            raise
        listed: Sequence[Any] = ()
        if rows is not None:
            reply, listed = reply
        status = _text(reply[0])
        if status == "busy":
            raise self._busy(key, reply)
        if status == "limit":
            check_sessions(int(reply[1]), self.max_sessions)
            raise DecisionHistoryLimitExceeded(  # pragma: no cover - check_sessions raised
                "the store is full; nothing was reserved", limit="max_sessions"
            )
        usage = self._usage_of(reply[1], reply[2])
        if status == "new":
            return _Claim(key, keys, reservation.token, found=False, usage=usage)
        claim = _Claim(
            key,
            keys,
            reservation.token,
            found=True,
            head=_text(reply[3]),
            split=_text(reply[4]) == "1",
            exchange_count=int(reply[5]),
            version=_text(reply[6]),
            row_count=int(reply[7]),
            usage=usage,
        )
        if full:
            return replace(claim, rows=_parse_rows(listed))
        if len(reply) == 8:
            return replace(claim, cached=True)
        try:
            entries = _loads(reply[9])
            if (
                not isinstance(entries, list)
                or len(entries) != 3 * int(reply[8])
                or (entries and set(map(type, entries)) != {int})
            ):
                raise _damaged("an exchange entry")
        except BaseException:  # refused without leaving the key held
            await self._release(claim)
            raise
        return replace(claim, entries=entries, rows=_parse_rows(listed))

    def _usage_of(self, sessions: Any, size: Any) -> StoreUsage:
        return StoreUsage(int(sessions), self.max_sessions, int(size), self.max_store_bytes)

    async def _commit(
        self,
        claim: _Claim,
        mode: str,
        head: str = "",
        identity: Record | None = None,
        args: Sequence[str | int] = (),
    ) -> None:
        identity_json, namespace = _identity_fields(identity)
        reply = await self._conv(
            self._commit_script,
            claim.keys,
            (
                claim.token,
                self.max_sessions,
                self.max_store_bytes,
                self._ttl_ms,
                mode,
                head,
                identity_json,
                namespace,
                *args,
            ),
            "a commit",
        )
        status = _text(reply[0])
        if status == "ok":
            return
        if status == "stale":
            raise busy(
                claim.key, " (its reservation was recovered while this one ran; nothing saved)"
            )
        if status == "limit":
            check_capacity(
                is_new=int(reply[1]) == 1,
                sessions=int(reply[2]),
                max_sessions=self.max_sessions,
                store_bytes_after=int(reply[3]),
                max_store_bytes=self.max_store_bytes,
            )
            raise DecisionHistoryLimitExceeded(  # pragma: no cover - check_capacity raised
                "the store is full; nothing was written", limit="max_store_bytes"
            )
        raise ValueError(f"append refused by the store ({status} {reply[1:]}); nothing saved")

    async def _release(self, claim: _Claim) -> None:
        """Free our reservation after a failure; never hide the original error."""
        try:
            await self._conv(self._release_script, claim.keys, (claim.token,), "a release")
        except (DecisionHistoryStoreUnavailable, ConfigurationError) as e:
            logger.warning(
                "could not release the reservation of conversation %r (%s); if it was taken, "
                "it stays busy until recover(key, worker_stopped=True)",
                claim.key,
                type(e.__cause__ or e).__name__,
            )

    async def _put(self, claim: _Claim, record: Record | None) -> None:
        if record is None:
            await self._commit(claim, "delete")
            return
        encoded = encode_record(record)
        if not encoded.split:
            await self._commit(claim, "put", encoded.head, None, ("0", 0, encoded.bytes, 0))
            return
        entries: list[str] = []
        rows: list[str] = []
        for index, exchange in enumerate(encoded.exchanges):
            sizes = 0
            for message in exchange:
                size, row = _row(index, message)
                sizes += size
                rows.append(row)
            entries.append(f"{len(rows) - len(exchange)}:{len(exchange)}:{sizes}")
        args: tuple[str | int, ...] = (
            "1",
            encoded.messages,
            encoded.bytes,
            len(entries),
            *entries,
            *rows,
        )
        await self._commit(claim, "put", encoded.head, _identity(record), args)

    async def _append(self, claim: _Claim, write: LogWrite) -> None:
        head = encode_checked_json(write.head, "head")
        check_appends(claim.exchange_count, write.append)
        self._appended_hint = min(MAX_ROWS, max(self._appended_hint, len(write.append)))
        args: list[str | int] = [len(write.append)]
        for index, message in write.append:
            size, row = _row(index, encode_checked_json(message, "message"))
            args += [index, size, row]
        await self._commit(claim, "append", head, _identity(write.head), args)

    # -- the contract ----------------------------------------------------------------

    async def transact(self, key: str, operation: Operation[T]) -> T:
        claim = await self._claim(key, full=True)
        try:
            record, result = await operation(claim.record())
            await self._put(claim, record)
        except BaseException:
            await self._release(claim)
            raise
        return result

    async def transact_log(self, key: str, operation: LogOperation[T]) -> T:
        claim = await self._claim(key, full=False)
        try:
            if claim.found and not claim.split:
                raise DecisionHistoryRecordInvalid(
                    "the stored value under this session key is not a touba decision history "
                    "record; it was not modified. Use another namespace or delete the key"
                )
            snapshot = _Snapshot(self, claim) if claim.found else None
            write, result = await operation(snapshot, claim.usage)
            if write is None:
                await self._release(claim)
                return result
            await self._append(claim, write)
        except BaseException:
            await self._release(claim)
            raise
        return result

    async def read(self, key: str) -> Record | None:
        """A detached copy, or None if absent or expired; does not renew the TTL."""
        keys = self._keys(key)
        reply = await self._conv(self._read_script, keys, (), "a read")
        status = _text(reply[0])
        if status == "busy":
            raise self._busy(key, reply)
        if status == "absent":
            return None
        stored = _Claim(
            key,
            keys,
            token="",
            found=True,
            head=_text(reply[1]),
            split=_text(reply[2]) == "1",
            rows=_parse_rows(reply[3:]),
        )
        return stored.record()

    async def delete(self, key: str) -> bool:
        """Delete an inactive conversation; False if it was absent or expired."""
        reply = await self._conv(self._delete_script, self._keys(key), (), "a delete")
        status = _text(reply[0])
        if status == "busy":
            raise self._busy(key, reply)
        return status == "deleted"

    async def recover(self, key: str, *, worker_stopped: bool) -> bool:
        """Free a reservation left by a crashed worker; the saved record is kept.

        Stop that worker and check it is gone first: this frees storage, it
        decides nothing about business effects the worker may have caused.
        """
        require_worker_stopped(worker_stopped)
        freed = await self._conv(self._release_script, self._keys(key), ("",), "a recover")
        return recovered(key, freed == 1)

    async def purge_expired(self) -> int:
        """Purge expired, unreserved conversations now; return how many went."""
        reply = await self._run(self._purge_script, self._store_keys, (self._base,), "a purge")
        return int(reply)

    async def usage(self) -> StoreUsage:
        """How full the store is now, over every client sharing the prefix.

        ``sessions`` counts stored conversations plus reservations of keys that
        have no record yet (a crashed worker's included, until ``recover``);
        ``bytes`` what the records retain (UTF-8 JSON of heads and messages).
        Expired conversations are purged first. Two reads of counters the
        scripts keep, whatever the number of conversations.
        """
        reply = await self._run(self._usage_script, self._store_keys, (self._base,), "a usage")
        return self._usage_of(reply[0], reply[1])

    async def list(self, namespace: str | None = None) -> list[StoredConversation]:
        """Every live conversation (and reserved key), sizes and holder, no content."""
        reply = list(await self._run(self._list_script, self._store_keys, (self._base,), "a list"))
        width = len(_LIST_FIELDS) + 1
        rows = []
        for i in range(0, len(reply), width):
            values = dict(zip(_LIST_FIELDS, reply[i : i + width], strict=False))
            active = int(reply[i + width - 1]) == 1
            identity: Any = _loads(values["identity"]) if values["identity"] else None
            if namespace is not None and (identity or {}).get("namespace") != namespace:
                continue
            holder = None
            if active:
                holder = {
                    "worker_id": _opt_text(values["worker_id"]),
                    "pid": int(_text(values["pid"])) if values["pid"] is not None else None,
                    "host": _opt_text(values["host"]),
                    "since": _ms_iso(values["since"]),
                }
            has_record = values["split"] is not None
            rows.append(
                StoredConversation(
                    key=json.loads(_text(values["key"])),
                    identity=identity if isinstance(identity, dict) else None,
                    messages=int(_text(values["messages"])) if has_record else 0,
                    bytes=int(_text(values["bytes"])) if has_record else 0,
                    updated_at=_ms_iso(values["updated_at"] or values["since"]) or "",
                    expires_at=_ms_iso(values["expires_at"]),
                    active=active,
                    reservation=holder,
                )
            )
        rows.sort(key=lambda row: row.key)
        return rows
