"""Deduplicated sends (``dedup="until_executed"``) on a RedisBroker, against plain sends."""

from __future__ import annotations

import functools
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

#: The floors' scripts: Dramatiq's enqueue doing, in its own script and with no Python of the
#: guard's, the least a one-step guarded send of each kind must do, with key names as long as the
#: guard's. KEYS: the guard key's holders, 4 others (waiters, reserved, limit, token), info, then
#: the queue and its message hash; ARGV: holder, ttl, message id, data.
#: ``lock``: what lock.lua does for a free key (look at its keys, the server's time, the holder, its
#: entry, their expiry), then the push; ``held``: what it does for a held key (look, the time, the
#: holders), no push; ``reserve``: what acquire.lua does for a free slot of a ``concurrency`` key
#: (look, the time, the limit and token, the holder, its entry, the fencing token, their expiry),
#: then the push.
FLOORS = {
    "lock": """
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
""",
    "held": """
redis.call('EXISTS', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
redis.call('TIME')
return #redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
""",
    "reserve": """
redis.call('EXISTS', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
redis.call('MGET', KEYS[4], KEYS[5])
local deadline = now + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], deadline, ARGV[1])
redis.call('HSET', KEYS[6], ARGV[1], string.format('%.0f', now) .. '|bench')
redis.call('SET', KEYS[5], string.format('%.0f', now * 1000), 'PXAT', deadline + 86400000)
redis.call('PEXPIREAT', KEYS[1], deadline)
redis.call('PEXPIREAT', KEYS[6], deadline)
redis.call('HSETNX', KEYS[8], ARGV[3], ARGV[4])
redis.call('RPUSH', KEYS[7], ARGV[3])
return 1
""",
}
#: The guard key the ``held`` floor looks at (one holder, taken before the sends).
HELD_KEY = "dramatiq-guard:{dedup:bench-floor-held}:"


def hold_floor_key(broker: RedisBroker) -> None:
    """Give the ``held`` floor's key (:data:`HELD_KEY`) its holder (again after a flush)."""
    broker.client.zadd(HELD_KEY + "holders", {"bench-holder": 2**50})


def fuse_floors(broker: RedisBroker, floors: dict[str, str]) -> None:
    """Make ``broker`` enqueue the messages of each queue of ``floors`` (queue name -> a name of
    :data:`FLOORS`) with that floor's script instead of its own: a plain send that does the least a
    one-step guarded send of that kind must do (a new guard key each send, but ``held``'s:
    :data:`HELD_KEY`)."""
    scripts = {queue: broker.client.register_script(FLOORS[floor]) for queue, floor in floors.items()}
    enqueue = broker.do_enqueue
    fields = ("holders", "waiters", "reserved", "limit", "token", "info")

    def do_enqueue(queue: str, message_id: str, data: bytes) -> Any:
        script = scripts.get(queue)
        if script is None:
            return enqueue(queue, message_id, data)
        full = f"{broker.namespace}:{queue}"
        held = floors[queue] == "held"
        prefix = HELD_KEY if held else f"dramatiq-guard:{{dedup:bench-floor:{message_id}}}:"
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
    * send rate, one-step floors: a plain send whose enqueue script also does the least a lock on a
      free key writes, or the least a duplicate reads (and pushes nothing), or the least a
      reservation at send writes (:data:`FLOORS`): what the accepted, duplicate and concurrency
      sends are read against when no Python of the guard's ran (the budgets are against the plain
      send; a budget its floor misses is out of reach on the machine).
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

    floors: dict[str, Any] = {}
    for floor in FLOORS:
        name = f"bench_{floor}_floor"

        @dramatiq.actor(broker=broker, actor_name=name, queue_name=name, max_retries=0)
        def floor_actor(i: int) -> None:
            """Never runs: no worker consumes the floors' queues."""

        floors[floor] = floor_actor

    fuse_floors(broker, {actor.queue_name: floor for floor, actor in floors.items()})

    noop = broker.client.register_script("return 1")

    n_send = ctx.n(5000, 300)
    n_count = ctx.n(500, 50)

    sends: dict[str, Callable[[int], object]] = {
        "plain": lambda i: plain.send(i),
        "accepted": lambda i: guarded.send(i),
        "duplicate": lambda i: guarded.send(0),
        "floor": lambda i: (noop(), plain.send(i)),
        "limited": lambda i: limited.send(i),
        "fused": lambda i: floors["lock"].send(i),
        "held": lambda i: floors["held"].send(i),
        "reserved": lambda i: floors["reserve"].send(i),
    }
    rounds = 1 if ctx.quick else SEND_ROUNDS
    runs: dict[str, list[float]] = {name: [] for name in sends}
    for name, send in in_turns(list(sends.items()), rounds):  # drift falls on all alike
        setup = functools.partial(hold_floor_key, broker) if name == "held" else None
        runs[name].append(ctx.send_rate(send, n_send, setup=setup, repeats=1))
    rate = {name: statistics.median(runs[name]) for name in sends}
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
            rate["plain"],
            "msg/s",
            vs="baseline/send_rate",
            detail=sized,
        ),
        Figure(
            "send_rate",
            "send rate, accepted (a new key each send)",
            rate["accepted"],
            "msg/s",
            vs="dedup/plain_send_rate",
            detail=sized,
        ),
        Figure(
            "duplicate_send_rate",
            "send rate, duplicates (one key)",
            rate["duplicate"],
            "msg/s",
            vs="dedup/plain_send_rate",
            detail=sized,
        ),
        Figure(
            "concurrency_send_rate",
            "send rate, concurrency under its limit (a slot reserved at each send)",
            rate["limited"],
            "msg/s",
            vs="dedup/plain_send_rate",
            detail=f"{sized}; limit 10 on each of 1,000 keys, at most 5 sends a key per run",
        ),
        Figure(
            "fused_floor_send_rate",
            "send rate, one-step floor: a plain send whose script also writes a lock",
            rate["fused"],
            "msg/s",
            vs="dedup/plain_send_rate",
            detail=f"{sized}; the 6 commands a lock on a free key runs, in Dramatiq's enqueue, no guard code",
        ),
        Figure(
            "held_floor_send_rate",
            "send rate, duplicate floor: a send whose script only looks at a held lock",
            rate["held"],
            "msg/s",
            vs="dedup/plain_send_rate",
            detail=f"{sized}; Dramatiq's enqueue, its script running the 3 commands a duplicate runs, "
            "pushing nothing; no guard code",
        ),
        Figure(
            "reserve_floor_send_rate",
            "send rate, reservation floor: a plain send whose script also reserves a slot",
            rate["reserved"],
            "msg/s",
            vs="dedup/plain_send_rate",
            detail=f"{sized}; the 8 commands a reservation of a free slot runs, in Dramatiq's enqueue, "
            "no guard code",
        ),
        Figure(
            "floor_send_rate",
            "send rate, floor: a plain send after a no-op script",
            rate["floor"],
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
