-- ARGV: P, purge ('1': purge expired conversations first, '0': write nothing), then
-- the head fields to return (RedisHistoryStore's _LIST_FIELDS).
-- Returns flat rows of those fields plus an active flag and an expired flag.
--@include _prelude.lua
local now = now_ms()
if ARGV[2] == '1' then purge(now) end
local seen, reply = {}, {}
local ids = redis.call('ZRANGE', EXPIRY, 0, -1)
for _, id in ipairs(redis.call('ZRANGE', HELD, 0, -1)) do ids[#ids + 1] = id end
for _, id in ipairs(ids) do
  if not seen[id] then
    seen[id] = true
    local h = conv(id)
    if redis.call('EXISTS', h) == 1 then
      for _, v in ipairs(redis.call('HMGET', h, unpack(ARGV, 3))) do reply[#reply + 1] = v end
      reply[#reply + 1] = redis.call('HEXISTS', h, 'token')
      local expires = redis.call('HGET', h, 'expires_at')
      reply[#reply + 1] = (expires and tonumber(expires) <= now) and 1 or 0
    end
  end
end
return reply
