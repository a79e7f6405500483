-- release(holder, standbys[, reserved_only]) -> {released, handoffs, standbys}: then sends the first
-- `standbys` waiters ahead, as standby('send') would (the caller enqueues and confirms them).
-- reserved_only '1': only a slot reserved for a message not started (no runner in its I entry).
OWNED = true
reclaim()
local released = 0
if holds(holder) and not (reserved_only == '1' and runner_of(redis.call('HGET', I, holder))) then
  released = 1
  if HN == 1 and not QUEUED then
    HN = 0 -- the last holder of a key nobody waits for: finish() deletes it all
  else
    drop_holders({ holder })
    if QUEUED then
      redis.call('HDEL', R, holder)
      forget(holder)
    end
  end
end
local handoffs, sent = {}, {}
handoff(limit_in_force(), handoffs)
send_ahead(tonumber(standbys), sent)
finish()
return { released, handoffs, sent }
