-- set_limit(limit or '' to clear) -> {0, handoffs}
-- With the limits index (KEYS[11], standalone Redis only), the guard key is
-- added to it or removed from it in the same step.
local refused
if ARGV[4] == '' then
  refused = validate_args()
else
  refused = validate_args({ 'limit', ARGV[4], 0, MAX_COUNT })
end
if refused then
  return refused
end
OWNED = true
reclaim()
local LIMITS = KEYS[11]
if ARGV[4] == '' then
  redis.call('DEL', L)
  LIMIT = DEFAULT_LIMIT
  if LIMITS then
    redis.call('SREM', LIMITS, guard_key())
  end
else
  redis.call('SET', L, ARGV[4])
  LIMIT = tonumber(ARGV[4])
  if LIMITS then
    redis.call('SADD', LIMITS, guard_key())
  end
end
local handoffs = {}
handoff(LIMIT, handoffs)
finish()
return { 0, handoffs }
