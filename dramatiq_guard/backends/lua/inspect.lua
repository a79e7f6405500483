-- inspect() -> {holders+deadlines, waiters+places, parked flags, reserved, limit, token, info}. Read only.
local refused = validate_args()
if refused then
  return refused
end
local waiters = redis.call('ZRANGE', W, 0, -1, 'WITHSCORES')
local parked = {}
for i = 1, #waiters, 2 do
  parked[#parked + 1] = redis.call('HEXISTS', P, waiters[i])
end
return {
  redis.call('ZRANGE', H, 0, -1, 'WITHSCORES'),
  waiters,
  parked,
  redis.call('HKEYS', R),
  redis.call('GET', L),
  redis.call('GET', T),
  redis.call('HGETALL', I),
}
