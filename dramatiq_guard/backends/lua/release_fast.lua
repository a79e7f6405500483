-- release.lua's path for a live holder of a key with nothing queued, run before the prelude is set
-- up (docs/redis.md, "The scripts"): the last holder drops the key's state but L, G and T; one of
-- several leaves H and I when no holder lapsed. The same state and reply as release.lua; anything
-- else (and a release of a reservation only) falls through to it.
-- H's two earliest deadlines answer both questions at once: alone (and live), or none lapsed.
do
  if reserved_only ~= '1' and redis.call('EXISTS', W, P, R, D, S) == 0 then
    local first = redis.call('ZRANGE', H, 0, 1, 'WITHSCORES')
    local _, now = server_time()
    if #first == 2 and first[1] == holder and tonumber(first[2]) > now then
      redis.call('DEL', H, I, M)
      return { 1, {}, {} }
    end
    if #first == 4 and tonumber(first[2]) > now
      and (first[1] == holder or first[3] == holder or redis.call('ZSCORE', H, holder)) then
      redis.call('ZREM', H, holder)
      redis.call('HDEL', I, holder)
      return { 1, {}, {} }
    end
  end
end
