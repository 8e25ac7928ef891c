-- ARGV: P, id
--@include _prelude.lua
local h = KEYS[5]
purge(now_ms())
if redis.call('HEXISTS', h, 'token') == 1 then return holder(h) end
if redis.call('HEXISTS', h, 'head') == 0 then return {'absent'} end
drop(ARGV[2])
store_backstop()
return {'deleted'}
