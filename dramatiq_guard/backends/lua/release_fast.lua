-- The nobody-waiting path of release.lua, run before _prelude.lua is even set up: a live holder
-- releasing a key with no waiter, payload, reservation, ready waiter or standby (so nothing to
-- hand on or send ahead). The last holder drops the key's state in 5 commands (all but the
-- run-time limit, G and T, which expire by themselves); one of several, when no holder has
-- lapsed, leaves in 6 (its entries in H and I; their expiries stay no earlier than the latest
-- deadline). Either way exactly what release.lua would leave, with the same reply. Anything else
-- (a lapsed holder to reclaim, a waiter to hand to), or a standbys count it cannot use, falls through
-- to the prelude and release.lua.
-- KEYS and ARGV named by the layout (backends/redis_layout.py), read by the prologue before this.
do
  -- Only numbers validate_args accepts (_bounds.lua); the full path refuses the others.
  if whole_number(standbys or '0', 0, MAX_COUNT) and whole_number(ARG_HANDOFF_TTL_MS, 1, MAX_DURATION_MS)
    and whole_number(ARG_WAKE_TTL_MS, 1, MAX_DURATION_MS) and whole_number(ARG_STALE_TTL_MS, 1, MAX_DURATION_MS)
    and (ARG_DEFAULT_LIMIT == '' or whole_number(ARG_DEFAULT_LIMIT, 0, MAX_COUNT))
    and redis.call('EXISTS', W, P, R, D, S) == 0 then
    local deadline = redis.call('ZSCORE', H, holder)
    local clock = redis.call('TIME')
    local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
    if deadline and tonumber(deadline) > now then
      if redis.call('ZCARD', H) == 1 then
        redis.call('DEL', H, I, M)
        return { 1, {}, {} }
      end
      if #redis.call('ZRANGEBYSCORE', H, '-inf', now, 'LIMIT', 0, 1) == 0 then
        redis.call('ZREM', H, holder)
        redis.call('HDEL', I, holder)
        return { 1, {}, {} }
      end
    end
  end
end
