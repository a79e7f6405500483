-- confirm_handoff(waiter, ttl_ms) -> 1 if the waiter still holds its reservation.
local waiter = arg(1)
OWNED = true
reclaim()
local held = 0
if QUEUED and redis.call('HDEL', R, waiter) == 1 then
  -- A live reservation: the payload is on the broker now.
  set_holders({ NOW + tonumber(arg(2)), waiter })
  redis.call('HDEL', P, waiter)
  held = 1
elseif HS[waiter] ~= nil then
  -- Already started (its acquire turned the reservation into a lease).
  held = 1
elseif QUEUED then
  -- The reservation lapsed and reclaim put the waiter back in the queue:
  -- the re-enqueued copy wins.
  redis.call('ZREM', W, waiter)
  redis.call('ZREM', D, waiter)
  redis.call('ZREM', S, waiter)
  redis.call('HDEL', P, waiter)
end
finish()
return held
