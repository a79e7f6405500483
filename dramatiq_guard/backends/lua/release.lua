-- release(holder, standbys) -> {released, handoffs, standbys}
--   With standbys > 0, then sends the first standbys waiters ahead as standbys, as
--   standby('send') would (within the standby window): the caller enqueues and confirms them.
local refused = validate_args({ 'send_ahead', standbys or '0', 0, MAX_COUNT })
if refused then
  return refused
end
OWNED = true
reclaim()
local released = 0
if holds(holder) then
  released = 1
  if HN == 1 and not QUEUED then
    -- The last holder of a key nobody waits for: finish() deletes it all.
    HN = 0
  else
    drop_holders({ holder })
    if QUEUED then
      redis.call('HDEL', R, holder)
      redis.call('HDEL', P, holder)
      forget(holder)
    end
  end
end
local handoffs, sent = {}, {}
local limit = limit_in_force()
handoff(limit, handoffs)
send_ahead(tonumber(standbys or '0'), sent)
finish()
return { released, handoffs, sent }
