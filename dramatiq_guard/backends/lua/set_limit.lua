-- set_limit(limit, '' to clear) -> {0, handoffs}; LIMITS (standalone Redis only) follows it.
OWNED = true
reclaim()
if limit == '' then
  redis.call('DEL', L)
else
  redis.call('SET', L, limit)
end
LIMIT = limit == '' and default_limit() or tonumber(limit)
if LIMITS then
  redis.call(limit == '' and 'SREM' or 'SADD', LIMITS, ARG_KEY)
end
local handoffs = {}
handoff(LIMIT, handoffs)
finish()
return { 0, handoffs }
