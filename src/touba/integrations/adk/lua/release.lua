-- KEYS: session. ARGV: B, now, owner. Clears the hold if owner holds it (live or
-- not); 1 when it did.
if redis.call('HGET', KEYS[1], 'holder') ~= ARGV[3] then return 0 end
redis.call('HDEL', KEYS[1], 'holder', 'hold_until')
return 1
