-- due() -> the guard keys of the waiting-keys index X due for a sweep now, by the server's clock.
local _, now = server_time()
return redis.call('ZRANGEBYSCORE', X, '-inf', now)
