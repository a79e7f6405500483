-- The prelude of the per-key scripts, part 1 (then _handoff.lua, _index.lua): the per-call state,
-- the holders and the fencing token. What they keep is docs/contract.md; how, docs/redis.md.
-- Invariants the scripts keep, which let the common paths skip work:
--   * D's and S's members are in W (never in both); R's are in H (after reclaim) with a payload in
--     P; P's are in W or R. So with W, P, R, D and S absent nothing is queued. In P and S: a
--     standby being sent (standby.lua, confirmed by confirm.lua).
--   * Q's members are D's, scored by their place in W (a queued waiter keeps its place).
--   * H, T and I, when they exist, expire no earlier than the largest deadline in H.
-- A script that sets OWNED changes H only through set_holders / drop_holders (finish() re-counts H
-- for one that does not).
-- The per-call values: as a function the prelude outlives a call, so begin() resets every one.
local HANDOFF_TTL, WAKE_TTL, KNOWN_DEFAULT, DEFAULT_LIMIT, STALE_TTL
local NOW_US, NOW
local HN -- how many members H has
local LATEST -- the largest deadline in H while it is known (a write to H forgets it)
local HMAX -- the largest deadline H had when loaded (its expiry is at least that)
local EXISTED -- whether H, W, P, R, D or S existed when loaded
local QUEUED -- whether W, P, R, D or S existed when loaded
local PARKED -- whether this script queued a waiter
local PASSED_OVER -- whether handoff left parked waiters of another route in the queue
local LOADED, OWNED
local RAISED -- a deadline in H went above HMAX: H, T and I must expire later
local META_AT -- the expiry T and I were already given by this script
local LIMIT, TOKEN -- the limit in force and the last fencing token issued, once read
local EARLIEST -- the earliest deadline this script wrote (in H, D or S): K is due by then
local REINDEX -- set by sweep.lua and debounce.lua: K's due time in X is recomputed, not moved earlier

local function begin()
  HANDOFF_TTL, WAKE_TTL = tonumber(ARG_HANDOFF_TTL_MS), tonumber(ARG_WAKE_TTL_MS)
  KNOWN_DEFAULT = ARG_DEFAULT_LIMIT ~= ''
  DEFAULT_LIMIT = tonumber(ARG_DEFAULT_LIMIT) -- nil until read from M (see default_limit)
  STALE_TTL = tonumber(ARG_STALE_TTL_MS)
  NOW_US, NOW = server_time()
  HN, LATEST, HMAX = 0, nil, 0
  EXISTED, QUEUED, PARKED, PASSED_OVER, LOADED, OWNED, RAISED = false, false, false, false, false, false, false
  META_AT, LIMIT, TOKEN, EARLIEST, REINDEX = nil, nil, nil, nil, false
end

-- A variadic command over a long list, in chunks (unpack has a stack limit; even-sized, so
-- score-member pairs stay together): the items of its replies, and the sum of its integer replies.
local function call_many(command, key, list)
  local items, n = {}, 0
  for i = 1, #list, 4000 do
    local reply = redis.call(command, key, unpack(list, i, math.min(i + 3999, #list)))
    if type(reply) == 'table' then
      for _, value in ipairs(reply) do
        items[#items + 1] = value
      end
    else
      n = n + reply
    end
  end
  return items, n
end

-- The largest deadline in H (0 if none), read once until H changes.
local function latest()
  if HN == 0 then
    return 0
  end
  if LATEST == nil then
    local last = redis.call('ZRANGE', H, -1, -1, 'WITHSCORES')
    LATEST = #last > 0 and tonumber(last[2]) or 0
  end
  return LATEST
end

-- What exists, read once: one EXISTS, and H's size and latest deadline.
local function load()
  if LOADED then
    return
  end
  LOADED = true
  local present = redis.call('EXISTS', H, W, P, R, D, S)
  EXISTED = present > 0
  if present == 0 then
    return
  end
  HN = redis.call('ZCARD', H)
  if HN > 0 then
    HMAX = latest()
    present = present - 1
  end
  QUEUED = present > 0
end

-- K is due for a sweep by `at` (a deadline this script wrote).
local function note_due(at)
  if EARLIEST == nil or at < EARLIEST then
    EARLIEST = at
  end
end

-- ZADD z at member: a deadline in D or S, noted for the index.
local function add_deadline(z, at, member)
  redis.call('ZADD', z, at, member)
  note_due(at)
end

-- Whether h holds a slot (after reclaim: a live holder).
local function holds(h)
  return HN > 0 and redis.call('ZSCORE', H, h) ~= false
end

-- The next fencing token (the caller writes TOKEN to T: store_token).
local function next_token()
  if TOKEN == nil then
    TOKEN = tonumber(redis.call('GET', T) or '0')
  end
  TOKEN = math.max(TOKEN + 1, NOW_US)
  return TOKEN
end

-- The caller's default limit, else the one recorded when a waiter queued, else 0.
local function default_limit()
  if DEFAULT_LIMIT == nil then
    DEFAULT_LIMIT = tonumber(redis.call('HGET', M, 'limit') or '0')
  end
  return DEFAULT_LIMIT
end

local function limit_in_force()
  if LIMIT == nil then
    local l = redis.call('GET', L)
    LIMIT = l and tonumber(l) or default_limit()
  end
  return LIMIT
end

-- Write TOKEN to T, expiring no earlier than the latest deadline in H nor STALE_TTL from now (T
-- outlives the key's other state). Returns the expiry given (for META_AT).
local function store_token()
  local at = math.max(latest(), NOW + STALE_TTL)
  redis.call('SET', T, fmt(TOKEN), 'PXAT', at)
  return at
end

-- ZADD H (score-member pairs), counted in HN.
local function set_holders(pairs_)
  local top = 0
  for i = 1, #pairs_, 2 do
    if pairs_[i] > HMAX then
      RAISED = true
    end
    top = math.max(top, pairs_[i])
    note_due(pairs_[i])
  end
  local before = HN == 0 and 0 or LATEST -- the largest deadline in H before, if known
  local _, added = call_many('ZADD', H, pairs_)
  HN = HN + added
  -- A holder's deadline may have gone down as well as up: the largest is known still only if the
  -- new ones reach the one before (every other member is below it).
  LATEST = OWNED and before and top >= before and top or nil
end

-- ZREM H and HDEL I of these holders, counted in HN. The last ZREM deletes H and its expiry: a
-- holder added later in the same script makes a new H, which RAISED gives an expiry again.
local function drop_holders(list)
  local _, removed = call_many('ZREM', H, list)
  HN = HN - removed
  LATEST = nil
  call_many('HDEL', I, list)
  if HN == 0 then
    HMAX = 0
  end
end
