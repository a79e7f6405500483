-- In front of every per-key script, before even the fast paths (acquire_fast.lua,
-- release_fast.lua) and _prelude.lua: how arguments are checked against the bounds (MAX_DURATION_MS,
-- MAX_COUNT, ...: generated from backends/redis_layout.py, in front of this), and how a holder's
-- runner is kept (runner_of, holder_entry, below).
-- Redis does not roll back a script that fails half-way, so a number a script cannot use must
-- be refused before its first write, not found out by a command in the middle (which would
-- leave, say, a holder without an expiry).

-- value as a whole number from low to high, else nil: a string of decimal digits only (no
-- sign, exponent, fraction, hex, blank, inf or nan: a limit is stored as given), or a number
-- already parsed.
local function whole_number(value, low, high)
  local n = nil
  if type(value) == 'string' then
    n = #value <= 16 and string.match(value, '^%d+$') and tonumber(value)
  elseif type(value) == 'number' then
    n = value
  end
  if n and n == n and n % 1 == 0 and n >= low and n <= high then
    return n
  end
  return nil
end

-- Also shared by the fast paths and the prelude: the runner recorded in a holder's I entry,
-- "<since_ms>@<runner>|<info>" (no '@' before the first '|': no runner), or nil. A runner never
-- holds '|' or '@' (acquire.lua refuses one that does).
local function runner_of(entry)
  local head = entry and string.match(entry, '^[^|]*')
  local at = head and string.find(head, '@', 1, true)
  return at and string.sub(head, at + 1) or nil
end

-- The I entry to write for a holder that acquires at now_ms, or nil to leave it: first is its
-- entry if it already held (a re-entrant acquire, a reservation or hand-off taken up), whose
-- since and info stay; a runner given ('' for none) is recorded.
local function holder_entry(first, now_ms, runner, info)
  if first and runner == '' then
    return nil
  end
  local since = first and string.match(first, '^%d+') or string.format('%.0f', now_ms)
  local rest = first and string.match(first, '|(.*)$') or info
  return since .. (runner ~= '' and '@' .. runner or '') .. '|' .. rest
end
