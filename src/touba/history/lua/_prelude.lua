-- The start of every store script (RedisHistoryStore, touba/history/redis.py): its
-- constants and the functions the scripts share.
--
-- Every mutation is one script, so it is atomic: claim (refuses at once when
-- held; a key without a record takes its place among ``max_sessions`` in
-- ``sessions`` there, or is refused when they are all held), commit (token still
-- ours, capacity, save, clear the reservation), release, recover, delete and the
-- purge of expired, unreserved conversations that every script but
-- release/recover runs first. Time is Redis's ``TIME``, so workers on hosts with
-- skewed clocks agree on expiry. Redis's own key expiry is a backstop only: a
-- conversation's keys expire a minute after its ``expires_at`` and the store's
-- own keys a minute after the last conversation's (neither while a key is
-- reserved), so an abandoned prefix leaves nothing behind; the scripts tolerate
-- keys it removed.
--
-- KEYS of every store script: sessions, bytes, expiry, held, then (for scripts on
-- one conversation) head, messages, exchanges. ARGV[1] is the key prefix P,
-- ARGV[2] the conversation id. Checks come before the first write, so a refusal
-- (or Redis refusing the first write when out of memory) changes nothing.
local P = ARGV[1]
local SESSIONS, BYTES, EXPIRY, HELD = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local GRACE = 60000
local RECORD = {'head', 'split', 'messages', 'bytes', 'updated_at', 'expires_at',
                'identity', 'namespace', 'last_token', 'head_bytes'}
local HOLDER = {'token', 'worker_id', 'pid', 'host', 'since'}

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function conv(id)
  local c = P .. 'c:' .. id .. ':'
  return c .. 'head', c .. 'messages', c .. 'exchanges'
end

-- A commit's mode (ARGV[7]) is "<mode>:<bytes of the plaintext head>": with
-- encryption at rest the stored head is sealed, and the bounds count plaintext.
local function mode_of(arg)
  local mode, head_bytes = string.match(arg, '^(%a+):(%d+)$')
  if not mode then return arg, nil end
  return mode, tonumber(head_bytes)
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
