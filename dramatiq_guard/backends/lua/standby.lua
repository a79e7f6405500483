-- standby(standbys) -> {handoffs, standbys}: hands on the free slots, then sends the first waiters
-- ahead (send_ahead), returning the waiter, payload, generation triples sent; confirm.lua confirms
-- each once its copy is on the broker.
OWNED = true
reclaim()
local handoffs, sent = {}, {}
handoff(limit_in_force(), handoffs)
send_ahead(tonumber(standbys), sent)
finish()
return { handoffs, sent }
