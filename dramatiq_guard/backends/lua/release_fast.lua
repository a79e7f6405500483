-- The last-holder path of release.lua, run before _prelude.lua is even set up: a live holder
-- releasing a key it holds alone, with no waiter, reservation or standby (so nothing to hand on
-- or send ahead). It drops the key's state in 5 commands, exactly as release.lua would (all but
-- the run-time limit, G and T, which expire by themselves), and returns the same reply. Anything
-- else, or a send_ahead it cannot use, falls through to the prelude and release.lua.
-- KEYS and ARGV as _prelude.lua; release's own arguments from ARGV[8] (see release.lua).
do
  -- A whole number from low to high, as validate_args would accept it (else: the full path).
  local function whole(v, low, high)
    local n = type(v) == 'string' and #v <= 16 and string.match(v, '^%d+$') and tonumber(v)
    return n and n >= low and n <= high and n
  end
  local DAY366, COUNT = 31622400000, 2147483647
  if whole(ARGV[9] or '0', 0, COUNT) and whole(ARGV[2], 1, DAY366) and whole(ARGV[3], 1, DAY366)
    and whole(ARGV[7], 1, DAY366) and (ARGV[5] == '' or whole(ARGV[5], 0, COUNT))
    and redis.call('EXISTS', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[9]) == 0
    and redis.call('ZCARD', KEYS[1]) == 1 then
    local deadline = redis.call('ZSCORE', KEYS[1], ARGV[8])
    local clock = redis.call('TIME')
    local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
    if deadline and tonumber(deadline) > now then
      redis.call('DEL', KEYS[1], KEYS[8], KEYS[10])
      return { 1, {}, {} }
    end
  end
end
