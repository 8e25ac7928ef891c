-- Store pending writes of one checkpoint (SaverBackend.put_writes).
-- ARGV: thread id, namespace, checkpoint id, n, then per write: its field
-- ("idx:task_id"), '1' when it replaces (a special write, idx < 0) else '0', its
-- packed value. Reply: {'ok'} | {'collision'}.
--@include _thread.lua
local thread, ns, id = ARGV[1], ARGV[2], ARGV[3]
local held = redis.call('HGET', META, 'thread')
if held and held ~= thread then return {'collision'} end
local N = registered(NSS, ns)
if not N then return {'collision'} end
redis.call('HSET', META, 'thread', thread)
redis.call('HSET', NSS, N, ns)
local w = nkey(N, 'w:' .. id)
for i = 5, 4 + 3 * tonumber(ARGV[4]), 3 do
  if ARGV[i + 1] == '1' then
    redis.call('HSET', w, ARGV[i], ARGV[i + 2])
  else
    redis.call('HSETNX', w, ARGV[i], ARGV[i + 2])
  end
end
redis.call('SADD', nkey(N, 'wids'), id)
return {'ok'}
