-- renew(holder_1, ttl_ms_1, holder_2, ttl_ms_2, ...) -> {1 or 0, ...}: per lease, 1 if renewed, 0
-- if the holder no longer holds the key. One lease or a batch of them in one call: the lease
-- renewer's and the dedup confirmer's batches run as one script on a standalone Redis (one call's
-- overhead, not one per lease); on a Redis Cluster, where a script's keys share one slot, each
-- lease is a call of its own.
-- On its own, without _prelude.lua: it touches only each holder's own entry (a lapsed entry is
-- left to the next reclaim, which hands its slot on, never revived), so it needs none of the
-- prelude's machinery.
--
-- KEYS: H T I of each lease's guard key (one hash tag per key); ARGV: holder, ttl_ms, per lease
-- (backends/redis_layout.py: lease(n) reads the n-th).
-- Keeps the prelude's invariant: H, T and I, when they exist, expire no earlier than the
-- largest deadline in H (PEXPIREAT GT: never sooner than they already do; on a server without
-- GT, Redis < 7, from the latest deadline, and T only later). Times come from the server's clock
-- only.
-- Checked before the first write (see validate_args in _prelude.lua): every lease's ttl, and
-- that KEYS and ARGV agree, so a bad batch writes nothing.
local count = #ARGV / ARGV_PER_LEASE
if count % 1 ~= 0 or #KEYS ~= count * KEYS_PER_LEASE then
  return redis.error_reply(
    'renew takes ' .. KEYS_PER_LEASE .. ' KEYS and ' .. ARGV_PER_LEASE .. ' ARGV per lease, got ' .. #KEYS .. ' and ' .. #ARGV
  )
end
local ttls = {}
for n = 1, count do
  local _, _, _, _, ttl_arg = lease(n)
  local ttl = #ttl_arg <= 16 and string.match(ttl_arg, '^%d+$') and tonumber(ttl_arg)
  if not (ttl and ttl <= MAX_DURATION_MS) then
    return redis.error_reply(
      'ttl_ms must be an integer from 0 to ' .. string.format('%.0f', MAX_DURATION_MS) .. ', got ' .. tostring(ttl_arg)
    )
  end
  ttls[n] = ttl
end

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local function renew(H, T, I, holder, ttl)
  local deadline = redis.call('ZSCORE', H, holder)
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
end

local renewed = {}
for n = 1, count do
  local H, T, I, holder = lease(n)
  renewed[n] = renew(H, T, I, holder, ttls[n])
end
return renewed
