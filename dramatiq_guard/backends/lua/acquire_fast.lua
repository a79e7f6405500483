-- The room-and-nobody-waiting path of acquire.lua, run before _prelude.lua is even set up (so it
-- costs neither the prelude's setup nor its general reads): an acquire with no generation (or
-- the original's, '0', of a message with no generation record: none of its copies parked), of a
-- key with nothing queued (no waiter, payload, reservation, ready waiter or standby) and no
-- lapsed holder, that the caller takes (a free slot under the limit in force: the run-time
-- limit, else the caller's default) or already holds (a re-entrant acquire, or a reservation
-- taken up: it is acquired whatever the limit) for no runner or the caller's own (a runner given
-- is recorded, as acquire.lua does). It leaves exactly the state, and returns exactly
-- the reply, that acquire.lua would: the holder with its new deadline, its I entry (holder_entry:
-- since and info kept if it already held), its wake list gone if it already held; fenced, the next fencing
-- token in T, expiring no earlier than the latest deadline nor STALE_TTL from now; H and I
-- expiring no earlier than the latest deadline (moved only when it rose, as finish() does).
-- Cost: O(log n) in the holders (ZRANGE -1 -1, ZCARD, ZRANGEBYSCORE LIMIT 1, ZSCORE, ZADD).
-- Anything else (a waiter to hand to or to queue behind, a lapsed holder to reclaim, a full key,
-- a generation to check, a holder running for another runner), or a number or runner it cannot
-- use, falls through to the prelude and acquire.lua (which refuses a bad one before any write).
-- KEYS and ARGV named by the layout (backends/redis_layout.py), read by the prologue before this.
do
  -- Only numbers validate_args accepts (_bounds.lua); the full path refuses the others.
  local ttl = whole_number(ttl_ms, 1, MAX_DURATION_MS)
  local stale = whole_number(ARG_STALE_TTL_MS, 1, MAX_DURATION_MS)
  if ttl and stale and whole_number(ARG_HANDOFF_TTL_MS, 1, MAX_DURATION_MS)
    and whole_number(ARG_WAKE_TTL_MS, 1, MAX_DURATION_MS) and whole_number(wait_ms, 0, MAX_DURATION_MS)
    and (ARG_DEFAULT_LIMIT == '' or whole_number(ARG_DEFAULT_LIMIT, 0, MAX_COUNT))
    and (generation == '' or generation == '0' and redis.call('EXISTS', G .. ':' .. holder) == 0)
    and not string.find(runner or '', '[|@]')
    and redis.call('EXISTS', W, P, R, D, S) == 0 then
    local runner = runner or ''
    local clock = redis.call('TIME')
    local now_us = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
    local now = math.floor(now_us / 1000)
    local top = redis.call('ZRANGE', H, -1, -1, 'WITHSCORES')
    local n = #top > 0 and redis.call('ZCARD', H) or 0
    if n == 0 or #redis.call('ZRANGEBYSCORE', H, '-inf', now, 'LIMIT', 0, 1) == 0 then
      local values = redis.call('MGET', L, T)
      local limit = values[1] and tonumber(values[1]) or (ARG_DEFAULT_LIMIT ~= '' and tonumber(ARG_DEFAULT_LIMIT) or 0)
      local own = n > 0 and redis.call('ZSCORE', H, holder)
      local first = own and redis.call('HGET', I, holder)
      local other = runner_of(first or nil)
      if not (other and other ~= runner) and (own or n < limit) then
        local fences = fenced ~= '0'
        local highest = #top > 0 and tonumber(top[2]) or 0
        local deadline = now + ttl
        redis.call('ZADD', H, deadline, holder)
        local entry = holder_entry(first or nil, now, runner, info)
        if entry then
          redis.call('HSET', I, holder, entry)
        end
        if own then
          redis.call('DEL', ARG_WAKE .. holder)
        end
        local raised = deadline > highest
        local latest = deadline
        if not raised then
          -- The holder's own deadline may have been the highest, and gone down.
          latest = tonumber(redis.call('ZRANGE', H, -1, -1, 'WITHSCORES')[2])
        end
        local token = false
        if fences then
          token = math.max(tonumber(values[2] or '0') + 1, now_us)
          redis.call('SET', T, string.format('%.0f', token), 'PXAT', math.max(latest, now + stale))
        end
        if raised then
          redis.call('PEXPIREAT', H, latest)
          if not fences and redis.call('PTTL', T) < latest - now then
            redis.call('PEXPIREAT', T, latest) -- later, never sooner: T may outlive the holders
          end
        end
        if raised or fences then
          redis.call('PEXPIREAT', I, latest)
        end
        return { 1, token, limit, '', {}, {} }
      end
    end
  end
end
