-- The checkpoints a get or a list selects, newest first, with their blobs, writes
-- and the log entries they name (SaverBackend.get and .list, one thread).
-- ARGV: '1' for one namespace (then ARGV[2] is it) or '0' for all, checkpoint
-- id ('' any), before ('' none: else only ids bytewise smaller), limit ('-1' none),
-- then nf and (key, canonical JSON value) per metadata filter, then nh and
-- (namespace, channel, token, length) per log the caller holds.
-- Reply: {rows, logs}; a row is {namespace, id, the checkpoint's fields and values,
-- {channel, packed blob}..., {field, packed write}...}; a log is {namespace,
-- channel, token ('' when there is no log), length, then position, entry...}
-- for the positions the rows' spans name (above the held length when the caller
-- holds the log under its current token).
--@include _thread.lua
local one, only, id, before = ARGV[1] == '1', ARGV[2], ARGV[3], ARGV[4]
local limit = tonumber(ARGV[5])

local take = argv_from(6)
local filters = {}
for _ = 1, tonumber(take()) do
  filters[#filters + 1] = {'f:' .. take(), take()}
end
local held = {}
for _ = 1, tonumber(take()) do
  local key = take() .. '\0' .. take()
  held[key] = {take(), tonumber(take())}
end

local spaces = {}
if one then
  local N = short(only)
  if redis.call('HGET', NSS, N) == only then spaces[1] = {N, only} end
else
  local all = redis.call('HGETALL', NSS)
  for i = 1, #all, 2 do spaces[#spaces + 1] = {all[i], all[i + 1]} end
end

local function matches(ck)
  if #filters == 0 then return true end
  local names = {}
  for i, f in ipairs(filters) do names[i] = f[1] end
  local got = redis.call('HMGET', ck, unpack(names))
  for i, f in ipairs(filters) do
    if got[i] ~= f[2] then return false end
  end
  return true
end

-- Each namespace's newest matching ids (at most limit), then all of them merged.
local found = {}
for _, space in ipairs(spaces) do
  local N, ns = space[1], space[2]
  local cps = nkey(N, 'cps')
  if limit == 0 then break end
  if id ~= '' then
    if (before == '' or bytes_lt(id, before)) and redis.call('ZSCORE', cps, id)
       and matches(nkey(N, 'c:' .. id)) then
      found[#found + 1] = {N, ns, id}
    end
  else
    local n, max = 0, (before == '' and '+' or '(' .. before)
    -- without filters the first `limit` ids are the answer: read no more than those
    local size = (#filters == 0 and limit > 0) and math.min(limit, 64) or 64
    while limit < 0 or n < limit do
      local page = redis.call('ZREVRANGEBYLEX', cps, max, '-', 'LIMIT', 0, size)
      for _, cid in ipairs(page) do
        if matches(nkey(N, 'c:' .. cid)) then
          found[#found + 1] = {N, ns, cid}
          n = n + 1
          if n == limit then break end
        end
      end
      if #page < size then break end
      max = '(' .. page[#page]
    end
  end
end
table.sort(found, function(a, b)
  if a[3] ~= b[3] then return bytes_lt(b[3], a[3]) end
  return bytes_lt(a[2], b[2])
end)

local rows, wanted, order = {}, {}, {}
for i, hit in ipairs(found) do
  if limit >= 0 and i > limit then break end
  local N, ns, cid = hit[1], hit[2], hit[3]
  local record = redis.call('HGETALL', nkey(N, 'c:' .. cid))
  local blobs = {}
  for j = 1, #record, 2 do
    local field = record[j]
    local kind, channel = string.sub(field, 1, 2), string.sub(field, 3)
    if kind == 'v:' then
      local blob = redis.call('HGET', nkey(N, 'b'), #channel .. ':' .. channel .. record[j + 1])
      if blob then
        blobs[#blobs + 1] = channel
        blobs[#blobs + 1] = blob
      end
    elseif kind == 'l:' then
      local key = N .. '\0' .. channel
      if not wanted[key] then
        wanted[key] = {N = N, ns = ns, channel = channel, spans = {}}
        order[#order + 1] = key
      end
      for _, s in ipairs(parse_spans(record[j + 1])) do
        table.insert(wanted[key].spans, s)
      end
    end
  end
  rows[#rows + 1] = {ns, cid, record, blobs, redis.call('HGETALL', nkey(N, 'w:' .. cid))}
end

local logs = {}
for _, key in ipairs(order) do
  local log = wanted[key]
  local L = nkey(log.N, 'L:' .. short(log.channel))
  local state = redis.call('HMGET', L, 't', 'n')
  local out = {log.ns, log.channel, state[1] or '', state[2] or '0'}
  if state[1] then
    local from = 0
    local mine = held[log.ns .. '\0' .. log.channel]
    if mine and mine[1] == state[1] then from = mine[2] end
    local names = positions(log.spans, from)
    local got = hmget_all(L, names)
    for i, name in ipairs(names) do
      if got[i] then
        out[#out + 1] = name
        out[#out + 1] = got[i]
      end
    end
  end
  logs[#logs + 1] = out
end
return {rows, logs}
