-- Remove a thread, every namespace of it (SaverBackend.delete_thread, prune
-- "delete"). ARGV: none. Reply: the SHA1s of the run ids it had (for the store-wide
-- run index, which the caller updates after).
--@include _thread.lua
return drop_thread()
