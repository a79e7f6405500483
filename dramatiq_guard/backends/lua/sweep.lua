-- sweep() -> {reclaimed_any, handoffs}
OWNED = true
REINDEX = true
local reclaimed = reclaim()
local handoffs = {}
handoff(limit_in_force(), handoffs)
finish()
return { reclaimed > 0 and 1 or 0, handoffs }
