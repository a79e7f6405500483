"""The smallest example: one guarded actor on a RedisBroker.

``dramatiq_guard.install(broker)`` adds the guard's middlewares, before any actor is declared;
an actor then opts in with an actor option. Here ``dedup="until_executed"``: while a greeting
for a name is queued or running, another send for the same name is not enqueued (``send()``
returns normally and ``deduplicated_by()`` names the message that holds the lock).

Run a worker, then send it messages (from the repository root)::

    .venv/bin/dramatiq examples.basic
    .venv/bin/python -m examples.basic

Without a worker running, the first greeting stays queued, so every later send is deduplicated
until a worker has run it. Redis is ``DRAMATIQ_GUARD_REDIS_URL``, else ``redis://localhost:6379/0``.
"""

from __future__ import annotations

import os

import dramatiq
from dramatiq.brokers.redis import RedisBroker

import dramatiq_guard

REDIS_URL = os.environ.get("DRAMATIQ_GUARD_REDIS_URL", "redis://localhost:6379/0")

broker = RedisBroker(url=REDIS_URL)
dramatiq_guard.install(broker)  # the guard's middlewares, before any actor is declared
dramatiq.set_broker(broker)


@dramatiq.actor(dedup="until_executed")
def greet(name: str) -> None:
    print(f"hello, {name}")


if __name__ == "__main__":
    for _ in range(3):
        message = greet.send("world")
        holder = dramatiq_guard.deduplicated_by(message)
        if holder is None:
            print(f"greet('world'): enqueued as {message.message_id}")
        else:
            print(f"greet('world'): deduplicated, {holder} is queued or running")
