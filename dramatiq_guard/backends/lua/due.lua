-- due() -> the guard keys of the waiting-keys index due for a sweep now (standalone Redis only).
-- KEYS: X, the index; no prelude: it lives in its own slot. The per-key scripts keep each
-- entry's score at the key's next due time on the server's clock (_prelude.lua, next_due),
-- so the server's clock decides what is due.
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
return redis.call('ZRANGEBYSCORE', X, '-inf', now)
