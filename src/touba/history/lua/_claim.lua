-- The claim's reservation (claim.lua, claim_rows.lua), after _stored.lua: returns
-- busy, limit or new at once; a found record's reply is left in ``reply``.
local token, head = stored[1], stored[2]
if token and token ~= ARGV[4] then
  return holder(h)
end
if not token then
  if not head then  -- a new conversation claims its place now
    local sessions = redis.call('HLEN', SESSIONS)
    if sessions >= tonumber(ARGV[9]) then return {'limit', sessions} end
    redis.call('HSET', SESSIONS, id, '0')
  end
  redis.call('HSET', h, 'key', ARGV[3], 'token', ARGV[4], 'worker_id', ARGV[5],
             'pid', ARGV[6], 'host', ARGV[7], 'since', string.format('%d', now))
  redis.call('ZADD', HELD, now, id)
  for _, k in ipairs({h, m, x}) do redis.call('PERSIST', k) end
  store_backstop()
end
if not head then
  local used = usage()
  return {'new', used[1], used[2]}
end
local entries = nil  -- 'all': the whole record, no entries
if ARGV[8] ~= 'all' then entries = tonumber(ARGV[8]) end
local reply = found(id, m, x, stored, entries)
