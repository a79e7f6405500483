-- confirm_handoff(waiter, ttl_ms, generation) -> 1 if the waiter still holds its reservation.
-- generation: the one the re-enqueued copy carries ('' for any); an older one changes nothing.
OWNED = true
reclaim()
local held = 0
local in_flight = QUEUED and redis.call('HGET', M, 'g:' .. waiter)
if QUEUED and (generation == '' or not in_flight or in_flight == generation)
  and redis.call('HDEL', R, waiter) == 1 then
  -- A live reservation: the payload is on the broker now.
  set_holders({ NOW + tonumber(ttl_ms), waiter })
  forget(waiter)
  held = 1
elseif holds(waiter) and not (QUEUED and redis.call('HEXISTS', R, waiter) == 1) then
  held = 1 -- already started (its acquire turned the reservation into a lease)
elseif QUEUED and redis.call('ZSCORE', W, waiter) then
  -- The reservation lapsed back into the queue: the re-enqueued copy wins, unless a newer hand-off
  -- was made or a copy picked up parked in its place (G: 'parked', acquire.lua).
  local live = live_generation(waiter)
  if live ~= 'parked' and (generation == '' or live == generation) then
    dequeue(waiter)
  end
end
finish()
return held
