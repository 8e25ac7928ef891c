-- KEYS: the index listed (the app's or one user's), app state
-- ARGV: B, now
-- Returns {app state, sessions, users}: per unexpired session its FIELDS'
-- values and its state; per user listed its id and its state. No event is read.
local INDEX, APP = KEYS[1], KEYS[2]
local sessions, users, seen = {}, {}, {}
for _, member in ipairs(redis.call('ZRANGE', INDEX, 0, -1)) do
  local s, st = session_keys(string.sub(member, 1, 32))
  local row = redis.call('HMGET', s, unpack(FIELDS))
  if row[6] and not expired(row[9]) then
    sessions[#sessions + 1] = row
    sessions[#sessions + 1] = redis.call('HGETALL', st)
    local uid = string.sub(member, 65, 96)
    if not seen[uid] then
      seen[uid] = true
      users[#users + 1] = row[2]
      users[#users + 1] = redis.call('HGETALL', B .. 'u:' .. uid .. ':state')
    end
  end
end
return {redis.call('HGETALL', APP), sessions, users}
