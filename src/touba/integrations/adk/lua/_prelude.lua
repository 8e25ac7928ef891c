-- The start of every script of RedisAdkBackend (touba/integrations/adk/_redis.py).
--
-- ARGV[1] is the base B (the prefix, then the store's hash tag: every key of the
-- store lives in one cluster slot), ARGV[2] the caller's clock `now` (epoch
-- seconds, Python's repr of a float, so exact): expiry and holds are judged by
-- it, never by Redis's clock. Key layout (ids are hex digests of the names,
-- so any character in an app, user or session id is safe):
--   B..'all'                  ZSET member -> expires_at ('inf' without a TTL)
--   B..'a:'..aid..':state'    HASH app state: key -> JSON value
--   B..'a:'..aid..':index'    ZSET member -> update_time (the app's sessions)
--   B..'u:'..uid..':state'    HASH user state: key -> JSON value
--   B..'u:'..uid..':index'    ZSET member -> update_time (the user's sessions)
--   B..'s:'..sid              HASH the session row (see FIELDS)
--   B..'s:'..sid..':state'    HASH session state: key -> JSON value
--   B..'s:'..sid..':events'   ZSET event id -> timestamp (ties: by id, as bytes)
--   B..'s:'..sid..':data'     HASH event id -> the event's JSON text
-- where member = sid..aid..uid (3 x 32 hex), so a purge finds every index
-- entry of a session whose own keys Redis has already expired.
-- Checks come before the first write (a create purges expired sessions, invisible
-- already, before it counts), so a refusal changes nothing anyone can see.
local B = ARGV[1]
local NOW = tonumber(ARGV[2])
local FIELDS = {'app', 'user', 'session', 'create_time', 'update_time', 'revision',
                'event_count', 'byte_count', 'expires_at', 'holder', 'hold_until', 'token'}
local CHUNK = 1000  -- most values given to one command (unpack's stack)

local function session_keys(sid)
  local s = B .. 's:' .. sid
  return s, s .. ':state', s .. ':events', s .. ':data'
end

local function index_keys(member)
  return B .. 'a:' .. string.sub(member, 33, 64) .. ':index',
         B .. 'u:' .. string.sub(member, 65, 96) .. ':index'
end

-- A stored expires_at ('' or missing: never) as of NOW.
local function expired(expires_at)
  return expires_at and expires_at ~= '' and tonumber(expires_at) <= NOW
end

-- Forget a session: its keys and its index entries.
local function drop(all, member)
  redis.call('UNLINK', session_keys(string.sub(member, 1, 32)))  -- freed off the main thread
  local app_index, user_index = index_keys(member)
  redis.call('ZREM', app_index, member)
  redis.call('ZREM', user_index, member)
  redis.call('ZREM', all, member)
end

-- Drop sessions expired as of NOW (at most `limit`, all when nil); how many.
local function purge(all, limit)
  local found
  if limit then
    found = redis.call('ZRANGEBYSCORE', all, '-inf', ARGV[2], 'LIMIT', 0, limit)
  else
    found = redis.call('ZRANGEBYSCORE', all, '-inf', ARGV[2])
  end
  for _, member in ipairs(found) do drop(all, member) end
  return #found
end

-- HSET the pairs ARGV[at] announces (ARGV[at] = n, then n names and values);
-- returns the index after them.
local function hset_pairs(key, at)
  local last = at + 2 * tonumber(ARGV[at])
  local first = at + 1
  while first < last do
    local stop = math.min(last, first + 2 * CHUNK - 1)
    redis.call('HSET', key, unpack(ARGV, first, stop))
    first = stop + 1
  end
  return last + 1
end

-- Redis's own expiry of a session's keys: `ms` after now ('' : none).
local function expire(ms, ...)
  for _, key in ipairs({...}) do
    if ms == '' then redis.call('PERSIST', key) else redis.call('PEXPIRE', key, ms) end
  end
end
