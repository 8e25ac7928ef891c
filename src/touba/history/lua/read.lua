-- ARGV: P, id
--@include _prelude.lua
local h, m, x = KEYS[5], KEYS[6], KEYS[7]
purge(now_ms())
if redis.call('HEXISTS', h, 'token') == 1 then return holder(h) end
local head = redis.call('HGET', h, 'head')
if not head then return {'absent'} end
local reply = {'found', head, redis.call('HGET', h, 'split'), redis.call('LLEN', x)}
for _, row in ipairs(redis.call('LRANGE', m, 0, -1)) do reply[#reply + 1] = row end
return reply
