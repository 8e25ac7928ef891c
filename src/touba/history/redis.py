"""``RedisHistoryStore``: conversations in Redis, shared by many workers and hosts.

Layout. Every key starts with ``prefix`` followed by one hash tag for the whole
store (``{<10 hex of sha256(prefix)>}``), so the store lives in one cluster
slot: capacity is a store-wide bound checked atomically, which a Lua script can
only do over keys of one slot. (With a ``RedisCluster`` client, whose pipelines
refuse scripts, a claim's rows come in a round trip of their own and a peek's
script brings them itself: ``tests/history/test_redis_cluster.py``.) A
conversation is named by the sha256 of its session key (``<id>``), so any
character (braces, colons, NUL, unicode) is safe in a session key and never
reaches a key name::

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
decision appends rows (RPUSH) and reads only the tail it needs; a
``LogWrite.drop_last`` trims the newest rows (LTRIM) in the same commit. The protocol
(reserve, save if the token still holds, release; the snapshot, the read-ahead
hints and the tail cache) is :mod:`touba.history._reserving`; this module gives
its primitives (:class:`_Backend`). The claim script returns, with the
reservation, the entries of the last exchanges the history layer weighed
lately, and an LRANGE pipelined after it (same round trip) the last rows of the
window it read lately plus what a decision appends; a read further back costs
a round trip. So a decision is two round trips, claim and commit, and what the
claim carries is bounded by the window, not by how far back anything was read.
A session's read of a window (``ToubaSession.get_items``) is one round trip
with no reservation: the peek script (the claim's read, renewing the expiry
instead of reserving) and the LRANGE of the rows in one MULTI.
Any other JSON dict is kept whole in ``head``. A record's version changes on
every touba save and never repeats, but another client's LSET or LREM of a row
leaves it as it was: the backend says so (``sees_edits = False``), so every
claim brings the window's rows and the shared cache reuses a parsed message
only while its stored text is byte-identical (content mode).

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
import math
import os
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Self, TypeVar

from touba.errors import (
    ConfigurationError,
    DecisionHistoryLimitExceeded,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStoreUnavailable,
    ToubaError,
)
from touba.history._backend import (
    Read,
    Reserved,
    Rows,
    Seen,
    Sizes,
    Write,
    dropped_elsewhere,
    parse_object,
)
from touba.history._common import (
    MiB,
    Reservation,
    busy,
    check_capacity,
    check_key,
    check_limits_config,
    check_sessions,
    iso,
    recovered,
    require_worker_stopped,
)
from touba.history._model import parse_json
from touba.history._record import join_record
from touba.history._reservations import MAX_TAIL, Recent, Reservations
from touba.history._store import (
    LogOperation,
    Operation,
    Record,
    StoredConversation,
    StoreUsage,
)

try:
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import NoScriptError, RedisError
except ImportError as e:  # pragma: no cover - exercised by a test that hides redis
    raise ImportError(
        'touba.history.redis needs redis-py; install it with: pip install "touba[redis]"'
    ) from e

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript

__all__ = ["RedisHistoryStore"]

MAX_ROWS: Final = 4096  # most messages read ahead with a claim
# The client a store makes from url= sends a command again, on a new connection, when
# its connection failed (a server restart, a proxy's idle timeout, CLIENT KILL): safe,
# since every write is a script that a second run with the same token finds done.
RETRIES: Final = 2
_LABEL: Final = "Redis"

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

-- A claim's reply for a stored record (``stored``: its token, head, split and
-- last_token): usage, head, split, exchange count, version, row count, bytes,
-- then (``tail``: how many) the last exchange entries as one JSON array.
local function found(id, m, x, stored, tail)
  local used = usage()
  local reply = {'found', used[1], used[2], stored[2], stored[3], redis.call('LLEN', x),
                 stored[4] or '', redis.call('LLEN', m), redis.call('HGET', SESSIONS, id) or '0'}
  if not tail then return reply end
  local entries = {}
  if tail > 0 then entries = redis.call('LRANGE', x, -tail, -1) end
  reply[10], reply[11] = #entries, '[' .. string.gsub(table.concat(entries, ','), ':', ',') .. ']'
  return reply
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

# The claim's and the peek's start: the purge, then what the conversation holds.
_STORED: Final = """
local id = ARGV[2]
local h, m, x = KEYS[5], KEYS[6], KEYS[7]
local now = now_ms()
purge(now)
local stored = redis.call('HMGET', h, 'token', 'head', 'split', 'last_token')
"""

# ARGV: P, id, key_json, token, worker_id, pid, host, entries ("all" for the whole
# record, else how many trailing exchange entries), max_sessions.
# Replies: busy + holder | limit, sessions | new, sessions, bytes |
# found, sessions, bytes, head, split, exchange count, version, row count, the
# record's bytes, then (transact_log) the entry count and the entries as one JSON
# array of first,count,bytes triples. The rows themselves
# never pass through Lua (copying them into Lua and back costs more than the
# whole read): the client reads them with an LRANGE pipelined after the claim,
# which sees the lists the claim saw since they stay as they are while reserved.
_CLAIM: Final = (
    _PRELUDE
    + _STORED
    + """local token, head = stored[1], stored[2]
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
if not head then
  local used = usage()
  return {'new', used[1], used[2]}
end
if ARGV[8] == 'all' then return found(id, m, x, stored, nil) end
return found(id, m, x, stored, tonumber(ARGV[8]))
"""
)

# ARGV: P, id, ttl_ms, entries (how many trailing exchange entries). The claim's
# read without its reservation (``peek``), for an operation that only reads: it
# renews the expiry as a save of the same head would (reading is activity) and
# replies as the claim does; "new" when there is no record, "other" for a
# record that is not a touba log (nothing renewed). Sent in a MULTI with the
# LRANGE of the rows, so that both see one state.
_PEEK_READ: Final = (
    _PRELUDE
    + _STORED
    + """if stored[1] then return holder(h) end
local head = stored[2]
if not head then return {'new'} end
if stored[3] ~= '1' then return {'other'} end
local expires = now + tonumber(ARGV[3])
redis.call('HSET', h, 'updated_at', string.format('%d', now),
           'expires_at', string.format('%d', expires))
redis.call('ZADD', EXPIRY, expires, id)
local at = string.format('%d', expires + GRACE)
for _, k in ipairs({h, m, x}) do redis.call('PEXPIREAT', k, at) end
store_backstop()
local reply = found(id, m, x, stored, tonumber(ARGV[4]))
"""
)
_PEEK: Final = _PEEK_READ + "return reply\n"

# The peek for a cluster client, whose pipelines refuse scripts: ARGV as _PEEK's, then
# how many trailing rows to bring, which the reply of a found record carries last.
_PEEK_ROWS: Final = (
    _PEEK_READ
    + """reply[#reply + 1] = redis.call('LRANGE', m, -tonumber(ARGV[5]), -1)
return reply
"""
)

# ARGV: P, id, token, max_sessions, max_store_bytes, ttl_ms, mode, head, identity,
# namespace, then by mode:
#   put:    split, messages, bytes, n_exchanges, exchange entries..., rows...
#   append: drop, n, then (exchange, bytes, row) per message; ``drop`` newest rows
#           leave first (LogWrite.drop_last), exchanges they empty too
#   delete: nothing
_COMMIT_HELD: Final = """
local id, token, mode = ARGV[2], ARGV[3], ARGV[7]
local h, m, x = KEYS[5], KEYS[6], KEYS[7]
local held = redis.call('HMGET', h, 'token', 'last_token', 'messages')
if held[1] ~= token then
  if held[2] == token then return {'ok'} end
  return {'stale'}
end
local now = now_ms()
purge(now)
"""

# The same append (and drop) without a reservation (``save_if``): ARGV as for
# the commit's append, token being the new version, then what the write was
# computed from (the rows a drop removes among them):
# the version, the head, the message count, the exchange count, the first
# exchange whose entry was read and those entries (newline-joined), the first
# row read and those rows (newline-joined). Written only if the conversation
# is unreserved, live and holds exactly that; else "changed", nothing written.
_APPEND_IF_SEEN: Final = """
local id, token, mode = ARGV[2], ARGV[3], ARGV[7]
local h, m, x = KEYS[5], KEYS[6], KEYS[7]
local held = redis.call('HMGET', h, 'token', 'last_token', 'messages', 'head', 'expires_at')
if held[2] == token then return {'ok'} end  -- this very write, run again (a retry)
local at = 13 + 3 * tonumber(ARGV[12])
local now = now_ms()
if held[1] or mode ~= 'append'
   or held[2] ~= ARGV[at] or held[4] ~= ARGV[at + 1] or held[3] ~= ARGV[at + 2]
   or not held[5] or tonumber(held[5]) <= now
   or redis.call('LLEN', x) ~= tonumber(ARGV[at + 3]) then
  return {'changed'}
end
if table.concat(redis.call('LRANGE', x, tonumber(ARGV[at + 4]), -1), '\\n') ~= ARGV[at + 5]
   or table.concat(redis.call('LRANGE', m, tonumber(ARGV[at + 6]), -1), '\\n') ~= ARGV[at + 7]
then
  return {'changed'}
end
purge(now)
"""

_COMMIT_WRITE: Final = """
if mode == 'delete' then
  drop(id)
  finish(id)
  return {'ok'}
end

local old = redis.call('HGET', SESSIONS, id)
local old_bytes = tonumber(old or '0')
local new_bytes, messages, split
local count = redis.call('LLEN', x)
local n, drop, keep, freed, last_entry = 0, 0, 0, 0, nil
if mode == 'put' then
  split, messages, new_bytes = ARGV[11], tonumber(ARGV[12]), tonumber(ARGV[13])
else
  drop, n = tonumber(ARGV[11]), tonumber(ARGV[12])
  local stored = tonumber(held[3] or '0')
  if drop > 0 then  -- planned here, written once the capacity check passed
    local rows = redis.call('LLEN', m)
    if rows ~= stored or drop > rows then  -- rows the head does not count
      return {'dropped_elsewhere', math.max(0, rows - stored + drop), drop}
    end
    keep = rows - drop
    local by = {}  -- bytes dropped per exchange
    for _, row in ipairs(redis.call('LRANGE', m, keep, -1)) do
      local e, size = string.match(row, '^%[(%d+),(%d+),')
      if not e then return {'damaged_row'} end
      e, size = tonumber(e), tonumber(size)
      by[e], freed = (by[e] or 0) + size, freed + size
    end
    while count > 0 do  -- the exchanges whose first row goes, go
      local f, k, b = string.match(redis.call('LINDEX', x, count - 1), '^(%d+):(%d+):(%d+)$')
      if not f then return {'damaged_entry'} end
      f, k, b = tonumber(f), tonumber(k), tonumber(b)
      if f < keep then
        if f + k > keep then  -- its newest rows go
          last_entry = string.format('%d:%d:%d', f, keep - f, b - (by[count - 1] or 0))
        end
        break
      end
      count = count - 1
    end
    local lowest = last_entry and count - 1 or count  -- no dropped row below it
    for e in pairs(by) do
      if e < lowest then return {'damaged_row'} end
    end
  end
  local added, c = 0, count
  for i = 0, n - 1 do
    local index = tonumber(ARGV[13 + 3 * i])
    if index == c then
      c = c + 1
    elseif index ~= c - 1 or index < 0 then
      return {'bad_append', index, count}
    end
    added = added + tonumber(ARGV[14 + 3 * i])
  end
  split = '1'
  messages = stored - drop + n
  new_bytes = old_bytes - redis.call('HSTRLEN', h, 'head') + #ARGV[8] + added - freed
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
  if drop > 0 and keep == 0 then
    redis.call('DEL', m, x)
  elseif drop > 0 then
    redis.call('LTRIM', m, 0, keep - 1)
    redis.call('LTRIM', x, 0, count - 1)
    if last_entry then redis.call('LSET', x, -1, last_entry) end
  end
  local nmsg = redis.call('LLEN', m)
  local grown, grown_bytes, opened, rows = 0, 0, {}, {}
  for i = 0, n - 1 do
    local index, size = tonumber(ARGV[13 + 3 * i]), tonumber(ARGV[14 + 3 * i])
    if index == count then
      opened[#opened + 1] = {nmsg + #rows, 1, size}
      count = count + 1
    elseif #opened > 0 then
      local e = opened[#opened]
      e[2], e[3] = e[2] + 1, e[3] + size
    else
      grown, grown_bytes = grown + 1, grown_bytes + size
    end
    rows[#rows + 1] = ARGV[15 + 3 * i]
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

_COMMIT: Final = _PRELUDE + _COMMIT_HELD + _COMMIT_WRITE
_APPEND_IF: Final = _PRELUDE + _APPEND_IF_SEEN + _COMMIT_WRITE

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
local h, m, x = KEYS[5], KEYS[6], KEYS[7]
purge(now_ms())
if redis.call('HEXISTS', h, 'token') == 1 then return holder(h) end
local head = redis.call('HGET', h, 'head')
if not head then return {'absent'} end
local reply = {'found', head, redis.call('HGET', h, 'split'), redis.call('LLEN', x)}
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


def _rows(raw: Sequence[Any], exchanges: int) -> list[tuple[int, int, str]]:
    """Stored rows ``[exchange,bytes,message]`` as (exchange, bytes, message text),
    the message left unparsed (the shared layer parses it, or finds it unchanged);
    a row of another shape or naming an exchange outside 0 .. ``exchanges - 1`` is
    damaged."""
    out = []
    for value in raw:
        try:
            row = value.decode("utf-8") if isinstance(value, bytes) else value
            first = row.index(",")
            second = row.index(",", first + 1)
            exchange, size = int(row[1:first]), int(row[first + 1 : second])
            body = row[second + 1 : -1]
        except (ValueError, UnicodeDecodeError, AttributeError):
            raise _damaged("a stored message row") from None
        if row[0] != "[" or row[-1] != "]" or not 0 <= exchange < exchanges:
            raise _damaged("a stored message row")
        out.append((exchange, size, body))
    return out


def _entries(value: Any, count: int) -> list[int]:
    """The claim's exchange entries: first row, messages, bytes of each."""
    entries = _loads(value)
    if (
        not isinstance(entries, list)
        or len(entries) != 3 * count
        or (entries and set(map(type, entries)) != {int})
    ):
        raise _damaged("an exchange entry")
    return entries


def _row(exchange: int, size: int, message: str) -> str:
    return f"[{exchange},{size},{message}]"


def _ms_iso(value: Any) -> str | None:
    return None if value is None else iso(int(_text(value)) / 1000)


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


class _Backend:
    """The protocol's primitives (:class:`touba.history._reserving.Backend`): each one
    round trip (a script, with an LRANGE pipelined after the claim).

    Redis cannot tell when another client edits a conversation's rows (an LSET
    leaves ``last_token`` as it was), so ``sees_edits`` is False: every claim
    brings the window's rows, and the shared cache reuses only the messages
    whose stored text did not change.
    """

    driver_errors: tuple[type[BaseException], ...] = (RedisError,)
    label = _LABEL
    sees_edits = False
    drops = True  # save honours Write.dropped (in the commit script)

    def __init__(self, store: RedisHistoryStore) -> None:
        self._store = store
        # Rows an LRANGE pipelined with a claim reads: the exchanges the bodies
        # hint asks for times the most messages per exchange the windows held
        # lately, plus the most a save appended lately (what the next window
        # holds more); "lately": the last HINT_MEMORY (see Recent).
        self._per_exchange = Recent()  # thousandths of a message
        self._appended_hint = Recent()

    async def reserve(self, key: str, reservation: Reservation, read: Read) -> Reserved:
        store = self._store
        keys = store._keys(key)
        token = reservation.token
        args = (
            json.dumps(key),
            token,
            reservation.worker_id,
            reservation.pid,
            reservation.host,
            "all" if read.whole else str(min(read.sizes, MAX_TAIL)),
            store.max_sessions,
        )
        tail = self._rows_ahead(read)
        pipelined = (keys.messages, 0, -1) if read.whole else (keys.messages, -tail, -1)
        rows = pipelined if read.whole or tail else None
        try:
            reply = await store._conv(store._claim_script, keys, args, "a reservation", rows)
        except BaseException:  # it may have run (a lost reply, a cancellation): free the key
            await self._release_quietly(key, keys, token)
            raise
        reply, listed, status = self._answer(key, reply, rows)
        if status == "limit":
            check_sessions(int(reply[1]), store.max_sessions)
            raise DecisionHistoryLimitExceeded(  # pragma: no cover - check_sessions raised
                "the store is full; nothing was reserved", limit="max_sessions"
            )
        usage = store._usage_of(reply[1], reply[2])
        if status == "new":
            return Reserved(None, False, 0, 0, 0, None, usage)
        try:
            reserved = await self._reserved(keys, reply, listed, read, usage)
            assert reserved is not None  # (only a peek stops short)
            return reserved
        except BaseException:  # refused without leaving the key held
            await self._release_quietly(key, keys, token)
            raise

    def _answer(
        self, key: str, result: Any, rows: tuple[str, int, int] | None
    ) -> tuple[Sequence[Any], Sequence[Any], str]:
        """A claim's or a peek's result: its reply, the rows listed with it (when
        ``rows`` were), its status; ``DecisionHistoryBusy`` when the key is held."""
        reply, listed = result if rows is not None else (result, ())
        status = _text(reply[0])
        if status == "busy":
            raise self._store._busy(key, reply)
        return reply, listed, status

    def _rows_ahead(self, read: Read) -> int:
        """How many trailing rows to read with a claim: before a window was read, as
        many as its exchanges may hold."""
        if not read.bodies:
            return 0
        guess = math.ceil(read.bodies * self._per_exchange.most / 1000)
        return min(MAX_ROWS, guess + self._appended_hint.most)

    async def peek(self, key: str, read: Read) -> Reserved | None:
        """What ``reserve`` reads, without reserving, for an operation that only
        reads: one round trip (the script and the LRANGE of the rows in one MULTI,
        so both see one state) that renews the expiry, as a save of the unchanged
        head would. Raises ``DecisionHistoryBusy`` while the key is held; None
        when only a reservation can answer (no record, a record that is not a
        touba log, a window that starts before the rows read ahead). On a cluster
        client, whose pipelines refuse scripts, the script brings the rows itself
        (``_PEEK_ROWS``)."""
        store = self._store
        if read.whole:
            return None
        keys = store._keys(key)
        tail = self._rows_ahead(read)
        rows = (keys.messages, -tail, -1) if tail else None
        args = (store._ttl_ms, min(read.sizes, MAX_TAIL))
        if isinstance(store._client, aioredis.RedisCluster) and rows is not None:
            # (its pipelines refuse scripts: the script brings the rows itself)
            found = list(await store._conv(store._peek_rows_script, keys, (*args, tail), "a read"))
            result = (found, found.pop() if _text(found[0]) == "found" else [])
        else:
            result = await store._conv(store._peek_script, keys, args, "a read", rows, atomic=True)
        reply, listed, status = self._answer(key, result, rows)
        if status != "found":
            return None
        usage = store._usage_of(reply[1], reply[2])
        return await self._reserved(keys, reply, listed, read, usage, further=False)

    async def _reserved(
        self,
        keys: _Keys,
        reply: Sequence[Any],
        listed: Sequence[Any],
        read: Read,
        usage: Any,
        *,
        further: bool = True,
    ) -> Reserved | None:
        """The claim's ``reply`` (and the ``listed`` rows) as the protocol reads it;
        without ``further`` (no reservation holds the rows still), None where the
        window starts before the rows listed."""
        head, split = _text(reply[3]), _text(reply[4]) == "1"
        count = int(reply[5]) if split else 0
        version, messages, size = _text(reply[6]) or None, int(reply[7]), int(reply[8])
        if read.whole:
            rows = _rows(listed, count)
            return Reserved(head, split, count, messages, size, version, usage, [], rows)
        if not split:  # a record kept whole: the protocol shows it as a head with no rows
            return Reserved(head, split, 0, messages, size, version, usage, [], [])
        entries = _entries(reply[10], int(reply[9]))
        sizes_first = count - len(entries) // 3
        bodies_first = max(0, count - read.bodies)
        at = 3 * (bodies_first - sizes_first)
        sizes = [(sizes_first + i // 3, entries[i + 1], entries[i + 2]) for i in range(0, at, 3)]
        if bodies_first >= count or at < 0:  # no window read: guess from the whole
            if count:
                self._per_exchange.note(-(-1000 * messages // count))
            return Reserved(head, split, count, messages, size, version, usage, sizes, [])
        first = entries[at]  # the window's first row
        offset = messages - len(listed)  # the first row the LRANGE brought
        if not 0 <= first <= messages:
            raise _damaged("an exchange entry")
        if first < offset and not further:
            return None
        if first < offset:  # the window grew past what was read ahead: one more trip
            raw: Sequence[Any] = [
                *await self._store._lrange(keys.messages, first, offset - 1),
                *listed,
            ]
        else:
            raw = listed[first - offset :]
        self._per_exchange.note(-(-1000 * (messages - first) // (count - bodies_first)))
        rows = _rows(raw, count)
        return Reserved(head, split, count, messages, size, version, usage, sizes, rows)

    async def save(self, key: str, token: str, write: Write) -> None:
        if write.rewrite and not write.split:
            await self._commit(key, token, "put", write, ("0", 0, write.bytes, 0))
        elif write.rewrite:
            counts = [0] * write.exchanges
            sizes = [0] * write.exchanges
            rows: list[str] = []
            for _seq, exchange, size, body in write.rows:
                counts[exchange] += 1
                sizes[exchange] += size
                rows.append(_row(exchange, size, body))
            entries: list[str] = []
            first = 0
            for n, total in zip(counts, sizes, strict=True):
                entries.append(f"{first}:{n}:{total}")
                first += n
            args: tuple[str | int, ...] = (
                "1",
                write.messages,
                write.bytes,
                len(entries),
                *entries,
                *rows,
            )
            await self._commit(key, token, "put", write, args)
        else:
            appended = len(write.rows)
            self._appended_hint.note(min(MAX_ROWS, appended))
            flat: list[str | int] = [write.dropped, appended]
            for _seq, exchange, size, body in write.rows:
                flat += [exchange, size, _row(exchange, size, body)]
            await self._commit(key, token, "append", write, flat)

    async def _commit(
        self, key: str, token: str, mode: str, write: Write | None, args: Sequence[str | int]
    ) -> None:
        store = self._store
        fields = ("", "", "") if write is None else (write.head, write.identity, write.namespace)
        reply = await store._conv(
            store._commit_script,
            store._keys(key),
            (
                token,
                store.max_sessions,
                store.max_store_bytes,
                store._ttl_ms,
                mode,
                *(field or "" for field in fields),
                *args,
            ),
            "a commit",
        )
        status = _text(reply[0])
        if status == "ok":
            return
        if status == "stale":
            raise busy(key, " (its reservation was recovered while this one ran; nothing saved)")
        if status == "limit":
            check_capacity(
                is_new=int(reply[1]) == 1,
                sessions=int(reply[2]),
                max_sessions=store.max_sessions,
                store_bytes_after=int(reply[3]),
                max_store_bytes=store.max_store_bytes,
            )
            raise DecisionHistoryLimitExceeded(  # pragma: no cover - check_capacity raised
                "the store is full; nothing was written", limit="max_store_bytes"
            )
        if status == "dropped_elsewhere":  # rows removed or added behind the head
            found, expected = int(reply[1]), int(reply[2])
            raise dropped_elsewhere(key, _LABEL, found, expected)
        if status == "damaged_row":
            raise _damaged("a stored message row")
        if status == "damaged_entry":
            raise _damaged("an exchange entry")
        raise ValueError(f"append refused by the store ({status} {reply[1:]}); nothing saved")

    async def save_if(
        self, key: str, version: str, head: str, token: str, write: Write, seen: Seen | None
    ) -> bool:
        """The append of ``save`` without a reservation, one script: written (the
        version then ``token``) only if the conversation is unreserved, live, at
        ``version`` with the head text ``head`` and holds the exchange entries and
        rows ``seen`` describes, byte for byte (an edit by another client changes
        no version, so what the write was computed from is compared as text), and
        the write fits; else False, nothing written."""
        if seen is None or write.rewrite:
            return False
        store = self._store
        flat: list[str | int] = [write.dropped, len(write.rows)]
        for _seq, exchange, size, body in write.rows:
            flat += [exchange, size, _row(exchange, size, body)]
        entries = "\n".join(f"{first}:{n}:{size}" for first, n, size in seen.entries)
        rows = "\n".join(
            _row(e, len(body.encode("utf-8", "surrogatepass")), body) for e, body in seen.rows
        )
        stored = write.kept + write.dropped  # before this write
        proof = (version, head, stored, seen.count)
        reply = await store._conv(
            store._append_if_script,
            store._keys(key),
            (
                token,
                store.max_sessions,
                store.max_store_bytes,
                store._ttl_ms,
                "append",
                write.head,
                write.identity or "",
                write.namespace or "",
                *flat,
                *proof,
                seen.entries_from,
                entries,
                seen.rows_from,
                rows,
            ),
            "an optimistic commit",
        )
        saved = _text(reply[0]) == "ok"
        if saved:
            self._appended_hint.note(min(MAX_ROWS, len(write.rows)))
        return saved

    async def delete(self, key: str, token: str) -> None:
        await self._commit(key, token, "delete", None, ())

    async def release(self, key: str, token: str) -> None:
        store = self._store
        await store._conv(store._release_script, store._keys(key), (token,), "a release")

    async def _release_quietly(self, key: str, keys: _Keys, token: str) -> None:
        """Free our reservation after a failure; never hide the original error."""
        store = self._store
        try:
            await store._conv(store._release_script, keys, (token,), "a release")
        except (DecisionHistoryStoreUnavailable, ConfigurationError) as e:
            logger.warning(
                "could not release the reservation of conversation %r (%s); if it was taken, "
                "it stays busy until recover(key, worker_stopped=True)",
                key,
                type(e.__cause__ or e).__name__,
            )

    async def read_sizes(self, key: str, start: int, stop: int) -> Sizes:
        if start >= stop:
            return []
        raw = await self._store._lrange(self._store._keys(key).exchanges, start, stop - 1)
        sizes = []
        for exchange, entry in enumerate(raw, start):
            try:
                _first, messages, size = _text(entry).split(":")
                sizes.append((exchange, int(messages), int(size)))
            except (ValueError, UnicodeDecodeError):
                raise _damaged("an exchange entry") from None
        return sizes

    async def read_rows(self, key: str, start: int, stop: int) -> Rows:
        if start >= stop:
            return []
        store = self._store
        keys = store._keys(key)
        raw = await store._run(
            store._exchanges, (keys.messages, keys.exchanges), (start, stop), "a read"
        )
        return _rows(raw, stop)


class RedisHistoryStore:
    """Durable store in Redis: bounded, expiring, refusing when full, crash-safe.

    Give exactly one of ``url`` (the store creates the client, which retries a
    command twice on a failed connection, and closes it) or ``client`` (a
    ``redis.asyncio.Redis`` or ``RedisCluster`` you own, with its own retry
    policy; ``close()`` leaves it open).
    Defaults: 128 conversations, 32 MiB, 24 hours of inactivity. A transaction
    reserves its conversation durably; after a crash the conversation answers
    :class:`~touba.errors.DecisionHistoryBusy` until
    ``recover(key, worker_stopped=True)``. Reserving a key that has no record
    claims its place among ``max_sessions`` at once; when every place is held
    (records and such reservations), it raises ``DecisionHistoryLimitExceeded``
    before the operation runs. Its ``transact_log`` honours
    ``LogWrite.drop_last`` (the newest rows trimmed in the commit script).
    """

    log_drops = True

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
                "or client= (a redis.asyncio.Redis or RedisCluster you own)"
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
                retry = Retry(ExponentialBackoff(cap=0.5, base=0.05), RETRIES)
                self._client = aioredis.Redis.from_url(url, retry=retry)
            except ValueError as e:
                raise ConfigurationError(f"invalid Redis url ({e})") from e
            self._owns_client = True
        self.prefix = prefix
        self.max_sessions = max_sessions
        self.max_store_bytes = max_store_bytes
        self.ttl_seconds = ttl_seconds
        self.worker_id = worker_id
        self._ttl_ms = max(1, round(ttl_seconds * 1000))
        tag = hashlib.sha256(prefix.encode("utf-8", "surrogatepass")).hexdigest()[:10]
        self._base = f"{prefix}{{{tag}}}:"
        self._store_keys = tuple(self._base + n for n in ("sessions", "bytes", "expiry", "held"))
        register = self._client.register_script
        self._claim_script = register(_CLAIM)
        self._commit_script = register(_COMMIT)
        self._append_if_script = register(_APPEND_IF)
        self._peek_script = register(_PEEK)
        self._peek_rows_script = register(_PEEK_ROWS)
        self._release_script = register(_RELEASE)
        self._read_script = register(_READ)
        self._delete_script = register(_DELETE)
        self._purge_script = register(_PURGE)
        self._usage_script = register(_USAGE)
        self._list_script = register(_LIST)
        self._exchanges = register(_EXCHANGES)
        self._closed = False
        worker = worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self._backend = _Backend(self)
        self._reservations = Reservations(self._backend, worker)

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
        *,
        atomic: bool = False,
    ) -> Any:
        """One round trip: ``script``; with ``rows`` (list, start, stop), an LRANGE
        pipelined after it (``atomic``: both in one MULTI), and the reply is
        ``(script reply, rows)``."""
        self._check_open()
        with _driver_errors(what):
            if rows is None:
                return await script(keys=keys, args=args)
            if isinstance(self._client, aioredis.RedisCluster):
                # A cluster client's pipelines refuse scripts: the LRANGE follows in a
                # round trip of its own (only after a claim: the rows stay as they are
                # while reserved; a peek, which needs both at once, uses _PEEK_ROWS).
                assert not atomic, "no atomic read on a cluster client"
                reply = await script(keys=keys, args=args)
                return reply, list(await self._client.lrange(*rows))
            for attempt in (1, 2):
                async with self._client.pipeline(transaction=atomic) as pipe:
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
        *,
        atomic: bool = False,
    ) -> Any:
        return await self._run(
            script, keys.all, (self._base, keys.id, *args), what, rows, atomic=atomic
        )

    def _busy(self, key: str, reply: Sequence[Any]) -> ToubaError:
        worker, pid, host, since = (_opt_text(v) for v in reply[1:5])
        held = f" (held by worker {worker}, pid {pid} on {host} since {_ms_iso(since)})"
        return busy(key, held)

    def _usage_of(self, sessions: Any, size: Any) -> StoreUsage:
        return StoreUsage(int(sessions), self.max_sessions, int(size), self.max_store_bytes)

    # -- the contract ----------------------------------------------------------------

    async def transact(self, key: str, operation: Operation[T]) -> T:
        """Run ``operation`` on the record of ``key`` under a durable reservation
        (see :class:`~touba.history.HistoryStore`): two round trips."""
        self._check_open()
        check_key(key)
        return await self._reservations.transact(key, operation)

    async def transact_log(self, key: str, operation: LogOperation[T]) -> T:
        """``transact`` for the history layer: the head, the tail, appends only.

        Two round trips (claim, commit) once this store object has seen how far
        back the history layer reads. Raises as :meth:`transact` does.
        """
        self._check_open()
        check_key(key)
        return await self._reservations.transact_log(key, operation)

    async def transact_log_optimistic(
        self, key: str, operation: LogOperation[T], *, drops: bool = False
    ) -> T:
        """``transact_log`` for an operation that may run twice (it only reads its
        snapshot and returns a write: a session's append or read, never a decision).

        When this store object holds the conversation's tail, the operation runs on
        it and its write is saved in one script if the conversation is unreserved,
        live, at that version and still holds, byte for byte, the head, exchange
        entries and rows the operation read; else it runs again through
        :meth:`transact_log` (see
        ``touba.history._reserving.Reservations.transact_log_optimistic``). Raises as
        :meth:`transact_log` does.
        """
        self._check_open()
        check_key(key)
        return await self._reservations.transact_log_optimistic(key, operation, drops=drops)

    async def read(self, key: str) -> Record | None:
        """A detached copy, or None if absent or expired; does not renew the TTL."""
        keys = self._keys(key)
        reply = await self._conv(self._read_script, keys, (), "a read")
        status = _text(reply[0])
        if status == "busy":
            raise self._busy(key, reply)
        if status == "absent":
            return None
        head = _object(reply[1])
        if _text(reply[2]) != "1":
            return head
        count = int(reply[3])
        exchanges: list[list[Record]] = [[] for _ in range(count)]
        for exchange, _size, body in _rows(reply[4:], count):
            exchanges[exchange].append(parse_object(body, key, "a message", _LABEL))
        return join_record(head, exchanges)

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
