-- KEYS: all, app state, app index, user state, user index, session, its state
-- ARGV: B, now, token (this create's: a retry of it finds it done), member,
--   create_time, expires_at ('' none), expire_ms ('' none), max_sessions ('' none),
--   app, user, session id, then three pair lists (n, name, value...): the
--   session state, the app delta, the user delta.
-- Returns {'ok' | 'again', app state, user state}, {'exists'} or {'full', live}.
local ALL, APP, AIDX, USER, UIDX, S, ST = unpack(KEYS)
local token, member = ARGV[3], ARGV[4]
local stored = redis.call('HMGET', S, 'token', 'expires_at')
local status = 'ok'
if stored[1] and not expired(stored[2]) then
  if stored[1] ~= token then return {'exists'} end
  status = 'again'  -- this very create, run again after a lost reply
else
  if stored[1] then drop(ALL, member) end  -- an expired session: replaced
  purge(ALL, 10)  -- a few expired sessions go with every create
  if ARGV[8] ~= '' then
    local live = redis.call('ZCOUNT', ALL, '(' .. ARGV[2], '+inf')
    if live >= tonumber(ARGV[8]) then return {'full', live} end
  end
  redis.call('HSET', S, 'token', token, 'app', ARGV[9], 'user', ARGV[10],
             'session', ARGV[11], 'create_time', ARGV[5], 'update_time', ARGV[5],
             'revision', 0, 'event_count', 0, 'byte_count', 0, 'expires_at', ARGV[6])
  local at = hset_pairs(ST, 12)
  at = hset_pairs(APP, at)
  hset_pairs(USER, at)
  redis.call('ZADD', ALL, ARGV[6] == '' and 'inf' or ARGV[6], member)
  redis.call('ZADD', AIDX, ARGV[5], member)
  redis.call('ZADD', UIDX, ARGV[5], member)
  expire(ARGV[7], S, ST)
end
return {status, redis.call('HGETALL', APP), redis.call('HGETALL', USER)}
