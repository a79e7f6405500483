-- renew(holder, ttl_ms) -> 1 if renewed, 0 if the holder no longer holds the key.
-- Touches only the holder's own entry: a lapsed entry is left to the next
-- reclaim (which hands its slot on), never revived.
local refused = validate_args({ 'ttl_ms', arg(2), 0, MAX_DURATION_MS })
if refused then
  return refused
end
local holder = arg(1)
local deadline = redis.call('ZSCORE', H, holder)
if not deadline or tonumber(deadline) <= NOW then
  return 0
end
local at = NOW + tonumber(arg(2))
redis.call('ZADD', H, at, holder)
extend_to(at)
return 1
