-- set_limit(limit or '' to clear) -> {0, handoffs}
-- With the limits index (KEYS[14], standalone Redis only), the guard key is
-- added to it or removed from it in the same step.
local refused
if arg(1) == '' then
  refused = validate_args()
else
  refused = validate_args({ 'limit', arg(1), 0, MAX_COUNT })
end
if refused then
  return refused
end
OWNED = true
reclaim()
local LIMITS = KEYS[14]
if arg(1) == '' then
  redis.call('DEL', L)
  LIMIT = default_limit()
  if LIMITS then
    redis.call('SREM', LIMITS, KEY)
  end
else
  redis.call('SET', L, arg(1))
  LIMIT = tonumber(arg(1))
  if LIMITS then
    redis.call('SADD', LIMITS, KEY)
  end
end
local handoffs = {}
handoff(LIMIT, handoffs)
finish()
return { 0, handoffs }
