-- Keep only the latest checkpoint of each namespace of one thread, with its writes,
-- its blobs and the log entries its spans name (SaverBackend.prune "keep_latest").
-- A log that loses entries gets a new token; its positions stay where they are.
-- ARGV: a fresh log token. Reply: the SHA1s of the run ids left with no
-- checkpoint here, still in RUNS (so a put of one of them meanwhile needs no index
-- update): the caller removes their store-wide index entries, then runs retire.lua.
--@include _thread.lua
local fresh = ARGV[1]
local keeps = {}
for _, N in ipairs(redis.call('HKEYS', NSS)) do
  local latest = redis.call('ZREVRANGEBYLEX', nkey(N, 'cps'), '+', '-', 'LIMIT', 0, 1)[1]
  if not latest then
    drop_namespace(N)
    redis.call('HDEL', NSS, N)
  else
    keeps[N] = latest
    for _, id in ipairs(redis.call('ZRANGE', nkey(N, 'cps'), 0, -1)) do
      if id ~= latest then redis.call('DEL', nkey(N, 'c:' .. id), nkey(N, 'w:' .. id)) end
    end
    for _, id in ipairs(redis.call('SMEMBERS', nkey(N, 'wids'))) do
      if id ~= latest then redis.call('DEL', nkey(N, 'w:' .. id)) end
    end
    redis.call('DEL', nkey(N, 'cps'), nkey(N, 'wids'))
    redis.call('ZADD', nkey(N, 'cps'), 0, latest)
    if redis.call('EXISTS', nkey(N, 'w:' .. latest)) == 1 then
      redis.call('SADD', nkey(N, 'wids'), latest)
    end

    local record = redis.call('HGETALL', nkey(N, 'c:' .. latest))
    local blobs, spans_of = {}, {}
    for j = 1, #record, 2 do
      local kind, channel = string.sub(record[j], 1, 2), string.sub(record[j], 3)
      if kind == 'v:' then
        local field = #channel .. ':' .. channel .. record[j + 1]
        local blob = redis.call('HGET', nkey(N, 'b'), field)
        if blob then
          blobs[#blobs + 1] = field
          blobs[#blobs + 1] = blob
        end
      elseif kind == 'l:' then
        spans_of[channel] = parse_spans(record[j + 1])
      end
    end
    redis.call('DEL', nkey(N, 'b'))
    hset_all(nkey(N, 'b'), blobs)

    local registry = redis.call('HGETALL', nkey(N, 'logs'))
    for j = 1, #registry, 2 do
      local C, channel = registry[j], registry[j + 1]
      local L = nkey(N, 'L:' .. C)
      local spans = spans_of[channel]
      if not spans then
        redis.call('DEL', L)
        redis.call('HDEL', nkey(N, 'logs'), C)
      else
        local state = redis.call('HMGET', L, 't', 'n')
        local stored = redis.call('HLEN', L) - 2
        local names = positions(spans, 0)
        local got = hmget_all(L, names)
        local kept = {}
        for i, name in ipairs(names) do
          if got[i] then
            kept[#kept + 1] = name
            kept[#kept + 1] = got[i]
          end
        end
        if stored > #kept / 2 then
          redis.call('DEL', L)
          kept[#kept + 1] = 't'
          kept[#kept + 1] = fresh
          kept[#kept + 1] = 'n'
          kept[#kept + 1] = state[2]
          hset_all(L, kept)
        end
      end
    end
  end
end

local emptied = {}
for _, rsha in ipairs(redis.call('SMEMBERS', RUNS)) do
  for _, member in ipairs(redis.call('SMEMBERS', run_key(rsha))) do
    local N, id = string.match(member, '^([^:]+):(.*)$')
    if keeps[N] ~= id then redis.call('SREM', run_key(rsha), member) end
  end
  if redis.call('EXISTS', run_key(rsha)) == 0 then
    emptied[#emptied + 1] = rsha  -- left in RUNS: retire.lua removes it
  end
end
if redis.call('HLEN', NSS) == 0 then redis.call('DEL', META) end
return emptied
