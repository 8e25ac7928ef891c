-- ARGV: P, id, token (empty: whoever holds it, for recover)
--@include _prelude.lua
local token = redis.call('HGET', KEYS[5], 'token')
if not token or (ARGV[3] ~= '' and token ~= ARGV[3]) then return 0 end
finish(ARGV[2])
return 1
