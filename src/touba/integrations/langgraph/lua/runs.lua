-- Remove the checkpoints of some runs from one thread, and their writes
-- (SaverBackend.delete_for_runs). Blobs and log entries stay. ARGV: the SHA1 of each
-- run id. Reply: how many checkpoints went.
--@include _thread.lua
local gone = 0
for i = 1, #ARGV do
  local rsha = ARGV[i]
  for _, member in ipairs(redis.call('SMEMBERS', run_key(rsha))) do
    local N, id = string.match(member, '^([^:]+):(.*)$')
    gone = gone + redis.call('ZREM', nkey(N, 'cps'), id)
    redis.call('DEL', nkey(N, 'c:' .. id), nkey(N, 'w:' .. id))
    redis.call('SREM', nkey(N, 'wids'), id)
  end
  redis.call('DEL', run_key(rsha))
  redis.call('SREM', RUNS, rsha)
end
return gone
