-- The nobody-waiting path of release.lua, run before _prelude.lua is even set up: a live holder
-- releasing a key with no waiter, payload, reservation, ready waiter or standby (so nothing to
-- hand on or send ahead). The last holder drops the key's state in 5 commands (all but the
-- run-time limit, G and T, which expire by themselves); one of several, when no holder has
-- lapsed, leaves in 6 (its entries in H and I; their expiries stay no earlier than the latest
-- deadline). Either way exactly what release.lua would leave, with the same reply. Anything else
-- (a lapsed holder to reclaim, a waiter to hand to), or a send_ahead it cannot use, falls through
-- to the prelude and release.lua.
-- KEYS and ARGV as _prelude.lua; release's own arguments from ARGV[8] (see release.lua).
do
  -- Only numbers validate_args accepts (_bounds.lua); the full path refuses the others.
  if whole_number(ARGV[9] or '0', 0, MAX_COUNT) and whole_number(ARGV[2], 1, MAX_DURATION_MS)
    and whole_number(ARGV[3], 1, MAX_DURATION_MS) and whole_number(ARGV[7], 1, MAX_DURATION_MS)
    and (ARGV[5] == '' or whole_number(ARGV[5], 0, MAX_COUNT))
    and redis.call('EXISTS', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[9]) == 0 then
    local deadline = redis.call('ZSCORE', KEYS[1], ARGV[8])
    local clock = redis.call('TIME')
    local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
    if deadline and tonumber(deadline) > now then
      if redis.call('ZCARD', KEYS[1]) == 1 then
        redis.call('DEL', KEYS[1], KEYS[8], KEYS[10])
        return { 1, {}, {} }
      end
      if #redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 1) == 0 then
        redis.call('ZREM', KEYS[1], ARGV[8])
        redis.call('HDEL', KEYS[8], ARGV[8])
        return { 1, {}, {} }
      end
    end
  end
end
