-- The claim: reserve a conversation and read it (RedisHistoryStore's reserve).
-- ARGV: P, id, key_json, token, worker_id, pid, host, entries ("all" for the whole
-- record, else how many trailing exchange entries), max_sessions.
-- Replies: busy + holder | limit, sessions | new, sessions, bytes |
-- found, sessions, bytes, head, split, exchange count, version, row count, the
-- record's bytes, then (transact_log) the entry count and the entries as one JSON
-- array of first,count,bytes triples. The rows themselves
-- never pass through Lua (copying them into Lua and back costs more than the
-- whole read): the client reads them with an LRANGE pipelined after the claim,
-- which sees the lists the claim saw since they stay as they are while reserved.
--@include _prelude.lua
--@include _stored.lua
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
if ARGV[8] == 'all' then return found(id, m, x, stored, nil) end
return found(id, m, x, stored, tonumber(ARGV[8]))
