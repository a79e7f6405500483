-- The last-holder path of release.lua, run before _prelude.lua is even set up: a live holder
-- releasing a key it holds alone, with no waiter, reservation or standby (so nothing to hand on
-- or send ahead). It drops the key's state in 5 commands, exactly as release.lua would (all but
-- the run-time limit, G and T, which expire by themselves), and returns the same reply. Anything
-- else, or a send_ahead it cannot use, falls through to the prelude and release.lua.
-- KEYS and ARGV as _prelude.lua; release's own arguments from ARGV[8] (see release.lua).
do
  -- Only numbers validate_args accepts (_bounds.lua); the full path refuses the others.
  if whole_number(ARGV[9] or '0', 0, MAX_COUNT) and whole_number(ARGV[2], 1, MAX_DURATION_MS)
    and whole_number(ARGV[3], 1, MAX_DURATION_MS) and whole_number(ARGV[7], 1, MAX_DURATION_MS)
    and (ARGV[5] == '' or whole_number(ARGV[5], 0, MAX_COUNT))
    and redis.call('EXISTS', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[9]) == 0
    and redis.call('ZCARD', KEYS[1]) == 1 then
    local deadline = redis.call('ZSCORE', KEYS[1], ARGV[8])
    local clock = redis.call('TIME')
    local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
    if deadline and tonumber(deadline) > now then
      redis.call('DEL', KEYS[1], KEYS[8], KEYS[10])
      return { 1, {}, {} }
    end
  end
end
