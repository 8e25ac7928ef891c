-- KEYS: all. ARGV: B, now. Drops every session expired as of now; how many.
return purge(KEYS[1], nil)
