-- set_limit(limit, '' to clear) -> {0, handoffs}; LIMITS (standalone Redis only) follows it.
OWNED = true
reclaim()
if limit == '' then
  redis.call('DEL', L)
  LIMIT = default_limit()
  if LIMITS then
    redis.call('SREM', LIMITS, ARG_KEY)
  end
else
  redis.call('SET', L, limit)
  LIMIT = tonumber(limit)
  if LIMITS then
    redis.call('SADD', LIMITS, ARG_KEY)
  end
end
local handoffs = {}
handoff(LIMIT, handoffs)
finish()
return { 0, handoffs }
