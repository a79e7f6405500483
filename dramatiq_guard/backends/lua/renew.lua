-- renew(holder, ttl_ms) -> 1 if renewed, 0 if the holder no longer holds the key.
-- On its own, without _prelude.lua: it touches only the holder's own entry (a lapsed entry is
-- left to the next reclaim, which hands its slot on, never revived), so it needs none of the
-- prelude's machinery. It is what the lease renewer and the dedup confirmer run, often.
--
-- KEYS: H T I of the guard key, the layout of _prelude.lua (one hash tag, one slot).
-- ARGV: holder, ttl_ms.
-- Keeps the prelude's invariant: H, T and I, when they exist, expire no earlier than the
-- largest deadline in H (PEXPIREAT GT: never sooner than they already do; on a server without
-- GT, Redis < 7, from the latest deadline, and T only later). Times come from the server's clock
-- only.
local MAX_DURATION_MS = 31622400000
local H, T, I = KEYS[1], KEYS[2], KEYS[3]
local holder, ttl_arg = ARGV[1], ARGV[2]

-- Checked before the first write (see validate_args in _prelude.lua).
local ttl = #ttl_arg <= 16 and string.match(ttl_arg, '^%d+$') and tonumber(ttl_arg)
if not (ttl and ttl <= MAX_DURATION_MS) then
  return redis.error_reply(
    'ttl_ms must be an integer from 0 to ' .. string.format('%.0f', MAX_DURATION_MS) .. ', got ' .. tostring(ttl_arg)
  )
end

local deadline = redis.call('ZSCORE', H, holder)
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
if not deadline or tonumber(deadline) <= now then
  return 0
end
local at = now + ttl
redis.call('ZADD', H, at, holder)
local reply = redis.pcall('PEXPIREAT', H, at, 'GT')
if type(reply) == 'table' and reply.err then
  local last = redis.call('ZRANGE', H, -1, -1, 'WITHSCORES')
  at = math.max(at, tonumber(last[2] or '0'))
  redis.call('PEXPIREAT', H, at)
  if redis.call('PTTL', T) < at - now then -- T may have to outlive the holders (store_token)
    redis.call('PEXPIREAT', T, at)
  end
  redis.call('PEXPIREAT', I, at)
  return 1
end
redis.call('PEXPIREAT', T, at, 'GT')
redis.call('PEXPIREAT', I, at, 'GT')
return 1
