"""Deduplicated sends (``dedup="until_executed"``) on a RedisBroker, against plain sends."""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable
from typing import Any

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import Retries

from bench.core import SCRIPT_COMMANDS, Context, Figure, in_turns, scenario
from dramatiq_guard.middleware.dedup import Deduplication
from dramatiq_guard.middleware.slots import Concurrency

#: Rounds of the send rates (each kind of send once per round).
SEND_ROUNDS = 5

#: The one-step floor's script: the writes a lock on a free key cannot do without (what lock.lua
#: does for one: look at its six keys, the server's time, the holder, its entry, their expiry),
#: then Dramatiq's enqueue (the message hash and the queue list), with key names as long as the
#: guard's. KEYS: holders, 4 others, info, queue, queue messages; ARGV: holder, ttl, id, data.
FUSED_FLOOR = """
redis.call('EXISTS', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local deadline = now + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], deadline, ARGV[1])
redis.call('HSET', KEYS[6], ARGV[1], string.format('%.0f', now) .. '|bench')
redis.call('PEXPIREAT', KEYS[1], deadline)
redis.call('PEXPIREAT', KEYS[6], deadline)
redis.call('HSET', KEYS[8], ARGV[3], ARGV[4])
redis.call('RPUSH', KEYS[7], ARGV[3])
return 1
"""


def fuse_floor(broker: RedisBroker, queue_name: str) -> None:
    """Make ``broker`` enqueue the messages of ``queue_name`` with :data:`FUSED_FLOOR` instead of
    its own script: a plain send that does the least a one-step guarded send must do."""
    script = broker.client.register_script(FUSED_FLOOR)
    enqueue = broker.do_enqueue
    fields = ("holders", "waiters", "reserved", "limit", "token", "info")

    def do_enqueue(queue: str, message_id: str, data: bytes) -> Any:
        if queue != queue_name:
            return enqueue(queue, message_id, data)
        full, prefix = f"{broker.namespace}:{queue}", f"dramatiq-guard:{{dedup:bench-floor:{message_id}}}:"
        return script(
            [*(prefix + name for name in fields), full, f"{full}.msgs"],
            [message_id, 60_000, message_id, data],
        )

    broker.do_enqueue = do_enqueue  # type: ignore[attr-defined]


@scenario("dedup", title="Deduplication (dedup=until_executed) on a RedisBroker", order=10)
def dedup(ctx: Context) -> list[Figure]:
    """``dedup="until_executed"`` on a RedisBroker whose own client holds the guard state.

    * send rate, plain: ``plain.send(i)``, an actor without ``dedup`` on the same broker: what
      the other send rates are read against (the four kinds of send take turns, one run of
      each per round, 5 rounds, medians, so drift of the machine falls on all alike).
    * send rate, accepted: ``actor.send(i)`` with a new key each time, so every send takes a
      lock and is pushed, in one Lua script (the broker shares the guard's Redis; elsewhere a
      pending lock, the broker's push, and confirmations batched in the background).
    * send rate, duplicates: ``actor.send(0)`` N times: the first takes the lock, the
      others are dropped after one round trip, without touching the broker.
    * send rate, concurrency under its limit: ``limited.send(i)``, an actor with
      ``concurrency={"limit": 10, ...}`` over 1,000 keys (``i % 1000``), so every send reserves a
      slot at send time and is pushed, in one Lua script, without parking.
    * send rate, one-step floor: a plain send whose enqueue script also does the least a lock on a
      free key writes (:data:`FUSED_FLOOR`): what the accepted and concurrency sends are read
      against when no Python of the guard's ran (the budgets are against the plain send).
    * send rate, floor: a plain send (an actor without ``dedup``) after a Lua script that
      does nothing (``return 1``): what one extra round trip costs on this machine (the two-step
      path's floor, for brokers that cannot take the one-step send).
    * round trips / commands per accepted send: as in the baseline, over a batch of sends
      with new keys. The round trips the sending thread waits for are counted apart from
      the background confirmations made during the batch (the batch ends with a flush of
      the last ones, so they are counted too); the commands count both.
    * commands in the lock alone: what the lock script runs for a free key without the push
      (``try_lock`` over new keys, the script call itself not counted): the two-step path.
    """
    broker = RedisBroker(url=ctx.redis_url)
    middleware = Deduplication()
    broker.add_middleware(middleware, before=Retries)
    broker.add_middleware(Concurrency(), before=Retries)

    @dramatiq.actor(broker=broker, queue_name="bench_dedup", dedup="until_executed", max_retries=0)
    def guarded(i: int) -> None:
        """Never runs: no worker consumes ``bench_dedup``."""

    @dramatiq.actor(broker=broker, queue_name="bench_dedup_plain", max_retries=0)
    def plain(i: int) -> None:
        """Never runs: no worker consumes ``bench_dedup_plain``."""

    @dramatiq.actor(
        broker=broker,
        queue_name="bench_limited",
        concurrency={"limit": 10, "key": lambda i: f"k{i % 1000}"},
        max_retries=0,
    )
    def limited(i: int) -> None:
        """Never runs: no worker consumes ``bench_limited``."""

    @dramatiq.actor(broker=broker, queue_name="bench_fused_floor", max_retries=0)
    def fused(i: int) -> None:
        """Never runs: no worker consumes ``bench_fused_floor``."""

    fuse_floor(broker, fused.queue_name)
    noop = broker.client.register_script("return 1")

    n_send = ctx.n(5000, 300)
    n_count = ctx.n(500, 50)

    sends: dict[str, Callable[[int], object]] = {
        "plain": lambda i: plain.send(i),
        "accepted": lambda i: guarded.send(i),
        "duplicate": lambda i: guarded.send(0),
        "floor": lambda i: (noop(), plain.send(i)),
        "limited": lambda i: limited.send(i),
        "fused": lambda i: fused.send(i),
    }
    rounds = 1 if ctx.quick else SEND_ROUNDS
    runs: dict[str, list[float]] = {name: [] for name in sends}
    for name, send in in_turns(list(sends.items()), rounds):  # drift falls on all alike
        runs[name].append(ctx.send_rate(send, n_send, repeats=1))
    plain_rate, accepted_rate, duplicate_rate, floor_rate, limited_rate, fused_rate = (
        statistics.median(runs[name]) for name in sends
    )
    middleware.flush()

    def send_and_confirm(i: int) -> Any:
        message = guarded.send(i)
        if i == n_count - 1:
            # The last confirmations, off the sending thread as the confirmation thread does them.
            flusher = threading.Thread(target=middleware.flush)
            flusher.start()
            flusher.join()
        return message

    calls = ctx.count_calls(send_and_confirm, n_count)
    backend = middleware.backend(broker)
    lock_calls = ctx.count_calls(
        lambda i: backend.try_lock(f"dedup:bench-lock:{i}", f"holder-{i}", ttl_ms=10_000), n_count
    )
    broker.close()
    in_lock = {name: n for name, n in lock_calls.by_command.items() if name not in SCRIPT_COMMANDS}

    sized = f"N={n_send}, median of {rounds}, the kinds of send taking turns"
    return [
        Figure(
            "plain_send_rate",
            "send rate, plain (an actor without dedup, same broker)",
            plain_rate,
            "msg/s",
            vs="baseline/send_rate",
            detail=sized,
        ),
        Figure(
            "send_rate",
            "send rate, accepted (a new key each send)",
            accepted_rate,
            "msg/s",
            vs="dedup/plain_send_rate",
            detail=sized,
        ),
        Figure(
            "duplicate_send_rate",
            "send rate, duplicates (one key)",
            duplicate_rate,
            "msg/s",
            vs="dedup/plain_send_rate",
            detail=sized,
        ),
        Figure(
            "concurrency_send_rate",
            "send rate, concurrency under its limit (a slot reserved at each send)",
            limited_rate,
            "msg/s",
            vs="dedup/plain_send_rate",
            detail=f"{sized}; limit 10 on each of 1,000 keys, at most 5 sends a key per run",
        ),
        Figure(
            "fused_floor_send_rate",
            "send rate, one-step floor: a plain send whose script also writes a lock",
            fused_rate,
            "msg/s",
            vs="dedup/plain_send_rate",
            detail=f"{sized}; the 6 commands a lock on a free key runs, in Dramatiq's enqueue, no guard code",
        ),
        Figure(
            "floor_send_rate",
            "send rate, floor: a plain send after a no-op script",
            floor_rate,
            "msg/s",
            vs="dedup/plain_send_rate",
            detail=f"{sized}; one extra round trip and nothing else",
        ),
        Figure(
            "commands_per_send",
            "Redis commands per accepted send",
            calls.commands,
            vs="baseline/commands_per_send",
            compare="delta",
            better="lower",
            detail=f"over {calls.calls} sends: {calls.breakdown()}",
        ),
        Figure(
            "lock_commands_per_send",
            "Redis commands per accepted send on the send path (the lock script)",
            sum(in_lock.values()),
            better="lower",
            detail=(
                f"the commands lock.lua runs for a free key, over {lock_calls.calls} locks: "
                + ", ".join(f"{name} {n:.2f}" for name, n in sorted(in_lock.items(), key=lambda kv: -kv[1]))
                + "; budget at most 6"
            ),
        ),
        Figure(
            "round_trips_per_send",
            "Redis round trips per accepted send",
            calls.round_trips,
            vs="baseline/round_trips_per_send",
            compare="delta",
            better="lower",
            detail=f"requests written by the thread calling send(), over {calls.calls} sends",
        ),
        Figure(
            "confirm_round_trips_per_send",
            "Redis round trips per accepted send, background confirmations",
            calls.background_round_trips,
            better="lower",
            detail=f"batched by the producer's confirmation thread, over {calls.calls} sends",
        ),
    ]
