-- renew(holder_1, ttl_ms_1, holder_2, ttl_ms_2, ...) -> {1 or 0, ...}: per lease (KEYS: its guard
-- key's prefix), 1 if renewed, 0 if the holder no longer holds (a lapsed entry is left to reclaim,
-- never revived). Without the prelude; keeps its invariant: H, T and I expire no earlier than the
-- largest deadline in H (expire_later). Every lease is checked before a write.
local count = #ARGV / ARGV_PER_LEASE
if #KEYS ~= count then
  return redis.error_reply(
    'renew takes 1 KEYS (its prefix) and ' .. ARGV_PER_LEASE .. ' ARGV per lease, got ' .. #KEYS .. ' and ' .. #ARGV
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

-- PEXPIREAT key at GT; before Redis 7 (no GT), only if key's TTL ends sooner.
local function expire_later(key, at)
  local reply = redis.pcall('PEXPIREAT', key, at, 'GT')
  if type(reply) == 'table' and reply.err and redis.call('PTTL', key) < at - now then
    redis.call('PEXPIREAT', key, at)
  end
end

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
  expire_later(H, at)
  expire_later(T, at)
  expire_later(I, at)
  return 1
end

local renewed = {}
for n = 1, count do
  local H, T, I, holder, ttl_ms = lease(n)
  renewed[n] = renew(H, T, I, holder, tonumber(ttl_ms))
end
return renewed
