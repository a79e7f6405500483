-- confirm_handoff(waiter, ttl_ms, generation) -> 1 if the waiter still holds its reservation.
-- generation: the one the re-enqueued copy carries ('' for any); an older one changes nothing.
OWNED = true
reclaim()
local held = confirm(waiter, ttl_ms, generation)
finish()
return held
