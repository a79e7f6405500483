-- release.lua's path for a live holder of a key with nothing queued, run before the prelude is set
-- up (docs/redis.md, "The scripts"): the last holder drops the key's state but L, G and T; one of
-- several leaves H and I when no holder lapsed. The same state and reply as release.lua; anything
-- else (and a release of a reservation only) falls through to it.
do
  if reserved_only ~= '1' and redis.call('EXISTS', W, P, R, D, S) == 0 then
    local deadline = redis.call('ZSCORE', H, holder)
    local _, now = server_time()
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
