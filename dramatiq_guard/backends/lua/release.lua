-- release(holder, send_ahead) -> {released, handoffs, standbys}
--   With send_ahead > 0, then sends the first send_ahead waiters ahead as standbys, as
--   standby('send') would (within the standby window): the caller enqueues and confirms them.
local refused = validate_args({ 'send_ahead', arg(2) or '0', 0, MAX_COUNT })
if refused then
  return refused
end
local holder = arg(1)
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
local handoffs, standbys = {}, {}
local limit = limit_in_force()
handoff(limit, handoffs)
send_ahead(tonumber(arg(2) or '0'), standbys)
finish()
return { released, handoffs, standbys }
