-- inspect(count) -> {holders+deadlines, waiters+places, parked flags, reserved, limit, token, info}.
-- Read only. count: at most this many of the first waiters ('' for all: the one read of a whole
-- queue, O(n)).
local refused = validate_args({ 'waiters', arg(1) == '' and 0 or arg(1), 0, MAX_COUNT })
if refused then
  return refused
end
local last = arg(1) == '' and -1 or tonumber(arg(1)) - 1
local waiters = {}
if last >= 0 or arg(1) == '' then
  waiters = redis.call('ZRANGE', W, 0, last, 'WITHSCORES')
end
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
