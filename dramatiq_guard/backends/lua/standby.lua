-- standby(op='send', standbys) -> {handoffs, standbys}: hands on the free slots, then sends the
--   first waiters ahead (send_ahead), returning the waiter, payload, generation triples sent.
-- standby(op='confirm', waiter, ttl_ms, payload, generation) -> 1 if the standby (or its slot)
--   holds: its copy is on the broker. If the stored payload is still the one sent, it is dropped: a
--   standby still waiting stays in S until ttl_ms; one handed a slot keeps it for ttl_ms. A
--   confirmation of an older generation changes nothing.
if (op == 'send' and (standbys or '') or (ttl_ms or '')) == '' then
  return redis.error_reply((op == 'send' and 'count' or 'ttl_ms') .. ' is missing')
end
OWNED = true
reclaim()
if op == 'send' then
  local handoffs, sent = {}, {}
  handoff(limit_in_force(), handoffs)
  send_ahead(tonumber(standbys), sent)
  finish()
  return { handoffs, sent }
end
local held = 0
local in_flight = QUEUED and redis.call('HGET', M, 'g:' .. waiter)
if generation ~= '' and in_flight and in_flight ~= generation then
  -- an older generation's confirmation changes nothing
elseif QUEUED and redis.call('HGET', P, waiter) == payload then
  if redis.call('HDEL', R, waiter) == 1 then
    set_holders({ NOW + tonumber(ttl_ms), waiter })
    forget(waiter)
    held = 1
  elseif redis.call('ZSCORE', S, waiter) then
    add_deadline(S, NOW + tonumber(ttl_ms), waiter)
    redis.call('HDEL', P, waiter)
    redis.call('HDEL', M, 'g:' .. waiter)
    held = 1
  end
elseif holds(waiter) or (QUEUED and (redis.call('ZSCORE', D, waiter) or redis.call('ZSCORE', S, waiter))) then
  held = 1 -- picked up already (it blocks as a standby, or holds its slot), or sent again
end
finish()
return held
