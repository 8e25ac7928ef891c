-- KEYS: messages, exchanges. ARGV: start, stop. Rows of exchanges start..stop-1.
local entries = redis.call('LRANGE', KEYS[2], ARGV[1], tonumber(ARGV[2]) - 1)
if #entries == 0 then return {} end
local first = tonumber(string.match(entries[1], '^(%d+):'))
local f, k = string.match(entries[#entries], '^(%d+):(%d+):')
return redis.call('LRANGE', KEYS[1], first, tonumber(f) + tonumber(k) - 1)
