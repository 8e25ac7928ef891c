-- KEYS: session, its state, its events, its data, app state, user state
-- ARGV: B, now, recent ('' all), after ('' none)
-- Returns {'absent'} or {'found', FIELDS' values, session state, app state,
-- user state, events (id, timestamp, ...), their data}: one snapshot.
local S, ST, EV, DATA, APP, USER = unpack(KEYS)
local row = redis.call('HMGET', S, unpack(FIELDS))
if not row[6] or expired(row[9]) then return {'absent'} end
local recent, after = ARGV[3], ARGV[4]
local events = {}
if recent ~= '0' then
  if after == '' and recent == '' then
    events = redis.call('ZRANGE', EV, 0, -1, 'WITHSCORES')
  elseif after == '' then
    events = redis.call('ZRANGE', EV, -tonumber(recent), -1, 'WITHSCORES')
  elseif recent == '' then
    events = redis.call('ZRANGEBYSCORE', EV, after, '+inf', 'WITHSCORES')
  else  -- the newest `recent` at or after `after`: read from the end, then reversed
    local newest = redis.call('ZREVRANGEBYSCORE', EV, '+inf', after, 'WITHSCORES',
                              'LIMIT', 0, tonumber(recent))
    for i = #newest - 1, 1, -2 do
      events[#events + 1] = newest[i]
      events[#events + 1] = newest[i + 1]
    end
  end
end
local ids = {}
for i = 1, #events, 2 do ids[#ids + 1] = events[i] end
local data = {}
for first = 1, #ids, CHUNK do
  for _, v in ipairs(redis.call('HMGET', DATA, unpack(ids, first, math.min(#ids, first + CHUNK - 1)))) do
    data[#data + 1] = v
  end
end
return {'found', row, redis.call('HGETALL', ST), redis.call('HGETALL', APP),
        redis.call('HGETALL', USER), events, data}
