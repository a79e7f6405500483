-- Helpers of every script (redis_scripts.py puts this in front of each, after the binding if any).
-- A number a script cannot use is refused before its first write (Redis does not roll a script
-- back): each script's prologue checks those redis_layout.py marks with a Check.

-- Integers up to 2^53 as decimal strings (tostring would use an exponent).
local function fmt(n)
  return string.format('%.0f', n)
end

-- The server's time, in us and in ms (times come from the server's clock only).
local function server_time()
  local clock = redis.call('TIME')
  local us = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
  return us, math.floor(us / 1000)
end

-- Message `id` (its `data`) onto a RedisBroker queue (list `queue`, message hash `messages`) as
-- Dramatiq's enqueue writes it, once: each enqueue has an id of its own, so one already in `messages`
-- was pushed by this very call, run again by a client that lost its reply (redis-py's retry).
local function push_once(queue, messages, id, data)
  if redis.call('HSETNX', messages, id, data) == 1 then
    redis.call('RPUSH', queue, id)
  end
end

-- value as a whole number from low to high, else nil: decimal digits, after a '-' at most (no '+',
-- exponent, fraction, hex, blank, inf or nan: a limit is stored as given), or a number already parsed.
-- Every call of a script checks several (string.find: no copy of the match is made).
local function whole_number(value, low, high)
  local n = type(value) == 'number' and value
    or type(value) == 'string' and #value <= 17 and string.find(value, '^%-?%d+$') and tonumber(value)
  return n and n == n and n % 1 == 0 and n >= low and n <= high and n or nil
end

-- nil, or an error reply naming the first {name, value, low, high} not a whole number in range.
local function refusal(checks)
  for _, check in ipairs(checks) do
    if whole_number(check[2], check[3], check[4]) == nil then
      return redis.error_reply(
        check[1] .. ' must be an integer from ' .. fmt(check[3]) .. ' to ' .. fmt(check[4]) .. ', got ' .. tostring(check[2])
      )
    end
  end
  return nil
end

-- The runner in a holder's I entry "<since_ms>@<runner>|<info>", or nil (no '@' before the first
-- '|'). A runner never holds '|' or '@' (acquire.lua refuses one that does).
local function runner_of(entry)
  local head = entry and string.match(entry, '^[^|]*')
  local at = head and string.find(head, '@', 1, true)
  return at and string.sub(head, at + 1) or nil
end

-- The I entry for a holder that acquires at now_ms, or nil to leave it: `first` is its entry if it
-- already held (since and info stay); a runner given ('' for none) is recorded.
local function holder_entry(first, now_ms, runner, info)
  if first and runner == '' then
    return nil
  end
  local since = first and string.match(first, '^%d+') or fmt(now_ms)
  local rest = first and string.match(first, '|(.*)$') or info
  return since .. (runner ~= '' and '@' .. runner or '') .. '|' .. rest
end
