-- health(namespace, seen...) -> {indexed, vanished, payloads, unindexed}: the state watch's check
-- that K is in X exactly while its W or R exists (standalone Redis only: it builds the names of
-- per-key keys itself). indexed: the keys in X now; vanished: those whose W and R are gone (their
-- entry is dropped, so each is reported once; payloads: how many payloads each still has, kept for
-- an operator); unindexed: keys of `seen` (in X at the previous check) no longer in X that still
-- have W or R (put back, so the sweeps find them again).
local prefix = namespace .. ':{'
local function queued(k)
  return redis.call('EXISTS', prefix .. k .. '}:waiters', prefix .. k .. '}:reserved') > 0
end
local _, now = server_time()
local indexed = redis.call('ZRANGE', X, 0, -1)
local seen, vanished, payloads, unindexed = {}, {}, {}, {}
for _, k in ipairs(indexed) do
  seen[k] = true
  if not queued(k) then
    vanished[#vanished + 1] = k
    payloads[#payloads + 1] = redis.call('HLEN', prefix .. k .. '}:payloads')
    redis.call('ZREM', X, k)
  end
end
for i = SEEN_FROM, #ARGV do
  local k = ARGV[i]
  if not seen[k] then
    seen[k] = true
    if queued(k) then
      redis.call('ZADD', X, now, k)
      unindexed[#unindexed + 1] = k
      indexed[#indexed + 1] = k
    end
  end
end
return { indexed, vanished, payloads, unindexed }
