-- unindex(member, cutoff_ms): drop a waiting-keys index entry unless it was
-- refreshed after cutoff_ms (a park refreshes it before its script runs).
-- KEYS[1] is the index; no prelude: it lives in its own slot.
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) <= tonumber(ARGV[2]) then
  return redis.call('ZREM', KEYS[1], ARGV[1])
end
return 0
