-- inspect(waiters) -> {holders+deadlines, waiters+places, parked flags, reserved, limit, token, info}.
-- Read only. waiters: how many of the first waiters, '' for all (the one O(n) read of a queue).
local last = waiters == '' and -1 or tonumber(waiters) - 1
local queue = (last >= 0 or waiters == '') and redis.call('ZRANGE', W, 0, last, 'WITHSCORES') or {}
local parked = {}
for i = 1, #queue, 2 do
  parked[#parked + 1] = redis.call('HEXISTS', P, queue[i])
end
return {
  redis.call('ZRANGE', H, 0, -1, 'WITHSCORES'),
  queue,
  parked,
  redis.call('HKEYS', R),
  redis.call('GET', L),
  redis.call('GET', T),
  redis.call('HGETALL', I),
}
