-- ARGV: P
--@include _prelude.lua
local n = purge(now_ms())
if n > 0 then store_backstop() end
return n
