-- acquire(holder, ttl_ms, mode, payload, wait_ms, info, generation[, fenced[, runner[, priority]]]) (base.py:
-- GuardBackend.acquire). mode: '' (no wait), 'park', 'block'; fenced: '0' issues and keeps no token;
-- runner: the worker thread that runs the holder's job, or '' (an enqueue-time reservation);
-- priority: the waiter's (lower is handed off first), from -MAX_PRIORITY to MAX_PRIORITY.
-- Returns {acquired, token|false, limit, queued, holders, handoffs[, lapses_in_ms]}
-- (RedisBackend._acquire_reply): queued is '', 'queued', 'standby' (a standby picked up blocks in
-- its place), 'stale' (not the generation that may start) or 'running' (held or blocked on for
-- another runner: a second copy; lapses_in_ms says when that entry lapses); holders: when refused,
-- the first HOLDERS_SHOWN live holders. 'stale' and 'running' did nothing.
-- With a push (QUEUE, QUEUE_MESSAGES: a RedisBroker queue's list and message hash; ARGV from
-- PUSH_FROM: its message id), a send's reservation enqueues its message (the park payload) as
-- Dramatiq's enqueue does, in the same step (GuardBackend.reserve_and_enqueue); nothing else does.
priority = tonumber(priority) or 0 -- checked: '', or a whole number within the bounds
local fences = fenced ~= '0'
runner = runner or ''
if string.find(runner, '[|@]') then
  return redis.error_reply("runner must not contain '|' or '@', got " .. runner)
end
OWNED = true
reclaim()
-- Whether the holder has a generation record cannot change below (new_generation only rewrites one).
local live, only_parked = false, false
if generation ~= '' then
  live, only_parked = live_generation(holder)
end
if live and live ~= generation then
  finish()
  return { 0, false, limit_in_force(), 'stale', {}, {} }
end
local was_holder = holds(holder)
-- The holder's I entry, read once (the hand-off below writes only waiters' entries).
local held_entry = was_holder and redis.call('HGET', I, holder) or nil
local other
if was_holder then
  other = runner_of(held_entry)
elseif QUEUED then
  other = redis.call('HGET', M, 'u:' .. holder) or nil
end
local entry_deadline = other and other ~= runner and redis.call('ZSCORE', was_holder and H or D, holder)
if entry_deadline then
  finish()
  return { 0, false, limit_in_force(), 'running', {}, {}, math.max(0, tonumber(entry_deadline) - NOW) }
end
local values = redis.call('MGET', L, T)
LIMIT = values[1] and tonumber(values[1]) or default_limit()
local limit = LIMIT
TOKEN = tonumber(values[2] or '0')
local token = false
local handed, handoffs = {}, {}
handoff(limit, handed)
for i = 1, #handed, 3 do
  if handed[i] == holder then
    was_holder = true -- the acquirer was handed the slot: it starts now, no hand-off to re-enqueue
  else
    handoffs[#handoffs + 1], handoffs[#handoffs + 2], handoffs[#handoffs + 3] = unpack(handed, i, i + 2)
  end
end
-- Free slots left after the hand-off are the caller's, unless it passed over parked waiters of
-- another route: then they are theirs.
local acquired = holds(holder) or (HN < limit and not PASSED_OVER)
local queued = ''
if acquired then
  set_holders({ NOW + tonumber(ttl_ms), holder })
  local first = held_entry or (was_holder and redis.call('HGET', I, holder) or nil)
  local entry = holder_entry(first, NOW, runner, info)
  if entry then
    redis.call('HSET', I, holder, entry)
  end
  if was_holder then
    redis.call('DEL', ARG_WAKE .. holder)
  end
  if QUEUED then
    dequeue(holder)
    redis.call('HDEL', R, holder)
  end
  if live then
    set_live_generation(holder, generation, only_parked) -- this copy is the one that may start again
  end
  if fences then
    token = next_token()
    META_AT = store_token()
  end
  if QUEUE then
    push_once(QUEUE, QUEUE_MESSAGES, ARGV[PUSH_FROM], payload)
  end
elseif mode ~= '' then
  local added = enqueue(holder, priority)
  -- A standby that was picked up, or one blocking in its place that asks again, blocks, ready.
  local sent = not added and redis.call('ZREM', S, holder) == 1
  local standby = mode == 'park' and tonumber(wait_ms) > 0 and not added
    and (sent or redis.call('ZSCORE', D, holder))
  if standby then
    set_ready(holder, NOW + tonumber(wait_ms), runner)
    redis.call('HDEL', P, holder)
  elseif mode == 'park' then
    redis.call('HSET', P, holder, payload)
    redis.call('HSET', M, 'r:' .. holder, ARG_ROUTE)
    if not added then
      unset_ready({ holder })
      redis.call('HDEL', I, holder)
    end
    if generation ~= '' then
      -- A copy from the broker parked in its place: no copy on the broker may start any more
      -- (docs/contract.md, Generations); a new record is kept for this copy only (forget_copy.lua).
      -- Not at the gate (no runner): no broker acks that copy, and it may come back (never '~').
      set_live_generation(holder, 'parked', not live and runner ~= '')
    end
  else
    set_ready(holder, NOW + tonumber(wait_ms), runner)
    if not added then
      redis.call('HDEL', P, holder)
    end
  end
  if (standby or mode == 'block') and info ~= '' then
    redis.call('HSET', I, holder, '|' .. info) -- a ready waiter's info: a hand-off makes it the holder's
  end
  queued = standby and 'standby' or 'queued'
end
finish()
local holders = {}
if not acquired then
  holders = redis.call('ZRANGE', H, 0, HOLDERS_SHOWN - 1)
end
return { acquired and 1 or 0, token, limit, queued, holders, handoffs }
