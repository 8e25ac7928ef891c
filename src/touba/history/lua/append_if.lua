-- The same append (and drop) without a reservation (``save_if``): ARGV as for
-- the commit's append, token being the new version, then what the write was
-- computed from (the rows a drop removes among them):
-- the version, the head, the message count, the exchange count, the first
-- exchange whose entry was read and those entries (newline-joined), the first
-- row read and those rows (newline-joined). Written only if the conversation
-- is unreserved, live and holds exactly that; else "changed", nothing written.
--@include _prelude.lua
local id, token = ARGV[2], ARGV[3]
local mode, head_bytes = mode_of(ARGV[7])
local h, m, x = KEYS[5], KEYS[6], KEYS[7]
local held = redis.call('HMGET', h, 'token', 'last_token', 'messages', 'head', 'expires_at')
if held[2] == token then return {'ok'} end  -- this very write, run again (a retry)
local at = 13 + 3 * tonumber(ARGV[12])
local now = now_ms()
if held[1] or mode ~= 'append'
   or held[2] ~= ARGV[at] or held[4] ~= ARGV[at + 1] or held[3] ~= ARGV[at + 2]
   or not held[5] or tonumber(held[5]) <= now
   or redis.call('LLEN', x) ~= tonumber(ARGV[at + 3]) then
  return {'changed'}
end
if table.concat(redis.call('LRANGE', x, tonumber(ARGV[at + 4]), -1), '\n') ~= ARGV[at + 5]
   or table.concat(redis.call('LRANGE', m, tonumber(ARGV[at + 6]), -1), '\n') ~= ARGV[at + 7]
then
  return {'changed'}
end
purge(now)
--@include _commit_write.lua
