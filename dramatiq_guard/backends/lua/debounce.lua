-- debounce(op, waiter, payload, wait_ms, max_wait_ms, generation) (GuardBackend.debounce, copy_is_live).
-- op 'send': `waiter` becomes K's pending run (its payload in P, queued in W), replacing every
-- pending one; its due time min(last send + wait_ms, first send + max_wait_ms) is the deadline of
-- the timer holder DUE, which keeps K's one slot until then: then the sweep hands the run off as a
-- parked waiter's (docs/flow-control-design.md, "Debounce"). Returns {superseded waiters, due in ms}.
-- op 'live': 1 if the copy of `waiter` carrying `generation` may start, 0 if it is stale.
local DUE = '~due'
if op == 'live' then
  local live = live_generation(waiter)
  return (live and live ~= generation) and 0 or 1
end
local refused = validate_args({ 'wait_ms', wait_ms, 0, MAX_DURATION_MS }, { 'max_wait_ms', max_wait_ms, 0, MAX_DURATION_MS })
if refused then
  return refused
end
OWNED = true
reclaim()
local pending, superseded = QUEUED and redis.call('ZRANGE', W, 0, -1) or {}, {}
local first = #pending > 0 and tonumber(redis.call('HGET', M, 'first') or NOW) or NOW
for _, w in ipairs(pending) do
  if w ~= waiter then
    dequeue(w)
    superseded[#superseded + 1] = w
  end
end
enqueue(waiter)
redis.call('HSET', P, waiter, payload)
redis.call('HSET', M, 'r:' .. waiter, ARG_ROUTE, 'first', fmt(first))
local due = math.min(NOW + tonumber(wait_ms), first + tonumber(max_wait_ms))
set_holders({ due, DUE })
finish()
return { superseded, due - NOW }
