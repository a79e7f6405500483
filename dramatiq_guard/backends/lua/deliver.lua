-- deliver(op, waiter, ttl_ms, generation, payload, message_id, data) -> as confirm_handoff.lua (op
-- 'handoff') or standby.lua's confirm (op 'standby': payload, the one sent): the re-enqueued copy of
-- a hand-off or standby send (data, as Dramatiq encodes it) goes to a RedisBroker queue (QUEUE,
-- QUEUE_MESSAGES: its list and message hash; message_id: its redis_message_id) as Dramatiq's enqueue
-- pushes it, and is confirmed, in one step (GuardBackend.enqueue_and_confirm). It is pushed whatever
-- the confirmation answers, as in two steps, where the push comes first; once (push_once), if a
-- client runs the same call again after losing its reply.
OWNED = true
reclaim()
push_once(QUEUE, QUEUE_MESSAGES, message_id, data)
local held
if op == 'standby' then
  held = confirm_standby(waiter, ttl_ms, payload, generation)
else
  held = confirm(waiter, ttl_ms, generation)
end
finish()
return held
