-- unindex(member, cutoff_ms): drop a waiting-keys index entry unless it was refreshed after
-- cutoff_ms (a park refreshes it before its script runs).
local score = redis.call('ZSCORE', X, member)
if score and tonumber(score) <= tonumber(cutoff_ms) then
  return redis.call('ZREM', X, member)
end
return 0
