-- set_limit(limit or '' to clear) -> {0, handoffs}
-- With the limits index (LIMITS, standalone Redis only), the guard key is
-- added to it or removed from it in the same step.
local refused
if limit == '' then
  refused = validate_args()
else
  refused = validate_args({ 'limit', limit, 0, MAX_COUNT })
end
if refused then
  return refused
end
OWNED = true
reclaim()
if limit == '' then
  redis.call('DEL', L)
  LIMIT = default_limit()
  if LIMITS then
    redis.call('SREM', LIMITS, KEY)
  end
else
  redis.call('SET', L, limit)
  LIMIT = tonumber(limit)
  if LIMITS then
    redis.call('SADD', LIMITS, KEY)
  end
end
local handoffs = {}
handoff(LIMIT, handoffs)
finish()
return { 0, handoffs }
