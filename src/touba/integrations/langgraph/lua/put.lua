-- Store one checkpoint, its new blobs and its log appends (SaverBackend.put).
-- ARGV: thread id, namespace, checkpoint id, parent id ('' none), checkpoint type
-- and bytes, metadata type and bytes, metadata JSON, run id ('' none), put token (a
-- retry of the same put finds it stored and writes nothing), a fresh log token (for
-- a log this put creates), '1' when the store-wide indexes were updated for this
-- call (else a put on a thread or run they may not name yet answers 'unindexed'
-- and writes nothing: the caller sends them, then the put again), then counted
-- groups: nf then (key, canonical JSON value)
-- per metadata key; nv then (channel, version); nb then (channel, version, packed
-- blob or '' for empty); nl then per log: channel, nbase, its base spans as
-- 2 * nbase numbers, nitems, the packed items.
-- Reply: {'ok', then per log: channel, token, length, spans} | {'base', channel}
-- (a base span past the log's end) | {'collision'} | {'unindexed'}.
--@include _thread.lua
local thread, ns, id, parent = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local run, put_token, fresh, indexed = ARGV[10], ARGV[11], ARGV[12], ARGV[13] == '1'

local held = redis.call('HGET', META, 'thread')
if held and held ~= thread then return {'collision'} end
local N = registered(NSS, ns)
if not N then return {'collision'} end
local ck = nkey(N, 'c:' .. id)

local take = argv_from(14)
local fields = {}
for _ = 1, tonumber(take()) do
  local key = take()
  fields[#fields + 1] = 'f:' .. key
  fields[#fields + 1] = take()
end
for _ = 1, tonumber(take()) do
  local channel = take()
  fields[#fields + 1] = 'v:' .. channel
  fields[#fields + 1] = take()
end
local blobs = {}
for _ = 1, tonumber(take()) do
  local channel = take()
  local version = take()
  blobs[#blobs + 1] = {#channel .. ':' .. channel .. version, take()}
end
local logs = {}
for _ = 1, tonumber(take()) do
  local log = {channel = take(), base = {}, items = {}}
  for _ = 1, tonumber(take()) do
    log.base[#log.base + 1] = {tonumber(take()), tonumber(take())}
  end
  for _ = 1, tonumber(take()) do
    log.items[#log.items + 1] = take()
  end
  logs[#logs + 1] = log
end

-- A retry of this very put (its reply was lost): answer what it stored.
if redis.call('HGET', ck, 'k') == put_token then
  local reply = {'ok'}
  for _, log in ipairs(logs) do
    local state = redis.call('HMGET', nkey(N, 'L:' .. short(log.channel)), 't', 'n')
    local spans = redis.call('HGET', ck, 'l:' .. log.channel) or ''
    for _, v in ipairs({log.channel, state[1] or fresh, state[2] or '0', spans}) do
      reply[#reply + 1] = v
    end
  end
  return reply
end

-- The store-wide indexes name this thread and its run before it holds anything.
if not indexed and (not redis.call('HGET', META, 'indexed')
                    or (run ~= '' and redis.call('SISMEMBER', RUNS, redis.sha1hex(run)) == 0)) then
  return {'unindexed'}
end

-- Checks first: every log's id is free, every base span lies inside its log.
for _, log in ipairs(logs) do
  log.C = registered(nkey(N, 'logs'), log.channel)
  if not log.C then return {'collision'} end
  log.key = nkey(N, 'L:' .. log.C)
  local state = redis.call('HMGET', log.key, 't', 'n')
  log.token, log.length = state[1], tonumber(state[2] or '0')
  for _, s in ipairs(log.base) do
    if s[1] < 0 or s[2] < s[1] or s[2] > log.length then return {'base', log.channel} end
  end
end

redis.call('HSET', META, 'thread', thread)
if indexed then redis.call('HSET', META, 'indexed', '1') end
redis.call('HSET', NSS, N, ns)
local reply = {'ok'}
for _, log in ipairs(logs) do
  if not log.token then
    log.token = fresh
    redis.call('HSET', nkey(N, 'logs'), log.C, log.channel)
    redis.call('HSET', log.key, 't', fresh, 'n', 0)
  end
  local L, k = log.length, #log.items
  if k > 0 then
    local args = {}
    for i, item in ipairs(log.items) do
      args[#args + 1] = string.format('%d', L + i - 1)
      args[#args + 1] = item
    end
    args[#args + 1] = 'n'
    args[#args + 1] = string.format('%d', L + k)
    hset_all(log.key, args)
  end
  local spans = {}
  for _, s in ipairs(log.base) do spans[#spans + 1] = s end
  spans[#spans + 1] = {L, L + k}
  log.spans = spans_text(merge(spans))
  fields[#fields + 1] = 'l:' .. log.channel
  fields[#fields + 1] = log.spans
  for _, v in ipairs({log.channel, log.token, string.format('%d', L + k), log.spans}) do
    reply[#reply + 1] = v
  end
end
for _, blob in ipairs(blobs) do
  redis.call('HSETNX', nkey(N, 'b'), blob[1], blob[2])
end

local before = redis.call('HGET', ck, 'r')
if before and before ~= run then
  redis.call('SREM', run_key(redis.sha1hex(before)), N .. ':' .. id)
end
redis.call('DEL', ck)
local record = {'k', put_token, 'ct', ARGV[5], 'c', ARGV[6], 'mt', ARGV[7], 'm', ARGV[8],
                'mj', ARGV[9]}
if parent ~= '' then
  record[#record + 1] = 'p'
  record[#record + 1] = parent
end
if run ~= '' then
  record[#record + 1] = 'r'
  record[#record + 1] = run
end
for _, v in ipairs(fields) do record[#record + 1] = v end
hset_all(ck, record)
redis.call('ZADD', nkey(N, 'cps'), 0, id)
if run ~= '' then
  local rsha = redis.sha1hex(run)
  redis.call('SADD', RUNS, rsha)
  redis.call('SADD', run_key(rsha), N .. ':' .. id)
end
return reply
