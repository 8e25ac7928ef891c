-- Store pending writes of one checkpoint (SaverBackend.put_writes).
-- ARGV: B, thread id, namespace, checkpoint id, n, then per write: its field
-- ("idx:task_id"), '1' when it replaces (a special write, idx < 0) else '0', its
-- packed value. Reply: {'ok'} | {'collision'}.
--@include _thread.lua
local thread, ns, id = ARGV[2], ARGV[3], ARGV[4]
local held = redis.call('HGET', META, 'thread')
if held and held ~= thread then return {'collision'} end
local N = registered(NSS, ns)
if not N then return {'collision'} end
redis.call('HSET', META, 'thread', thread)
redis.call('HSET', NSS, N, ns)
local w = nkey(N, 'w:' .. id)
for i = 6, 5 + 3 * tonumber(ARGV[5]), 3 do
  if ARGV[i + 1] == '1' then
    redis.call('HSET', w, ARGV[i], ARGV[i + 2])
  else
    redis.call('HSETNX', w, ARGV[i], ARGV[i + 2])
  end
end
redis.call('SADD', nkey(N, 'wids'), id)
return {'ok'}
