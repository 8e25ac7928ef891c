-- ARGV: P, id, ttl_ms, entries (how many trailing exchange entries). The claim's
-- read without its reservation (``peek``), for an operation that only reads: it
-- renews the expiry as a save of the same head would (reading is activity) and
-- replies as the claim does; "new" when there is no record, "other" for a
-- record that is not a touba log (nothing renewed). Sent in a MULTI with the
-- LRANGE of the rows, so that both see one state.
--@include _prelude.lua
--@include _stored.lua
--@include _peek_read.lua
return reply
