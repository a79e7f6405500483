-- acquire.lua's path for a key with nothing queued and no lapsed holder, run before the prelude is
-- set up (docs/redis.md, "The scripts"): an acquire with no generation (or '0' without a record)
-- that takes a free slot or already holds one, for no runner or its own. It leaves the state, and
-- returns the reply, acquire.lua would; anything else falls through to it.
do
  -- One EXISTS says the key is free (0), or may have holders only (1: H if its top is read); a
  -- worker's generation record, read by the same call (W twice when there is none), falls through.
  local present = (generation == '' or generation == '0')
    and not string.find(runner or '', '[|@]')
    and redis.call('EXISTS', H, W, P, R, D, S, generation == '0' and G .. ':' .. holder or W)
  local top = present == 1 and redis.call('ZRANGE', H, -1, -1, 'WITHSCORES') or {}
  if present == 0 or #top > 0 then
    local runner = runner or ''
    local now_us, now = server_time()
    local n = #top > 0 and redis.call('ZCARD', H) or 0
    -- With one holder, its deadline is the top's: no other can have lapsed.
    local lapsed = n == 1 and tonumber(top[2]) <= now
      or n > 1 and #redis.call('ZRANGEBYSCORE', H, '-inf', now, 'LIMIT', 0, 1) > 0
    if not lapsed then
      local values = redis.call('MGET', L, T)
      local limit = values[1] and tonumber(values[1]) or (ARG_DEFAULT_LIMIT ~= '' and tonumber(ARG_DEFAULT_LIMIT) or 0)
      local deadline = now + tonumber(ttl_ms)
      local own, added = n > 0 and top[1] == holder, false
      if n > 1 and not own then
        if n < limit then -- under the limit: NX adds a new holder, or finds it held already
          added = redis.call('ZADD', H, 'NX', deadline, holder) == 1
          own = not added
        else
          own = redis.call('ZSCORE', H, holder) ~= false
        end
      end
      local first = own and redis.call('HGET', I, holder)
      local other = runner_of(first or nil)
      if not (other and other ~= runner) and (own or n < limit) then
        local fences = fenced ~= '0'
        if not added then
          redis.call('ZADD', H, deadline, holder)
        end
        local entry = holder_entry(first or nil, now, runner, info)
        if entry then
          redis.call('HSET', I, holder, entry)
        end
        if own then
          redis.call('DEL', ARG_WAKE .. holder)
        end
        local raised = deadline > (#top > 0 and tonumber(top[2]) or 0)
        -- Not raised: the top stands, unless it was the holder's own deadline, which went down.
        local latest = raised and deadline or top[1] ~= holder and tonumber(top[2])
          or n > 1 and tonumber(redis.call('ZRANGE', H, -1, -1, 'WITHSCORES')[2]) or deadline
        local token = false
        if fences then
          token = math.max(tonumber(values[2] or '0') + 1, now_us)
          redis.call('SET', T, fmt(token), 'PXAT', math.max(latest, now + tonumber(ARG_STALE_TTL_MS)))
        end
        -- Lowered (its own deadline was the latest: a throttle's start after its reservation), H
        -- and I expire with the latest left, not with the reservation.
        local lowered = not raised and own and latest < tonumber(top[2])
        if raised or lowered then
          redis.call('PEXPIREAT', H, latest)
          if not fences and values[2] and redis.call('PTTL', T) < latest - now then
            redis.call('PEXPIREAT', T, latest) -- later, never sooner: T may outlive the holders
          end
        end
        if raised or fences or lowered then
          redis.call('PEXPIREAT', I, latest)
        end
        if QUEUE then -- a reservation at send, with its push (acquire.lua's header)
          push_once(QUEUE, QUEUE_MESSAGES, ARGV[PUSH_FROM], payload)
        end
        return { 1, token, limit, '', {}, {} }
      end
    end
  end
end
