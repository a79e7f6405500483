-- Shared prelude of every per-key guard script but lock.lua and renew.lua: as a script, put in
-- front of it after _bounds.lua and the script's fast path, if it has one, and followed by
-- begin(); as a function, at the top of the library, once (backends/redis_scripts.py).
-- The contract these scripts implement is GuardBackend's (backends/base.py: holders, limit,
-- fencing token, waiters, hand-off, standbys); the comments here say how, not what.
--
-- Every script of a guard key K gets the same KEYS and leading ARGV, named by the layout that
-- backends/redis_layout.py defines (KeyNames, CallArgs) and generates in front of this: bind(),
-- called first by every call, sets H, W, P, ... X and ARG_WAKE, ... ARG_STALE_TTL_MS; a script's own
-- arguments are locals of their own name, read at its top.
-- Times come from the server's clock only.
--
-- Invariants the scripts keep, which let the common paths skip work:
--   * D's and S's members are in W (never in both), R's members are in H (after reclaim) and
--     have a payload in P, and P's members are in W or R: with W, P, R, D and S all absent
--     nothing is queued. A member of both P and S is a standby being sent (standby.lua).
--   * Q's members are D's, each scored by its place in W (a queued waiter keeps its place:
--     enqueue adds with NX, and reclaim puts back in W only reserved waiters, never queued ones).
--   * H, T and I, when they exist, expire no earlier than the largest deadline in H,
--     so a key whose holders all died vanishes by itself (T, and G, later still).
--
-- Cost model: every operation is O(log n) in the key's holders, waiters and reservations,
-- plus what it changes (a limit of 10,000 costs what a limit of 8 does). load() reads what
-- exists with one EXISTS, the holder count with ZCARD and the latest deadline with one
-- ZRANGE -1 -1; reclaim reads only the lapsed holders (ZRANGEBYSCORE up to now) and their
-- reservations; whether one member holds is one ZSCORE (holds()). Nothing reads all of H, W,
-- R or I but inspect.lua. A script that sets OWNED = true promises to change H only through
-- set_holders / drop_holders (or to keep HN, RAISED right itself); finish() re-counts H for a
-- script that does not.
-- The per-call values, set by begin() (which every script but the fast paths' early returns
-- runs first): as a script (EVALSHA) the prelude runs on every call; as a function (FCALL, see
-- redis_scripts.py) it runs once, when the library loads, and begin() resets every one of them, so
-- no call sees another's. A value a call changes belongs in this list.
local WAKE, HANDOFF_TTL, WAKE_TTL, KEY, KNOWN_DEFAULT, DEFAULT_LIMIT, ROUTE, STALE_TTL
local NOW_US, NOW
local HN -- how many members H has (kept by set_holders / drop_holders)
local LATEST -- the largest deadline in H while it is known (latest(); a write to H forgets it)
local HMAX -- the largest deadline H had when loaded (its expiry is at least that)
local EXISTED -- whether H, W, P, R, D or S existed when loaded
local QUEUED -- whether W, P, R, D or S existed when loaded (see the invariants)
local PARKED -- whether this script queued a waiter
local PASSED_OVER -- whether handoff left parked waiters of another route in the queue
local LOADED, OWNED
local RAISED -- a deadline in H went above HMAX: H, T and I must expire later
local META_AT -- the expiry T and I were already given by this script (acquire)
local LIMIT
local TOKEN -- the last fencing token issued, once read (see next_token)
local EARLIEST -- the earliest deadline this script wrote (in H, D or S): K is due by then
local SWEEPING -- set by sweep.lua: K's due time in X is recomputed, not only moved earlier

local function begin()
  WAKE = ARG_WAKE
  HANDOFF_TTL = tonumber(ARG_HANDOFF_TTL_MS)
  WAKE_TTL = tonumber(ARG_WAKE_TTL_MS)
  KEY = ARG_KEY
  KNOWN_DEFAULT = ARG_DEFAULT_LIMIT ~= ''
  DEFAULT_LIMIT = tonumber(ARG_DEFAULT_LIMIT) -- nil until read from M (see default_limit)
  ROUTE = ARG_ROUTE
  STALE_TTL = tonumber(ARG_STALE_TTL_MS)
  local clock = redis.call('TIME')
  NOW_US = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
  NOW = math.floor(NOW_US / 1000)
  HN, LATEST, HMAX = 0, nil, 0
  EXISTED, QUEUED, PARKED, PASSED_OVER, LOADED, OWNED, RAISED = false, false, false, false, false, false, false
  META_AT, LIMIT, TOKEN, EARLIEST, SWEEPING = nil, nil, nil, nil, false
end

-- Integers up to 2^53 as decimal strings (tostring would use an exponent).
local function fmt(n)
  return string.format('%.0f', n)
end

-- A variadic command over a long list, in chunks (unpack has a stack limit).
-- Chunks are even-sized, so score-member pairs stay together.
local function call_many(command, key, list)
  local results = {}
  for i = 1, #list, 4000 do
    local reply = redis.call(command, key, unpack(list, i, math.min(i + 3999, #list)))
    if type(reply) == 'table' then
      for _, value in ipairs(reply) do
        results[#results + 1] = value
      end
    end
  end
  return results
end

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
    HMAX = tonumber(redis.call('ZRANGE', H, -1, -1, 'WITHSCORES')[2])
    LATEST = HMAX
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

-- Make w, queued in W, a ready waiter (a thread blocks on it) until `at`: in D by that deadline,
-- in Q by its place; the thread's runner ('' for none) in M, as 'u:<w>' (see acquire.lua).
local function set_ready(w, at, runner)
  add_deadline(D, at, w)
  redis.call('ZADD', Q, redis.call('ZSCORE', W, w), w)
  if runner ~= '' then
    redis.call('HSET', M, 'u:' .. w, runner)
  else
    redis.call('HDEL', M, 'u:' .. w)
  end
end

-- Whether h holds a slot (after reclaim: a live holder).
local function holds(h)
  return HN > 0 and redis.call('ZSCORE', H, h) ~= false
end

-- The next fencing token: above every token issued before for this key, and at least
-- the server's time in us (so a key that vanished and came back never goes back).
-- The caller writes TOKEN to T.
local function next_token()
  if TOKEN == nil then
    TOKEN = tonumber(redis.call('GET', T) or '0')
  end
  TOKEN = math.max(TOKEN + 1, NOW_US)
  return TOKEN
end

-- The default limit: the caller's, else the one recorded when a waiter queued, else 0 (a
-- process that knows neither hands nothing on).
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

-- 'prefix' .. w for each w of list.
local function prefixed(prefix, list)
  local out = {}
  for i, w in ipairs(list) do
    out[i] = prefix .. w
  end
  return out
end

-- The waiters of `list` are no longer ready waiters (if they were), nor blocked on by a runner.
local function unset_ready(list)
  call_many('ZREM', D, list)
  call_many('ZREM', Q, list)
  call_many('HDEL', M, prefixed('u:', list))
end

-- The generation of w's message that may start (its record in G), or false if any may; and
-- whether the record is kept only for the copy that parked (its '~' prefix).
-- G .. ':' .. w is kept for waiters of which a copy that must not start may be on the broker (w's
-- hand-off or standby send lapsed unconfirmed, or a copy from the broker parked, and may be
-- delivered again): the one generation that may start, 'parked' when no copy on the broker may.
-- Each expires STALE_TTL after its own last write (so a key that keeps parking keeps no more than
-- a STALE_TTL's worth). '~' marks a record written by a park with no record before, and no
-- hand-off or send lapsed since: kept only for the copy that parked, whose ack by the broker
-- deletes it (forget_copy.lua), so it outlives the work only where a second copy can exist.
local function live_generation(w)
  local record = redis.call('GET', G .. ':' .. w)
  if record and string.sub(record, 1, 1) == '~' then
    return string.sub(record, 2), true
  end
  return record, false
end

-- From now on only `gen` of w's message may start ('parked': no copy on the broker), for STALE_TTL;
-- `only_parked`: the record is kept only for the copy that parked (its ack deletes it).
local function set_live_generation(w, gen, only_parked)
  redis.call('SET', G .. ':' .. w, (only_parked and '~' or '') .. gen, 'PX', STALE_TTL)
end

-- These waiters' hand-offs or standby sends lapsed unconfirmed: their copy (of the generation in
-- M) may still be on the broker, and is now the only one that may start (G), until a newer
-- hand-off or send replaces it.
local function mark_lapsed(list)
  local gens = call_many('HMGET', M, prefixed('g:', list))
  local marked = false
  for i, w in ipairs(list) do
    if gens[i] then
      set_live_generation(w, gens[i])
      marked = true
    end
  end
  if marked then
    call_many('HDEL', M, prefixed('g:', list))
  end
end

-- w left the queue for good (it started, or gave up): its route and in-flight generation go.
local function forget(w)
  redis.call('HDEL', M, 'r:' .. w, 'g:' .. w)
end

-- A new generation for w's hand-off or standby send (a fencing token of the key): recorded as in
-- flight in M, and in G if an older copy of w may be on the broker.
local function new_generation(w)
  local gen = fmt(next_token())
  redis.call('HSET', M, 'g:' .. w, gen)
  local live, only_parked = live_generation(w)
  if live then
    set_live_generation(w, gen, only_parked)
  end
  return gen
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

-- A variadic write over a long list, in chunks (see call_many), returning the sum of its
-- integer replies (how many members it added or removed).
local function count_many(command, key, list)
  local n = 0
  for i = 1, #list, 4000 do
    n = n + redis.call(command, key, unpack(list, i, math.min(i + 3999, #list)))
  end
  return n
end

-- Write TOKEN to T, to expire no earlier than the latest deadline in H nor STALE_TTL from now.
-- T outlives the key's other state (finish() leaves it to expire): a token issued after the key
-- fell idle is still above the last one, even by a server whose clock is behind the one that
-- issued it (a replica promoted by a failover), unless the key stayed idle longer than STALE_TTL.
-- Returns the expiry given (for META_AT).
local function store_token()
  local at = math.max(latest(), NOW + STALE_TTL)
  redis.call('SET', T, fmt(TOKEN), 'PXAT', at)
  return at
end

-- ZADD H (score-member pairs), counted in HN.
local function set_holders(pairs_)
  for i = 1, #pairs_, 2 do
    if pairs_[i] > HMAX then
      RAISED = true
    end
    note_due(pairs_[i])
  end
  HN = HN + count_many('ZADD', H, pairs_)
  LATEST = nil -- a holder's deadline may have gone down as well as up
end

-- ZREM H and HDEL I of these holders, counted in HN. A ZREM of the last member deletes H, and
-- its expiry with it: a holder added later in the same script (a hand-off) makes a new H, which
-- must be given an expiry again (RAISED), or it would never expire.
local function drop_holders(list)
  HN = HN - count_many('ZREM', H, list)
  LATEST = nil
  call_many('HDEL', I, list)
  if HN == 0 then
    HMAX = 0
  end
end

-- Reclaim: a lapsed reservation of a parked waiter goes back to its place in
-- the queue (its payload never left P); other lapsed holders and expired
-- blocking waiters are dropped. A reservation whose holder entry vanished
-- (H expired because every holder died) counts as lapsed.
-- A reservation's holder entry leaves H only by lapsing (release and cancel_wait drop the
-- reservation with it), so the reservations to look at are the lapsed holders', or all of R
-- once H is gone.
-- Returns how many holders were reclaimed.
local function reclaim()
  load()
  local lapsed = {}
  if HN > 0 then
    lapsed = redis.call('ZRANGEBYSCORE', H, '-inf', NOW)
    if #lapsed > 0 then
      drop_holders(lapsed)
    end
  end
  local reclaimed = #lapsed
  if QUEUED then
    local back, gone = {}, {}
    if HN == 0 then
      local was_lapsed = {}
      for _, h in ipairs(lapsed) do
        was_lapsed[h] = true
      end
      local reserved = redis.call('HGETALL', R)
      for i = 1, #reserved, 2 do
        local w = reserved[i]
        back[#back + 1] = reserved[i + 1]
        back[#back + 1] = w
        gone[#gone + 1] = w
        if not was_lapsed[w] then
          reclaimed = reclaimed + 1
        end
      end
    elseif #lapsed > 0 then
      local places = call_many('HMGET', R, lapsed)
      for i, w in ipairs(lapsed) do
        if places[i] then
          back[#back + 1] = places[i]
          back[#back + 1] = w
          gone[#gone + 1] = w
        end
      end
    end
    if #gone > 0 then
      call_many('HDEL', R, gone)
      call_many('ZADD', W, back)
      mark_lapsed(gone)
    end
    -- A ready waiter whose thread stopped waiting (it died, or gave up without a word) is dropped.
    local dropped = redis.call('ZRANGEBYSCORE', D, '-inf', NOW)
    if #dropped > 0 then
      unset_ready(dropped)
      call_many('ZREM', W, dropped)
      call_many('HDEL', I, dropped)
    end
    -- A standby not picked up in time: one never confirmed (standby.lua) still has its payload
    -- and parks again; a confirmed one is on the broker and becomes an ordinary message there.
    local lapsed_standbys = redis.call('ZRANGEBYSCORE', S, '-inf', NOW)
    if #lapsed_standbys > 0 then
      call_many('ZREM', S, lapsed_standbys)
      local payloads = call_many('HMGET', P, lapsed_standbys)
      local gone, unconfirmed = {}, {}
      for i, w in ipairs(lapsed_standbys) do
        if payloads[i] then
          unconfirmed[#unconfirmed + 1] = w
        else
          gone[#gone + 1] = w
        end
      end
      if #gone > 0 then
        call_many('ZREM', W, gone)
      end
      if #unconfirmed > 0 then
        mark_lapsed(unconfirmed)
      end
    end
  end
  return reclaimed
end

-- The waiters the next `free` slots go to, oldest first, with their places: among the first
-- `limit` waiters of the FIFO, the ready ones (a thread is blocked on them, in D) are chosen
-- first, then the oldest others. A ready waiter starts on a push; any other needs a worker
-- to fetch its message first, and a slot handed to it stands idle until then. So the FIFO
-- order is relaxed within a window of the limit's size only (not at all for a mutex).
-- Cost: O(log n) plus the waiters chosen: the first ready waiters within the window are read
-- from Q, bounded by the place of the window's last waiter; the window itself is never read (it
-- may hold thousands), nor are the ready waiters behind it.
local function choose(free, limit)
  if free >= limit or redis.call('EXISTS', Q) == 0 then
    return redis.call('ZRANGE', W, 0, free - 1, 'WITHSCORES')
  end
  -- The first ready waiters within the window, by their places.
  local last = redis.call('ZRANGE', W, limit - 1, limit - 1, 'WITHSCORES')
  local bound = #last > 0 and last[2] or '+inf'
  local flat = redis.call('ZRANGEBYSCORE', Q, '-inf', bound, 'WITHSCORES', 'LIMIT', 0, free)
  local ready, members = {}, {}
  for i = 1, #flat, 2 do
    members[#members + 1] = flat[i]
  end
  local in_d = #members > 0 and call_many('ZMSCORE', D, members) or {}
  for i = 1, #flat, 2 do
    if in_d[(i + 1) / 2] then
      ready[#ready + 1] = { flat[i + 1], flat[i] }
    else
      -- Left by a script of a release before Q (a rolling upgrade): not a ready waiter.
      redis.call('ZREM', Q, flat[i])
    end
  end
  local picked = {}
  for i = 1, math.min(free, #ready) do
    picked[ready[i][2]] = true
  end
  -- Then the oldest others: among the first `free` + (ready picked) waiters there are enough.
  local n = math.min(free, #ready)
  local head = redis.call('ZRANGE', W, 0, free + n - 1, 'WITHSCORES')
  local chosen, others = {}, free - n
  for i = 1, #head, 2 do
    local w = head[i]
    if picked[w] then
      picked[w] = nil
      chosen[#chosen + 1] = w
      chosen[#chosen + 1] = head[i + 1]
    elseif others > 0 then
      others = others - 1
      chosen[#chosen + 1] = w
      chosen[#chosen + 1] = head[i + 1]
    end
  end
  -- Ready waiters further back than the head read above, in FIFO order after it.
  for i = 1, n do
    local w = ready[i][2]
    if picked[w] then
      chosen[#chosen + 1] = w
      chosen[#chosen + 1] = ready[i][1]
    end
  end
  return chosen
end

-- Hand every free slot to a waiter (see choose): each becomes a holder with a
-- reservation deadline. A parked waiter keeps its payload (and its place, in
-- R) until confirm_handoff, and its hand-off gets a new generation (a fencing
-- token, which its re-enqueued copy carries); a ready waiter, or a standby
-- already confirmed on the broker, gets its fencing token pushed on its wake
-- list, which expires after half the reservation: a woken waiter that takes it
-- holds the slot at once and has the other half, at least, to renew it into a
-- lease. A parked waiter of another route (another application's broker) is
-- left for a process of its route, and so are the parked waiters after it:
-- its slot stays free until that process's sweep hands it over.
-- Appends waiter, payload-or-false, generation-or-false triples to `out`.
local function handoff(limit, out)
  if not (QUEUED or PARKED) then
    return
  end
  local free = limit - HN
  if free <= 0 then
    return
  end
  local heads = choose(free, limit)
  if #heads == 0 then
    return
  end
  local candidates = {}
  for i = 1, #heads, 2 do
    candidates[#candidates + 1] = heads[i]
  end
  local payloads = call_many('HMGET', P, candidates)
  local routes = call_many('HMGET', M, prefixed('r:', candidates))
  local standbys = call_many('ZMSCORE', S, candidates)
  local deadline = NOW + HANDOFF_TTL
  local waiters, holders, places, stopped = {}, {}, {}, false
  for i, w in ipairs(candidates) do
    -- A standby being sent (its payload still in P, and in S) is no parked waiter: its sender, of
    -- its route, enqueues it, so neither its route nor a foreign waiter ahead of it stops it.
    local parked = payloads[i] and not standbys[i]
    local foreign = parked and routes[i] and routes[i] ~= '' and routes[i] ~= ROUTE
    stopped = stopped or (foreign and true or false)
    PASSED_OVER = PASSED_OVER or (parked and stopped and true or false)
    if not (parked and stopped) then
      waiters[#waiters + 1] = w
      places[#waiters] = heads[2 * i]
      payloads[#waiters] = payloads[i]
      holders[#holders + 1] = deadline
      holders[#holders + 1] = w
    end
  end
  if #waiters == 0 then
    return
  end
  call_many('ZREM', W, waiters)
  set_holders(holders)
  local reserve, woken = {}, {}
  for i, w in ipairs(waiters) do
    local payload, gen = payloads[i], false
    if payload then
      reserve[#reserve + 1] = w
      reserve[#reserve + 1] = places[i]
      if redis.call('ZREM', S, w) == 1 then
        -- A standby being sent (standby.lua): its sender enqueues and confirms it.
        payload = false
      else
        gen = new_generation(w)
      end
    else
      woken[#woken + 1] = w
      redis.call('RPUSH', WAKE .. w, fmt(next_token()))
      redis.call('PEXPIRE', WAKE .. w, WAKE_TTL)
      -- A ready waiter left its info, and its runner in M: it holds the slot from now on, for it.
      local info = redis.call('HGET', I, w)
      local runner = redis.call('HGET', M, 'u:' .. w)
      if info or runner then
        redis.call('HSET', I, w, fmt(NOW) .. (runner and '@' .. runner or '') .. (info or '|'))
      end
    end
    out[#out + 1] = w
    out[#out + 1] = payload
    out[#out + 1] = gen
  end
  if #reserve > 0 then
    call_many('HSET', R, reserve)
  end
  if #woken > 0 then
    unset_ready(woken)
    call_many('ZREM', S, woken)
  end
  if TOKEN ~= nil then
    META_AT = store_token()
  end
end

-- Send the first `count` waiters of the FIFO ahead as standbys (see standby.lua), at most the
-- standby window (MIN_STANDBY_WINDOW or the limit in force, whichever is larger): each parked
-- one among them of the caller's route (a payload, not in S) gets a deadline in S and a new
-- generation, and its waiter, payload, generation triple is appended to `out`; ready waiters,
-- standbys already sent and other routes' waiters are left as they are.
local function send_ahead(count, out)
  if not (QUEUED and count > 0) then
    return
  end
  -- At most the limit in force, or MIN_STANDBY_WINDOW if it is smaller; none for a halted key.
  local limit = limit_in_force()
  if limit <= 0 then
    return
  end
  count = math.min(count, math.max(limit, MIN_STANDBY_WINDOW))
  local heads = redis.call('ZRANGE', W, 0, count - 1)
  local sent = #heads > 0 and call_many('ZMSCORE', S, heads) or {}
  for i, w in ipairs(heads) do
    if not sent[i] then
      local payload = redis.call('HGET', P, w)
      local route = payload and redis.call('HGET', M, 'r:' .. w)
      if payload and not (route and route ~= '' and route ~= ROUTE) then
        add_deadline(S, NOW + HANDOFF_TTL, w)
        out[#out + 1] = w
        out[#out + 1] = payload
        out[#out + 1] = new_generation(w)
      end
    end
  end
  if TOKEN ~= nil then
    store_token()
  end
end

-- Queue `w` as a waiter at the back (keeping its place if it is already queued).
-- Returns whether it was not queued before.
local function enqueue(w)
  local place = NOW_US
  if QUEUED then
    -- A place only grows: max(last + 1, now in us).
    local last = redis.call('ZRANGE', W, -1, -1, 'WITHSCORES')
    if #last > 0 then
      place = math.max(tonumber(last[2]) + 1, NOW_US)
    end
  end
  local added = redis.call('ZADD', W, 'NX', fmt(place), w) == 1
  if KNOWN_DEFAULT then
    -- For processes that do not know the key's actor (another application's sweep).
    redis.call('HSET', M, 'limit', DEFAULT_LIMIT)
  end
  PARKED = true
  return added
end

-- When K next needs a sweep: at its earliest deadline (a holder's lease or reservation, a ready
-- waiter's, a standby's), now if a parked waiter of another route was passed over (a process of
-- its route hands it on), and DUE_BACKSTOP_MS from now at the latest.
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

-- K's entry in X, for a key with waiters: set to next_due() by a sweep, or when missing (K just
-- started queueing); else only ever moved earlier, to the earliest deadline this script wrote.
local function index_due()
  local current = redis.call('ZSCORE', X, KEY)
  if SWEEPING or not current then
    redis.call('ZADD', X, next_due(), KEY)
    return
  end
  local at = PASSED_OVER and NOW or EARLIEST
  if at and at < tonumber(current) then
    redis.call('ZADD', X, at, KEY)
  end
end

-- With no holder, no waiter and no reservation left, drop all state but the limit, G and T
-- (which expire by themselves: mark_lapsed, store_token), and the key's waiting-keys index
-- entry. Otherwise make the holder-derived keys expire with the last holder: waiters, payloads
-- and reservations never expire.
local function finish()
  if not OWNED then
    HN = redis.call('ZCARD', H)
    LATEST = nil
    RAISED = HN > 0
    QUEUED = true
  end
  local queued = PARKED or (QUEUED and redis.call('EXISTS', W, R) > 0)
  if X and QUEUED and not queued then
    redis.call('ZREM', X, KEY)
  end
  if X and queued then
    index_due()
  end
  if HN == 0 and not queued then
    if EXISTED or PARKED or not OWNED then
      redis.call('DEL', H, W, P, R, D, S, I, M, Q)
    end
    return
  end
  if QUEUED and not queued then
    -- The queue drained but holders remain: M (never expiring) goes with the queue it served.
    redis.call('DEL', M)
  end
  if HN > 0 and (RAISED or META_AT) then
    local at = latest()
    if RAISED then
      redis.call('PEXPIREAT', H, at)
    end
    if RAISED and not META_AT and redis.call('PTTL', T) < at - NOW then
      -- Later, never sooner (store_token): T may have to outlive the holders.
      redis.call('PEXPIREAT', T, at)
    end
    redis.call('PEXPIREAT', I, at)
  end
end

-- Argument checks, run by every per-key script before anything else (the bounds and
-- whole_number are generated and _bounds.lua's, in front of the script).
-- validate_args({name, value, low, high}, ...) -> nil, or an error reply naming the first
-- value that is not a whole number in its range. The prelude's own numbers (handoff_ttl_ms,
-- wake_ttl_ms, stale_ttl_ms, the default limit if given) are checked first. A script starts with:
--   local refused = validate_args(...)
--   if refused then return refused end
local function validate_args(...)
  local checks = {
    { 'handoff_ttl_ms', HANDOFF_TTL, 1, MAX_DURATION_MS },
    { 'wake_ttl_ms', WAKE_TTL, 1, MAX_DURATION_MS },
    { 'stale_ttl_ms', STALE_TTL, 1, MAX_DURATION_MS },
    { 'default_limit', KNOWN_DEFAULT and DEFAULT_LIMIT or 0, 0, MAX_COUNT },
    ...,
  }
  for _, check in ipairs(checks) do
    if whole_number(check[2], check[3], check[4]) == nil then
      return redis.error_reply(
        check[1] .. ' must be an integer from ' .. fmt(check[3]) .. ' to ' .. fmt(check[4])
          .. ', got ' .. tostring(check[2])
      )
    end
  end
  return nil
end
