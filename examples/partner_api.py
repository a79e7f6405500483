"""A partner API that allows three calls a second: a throttle that parks what is over the limit.

Run a worker, then send (from the repository root)::

    .venv/bin/dramatiq examples.partner_api --processes 2 --threads 8
    .venv/bin/python -m examples.partner_api

Thirty calls are sent at once; three start in any second, whatever the number of worker threads,
and the rest wait parked in the key's lockwait area (no broker pickup, no retry consumed) until
the window lets them in, oldest first. Halfway, the limit is raised to ten a second from here;
the same is possible from the command line::

    dramatiq-guard limit set throttle:partner-api 10 --broker examples.partner_api:broker

Redis is ``DRAMATIQ_GUARD_REDIS_URL``, else ``redis://localhost:6379/0``.
"""

from __future__ import annotations

import os
import time

import dramatiq
from dramatiq.brokers.redis import RedisBroker

import dramatiq_guard

REDIS_URL = os.environ.get("DRAMATIQ_GUARD_REDIS_URL", "redis://localhost:6379/0")

broker = RedisBroker(url=REDIS_URL)
dramatiq_guard.install(broker)  # before any actor is declared
dramatiq.set_broker(broker)
throttle = next(m for m in broker.middleware if isinstance(m, dramatiq_guard.Throttle))


@dramatiq.actor(throttle={"limit": 3, "period": 1_000, "key": lambda order_id: "partner-api"})
def sync_order(order_id: int) -> None:
    print(f"{time.strftime('%H:%M:%S')} synced order {order_id}")


if __name__ == "__main__":
    for order_id in range(30):
        sync_order.send(order_id)
    time.sleep(4)
    throttle.set_limit("partner-api", 10)  # the partner raised our quota
