-- forget_copy(waiter) -> 1 if the waiter's generation record went, else 0.
-- The broker acked the copy of `waiter` that parked after pickup (acquire.lua): it cannot be
-- delivered again. A record kept only for that copy ('~', see live_generation in the prelude) goes; any
-- other stays until it expires (a lapsed hand-off's or send's copy, or another parked one, may
-- still be on the broker).
local refused = validate_args()
if refused then
  return refused
end
local live, only_parked = live_generation(waiter)
if live and only_parked then
  redis.call('DEL', G .. ':' .. waiter)
  return 1
end
return 0
