-- The state watch's consistency check of the waiting-keys index (standalone Redis only:
-- it builds the names of per-key keys itself, which a Redis Cluster would refuse).
--
-- The per-key scripts keep this invariant, atomically: a guard key K is in the index X exactly
-- while its waiters (W) or its unconfirmed reservations (R) are not empty. A break of it was
-- made from outside the guard's scripts: a key evicted, deleted or flushed.
--
--   KEYS: X, the waiting-keys index
--   ARGV: namespace, then (from SEEN_FROM) the guard keys the caller saw in the index at its
--   previous check
--
-- Returns {indexed, vanished, payloads, unindexed}:
--   indexed    the keys in X now
--   vanished   keys in X whose W and R are both gone: their waiters were lost. Their entry is
--              dropped from X (so they are reported once); their stored payloads, if any are
--              left, are kept for an operator to recover.
--   payloads   for each vanished key, how many payloads it still has
--   unindexed  keys of ARGV no longer in X that still have W or R: the index entry was lost.
--              It is put back, so the workers' sweeps find the key again.
local prefix = namespace .. ':{'
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local indexed = redis.call('ZRANGE', X, 0, -1)
local seen = {}
local vanished, payloads, unindexed = {}, {}, {}
for _, k in ipairs(indexed) do
  seen[k] = true
  if redis.call('EXISTS', prefix .. k .. '}:waiters', prefix .. k .. '}:reserved') == 0 then
    vanished[#vanished + 1] = k
    payloads[#payloads + 1] = redis.call('HLEN', prefix .. k .. '}:payloads')
    redis.call('ZREM', X, k)
  end
end
for i = SEEN_FROM, #ARGV do
  local k = ARGV[i]
  if not seen[k] then
    seen[k] = true
    if redis.call('EXISTS', prefix .. k .. '}:waiters', prefix .. k .. '}:reserved') > 0 then
      redis.call('ZADD', X, now, k)
      unindexed[#unindexed + 1] = k
      indexed[#indexed + 1] = k
    end
  end
end
return {indexed, vanished, payloads, unindexed}
