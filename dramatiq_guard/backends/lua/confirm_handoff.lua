-- confirm_handoff(waiter, ttl_ms) -> 1 if the waiter still holds its reservation.
local refused = validate_args({ 'ttl_ms', ARGV[5], 1, MAX_DURATION_MS })
if refused then
  return refused
end
local waiter = ARGV[4]
OWNED = true
reclaim()
local held = 0
if QUEUED and redis.call('HDEL', R, waiter) == 1 then
  -- A live reservation: the payload is on the broker now.
  set_holders({ NOW + tonumber(ARGV[5]), waiter })
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
