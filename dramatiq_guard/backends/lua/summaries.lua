-- summaries(first): a few numbers about many guard keys at once, for an overview. Read only.
-- Standalone Redis only (the keys of many guard keys are in many Cluster slots; on a cluster
-- RedisBackend.summaries pipelines the same reads instead). No prelude.
-- KEYS: per guard key H, W, R, L, M (guard_key(n) reads the n-th's); ARGV: first, how many of
-- each key's first waiters to return (at least 1: the oldest).
-- Returns, per guard key: {ZCARD H, ZCARD W, first waiters with scores, HLEN R, L, M's 'limit'}.
local last = tonumber(first) - 1
local out = {}
for n = 1, #KEYS / KEYS_PER_GUARD_KEY do
  local H, W, R, L, M = guard_key(n)
  out[n] = {
    redis.call('ZCARD', H),
    redis.call('ZCARD', W),
    redis.call('ZRANGE', W, 0, last, 'WITHSCORES'),
    redis.call('HLEN', R),
    redis.call('GET', L) or false,
    redis.call('HGET', M, 'limit') or false,
  }
end
return out
