-- KEYS: session. ARGV: B, now, owner, hold_until.
-- Returns {'missing'}, {'busy', holder, hold_until} (another owner's live hold) or
-- {'ok'}: held by owner until hold_until, nothing else changed.
local S = KEYS[1]
local row = redis.call('HMGET', S, 'revision', 'expires_at', 'holder', 'hold_until')
if not row[1] or expired(row[2]) then return {'missing'} end
if row[3] and row[3] ~= ARGV[3] and tonumber(row[4]) > NOW then
  return {'busy', row[3], row[4]}
end
redis.call('HSET', S, 'holder', ARGV[3], 'hold_until', ARGV[4])
return {'ok'}
