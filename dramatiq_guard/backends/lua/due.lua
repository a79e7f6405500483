-- due(within_ms, prompt...) -> {the guard keys of the waiting-keys index X due for a sweep now, by
-- the server's clock; in how many ms the first key due within within_ms that starts with a
-- `prompt` prefix is due (of the first PROMPT_SCAN ahead), or false}.
local PROMPT_SCAN = 100
local _, now = server_time()
local due = redis.call('ZRANGEBYSCORE', X, '-inf', now)
if PROMPT_FROM > #ARGV then
  return { due, false }
end
local within = now + tonumber(within_ms)
local ahead = redis.call('ZRANGEBYSCORE', X, '(' .. now, within, 'WITHSCORES', 'LIMIT', 0, PROMPT_SCAN)
for i = 1, #ahead, 2 do
  for p = PROMPT_FROM, #ARGV do
    if string.sub(ahead[i], 1, #ARGV[p]) == ARGV[p] then
      return { due, tonumber(ahead[i + 1]) - now }
    end
  end
end
return { due, false }
