-- forget_copy(waiter) -> 1 if the waiter's generation record went, else 0: the broker acked the copy
-- that parked after pickup (acquire.lua), so a record kept only for it ('~') goes; any other stays.
local live, only_parked = live_generation(waiter)
if live and only_parked then
  redis.call('DEL', G .. ':' .. waiter)
  return 1
end
return 0
