-- confirm(op, waiter, ttl_ms, generation, payload[, message_id, data]) -> 1 if the waiter still holds:
-- its copy is on the broker. generation: the one that copy carries ('' for any); an older one
-- changes nothing. op 'handoff' (GuardBackend.confirm_handoff): a hand-off keeps its reservation
-- for ttl_ms. op 'standby' (GuardBackend.confirm_standby; payload, the one sent): if the stored
-- payload is still the one sent, it is dropped; a standby still waiting stays in S until ttl_ms, one
-- handed a slot keeps it for ttl_ms.
-- With a push (QUEUE, QUEUE_MESSAGES: a RedisBroker queue's list and message hash; message_id: its
-- redis_message_id), the copy (data, as Dramatiq encodes it) is pushed as Dramatiq's enqueue pushes
-- it, and confirmed, in one step (GuardBackend.enqueue_and_confirm). It is pushed whatever the
-- confirmation answers, as in two steps, where the push comes first; once (push_once), if a client
-- runs the same call again after losing its reply.
OWNED = true
reclaim()
if QUEUE then
  push_once(QUEUE, QUEUE_MESSAGES, message_id, data)
end
local held
if op == 'standby' then
  held = confirm_standby(waiter, ttl_ms, payload, generation)
else
  held = confirm(waiter, ttl_ms, generation)
end
finish()
return held
