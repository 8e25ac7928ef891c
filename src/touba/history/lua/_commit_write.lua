-- The write of commit.lua and append_if.lua, once they found the conversation theirs
-- to write (``id``, ``token``, ``mode``, ``h``, ``m``, ``x``, ``held``, ``now`` set).
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
  local old_head = tonumber(redis.call('HGET', h, 'head_bytes') or '')
                   or redis.call('HSTRLEN', h, 'head')
  new_bytes = old_bytes - old_head + (head_bytes or #ARGV[8]) + added - freed
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
           'identity', ARGV[9], 'namespace', ARGV[10], 'last_token', token,
           'head_bytes', string.format('%d', head_bytes or #ARGV[8]))
redis.call('HSET', SESSIONS, id, string.format('%d', new_bytes))
redis.call('INCRBY', BYTES, string.format('%d', new_bytes - old_bytes))
redis.call('ZADD', EXPIRY, expires, id)
finish(id, expires)
return {'ok'}
