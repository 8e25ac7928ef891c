-- After a prune (SaverBackend.prune "keep_latest"): the runs prune.lua left with no
-- checkpoint here, whose store-wide index entries the caller has just removed. A run
-- still without a checkpoint leaves RUNS; one a put gave a checkpoint since (that put
-- found it in RUNS, so sent no index update) is returned, for the caller to index
-- again. ARGV: the runs' SHA1s. Reply: the SHA1s to index again.
--@include _thread.lua
local back = {}
for i = 1, #ARGV do
  if redis.call('EXISTS', run_key(ARGV[i])) == 1 then
    back[#back + 1] = ARGV[i]
  else
    redis.call('SREM', RUNS, ARGV[i])
  end
end
return back
