-- The peek's read (peek.lua, peek_rows.lua), after _stored.lua: replies as the claim
-- does, renewing the expiry instead of reserving; the reply is left in ``reply``.
if stored[1] then return holder(h) end
local head = stored[2]
if not head then return {'new'} end
if stored[3] ~= '1' then return {'other'} end
local expires = now + tonumber(ARGV[3])
redis.call('HSET', h, 'updated_at', string.format('%d', now),
           'expires_at', string.format('%d', expires))
redis.call('ZADD', EXPIRY, expires, id)
local at = string.format('%d', expires + GRACE)
for _, k in ipairs({h, m, x}) do redis.call('PEXPIREAT', k, at) end
store_backstop()
local reply = found(id, m, x, stored, tonumber(ARGV[4]))
