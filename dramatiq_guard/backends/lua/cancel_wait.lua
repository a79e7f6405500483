-- cancel_wait(waiter) -> {released, handoffs}
local refused = validate_args()
if refused then
  return refused
end
local waiter = arg(1)
OWNED = true
reclaim()
local released = 0
if holds(waiter) then
  released = 1
  drop_holders({ waiter })
end
if QUEUED then
  redis.call('ZREM', W, waiter)
  unset_ready({ waiter })
  redis.call('ZREM', S, waiter)
  redis.call('HDEL', P, waiter)
  redis.call('HDEL', R, waiter)
  forget(waiter)
end
if released == 1 then
  redis.call('DEL', WAKE .. waiter)
else
  redis.call('HDEL', I, waiter)
end
local handoffs = {}
handoff(limit_in_force(), handoffs)
finish()
return { released, handoffs }
