-- KEYS: the index listed (the app's or one user's), app state
-- ARGV: B, now
-- Returns one JSON text (one reply to parse, however many sessions):
--   {"app": {app state}, "sessions": [[user, session, create_time, update_time,
--    revision, event_count, byte_count, expires_at, holder, hold_until,
--    {session state}], ...], "users": [[user, {user state}], ...]}
-- with each unexpired session of the index and the state of each user listed.
-- State values are spliced as stored (JSON texts); no event is read.
local INDEX, APP = KEYS[1], KEYS[2]
local encode = cjson.encode

local function object(flat)  -- an HGETALL of a state hash, as a JSON object
  if #flat == 0 then return '{}' end
  local parts = {}
  for i = 1, #flat, 2 do parts[#parts + 1] = encode(flat[i]) .. ':' .. flat[i + 1] end
  return '{' .. table.concat(parts, ',') .. '}'
end

local sessions, users, names = {}, {}, {}
local row_fields = {'user', 'session', 'create_time', 'update_time', 'revision',
                    'event_count', 'byte_count', 'expires_at', 'holder', 'hold_until'}
for _, member in ipairs(redis.call('ZRANGE', INDEX, 0, -1)) do
  local s = B .. 's:' .. string.sub(member, 1, 32)
  local row = redis.call('HMGET', s, unpack(row_fields))
  if row[5] and not expired(row[8]) then
    local uid = string.sub(member, 65, 96)
    local user = names[uid]
    if not user then  -- the first session of this user: its name, and its state
      user = encode(row[1])
      names[uid] = user
      users[#users + 1] = '[' .. user .. ','
        .. object(redis.call('HGETALL', B .. 'u:' .. uid .. ':state')) .. ']'
    end
    sessions[#sessions + 1] = table.concat({
      '[' .. user, encode(row[2]), row[3], row[4], row[5], row[6], row[7],
      (row[8] and row[8] ~= '') and row[8] or 'null',
      row[9] and encode(row[9]) or 'null', row[10] or 'null',
      object(redis.call('HGETALL', s .. ':state')) .. ']'}, ',')
  end
end
return '{"app":' .. object(redis.call('HGETALL', APP)) .. ',"sessions":['
  .. table.concat(sessions, ',') .. '],"users":[' .. table.concat(users, ',') .. ']}'
