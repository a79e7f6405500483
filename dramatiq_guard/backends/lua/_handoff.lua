-- The prelude, part 2: waiters, generation records, reclaim and the hand-off (docs/contract.md).

-- 'prefix' .. w for each w of list.
local function prefixed(prefix, list)
  local out = {}
  for i, w in ipairs(list) do
    out[i] = prefix .. w
  end
  return out
end

-- Make w, queued in W, a ready waiter until `at`: in D by that deadline, in Q by its place, and its
-- runner ('' for none) in M's 'u:<w>'.
local function set_ready(w, at, runner)
  add_deadline(D, at, w)
  redis.call('ZADD', Q, redis.call('ZSCORE', W, w), w)
  if runner ~= '' then
    redis.call('HSET', M, 'u:' .. w, runner)
  else
    redis.call('HDEL', M, 'u:' .. w)
  end
end

-- The waiters of `list` are no longer ready waiters (if they were), nor blocked on by a runner.
local function unset_ready(list)
  call_many('ZREM', D, list)
  call_many('ZREM', Q, list)
  call_many('HDEL', M, prefixed('u:', list))
end

-- Whether a parked waiter's route (M's 'r:<w>') is another's than the caller's ('' or none: anyone's).
local function foreign(route)
  return (route or '') ~= '' and route ~= ARG_ROUTE
end

-- The generation of w's message that may start (G:<w>), or false if any may; and whether the record
-- is kept only for the copy that parked (its '~' prefix: its ack deletes it, forget_copy.lua).
local function live_generation(w)
  local record = redis.call('GET', G .. ':' .. w)
  local only_parked = record and string.sub(record, 1, 1) == '~' or false
  return only_parked and string.sub(record, 2) or record, only_parked
end

-- From now on only `gen` of w's message may start ('parked': no copy on the broker), for STALE_TTL.
local function set_live_generation(w, gen, only_parked)
  redis.call('SET', G .. ':' .. w, (only_parked and '~' or '') .. gen, 'PX', STALE_TTL)
end

-- These waiters' hand-offs or sends lapsed unconfirmed: the copy of the generation in flight (M's
-- 'g:<w>') may be on the broker, and is now the only one that may start.
local function mark_lapsed(list)
  local fields = prefixed('g:', list)
  local gens = call_many('HMGET', M, fields)
  for i, w in ipairs(list) do
    if gens[i] then
      set_live_generation(w, gens[i])
    end
  end
  call_many('HDEL', M, fields)
end

-- A new generation for w's hand-off or standby send: in flight in M, and in G if G has a record.
local function new_generation(w)
  local gen = fmt(next_token())
  redis.call('HSET', M, 'g:' .. w, gen)
  local live, only_parked = live_generation(w)
  if live then
    set_live_generation(w, gen, only_parked)
  end
  return gen
end

-- w left the queue for good (it started, or gave up): its payload, route and generation in flight go.
local function forget(w)
  redis.call('HDEL', P, w)
  redis.call('HDEL', M, 'r:' .. w, 'g:' .. w)
end

-- w leaves its place in the queue (if it has one) for good.
local function dequeue(w)
  if redis.call('ZREM', W, w) == 1 then
    unset_ready({ w })
    redis.call('ZREM', S, w)
  end
  forget(w)
end

-- The copy of w's hand-off that carries `generation` ('' for any) is on the broker: its reservation
-- becomes a hold until ttl_ms from now (its payload goes). Returns 1 if w holds (or held already).
-- One that lapsed back into the queue is dropped from it (the copy wins), unless a newer hand-off
-- was made or a copy picked up parked in its place (G: 'parked', acquire.lua). After reclaim().
local function confirm(w, ttl_ms, generation)
  local in_flight = QUEUED and redis.call('HGET', M, 'g:' .. w)
  if QUEUED and (generation == '' or not in_flight or in_flight == generation)
    and redis.call('HDEL', R, w) == 1 then
    set_holders({ NOW + tonumber(ttl_ms), w })
    forget(w)
    return 1
  elseif holds(w) and not (QUEUED and redis.call('HEXISTS', R, w) == 1) then
    return 1 -- already started (its acquire turned the reservation into a lease)
  elseif QUEUED and redis.call('ZSCORE', W, w) then
    local live = live_generation(w)
    if live ~= 'parked' and (generation == '' or live == generation) then
      dequeue(w)
    end
  end
  return 0
end

-- The copy of standby w sent with `payload` (its generation `generation`, '' for any) is on the
-- broker (confirm.lua): if the stored payload is still the one sent, it is dropped; a standby still
-- waiting stays in S until ttl_ms from now, one handed a slot keeps it until then. An older
-- generation's confirmation changes nothing. Returns 1 if the standby (or its slot) holds. After
-- reclaim().
local function confirm_standby(w, ttl_ms, payload, generation)
  local in_flight = QUEUED and redis.call('HGET', M, 'g:' .. w)
  if generation ~= '' and in_flight and in_flight ~= generation then
    return 0
  elseif QUEUED and redis.call('HGET', P, w) == payload then
    if redis.call('HDEL', R, w) == 1 then
      set_holders({ NOW + tonumber(ttl_ms), w })
      forget(w)
      return 1
    elseif redis.call('ZSCORE', S, w) then
      add_deadline(S, NOW + tonumber(ttl_ms), w)
      redis.call('HDEL', P, w)
      redis.call('HDEL', M, 'g:' .. w)
      return 1
    end
    return 0
  elseif holds(w) or (QUEUED and (redis.call('ZSCORE', D, w) or redis.call('ZSCORE', S, w))) then
    return 1 -- picked up already (it blocks as a standby, or holds its slot), or sent again
  end
  return 0
end

-- Queue w at the back of its priority's band in W, or keep its place if it is queued (a place only
-- grows: max(last + 1, now)). Priority 0's band is [0, 2^52), places in us (as before priorities);
-- another's is PLACE_BAND wide, places in ms since PLACE_EPOCH_MS: below 0 for p < 0, from 2^52 for
-- p > 0 (redis_layout.since_ms). Returns whether it was not queued before.
local function enqueue(w, priority)
  local low, place = 0, NOW_US
  if priority ~= 0 then
    low = priority < 0 and priority * PLACE_BAND or 2 ^ 52 + (priority - 1) * PLACE_BAND
    place = low + NOW - PLACE_EPOCH_MS
  end
  if QUEUED then
    local high = '(' .. fmt(priority == 0 and 2 ^ 52 or low + PLACE_BAND)
    local last = redis.call('ZREVRANGEBYSCORE', W, high, fmt(low), 'WITHSCORES', 'LIMIT', 0, 1)
    if #last > 0 then
      place = math.max(tonumber(last[2]) + 1, place)
    end
  end
  local added = redis.call('ZADD', W, 'NX', fmt(place), w) == 1
  if KNOWN_DEFAULT then
    redis.call('HSET', M, 'limit', DEFAULT_LIMIT) -- for processes that do not know the key's actor
  end
  PARKED = true
  return added
end

-- The lapsed reservations go back to their places in W (their payloads never left P): those of
-- the lapsed holders, or all of R once H is gone. Returns how many were not among `lapsed`.
local function requeue(lapsed)
  local back, gone, extra = {}, {}, 0
  if HN == 0 then
    local was_lapsed = {}
    for _, h in ipairs(lapsed) do
      was_lapsed[h] = true
    end
    local reserved = redis.call('HGETALL', R)
    for i = 1, #reserved, 2 do
      local w = reserved[i]
      back[#back + 1], back[#back + 2], gone[#gone + 1] = reserved[i + 1], w, w
      extra = extra + (was_lapsed[w] and 0 or 1)
    end
  elseif #lapsed > 0 then
    local places = call_many('HMGET', R, lapsed)
    for i, w in ipairs(lapsed) do
      if places[i] then
        back[#back + 1], back[#back + 2], gone[#gone + 1] = places[i], w, w
      end
    end
  end
  call_many('HDEL', R, gone)
  call_many('ZADD', W, back)
  mark_lapsed(gone)
  return extra
end

-- Reclaim: drop the lapsed holders and ready waiters, requeue the lapsed reservations, and park
-- again the standbys not confirmed in time (a confirmed one is an ordinary message on the broker
-- now). Returns how many holders were reclaimed.
local function reclaim()
  load()
  local lapsed = {}
  if HN > 0 then
    lapsed = redis.call('ZRANGEBYSCORE', H, '-inf', NOW)
    if #lapsed > 0 then
      drop_holders(lapsed)
    end
  end
  if not QUEUED then
    return #lapsed
  end
  local reclaimed = #lapsed + requeue(lapsed)
  local dropped = redis.call('ZRANGEBYSCORE', D, '-inf', NOW)
  unset_ready(dropped)
  call_many('ZREM', W, dropped)
  call_many('HDEL', I, dropped)
  local standbys = redis.call('ZRANGEBYSCORE', S, '-inf', NOW)
  call_many('ZREM', S, standbys)
  local payloads = call_many('HMGET', P, standbys)
  local gone, unconfirmed = {}, {}
  for i, w in ipairs(standbys) do
    local list = payloads[i] and unconfirmed or gone
    list[#list + 1] = w
  end
  call_many('ZREM', W, gone)
  mark_lapsed(unconfirmed)
  return reclaimed
end

-- The waiters the next `free` slots go to, with their places: the ready ones among the first
-- `limit` of the FIFO first, then the oldest others. O(log n) plus the waiters chosen: the window
-- itself is never read, only Q up to the place of its last waiter.
local function choose(free, limit)
  if free >= limit or redis.call('EXISTS', Q) == 0 then
    return redis.call('ZRANGE', W, 0, free - 1, 'WITHSCORES')
  end
  local last = redis.call('ZRANGE', W, limit - 1, limit - 1, 'WITHSCORES')
  local bound = #last > 0 and last[2] or '+inf'
  local flat = redis.call('ZRANGEBYSCORE', Q, '-inf', bound, 'WITHSCORES', 'LIMIT', 0, free)
  local ready, members, picked = {}, {}, {}
  for i = 1, #flat, 2 do
    members[#members + 1] = flat[i]
  end
  local in_d = call_many('ZMSCORE', D, members)
  for i = 1, #flat, 2 do
    if in_d[(i + 1) / 2] then
      ready[#ready + 1] = { flat[i + 1], flat[i] }
      picked[flat[i]] = true
    else
      redis.call('ZREM', Q, flat[i]) -- left by a release before Q (a rolling upgrade)
    end
  end
  -- Then the oldest others: among the first `free` + (ready picked) waiters there are enough.
  local n = #ready -- at most `free` (the LIMIT above)
  local head = redis.call('ZRANGE', W, 0, free + n - 1, 'WITHSCORES')
  local chosen, others = {}, free - n
  for i = 1, #head, 2 do
    local w = head[i]
    if picked[w] or others > 0 then
      others = others - (picked[w] and 0 or 1)
      picked[w] = nil
      chosen[#chosen + 1], chosen[#chosen + 2] = w, head[i + 1]
    end
  end
  for i = 1, n do -- ready waiters behind the head read above
    local w = ready[i][2]
    if picked[w] then
      chosen[#chosen + 1], chosen[#chosen + 2] = w, ready[i][1]
    end
  end
  return chosen
end

-- The waiter given the slot is reserved until HANDOFF_TTL: a parked one (not a standby being sent)
-- gets a generation, a ready one (or a confirmed standby) its token on its wake list, and its
-- runner moves to its I entry. Returns its payload (or false) and generation (or false).
local function hand_to(w, payload)
  if payload then
    if redis.call('ZREM', S, w) == 1 then
      return false, false -- a standby being sent: its sender enqueues and confirms it
    end
    return payload, new_generation(w)
  end
  redis.call('RPUSH', ARG_WAKE .. w, fmt(next_token()))
  redis.call('PEXPIRE', ARG_WAKE .. w, WAKE_TTL)
  local info = redis.call('HGET', I, w)
  local runner = redis.call('HGET', M, 'u:' .. w)
  if info or runner then
    redis.call('HSET', I, w, fmt(NOW) .. (runner and '@' .. runner or '') .. (info or '|'))
  end
  return false, false
end

-- Hand every free slot to a waiter (see choose). A parked waiter of another route is left for a
-- process of its route, and so are the parked waiters after it. Appends waiter,
-- payload-or-false, generation-or-false triples to `out`.
local function handoff(limit, out)
  if not (QUEUED or PARKED) or limit - HN <= 0 then
    return
  end
  local heads = choose(limit - HN, limit)
  local candidates = {}
  for i = 1, #heads, 2 do
    candidates[#candidates + 1] = heads[i]
  end
  local payloads = call_many('HMGET', P, candidates)
  local routes = call_many('HMGET', M, prefixed('r:', candidates))
  local standbys = call_many('ZMSCORE', S, candidates)
  local waiters, holders, places, stopped = {}, {}, {}, false
  for i, w in ipairs(candidates) do
    -- A standby being sent (in P and S) is no parked waiter: its sender, of its route, enqueues it.
    local parked = payloads[i] and not standbys[i]
    stopped = stopped or (parked and foreign(routes[i]))
    PASSED_OVER = PASSED_OVER or (parked and stopped)
    if not (parked and stopped) then
      waiters[#waiters + 1] = w
      places[#waiters], payloads[#waiters] = heads[2 * i], payloads[i]
      holders[#holders + 1], holders[#holders + 2] = NOW + HANDOFF_TTL, w
    end
  end
  if #waiters == 0 then
    return
  end
  call_many('ZREM', W, waiters)
  set_holders(holders)
  local reserve, woken = {}, {}
  for i, w in ipairs(waiters) do
    if payloads[i] then
      reserve[#reserve + 1], reserve[#reserve + 2] = w, places[i]
    else
      woken[#woken + 1] = w
    end
    out[#out + 1] = w
    out[#out + 1], out[#out + 2] = hand_to(w, payloads[i])
  end
  call_many('HSET', R, reserve)
  unset_ready(woken)
  call_many('ZREM', S, woken)
  if TOKEN ~= nil then
    META_AT = store_token()
  end
end

-- Send the first `count` waiters ahead as standbys (standby.lua), within the standby window (the
-- limit in force, at least MIN_STANDBY_WINDOW; none if it is 0): each parked one of the caller's
-- route not sent yet gets a deadline in S and a generation; its waiter, payload, generation triple
-- is appended to `out`.
local function send_ahead(count, out)
  if not (QUEUED and count > 0) or limit_in_force() <= 0 then
    return
  end
  count = math.min(count, math.max(limit_in_force(), MIN_STANDBY_WINDOW))
  local heads = redis.call('ZRANGE', W, 0, count - 1)
  local sent = call_many('ZMSCORE', S, heads)
  for i, w in ipairs(heads) do
    local payload = not sent[i] and redis.call('HGET', P, w)
    if payload and not foreign(redis.call('HGET', M, 'r:' .. w)) then
      add_deadline(S, NOW + HANDOFF_TTL, w)
      out[#out + 1], out[#out + 2], out[#out + 3] = w, payload, new_generation(w)
    end
  end
  if TOKEN ~= nil then
    store_token()
  end
end
