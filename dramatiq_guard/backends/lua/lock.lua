-- lock(holder, ttl_ms, info): the send-time dedup lock (GuardBackend.try_lock), on its own,
-- without _prelude.lua: it decides only the two common cases, in at most 6 commands, and leaves
-- every other to the generic acquire (acquire.lua), which the caller then runs.
--
-- KEYS: H W R L T I of the guard key; ARGV: holder, ttl_ms, info (backends/redis_layout.py).
-- Returns {1, {}}: acquired; {0, holders}: refused, held by these live holders (oldest deadline
-- first), none of them the caller, with no run-time limit; {-1, {}}: not decided here.
--
--   * Free: none of H, W, R, L, T, I exists (no holder, no waiter, no reservation, no run-time
--     limit, no token to keep above). Then, as acquire.lua would with a limit of 1: H gets the
--     holder with its deadline, I its "<since_ms>|<info>", and both expire at that deadline (the
--     prelude's invariants: with W, P, R, D and S absent nothing is queued; H, T and I expire no
--     earlier than the largest deadline in H). No fencing token is issued (T stays absent):
--     tokens only grow anyway, as the next one is at least the time in us.
--   * Held: H holds only live holders other than the caller and L is absent: limit 1, so the
--     generic acquire would refuse it too (a waiter queued or not). Nothing is written.
--   * Anything else (a waiter or reservation with a free slot, a run-time limit, a lapsed holder
--     to reclaim, the caller re-entering, a token left behind): -1.
-- With a push (QUEUE, QUEUE_MESSAGES: a RedisBroker queue's list and its messages hash; ARGV from
-- PUSH_FROM: the broker's message id and encoded message), an acquired lock enqueues the message
-- as Dramatiq's own enqueue does (HSET, RPUSH), in the same step: both or neither.
-- Times come from the server's clock only.
-- Checked before the first write (see validate_args in _prelude.lua).
local ttl = #ttl_ms <= 16 and string.match(ttl_ms, '^%d+$') and tonumber(ttl_ms)
if not (ttl and ttl >= 1 and ttl <= MAX_DURATION_MS) then
  return redis.error_reply(
    'ttl_ms must be an integer from 1 to ' .. string.format('%.0f', MAX_DURATION_MS) .. ', got ' .. tostring(ttl_ms)
  )
end

local present = redis.call('EXISTS', H, W, R, L, T, I)
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

if present == 0 then
  local deadline = now + ttl
  redis.call('ZADD', H, deadline, holder)
  redis.call('HSET', I, holder, string.format('%.0f', now) .. '|' .. info)
  redis.call('PEXPIREAT', H, deadline)
  redis.call('PEXPIREAT', I, deadline)
  if QUEUE then
    redis.call('HSET', QUEUE_MESSAGES, ARGV[PUSH_FROM], ARGV[PUSH_FROM + 1])
    redis.call('RPUSH', QUEUE, ARGV[PUSH_FROM])
  end
  return { 1, {} }
end

local flat = redis.call('ZRANGE', H, 0, -1, 'WITHSCORES')
local holders = {}
for i = 1, #flat, 2 do
  if flat[i] == holder or tonumber(flat[i + 1]) <= now then
    return { -1, {} }
  end
  holders[#holders + 1] = flat[i]
end
if #holders == 0 or redis.call('EXISTS', L) == 1 then
  return { -1, {} }
end
return { 0, holders }
