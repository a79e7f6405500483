-- summaries(first): a few numbers about many guard keys at once, for an overview. Read only.
-- Standalone Redis only (the keys of many guard keys are in many Cluster slots; on a cluster
-- RedisBackend.summaries pipelines the same reads instead). No prelude.
-- KEYS: per guard key, 5 names in this order: H (holders), W (waiters), R (reserved), L (limit),
-- M (meta). ARGV[1]: how many of each key's first waiters to return (at least 1: the oldest).
-- Returns, per guard key: {ZCARD H, ZCARD W, first waiters with scores, HLEN R, L, M's 'limit'}.
local first = tonumber(ARGV[1]) - 1
local out = {}
for i = 1, #KEYS, 5 do
  out[#out + 1] = {
    redis.call('ZCARD', KEYS[i]),
    redis.call('ZCARD', KEYS[i + 1]),
    redis.call('ZRANGE', KEYS[i + 1], 0, first, 'WITHSCORES'),
    redis.call('HLEN', KEYS[i + 2]),
    redis.call('GET', KEYS[i + 3]) or false,
    redis.call('HGET', KEYS[i + 4], 'limit') or false,
  }
end
return out
