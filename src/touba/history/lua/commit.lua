-- The commit: save (or delete) a reserved conversation and clear the reservation.
-- ARGV: P, id, token, max_sessions, max_store_bytes, ttl_ms, mode (as "mode:head bytes",
-- the plaintext head's UTF-8 bytes; see mode_of), head, identity,
-- namespace, then by mode:
--   put:    split, messages, bytes, n_exchanges, exchange entries..., rows...
--   append: drop, n, then (exchange, bytes, row) per message; ``drop`` newest rows
--           leave first (LogWrite.drop_last), exchanges they empty too
--   delete: nothing
--@include _prelude.lua
local id, token = ARGV[2], ARGV[3]
local mode, head_bytes = mode_of(ARGV[7])
local h, m, x = KEYS[5], KEYS[6], KEYS[7]
local held = redis.call('HMGET', h, 'token', 'last_token', 'messages')
if held[1] ~= token then
  if held[2] == token then return {'ok'} end
  return {'stale'}
end
local now = now_ms()
purge(now)
--@include _commit_write.lua
