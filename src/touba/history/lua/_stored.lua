-- The claim's and the peek's start: the purge, then what the conversation holds.
local id = ARGV[2]
local h, m, x = KEYS[5], KEYS[6], KEYS[7]
local now = now_ms()
purge(now)
local stored = redis.call('HMGET', h, 'token', 'head', 'split', 'last_token')
