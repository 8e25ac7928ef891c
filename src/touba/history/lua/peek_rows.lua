-- The peek for a cluster client, whose pipelines refuse scripts: ARGV as peek.lua's, then
-- how many trailing rows to bring, which the reply of a found record carries last.
--@include _prelude.lua
--@include _stored.lua
--@include _peek_read.lua
reply[#reply + 1] = redis.call('LRANGE', m, -tonumber(ARGV[5]), -1)
return reply
