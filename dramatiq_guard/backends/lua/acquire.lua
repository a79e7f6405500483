-- acquire(holder, ttl_ms, mode, payload, wait_ms, info, generation[, fenced[, runner]]); mode: ''
-- (no wait), 'park', 'block'; generation: the one a handed-off copy carries, or ''; fenced: '0' for
-- a lock that fences nothing (GuardBackend.try_lock: no token is issued, T is not written), else a
-- token; runner: who runs the holder's job if it acquires (a worker thread), or '' for nobody yet
-- (an enqueue-time reservation).
-- A holder's runner is kept in its I entry ("<since_ms>@<runner>|<info>", see runner_of); a ready
-- waiter's in M ('u:<waiter>', set_ready), and a hand-off moves it to the holder's I entry. A
-- holder that holds for a runner, or a ready waiter a runner blocks on, is running (or waiting)
-- there: an acquire by any other runner, or by none, is a second copy of its message (the broker
-- delivered it again while the first runs, or the first's worker died and its lease has not
-- lapsed; or it is sent again meanwhile). It is refused as 'running', nothing done, and the copy
-- does not queue (it is not a waiter).
-- generation '0' is the message as sent (ORIGINAL_GENERATION), picked up from the broker: like a
-- hand-off's, a copy with a generation that parks makes the stored payload the only copy that may
-- start (G: 'parked'), since the broker may deliver the copy again (its worker died before the ack).
-- Returns {acquired, token|nil, limit, queued, holders, handoffs[, lapses_in_ms]}
-- (RedisBackend._acquire_reply); lapses_in_ms, with 'running' only: when the entry in the way lapses;
-- holders: when refused, the first HOLDERS_SHOWN live holders (earliest deadline first), else none;
-- queued is '' (not waiting), 'queued', 'standby' for a standby (sent ahead, see
-- standby.lua) picked up in 'park' mode with wait_ms > 0: it blocks in its place, a ready
-- waiter (in D) from now on; or 'stale': the copy's generation is not the one that may start
-- (a newer hand-off of the same message exists), and nothing was done; or 'running': the holder
-- already holds the key (or blocks for it) for another runner, and nothing was done.
local refused = validate_args(
  { 'ttl_ms', ttl_ms, 1, MAX_DURATION_MS },
  { 'wait_ms', wait_ms, 0, MAX_DURATION_MS },
  { 'generation', generation == '' and 0 or generation, 0, MAX_GENERATION }
)
if refused then
  return refused
end
local ttl = tonumber(ttl_ms)
local fences = fenced ~= '0'
runner = runner or ''
if string.find(runner, '[|@]') then
  return redis.error_reply("runner must not contain '|' or '@', got " .. runner)
end
OWNED = true

reclaim()
-- The holder's generation record, read once: whether it exists cannot change below (a hand-off
-- to the holder rewrites an existing one only, new_generation); only_parked: see live_generation.
local live, only_parked = false, false
if generation ~= '' then
  live, only_parked = live_generation(holder)
end
if live and live ~= generation then
  finish()
  return { 0, false, limit_in_force(), 'stale', {}, {} }
end
local was_holder = holds(holder)
-- Held, or blocked on as a ready waiter, for another runner (or the caller gives none): a second
-- copy of the message.
-- held_entry: the holder's I entry, read once (the hand-off below writes only other waiters'
-- entries, or this caller's if it was a waiter, not a holder).
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
-- The limit and the last token in one read.
local values = redis.call('MGET', L, T)
LIMIT = values[1] and tonumber(values[1]) or default_limit()
local limit = LIMIT
TOKEN = tonumber(values[2] or '0')
local token = false
local handed = {}
handoff(limit, handed)
-- The acquirer itself may have been the head waiter: it starts now, so it
-- is not reported as a hand-off to re-enqueue.
local handoffs = {}
for i = 1, #handed, 3 do
  if handed[i] == holder then
    was_holder = true
  else
    handoffs[#handoffs + 1] = handed[i]
    handoffs[#handoffs + 1] = handed[i + 1]
    handoffs[#handoffs + 1] = handed[i + 2]
  end
end

-- Free slots left after the hand-off mean the queue is empty, unless the hand-off passed over
-- parked waiters of another route: then the slots are theirs (their route's sweep hands them on).
local acquired = holds(holder) or (HN < limit and not PASSED_OVER)
local queued = ''
if acquired then
  set_holders({ NOW + ttl, holder })
  -- A re-entrant acquire (or a reservation taken up): the first since and info stay, and a runner
  -- given is recorded (holder_entry).
  local first = held_entry or (was_holder and redis.call('HGET', I, holder) or nil)
  local entry = holder_entry(first, NOW, runner, info)
  if entry then
    redis.call('HSET', I, holder, entry)
  end
  if was_holder then
    redis.call('DEL', WAKE .. holder)
  end
  if QUEUED then
    if redis.call('ZREM', W, holder) == 1 then
      unset_ready({ holder })
      redis.call('ZREM', S, holder)
    end
    redis.call('HDEL', P, holder)
    redis.call('HDEL', R, holder)
    forget(holder)
  end
  if live then
    -- This copy started: it is the one that may start again (a redelivery), no older one.
    set_live_generation(holder, generation, only_parked)
  end
  if fences then
    token = next_token()
    META_AT = store_token()
  end
elseif mode ~= '' then
  local added = enqueue(holder)
  -- A standby sent ahead (standby.lua) that was picked up, or one already blocking in its place
  -- that asks again, blocks (on) in its place, ready.
  local sent = not added and redis.call('ZREM', S, holder) == 1
  local standby = mode == 'park' and tonumber(wait_ms) > 0 and not added
    and (sent or redis.call('ZSCORE', D, holder))
  if standby then
    set_ready(holder, NOW + tonumber(wait_ms), runner)
    redis.call('HDEL', P, holder)
  elseif mode == 'park' then
    redis.call('HSET', P, holder, payload)
    redis.call('HSET', M, 'r:' .. holder, ROUTE)
    if not added then
      unset_ready({ holder })
      redis.call('HDEL', I, holder)
    end
    if generation ~= '' then
      -- A copy from the broker parked in its place: it is the queue entry now. No copy on the
      -- broker may start any more (this one included, if the broker delivers it again: its
      -- worker may die before the ack), and a late confirmation of its own generation must not
      -- take the entry out (confirm_handoff.lua): that copy is gone. With no record before, it
      -- is kept for this copy only, until the broker acks it (forget_copy.lua).
      set_live_generation(holder, 'parked', not live)
    end
  else
    set_ready(holder, NOW + tonumber(wait_ms), runner)
    if not added then
      redis.call('HDEL', P, holder)
    end
  end
  if (standby or mode == 'block') and info ~= '' then
    -- Ready: a hand-off records it as the holder's info.
    redis.call('HSET', I, holder, '|' .. info)
  end
  queued = standby and 'standby' or 'queued'
end
finish()
-- Who is in the way, for a refused caller to name: the first few live holders, earliest
-- deadline first (never the whole set: a limit may be thousands).
local holders = {}
if not acquired then
  holders = redis.call('ZRANGE', H, 0, HOLDERS_SHOWN - 1)
end
return { acquired and 1 or 0, token, limit, queued, holders, handoffs }
