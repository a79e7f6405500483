"""Webhooks: at most 10 deliveries at a time per customer, many customers, a limit changed live.

Run a worker, then send (from the repository root)::

    .venv/bin/dramatiq examples.webhooks --processes 2 --threads 25
    .venv/bin/python -m examples.webhooks

Each customer's server gets at most 10 concurrent deliveries, whatever the number of worker
threads; the deliveries over the limit park in the customer's lockwait area (they cost no
broker pickup and hold no thread) and start, oldest first, as slots free. Halfway through, the
script lowers customer 7's limit to 2 (slow server), then lifts it again; the same is possible
from the command line::

    dramatiq-guard limit set concurrency:webhooks:7 2 --broker examples.webhooks:broker

Redis is ``DRAMATIQ_GUARD_REDIS_URL``, else ``redis://localhost:6379/0``.
"""

from __future__ import annotations

import os
import random
import time

import dramatiq
from dramatiq.brokers.redis import RedisBroker

import dramatiq_guard
from dramatiq_guard.middleware.slots import Concurrency

REDIS_URL = os.environ.get("DRAMATIQ_GUARD_REDIS_URL", "redis://localhost:6379/0")

broker = RedisBroker(url=REDIS_URL)
dramatiq_guard.install(broker)  # before any actor is declared
dramatiq.set_broker(broker)
concurrency = next(m for m in broker.middleware if isinstance(m, Concurrency))


@dramatiq.actor(
    concurrency={"limit": 10, "key": lambda customer_id, payload: f"webhooks:{customer_id}"},
    max_retries=5,
)
def deliver_webhook(customer_id: int, payload: dict[str, object]) -> None:
    lease = dramatiq_guard.current_lease()
    time.sleep(random.uniform(0.05, 0.2))  # the HTTP call
    print(f"delivered {payload['event']} to customer {customer_id} (slot token {lease.token})")


if __name__ == "__main__":
    for n in range(200):
        deliver_webhook.send(n % 20, {"event": f"order.{n}"})
    concurrency.set_limit("webhooks:7", 2)  # customer 7's server is struggling
    time.sleep(3)
    concurrency.set_limit("webhooks:7", None)  # back to the declared 10: its waiters start at once
