-- The start of every ToubaSaver Redis script (RedisSaverBackend,
-- touba/integrations/langgraph/_redis.py): the key names of one thread and the
-- functions the scripts share.
--
-- Every key of a thread starts with B = prefix .. '{' .. sha256(thread_id) .. '}:',
-- so a thread lives in one cluster slot and each script, which touches one thread
-- only, is atomic. KEYS[1] is B .. 'meta' (it routes the script); the other names
-- are built here from B. ARGV are each script's own. A namespace N and a channel C are named by
-- the first 16 hex digits of the SHA1 of their text; the registries below map them
-- back, and a script refuses a text whose id another text already holds
-- ('collision'), so two texts never share keys.
--
--   B meta              HASH  thread -> thread id; copy -> the last copy applied;
--                             indexed -> '1' once the store-wide index names it
--   B ns                HASH  N -> namespace text
--   B runs              SET   SHA1 of each run id with a checkpoint here (each one
--                             the store-wide run index names; a run a prune emptied
--                             stays until retire.lua)
--   B run:<sha1(run)>   SET   "N:checkpoint_id" of that run's checkpoints
--   B n:N:cps           ZSET  checkpoint ids (score 0: ordered by id, bytewise)
--   B n:N:c:<id>        HASH  a checkpoint: k (put token), p (parent), ct/c
--                             (checkpoint), mt/m (metadata), mj (metadata JSON),
--                             r (run id), v:<channel> (version), l:<channel>
--                             (spans "s-e,s-e"), f:<key> (canonical JSON of a
--                             metadata value, for filters)
--   B n:N:w:<id>        HASH  pending writes: "idx:task_id" -> packed value
--   B n:N:wids          SET   ids with pending writes
--   B n:N:b             HASH  "<#channel>:<channel><version>" -> packed blob
--                             ("" is LangGraph's empty marker)
--   B n:N:logs          HASH  C -> channel text
--   B n:N:L:C           HASH  a log: t (token), n (length), <position> -> entry
--
-- Values (blobs, entries, writes) are packed by the Python side and never read
-- here. Checks come before the first write, so a refusal changes nothing.
local B = string.sub(KEYS[1], 1, -5)  -- KEYS[1] without 'meta'
local META, NSS, RUNS = B .. 'meta', B .. 'ns', B .. 'runs'

local function short(text)
  return string.sub(redis.sha1hex(text), 1, 16)
end

local function nkey(N, suffix)
  return B .. 'n:' .. N .. ':' .. suffix
end

local function run_key(rsha)
  return B .. 'run:' .. rsha
end

-- The id of a text in a registry, nil when another text holds it.
local function registered(registry, text)
  local id = short(text)
  local held = redis.call('HGET', registry, id)
  if held and held ~= text then return nil end
  return id
end

-- Byte order of two strings (Lua's < follows the server's locale).
local function bytes_lt(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end

local function parse_spans(text)
  local out = {}
  for s, e in string.gmatch(text, '(%d+)-(%d+)') do
    out[#out + 1] = {tonumber(s), tonumber(e)}
  end
  return out
end

local function spans_text(spans)
  local parts = {}
  for i, s in ipairs(spans) do
    parts[i] = string.format('%d-%d', s[1], s[2])
  end
  return table.concat(parts, ',')
end

-- Adjacent spans joined, empty ones dropped, order kept (a value is their concatenation).
local function merge(spans)
  local out = {}
  for _, s in ipairs(spans) do
    if s[2] > s[1] then
      local last = out[#out]
      if last and last[2] == s[1] then
        last[2] = s[2]
      else
        out[#out + 1] = {s[1], s[2]}
      end
    end
  end
  return out
end

-- The field names of the positions the spans name at or above from, each once (the
-- spans sorted by start, in place first).
local function positions(spans, from)
  table.sort(spans, function(a, b) return a[1] < b[1] end)
  local names, last = {}, from
  for _, s in ipairs(spans) do
    for p = math.max(s[1], last), s[2] - 1 do names[#names + 1] = string.format('%d', p) end
    last = math.max(last, s[2])
  end
  return names
end

-- A reader of ARGV from position at: each call returns the next argument.
local function argv_from(at)
  return function()
    at = at + 1
    return ARGV[at - 1]
  end
end

-- HSET of a flat field/value list, in chunks (unpack has a limit).
local function hset_all(key, flat)
  for i = 1, #flat, 1000 do
    redis.call('HSET', key, unpack(flat, i, math.min(i + 999, #flat)))
  end
end

-- HMGET of many fields, in chunks.
local function hmget_all(key, names)
  local out = {}
  for i = 1, #names, 1000 do
    local got = redis.call('HMGET', key, unpack(names, i, math.min(i + 999, #names)))
    for j = 1, #got do out[i + j - 1] = got[j] end
  end
  return out
end

-- Delete every key of namespace N (its checkpoints, writes, blobs and logs).
local function drop_namespace(N)
  for _, id in ipairs(redis.call('ZRANGE', nkey(N, 'cps'), 0, -1)) do
    redis.call('DEL', nkey(N, 'c:' .. id), nkey(N, 'w:' .. id))
  end
  for _, id in ipairs(redis.call('SMEMBERS', nkey(N, 'wids'))) do
    redis.call('DEL', nkey(N, 'w:' .. id))
  end
  for _, C in ipairs(redis.call('HKEYS', nkey(N, 'logs'))) do
    redis.call('DEL', nkey(N, 'L:' .. C))
  end
  redis.call('DEL', nkey(N, 'cps'), nkey(N, 'wids'), nkey(N, 'b'), nkey(N, 'logs'))
end

-- Delete the whole thread; returns the SHA1s of the run ids it had.
local function drop_thread()
  for _, N in ipairs(redis.call('HKEYS', NSS)) do
    drop_namespace(N)
  end
  local runs = redis.call('SMEMBERS', RUNS)
  for _, rsha in ipairs(runs) do
    redis.call('DEL', run_key(rsha))
  end
  redis.call('DEL', RUNS, NSS, META)
  return runs
end
