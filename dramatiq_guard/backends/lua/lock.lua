-- lock(holder, ttl_ms, info) -> {1, {}}: acquired; {0, holders}: refused, held by these live
-- holders (none the caller, no run-time limit); {-1, {}}: not decided here, the caller runs
-- acquire.lua. The send-time dedup lock (GuardBackend.try_lock) without the prelude: a free key
-- (none of H W R L T I) is taken as acquire.lua would with a limit of 1, issuing no token. With
-- a push (QUEUE, QUEUE_MESSAGES: a RedisBroker queue's list and message hash; ARGV from PUSH_FROM:
-- its message id and data), the lock enqueues the message as Dramatiq's enqueue does: both or neither.
-- One EXISTS says whether the key is free (0) and whether it has a run-time limit (over 5): L is
-- named six times, and EXISTS counts a key once for each time it is named.
local present = redis.call('EXISTS', H, W, R, T, I, L, L, L, L, L, L)
local _, now = server_time()
if present == 0 then
  local deadline = now + tonumber(ttl_ms)
  redis.call('ZADD', H, deadline, holder)
  redis.call('HSET', I, holder, holder_entry(nil, now, '', info))
  redis.call('PEXPIREAT', H, deadline)
  redis.call('PEXPIREAT', I, deadline)
  if QUEUE then
    push_once(QUEUE, QUEUE_MESSAGES, ARGV[PUSH_FROM], ARGV[PUSH_FROM + 1])
  end
  return { 1, {} }
end
local flat = redis.call('ZRANGE', H, 0, -1, 'WITHSCORES')
local holders = {}
for i = 1, #flat, 2 do
  if flat[i] == holder and QUEUE and redis.call('HEXISTS', QUEUE_MESSAGES, ARGV[PUSH_FROM]) == 1 then
    return { 1, {} } -- this call run again (its reply was lost): it took the lock and pushed
  elseif flat[i] == holder or tonumber(flat[i + 1]) <= now then
    return { -1, {} } -- the caller re-entering, or a lapsed holder to reclaim
  end
  holders[#holders + 1] = flat[i]
end
if #holders == 0 or present > 5 then
  return { -1, {} }
end
return { 0, holders }
