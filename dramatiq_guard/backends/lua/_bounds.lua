-- In front of every per-key script but lock.lua and renew.lua, before even the fast paths
-- (acquire_fast.lua, release_fast.lua) and _prelude.lua: the argument bounds they check.
-- Redis does not roll back a script that fails half-way, so a number a script cannot use must
-- be refused before its first write, not found out by a command in the middle (which would
-- leave, say, a holder without an expiry). The bounds are dramatiq_guard/bounds.py's (a test
-- keeps them equal): durations from 0 to 366 days in ms, limits and counts from 0 to 2^31 - 1.
local MAX_DURATION_MS = 31622400000
local MAX_COUNT = 2147483647

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
