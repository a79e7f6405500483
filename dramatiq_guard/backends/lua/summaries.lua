-- summaries(first) -> per guard key (KEYS: its prefix) {ZCARD H, ZCARD W, its first waiters with
-- scores, HLEN R, L, M's 'limit', a debounce key's due time (DEBOUNCE_TIMER's deadline) and M's
-- 'superseded'}. Read only; on a Redis Cluster, one guard key per call.
local last = tonumber(first) - 1
local out = {}
for n = 1, #KEYS do
  local H, W, R, L, M = guard_key(n)
  out[n] = {
    redis.call('ZCARD', H),
    redis.call('ZCARD', W),
    redis.call('ZRANGE', W, 0, last, 'WITHSCORES'),
    redis.call('HLEN', R),
    redis.call('GET', L) or false,
    redis.call('HGET', M, 'limit') or false,
    redis.call('ZSCORE', H, DEBOUNCE_TIMER) or false,
    redis.call('HGET', M, 'superseded') or false,
  }
end
return out
