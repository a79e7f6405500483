-- debounce(op, waiter, payload, wait_ms, max_wait_ms, generation) (GuardBackend.debounce, copy_is_live).
-- op 'send': `waiter` becomes K's pending run (its payload in P, queued in W), replacing every
-- pending one; its due time min(last send + wait_ms, first send + max_wait_ms) is the deadline of
-- the timer holder DEBOUNCE_TIMER, which keeps K's one slot until then: then the sweep hands the run
-- off as a parked waiter's (docs/flow-control-design.md, "Debounce"). M keeps the burst's first send
-- and how many sends it superseded (summaries.lua shows them). Returns {superseded waiters, due in ms}.
-- op 'live': 0 if the copy of `waiter` carrying `generation` is stale; else 1, and the copy
-- starts: its hand-off is confirmed if it was not yet (so it cannot lapse and be handed off again).
OWNED = true
reclaim()
if op == 'live' then
  local live = live_generation(waiter)
  local started = not live or live == generation
  if started then
    confirm(waiter, 1, generation)
  end
  finish()
  return started and 1 or 0
end
local pending, superseded = QUEUED and redis.call('ZRANGE', W, 0, -1) or {}, {}
local first, count = NOW, 0
if #pending > 0 then
  local burst = redis.call('HMGET', M, 'first', 'superseded')
  first, count = tonumber(burst[1] or NOW), tonumber(burst[2] or 0)
end
for _, w in ipairs(pending) do
  if w ~= waiter then
    dequeue(w)
    superseded[#superseded + 1] = w
  end
end
enqueue(waiter, 0)
redis.call('HSET', P, waiter, payload)
redis.call('HSET', M, 'r:' .. waiter, ARG_ROUTE, 'first', fmt(first), 'superseded', count + #superseded)
local due = math.max(NOW, math.min(NOW + tonumber(wait_ms), first + tonumber(max_wait_ms)))
set_holders({ due, DEBOUNCE_TIMER })
REINDEX = true -- the timer moved later: K is due then, not at the entry it had
finish()
return { superseded, due - NOW }
