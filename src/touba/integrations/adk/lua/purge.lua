-- KEYS: all. ARGV: B, now, most. Drops up to `most` sessions expired as of now
-- (a bounded script: the caller runs it again while it finds that many); how many.
return purge(KEYS[1], tonumber(ARGV[3]))
