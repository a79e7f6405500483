-- release(holder) -> {released, handoffs}
local holder = ARGV[4]
OWNED = true
reclaim()
local released = 0
if HS[holder] ~= nil then
  released = 1
  if HN == 1 and not QUEUED then
    -- The last holder of a key nobody waits for: finish() deletes it all.
    HS[holder] = nil
    HN = 0
  else
    drop_holders({ holder })
    if QUEUED then
      redis.call('HDEL', R, holder)
      redis.call('HDEL', P, holder)
    end
  end
end
local handoffs = {}
handoff(limit_in_force(), handoffs)
finish()
return { released, handoffs }
