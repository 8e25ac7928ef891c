-- The claim for a cluster client, whose pipelines refuse scripts: ARGV as claim.lua's,
-- then the first and the last of the rows to bring (LRANGE's indexes), which the reply
-- of a found record carries last: a reservation and its rows in one round trip, where
-- an LRANGE of its own would take a second.
--@include _prelude.lua
--@include _stored.lua
--@include _claim.lua
reply[#reply + 1] = redis.call('LRANGE', m, tonumber(ARGV[10]), tonumber(ARGV[11]))
return reply
