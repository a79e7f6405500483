-- The prelude, part 3: the waiting-keys index (X, standalone Redis only) and the end of every call.

-- When K next needs a sweep: its earliest deadline in H, D or S, now if a parked waiter of another
-- route was passed over, and DUE_BACKSTOP_MS from now at the latest.
local function next_due()
  if PASSED_OVER then
    return NOW
  end
  local due = NOW + DUE_BACKSTOP_MS
  for _, z in ipairs({ H, D, S }) do
    local first = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
    if #first > 0 and tonumber(first[2]) < due then
      due = tonumber(first[2])
    end
  end
  return due
end

-- K's entry in X, for a key with waiters: set to next_due() by a sweep, a debounce send or when
-- missing, else only ever moved earlier, to the earliest deadline this script wrote.
local function index_due()
  local current = not REINDEX and redis.call('ZSCORE', X, ARG_KEY)
  if not current then
    redis.call('ZADD', X, next_due(), ARG_KEY)
    return
  end
  local at = PASSED_OVER and NOW or EARLIEST
  if at and at < tonumber(current) then
    redis.call('ZADD', X, at, ARG_KEY)
  end
end

-- With no holder, waiter nor reservation left, drop all state but L, G and T (which expire by
-- themselves) and K's entry in X; else make H, T and I expire with the last holder (H and I
-- sooner too, when the latest deadline went down).
local function finish()
  if not OWNED then
    HN = redis.call('ZCARD', H)
    LATEST = nil
    RAISED = HN > 0
    QUEUED = true
  end
  local queued = PARKED or (QUEUED and redis.call('EXISTS', W, R) > 0)
  if X and queued then
    index_due()
  elseif X and QUEUED then
    redis.call('ZREM', X, ARG_KEY)
  end
  if HN == 0 and not queued then
    if EXISTED or PARKED or not OWNED then
      redis.call('DEL', H, W, P, R, D, S, I, M, Q)
    end
    return
  end
  if QUEUED and not queued then
    redis.call('DEL', M) -- the queue drained but holders remain: M goes with the queue it served
  end
  -- The latest deadline went down (a holder's own, or the latest holder gone): H and I follow it.
  local lowered = HN > 0 and not RAISED and HMAX > 0 and latest() < HMAX
  if HN > 0 and (RAISED or META_AT or lowered) then
    local at = latest()
    if RAISED or lowered then
      redis.call('PEXPIREAT', H, at)
    end
    if RAISED and not META_AT and redis.call('PTTL', T) < at - NOW then
      redis.call('PEXPIREAT', T, at) -- later, never sooner: T may outlive the holders
    end
    redis.call('PEXPIREAT', I, at)
  end
end
