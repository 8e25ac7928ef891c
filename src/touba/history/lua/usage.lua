-- ARGV: P, purge ('1': purge expired conversations first, '0': write nothing).
-- Returns sessions, bytes.
--@include _prelude.lua
if ARGV[2] == '1' and purge(now_ms()) > 0 then store_backstop() end
return usage()
