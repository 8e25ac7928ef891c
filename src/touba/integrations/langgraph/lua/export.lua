-- Everything one thread holds, for a copy (SaverBackend.copy_thread reads the
-- source with this, then writes the target with import.lua: two threads are two
-- cluster slots, so no one script may touch both). ARGV: none.
-- Reply: {run SHA1s, spaces}; a space is {namespace, {id, checkpoint fields}...,
-- {id, write fields}..., blob fields, {channel, length, position, entry...}...}.
--@include _thread.lua
local spaces = {}
local all = redis.call('HGETALL', NSS)
for i = 1, #all, 2 do
  local N, ns = all[i], all[i + 1]
  local cps, writes, logs = {}, {}, {}
  for _, id in ipairs(redis.call('ZRANGE', nkey(N, 'cps'), 0, -1)) do
    cps[#cps + 1] = {id, redis.call('HGETALL', nkey(N, 'c:' .. id))}
  end
  for _, id in ipairs(redis.call('SMEMBERS', nkey(N, 'wids'))) do
    writes[#writes + 1] = {id, redis.call('HGETALL', nkey(N, 'w:' .. id))}
  end
  local registry = redis.call('HGETALL', nkey(N, 'logs'))
  for j = 1, #registry, 2 do
    local stored = redis.call('HGETALL', nkey(N, 'L:' .. registry[j]))
    local log = {registry[j + 1], '0'}
    for k = 1, #stored, 2 do
      if stored[k] == 'n' then
        log[2] = stored[k + 1]
      elseif stored[k] ~= 't' then
        log[#log + 1] = stored[k]
        log[#log + 1] = stored[k + 1]
      end
    end
    logs[#logs + 1] = log
  end
  spaces[#spaces + 1] = {ns, cps, writes, redis.call('HGETALL', nkey(N, 'b')), logs}
end
return {redis.call('SMEMBERS', RUNS), spaces}
