"""Two limits on one actor: at most six calls to a partner at once in all, and two per tenant.

Run a worker, then send (from the repository root)::

    .venv/bin/dramatiq examples.tenants --processes 2 --threads 8
    .venv/bin/python -m examples.tenants

Forty calls of four tenants are sent at once. A call runs only when both limits admit it: the
first tenant's burst cannot take the six slots of all, and a call that one limit refuses waits
parked on that limit's key, holding no slot of the other (docs/slots.md, "Several limits on one
actor"). Each run prints how many run now in all and for its tenant.

Redis is ``DRAMATIQ_GUARD_REDIS_URL``, else ``redis://localhost:6379/0``.
"""

from __future__ import annotations

import collections
import os
import threading
import time

import dramatiq
from dramatiq.brokers.redis import RedisBroker

import dramatiq_guard

REDIS_URL = os.environ.get("DRAMATIQ_GUARD_REDIS_URL", "redis://localhost:6379/0")

broker = RedisBroker(url=REDIS_URL)
dramatiq_guard.install(broker)  # before any actor is declared
dramatiq.set_broker(broker)

running: collections.Counter[str] = collections.Counter()  # this process's runs (a worker's)
lock = threading.Lock()


@dramatiq.actor(
    concurrency=[
        {"limit": 6, "key": lambda tenant, call: "partner"},  # six at once in all
        {"limit": 2, "key": ["tenant"]},  # two at once per tenant
    ]
)
def call_partner(tenant: str, call: int) -> None:
    with lock:
        running["all"] += 1
        running[tenant] += 1
        print(f"{tenant} call {call}: {running[tenant]} of {tenant}'s, {running['all']} in this process")
    time.sleep(0.5)  # the partner's answer
    with lock:
        running["all"] -= 1
        running[tenant] -= 1


if __name__ == "__main__":
    for tenant in ("acme", "globex", "initech", "umbrella"):
        for call in range(10):
            call_partner.send(tenant, call)
