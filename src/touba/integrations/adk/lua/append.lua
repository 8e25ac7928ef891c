-- KEYS: session, its state, its events, its data, app state, user state, all,
--   app index, user index
-- ARGV: B, now, member, event id, timestamp, data, size, update_time,
--   expires_at ('' none), expire_ms ('' none), expected revision ('' none),
--   expected update_time ('' none), owner ('' none), release ('1'/'0'),
--   hold_until, max event bytes ('' none), max session bytes ('' none), then
--   three pair lists (n, name, value...): session, app, user deltas.
-- The checks of AdkBackend.append, in its order; returns {'missing'},
-- {'busy', holder, hold_until}, {'stale'}, {'limit', byte_count} (nothing written) or
-- {'ok' | 'dup', revision, update_time, event_count, byte_count}.
local S, ST, EV, DATA, APP, USER, ALL, AIDX, UIDX = unpack(KEYS)
local member, id, size = ARGV[3], ARGV[4], tonumber(ARGV[7])
local row = redis.call('HMGET', S, 'revision', 'update_time', 'event_count', 'byte_count',
                       'expires_at', 'holder', 'hold_until')
if not row[1] or expired(row[5]) then return {'missing'} end
if redis.call('HEXISTS', DATA, id) == 1 then
  return {'dup', row[1], row[2], row[3], row[4]}
end
local owner = ARGV[13]
local held = row[6] and row[6] ~= '' and tonumber(row[7]) > NOW
if held and row[6] ~= owner then return {'busy', row[6], row[7]} end
if (ARGV[11] ~= '' and tonumber(row[1]) ~= tonumber(ARGV[11]))
   or (ARGV[11] == '' and ARGV[12] ~= '' and tonumber(row[2]) > tonumber(ARGV[12])) then
  return {'stale'}
end
local bytes = tonumber(row[4]) + size
if (ARGV[16] ~= '' and size > tonumber(ARGV[16]))
   or (ARGV[17] ~= '' and bytes > tonumber(ARGV[17])) then
  return {'limit', row[4]}
end
redis.call('ZADD', EV, ARGV[5], id)
redis.call('HSET', DATA, id, ARGV[6])
local at = hset_pairs(ST, 18)
at = hset_pairs(APP, at)
hset_pairs(USER, at)
local revision = tonumber(row[1]) + 1
local count = tonumber(row[3]) + 1
redis.call('HSET', S, 'revision', revision, 'update_time', ARGV[8], 'event_count', count,
           'byte_count', bytes, 'expires_at', ARGV[9])
if owner == '' or ARGV[14] == '1' then  -- no live hold here, or its owner's release
  redis.call('HDEL', S, 'holder', 'hold_until')
else
  redis.call('HSET', S, 'holder', owner, 'hold_until', ARGV[15])
end
redis.call('ZADD', ALL, ARGV[9] == '' and 'inf' or ARGV[9], member)
redis.call('ZADD', AIDX, ARGV[8], member)
redis.call('ZADD', UIDX, ARGV[8], member)
expire(ARGV[10], S, ST, EV, DATA)
return {'ok', revision, ARGV[8], count, bytes}
