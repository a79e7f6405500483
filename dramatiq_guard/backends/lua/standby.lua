-- standby(op='send', standbys) -> {handoffs, standbys}
--   Sends the oldest parked waiters ahead as standbys, so that the first min(standbys, max(limit,
--   MIN_STANDBY_WINDOW)) waiters of the FIFO (none if the limit is 0) are all standbys (or ready
--   waiters). A sent standby keeps its place and its payload, and gets a deadline in S (a payload
--   and a deadline in S together mark "sent, unconfirmed"): if it is not confirmed by then, reclaim
--   makes it a parked waiter again; if a slot is handed to it meanwhile, handoff reserves the slot
--   (in R, as for a parked waiter) without returning its payload (its sender enqueues it). Returns
--   the hand-offs of this operation and the waiter, payload pairs sent.
-- standby(op='confirm', waiter, ttl_ms, payload, generation) -> 1 if the standby (or its slot) holds
--   (generation: the one the sent copy carries; a confirmation of an older one changes nothing)
--   Its copy is on the broker now. If the stored payload is still the one sent
--   (else the message parked itself again meanwhile, and its entry is left
--   alone), it is dropped: a standby still waiting stays in S, on the broker,
--   until it is picked up (then it is a ready waiter, in D) or ttl_ms passes
--   (then it is dropped); one handed a slot meanwhile keeps the slot for ttl_ms
--   (as confirm_handoff). One that reclaim already made a parked waiter again
--   is left parked (its enqueued copy parks into the same entry when picked up).
local refused
if op == 'send' then
  refused = validate_args({ 'count', standbys, 0, MAX_COUNT })
else
  refused = validate_args(
    { 'ttl_ms', ttl_ms, 1, MAX_DURATION_MS },
    { 'generation', (generation or '') == '' and 0 or generation, 0, MAX_GENERATION }
  )
end
if refused then
  return refused
end
OWNED = true
reclaim()
if op == 'send' then
  local handoffs, sent = {}, {}
  local limit = limit_in_force()
  handoff(limit, handoffs)
  send_ahead(tonumber(standbys), sent)
  finish()
  return { handoffs, sent }
end
local ttl = tonumber(ttl_ms)
local held = 0
local in_flight = QUEUED and redis.call('HGET', M, 'g:' .. waiter)
if generation ~= '' and in_flight and in_flight ~= generation then
  -- A confirmation of an older send: that copy will not start (it is stale).
  finish()
  return 0
end
if QUEUED and redis.call('HGET', P, waiter) == payload then
  if redis.call('HDEL', R, waiter) == 1 then
    set_holders({ NOW + ttl, waiter })
    redis.call('HDEL', P, waiter)
    forget(waiter)
    held = 1
  elseif redis.call('ZSCORE', S, waiter) then
    add_deadline(S, NOW + ttl, waiter)
    redis.call('HDEL', P, waiter)
    redis.call('HDEL', M, 'g:' .. waiter)
    held = 1
  end
elseif holds(waiter) or (QUEUED and (redis.call('ZSCORE', D, waiter) or redis.call('ZSCORE', S, waiter))) then
  -- Picked up already (it blocks as a standby, or holds its slot), or sent again.
  held = 1
end
finish()
return held
