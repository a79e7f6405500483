-- sweep() -> {reclaimed_any, handoffs}
OWNED = true
REINDEX = true
local reclaimed = reclaim()
local handoffs = {}
handoff(limit_in_force(), handoffs)
finish()
if X and not QUEUED then
  redis.call('ZREM', X, ARG_KEY) -- an index entry left from before
end
return { reclaimed > 0 and 1 or 0, handoffs }
