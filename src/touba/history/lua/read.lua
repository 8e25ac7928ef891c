-- ARGV: P, id, purge ('1': purge expired conversations first, '0': write nothing),
-- held ('1': read the saved record even while the key is reserved)
--@include _prelude.lua
local h, m, x = KEYS[5], KEYS[6], KEYS[7]
local now = now_ms()
if ARGV[3] == '1' then purge(now) end
if ARGV[4] ~= '1' and redis.call('HEXISTS', h, 'token') == 1 then return holder(h) end
local head = redis.call('HGET', h, 'head')
if not head then return {'absent'} end
local expires = tonumber(redis.call('HGET', h, 'expires_at'))
if expires and expires <= now then return {'absent'} end
local reply = {'found', head, redis.call('HGET', h, 'split'), redis.call('LLEN', x)}
for _, row in ipairs(redis.call('LRANGE', m, 0, -1)) do reply[#reply + 1] = row end
return reply
