-- confirm_handoff(waiter, ttl_ms, generation) -> 1 if the waiter still holds its reservation.
-- generation: the one the re-enqueued copy carries ('' for any). A confirmation of an older
-- generation than the waiter's latest hand-off changes nothing: that copy will not start.
local refused = validate_args(
  { 'ttl_ms', ttl_ms, 1, MAX_DURATION_MS },
  { 'generation', generation == '' and 0 or generation, 0, MAX_GENERATION }
)
if refused then
  return refused
end
OWNED = true
reclaim()
local held = 0
-- Whether the copy of this generation takes the waiter's place, given the generation that may
-- start (G): not if the copy parked in its place already (G is 'parked', acquire.lua).
local function copy_wins(live)
  return live ~= 'parked' and (generation == '' or live == generation)
end
local in_flight = QUEUED and redis.call('HGET', M, 'g:' .. waiter)
if QUEUED and (generation == '' or not in_flight or in_flight == generation)
  and redis.call('HDEL', R, waiter) == 1 then
  -- A live reservation: the payload is on the broker now.
  set_holders({ NOW + tonumber(ttl_ms), waiter })
  redis.call('HDEL', P, waiter)
  forget(waiter)
  held = 1
elseif holds(waiter) and not (QUEUED and redis.call('HEXISTS', R, waiter) == 1) then
  -- Already started (its acquire turned the reservation into a lease).
  held = 1
elseif QUEUED and redis.call('ZSCORE', W, waiter) and copy_wins(live_generation(waiter)) then
  -- The reservation lapsed and reclaim put the waiter back in the queue before any newer
  -- hand-off: the re-enqueued copy wins (unless it was picked up already and parked in its
  -- place, acquire.lua: then the entry is that copy).
  redis.call('ZREM', W, waiter)
  unset_ready({ waiter })
  redis.call('ZREM', S, waiter)
  redis.call('HDEL', P, waiter)
  forget(waiter)
end
finish()
return held
