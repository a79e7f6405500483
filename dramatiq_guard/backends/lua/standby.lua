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
local held = confirm_standby(waiter, ttl_ms, payload, generation)
finish()
return held
