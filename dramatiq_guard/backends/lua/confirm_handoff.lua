-- confirm_handoff(waiter, ttl_ms, generation) -> 1 if the waiter still holds its reservation.
-- generation: the one the re-enqueued copy carries ('' for any); an older one changes nothing.
local refused = validate_args(
  { 'ttl_ms', ttl_ms, 1, MAX_DURATION_MS },
  { 'generation', generation == '' and 0 or generation, 0, MAX_GENERATION }
)
if refused then
  return refused
end
OWNED = true
reclaim()
local held = confirm(waiter, ttl_ms, generation)
finish()
return held
