-- cancel_wait(waiter, generation) -> {released, handoffs}. generation: '' to withdraw whatever the
-- waiter is doing; else only the hand-off or standby send of that generation, while it is
-- unconfirmed (M's 'g:<w>') and current (the waiter in R or S).
generation = generation or ''
OWNED = true
reclaim()
local released = 0
local leaves = generation == ''
  or (QUEUED and redis.call('HGET', M, 'g:' .. waiter) == generation
    and (redis.call('HEXISTS', R, waiter) == 1 or redis.call('ZSCORE', S, waiter)))
if leaves then
  released = holds(waiter) and 1 or 0
  if released == 1 then
    drop_holders({ waiter })
    redis.call('DEL', ARG_WAKE .. waiter)
  else
    redis.call('HDEL', I, waiter)
  end
  if QUEUED then
    dequeue(waiter)
    redis.call('HDEL', R, waiter)
  end
end
local handoffs = {}
handoff(limit_in_force(), handoffs)
finish()
return { released, handoffs }
