-- KEYS: session. ARGV: B, now. Drops its hold, live or not; 1 when there was one.
local holder = redis.call('HGET', KEYS[1], 'holder')
if not holder or holder == '' then return 0 end
redis.call('HDEL', KEYS[1], 'holder', 'hold_until')
return 1
