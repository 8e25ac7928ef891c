-- ARGV: P. Returns sessions, bytes.
--@include _prelude.lua
if purge(now_ms()) > 0 then store_backstop() end
return usage()
