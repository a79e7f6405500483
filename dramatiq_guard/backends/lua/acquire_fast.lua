-- acquire.lua's path for a key with nothing queued and no lapsed holder, run before the prelude is
-- set up (docs/redis.md, "The scripts"): an acquire with no generation (or '0' without a record)
-- that takes a free slot or already holds one, for no runner or its own. It leaves the state, and
-- returns the reply, acquire.lua would; anything else falls through to it.
do
  -- One EXISTS says the key is free (0), or may have holders only (1: H if a read of it finds any);
  -- a worker's generation record, read by the same call (W twice when there is none), falls through.
  local present = (generation == '' or generation == '0')
    and not string.find(runner or '', '[|@]')
    and redis.call('EXISTS', H, W, P, R, D, S, generation == '0' and G .. ':' .. holder or W)
  -- H's first FAST_READ + 1 holders by deadline, all of them when it has no more than FAST_READ:
  -- then this one ZRANGE tells the count, the earliest deadline (a lapsed holder is the first),
  -- the latest and whether the caller holds, for as many commands as a free key's path. A longer H
  -- is counted (ZCARD) and its top read apart; the earliest is still the first read.
  local FAST_READ = 16
  local flat = present == 1 and redis.call('ZRANGE', H, 0, FAST_READ, 'WITHSCORES') or {}
  local now_us, now
  if present == 0 or #flat > 0 then
    now_us, now = server_time()
  end
  -- No holder lapsed: the earliest deadline (the first read) is still ahead.
  if present == 0 or #flat > 0 and tonumber(flat[2]) > now then
    local runner = runner or ''
    local complete = #flat <= 2 * FAST_READ
    local n = complete and #flat / 2 or redis.call('ZCARD', H)
    local top = complete and { flat[#flat - 1], flat[#flat] } or redis.call('ZRANGE', H, -1, -1, 'WITHSCORES')
    local top_at = n > 0 and tonumber(top[2]) or 0
    local values = redis.call('MGET', L, T)
    local limit = values[1] and tonumber(values[1]) or (ARG_DEFAULT_LIMIT ~= '' and tonumber(ARG_DEFAULT_LIMIT) or 0)
    local deadline = now + tonumber(ttl_ms)
    local own, added = top[1] == holder, false
    for i = 1, #flat, 2 do
      own = own or flat[i] == holder
    end
    if not (own or complete) then -- past what was read: ZADD NX adds a new holder, or finds it held
      if n < limit then
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
        redis.call('DEL', ARG_WAKE .. holder) -- as acquire.lua: only for one that held already
      end
      -- H, T and I expire no earlier than the latest deadline in H (_lease.lua): their expiry is
      -- written only when the latest deadline moves.
      local raised = deadline > top_at
      -- Not raised: the top stands, unless it was the holder's own deadline, which went down: then
      -- the latest is the larger of its new one and the next (the one before it in a complete read).
      local latest = raised and deadline
        or top[1] ~= holder and top_at
        or n == 1 and deadline
        or complete and math.max(deadline, tonumber(flat[#flat - 2]))
        or tonumber(redis.call('ZRANGE', H, -1, -1, 'WITHSCORES')[2])
      local token = false
      if fences then
        token = math.max(tonumber(values[2] or '0') + 1, now_us)
        redis.call('SET', T, fmt(token), 'PXAT', math.max(latest, now + tonumber(ARG_STALE_TTL_MS)))
      end
      -- Lowered (its own deadline was the latest: a throttle's start after its reservation), H
      -- and I expire with the latest left, not with the reservation.
      local lowered = not raised and own and latest < top_at
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
