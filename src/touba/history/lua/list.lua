-- ARGV: P, then the head fields to return (RedisHistoryStore's _LIST_FIELDS).
-- Returns flat rows of those fields plus an active flag.
--@include _prelude.lua
purge(now_ms())
local seen, reply = {}, {}
local ids = redis.call('ZRANGE', EXPIRY, 0, -1)
for _, id in ipairs(redis.call('ZRANGE', HELD, 0, -1)) do ids[#ids + 1] = id end
for _, id in ipairs(ids) do
  if not seen[id] then
    seen[id] = true
    local h = conv(id)
    if redis.call('EXISTS', h) == 1 then
      for _, v in ipairs(redis.call('HMGET', h, unpack(ARGV, 2))) do reply[#reply + 1] = v end
      reply[#reply + 1] = redis.call('HEXISTS', h, 'token')
    end
  end
end
return reply
