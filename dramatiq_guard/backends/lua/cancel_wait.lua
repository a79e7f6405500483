-- cancel_wait(waiter, generation) -> {released, handoffs}
--   generation: '' to leave whatever the waiter is doing; else only the hand-off or standby send
--   of that generation is withdrawn, while it is unconfirmed (M's 'g:' entry) and current (the
--   waiter reserved in R, or being sent in S): a message parked elsewhere on its way that came
--   back to the key meanwhile (parked again, or holding the slot) keeps its entry.
local refused = validate_args({ 'generation', (generation or '') == '' and 0 or generation, 0, MAX_GENERATION })
if refused then
  return refused
end
generation = generation or ''
OWNED = true
reclaim()
local released = 0
local leaves = generation == ''
  or (QUEUED and redis.call('HGET', M, 'g:' .. waiter) == generation
    and (redis.call('HEXISTS', R, waiter) == 1 or redis.call('ZSCORE', S, waiter)))
if leaves then
  if holds(waiter) then
    released = 1
    drop_holders({ waiter })
  end
  if QUEUED then
    redis.call('ZREM', W, waiter)
    unset_ready({ waiter })
    redis.call('ZREM', S, waiter)
    redis.call('HDEL', P, waiter)
    redis.call('HDEL', R, waiter)
    forget(waiter)
  end
  if released == 1 then
    redis.call('DEL', WAKE .. waiter)
  else
    redis.call('HDEL', I, waiter)
  end
end
local handoffs = {}
handoff(limit_in_force(), handoffs)
finish()
return { released, handoffs }
