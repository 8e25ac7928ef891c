-- Write a copy of another thread into this one (SaverBackend.copy_thread, after
-- export.lua read the source). Each source log's entries go at the end of this
-- thread's log of the same namespace and channel, the copied spans shifted by
-- that offset; a checkpoint or write already here is kept as it is.
-- ARGV: thread id, copy token (a retry of the same copy writes nothing), a
-- fresh log token, then: nspaces, and per space: namespace, ncheckpoints, per
-- checkpoint (id, nfields, its fields and values), nwrites, per id (id, nfields,
-- its fields and values), nblobs, its fields and values, nlogs, per log (channel,
-- length, nentries, position and entry per entry).
-- Reply: {'ok'} | {'collision'}.
--@include _thread.lua
local thread, copy, fresh = ARGV[1], ARGV[2], ARGV[3]
local held = redis.call('HGET', META, 'thread')
if held and held ~= thread then return {'collision'} end
if redis.call('HGET', META, 'copy') == copy then return {'ok'} end

local take = argv_from(4)
local function pairs_of(n)
  local out = {}
  for _ = 1, 2 * tonumber(n) do out[#out + 1] = take() end
  return out
end

local spaces = {}
for _ = 1, tonumber(take()) do
  local space = {ns = take(), cps = {}, writes = {}, logs = {}}
  for _ = 1, tonumber(take()) do
    local id = take()
    space.cps[#space.cps + 1] = {id, pairs_of(take())}
  end
  for _ = 1, tonumber(take()) do
    local id = take()
    space.writes[#space.writes + 1] = {id, pairs_of(take())}
  end
  space.blobs = pairs_of(take())
  for _ = 1, tonumber(take()) do
    local channel, length = take(), tonumber(take())
    space.logs[#space.logs + 1] = {channel = channel, length = length, entries = pairs_of(take())}
  end
  spaces[#spaces + 1] = space
end

-- Checks first: every namespace's and log's id is free.
for _, space in ipairs(spaces) do
  space.N = registered(NSS, space.ns)
  if not space.N then return {'collision'} end
  for _, log in ipairs(space.logs) do
    log.C = registered(nkey(space.N, 'logs'), log.channel)
    if not log.C then return {'collision'} end
  end
end

redis.call('HSET', META, 'thread', thread, 'copy', copy, 'indexed', '1')
for _, space in ipairs(spaces) do
  local N = space.N
  redis.call('HSET', NSS, N, space.ns)
  local offsets = {}
  for _, log in ipairs(space.logs) do
    local L = nkey(N, 'L:' .. log.C)
    local state = redis.call('HMGET', L, 't', 'n')
    if not state[1] then
      redis.call('HSET', nkey(N, 'logs'), log.C, log.channel)
      redis.call('HSET', L, 't', fresh)
    end
    local offset = tonumber(state[2] or '0')
    local flat = {}
    for j = 1, #log.entries, 2 do
      flat[#flat + 1] = string.format('%d', tonumber(log.entries[j]) + offset)
      flat[#flat + 1] = log.entries[j + 1]
    end
    flat[#flat + 1] = 'n'
    flat[#flat + 1] = string.format('%d', offset + log.length)
    hset_all(L, flat)
    offsets[log.channel] = offset
  end
  for j = 1, #space.blobs, 2 do
    redis.call('HSETNX', nkey(N, 'b'), space.blobs[j], space.blobs[j + 1])
  end
  for _, cp in ipairs(space.cps) do
    local id, fields = cp[1], cp[2]
    local ck = nkey(N, 'c:' .. id)
    if redis.call('EXISTS', ck) == 0 then
      local record = {}
      for j = 1, #fields, 2 do
        local field, value = fields[j], fields[j + 1]
        local kind, channel = string.sub(field, 1, 2), string.sub(field, 3)
        if kind == 'l:' then
          local shifted = {}
          for _, s in ipairs(parse_spans(value)) do
            local offset = offsets[channel] or 0
            shifted[#shifted + 1] = {s[1] + offset, s[2] + offset}
          end
          value = spans_text(shifted)
        elseif field == 'r' then
          local rsha = redis.sha1hex(value)
          redis.call('SADD', RUNS, rsha)
          redis.call('SADD', run_key(rsha), N .. ':' .. id)
        end
        if field ~= 'k' then
          record[#record + 1] = field
          record[#record + 1] = value
        end
      end
      hset_all(ck, record)
      redis.call('ZADD', nkey(N, 'cps'), 0, id)
    end
  end
  for _, w in ipairs(space.writes) do
    local id, fields = w[1], w[2]
    for j = 1, #fields, 2 do
      redis.call('HSETNX', nkey(N, 'w:' .. id), fields[j], fields[j + 1])
    end
    redis.call('SADD', nkey(N, 'wids'), id)
  end
end
return {'ok'}
