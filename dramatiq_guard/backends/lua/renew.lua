-- renew(holder_1, ttl_ms_1, holder_2, ttl_ms_2, ...) -> {1 or 0, ...}: per lease, 1 if renewed, 0 if
-- the holder no longer holds (a lapsed entry is left to reclaim, never revived). Without the
-- prelude; keeps its invariant: H, T and I expire no earlier than the largest deadline in H
-- (PEXPIREAT GT; before Redis 7, from the latest deadline). Every lease is checked before a write.
local count = #ARGV / ARGV_PER_LEASE
if count % 1 ~= 0 or #KEYS ~= count * KEYS_PER_LEASE then
  return redis.error_reply(
    'renew takes ' .. KEYS_PER_LEASE .. ' KEYS and ' .. ARGV_PER_LEASE .. ' ARGV per lease, got ' .. #KEYS .. ' and ' .. #ARGV
  )
end
for n = 1, count do
  local _, _, _, _, ttl_ms = lease(n)
  local refused = refusal({ { 'ttl_ms', ttl_ms, 0, MAX_DURATION_MS } })
  if refused then
    return refused
  end
end
local _, now = server_time()

local function renew(H, T, I, holder, ttl)
  local deadline = redis.call('ZSCORE', H, holder)
  if not deadline or tonumber(deadline) <= now then
    return 0
  end
  local at = now + ttl
  redis.call('ZADD', H, at, holder)
  if at < tonumber(deadline) then -- lowered (a throttle's start): H and I follow the latest left
    local latest = redis.call('ZRANGE', H, -1, -1, 'WITHSCORES')[2]
    if tonumber(latest) < tonumber(deadline) then
      redis.call('PEXPIREAT', H, latest)
      redis.call('PEXPIREAT', I, latest)
    end
    return 1
  end
  local reply = redis.pcall('PEXPIREAT', H, at, 'GT')
  if type(reply) == 'table' and reply.err then
    local last = redis.call('ZRANGE', H, -1, -1, 'WITHSCORES')
    at = math.max(at, tonumber(last[2] or '0'))
    redis.call('PEXPIREAT', H, at)
    if redis.call('PTTL', T) < at - now then
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
  local H, T, I, holder, ttl_ms = lease(n)
  renewed[n] = renew(H, T, I, holder, tonumber(ttl_ms))
end
return renewed
