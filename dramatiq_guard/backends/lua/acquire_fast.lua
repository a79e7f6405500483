-- The free-key path of acquire.lua, run before _prelude.lua is even set up (so it costs neither
-- the prelude's setup nor its general reads): a fenced acquire with no generation, of a key that
-- has no holder, waiter, reservation or standby, with a limit of at least 1 (its run-time limit,
-- else the caller's default). It takes the key in 8 commands and leaves exactly the state, and
-- returns exactly the reply, that acquire.lua would (a holder with its deadline and
-- "<since_ms>|<info>", the next fencing token in T expiring no earlier than STALE_TTL from now,
-- H and I expiring at the holder's deadline). Anything else, or a number it cannot use, falls
-- through to the prelude and acquire.lua (which refuses a bad number before any write).
-- KEYS and ARGV as _prelude.lua; acquire's own arguments from ARGV[8] (see acquire.lua).
do
  -- Only numbers validate_args accepts (_bounds.lua); the full path refuses the others.
  local ttl = whole_number(ARGV[9], 1, MAX_DURATION_MS)
  local stale = whole_number(ARGV[7], 1, MAX_DURATION_MS)
  if ttl and stale and whole_number(ARGV[2], 1, MAX_DURATION_MS)
    and whole_number(ARGV[3], 1, MAX_DURATION_MS) and whole_number(ARGV[12], 0, MAX_DURATION_MS)
    and (ARGV[5] == '' or whole_number(ARGV[5], 0, MAX_COUNT))
    and ARGV[14] == '' and ARGV[15] ~= '0'
    and redis.call('EXISTS', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[9]) == 0 then
    local values = redis.call('MGET', KEYS[7], KEYS[6])
    local limit = values[1] and tonumber(values[1]) or (ARGV[5] ~= '' and tonumber(ARGV[5]) or 0)
    if limit >= 1 then
      local clock = redis.call('TIME')
      local now_us = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
      local now = math.floor(now_us / 1000)
      local deadline = now + ttl
      local token = math.max(tonumber(values[2] or '0') + 1, now_us)
      redis.call('ZADD', KEYS[1], deadline, ARGV[8])
      redis.call('HSET', KEYS[8], ARGV[8], string.format('%.0f', now) .. '|' .. ARGV[13])
      redis.call('SET', KEYS[6], string.format('%.0f', token), 'PXAT', math.max(deadline, now + stale))
      redis.call('PEXPIREAT', KEYS[1], deadline)
      redis.call('PEXPIREAT', KEYS[8], deadline)
      return { 1, token, limit, '', {}, {} }
    end
  end
end
