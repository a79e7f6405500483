"""GitLab's "refresh a user's authorizations" job, deduplicated with ``dedup="until_executing"``.

GitLab recomputes a user's project authorizations whenever something that may
change them happens: a membership added, a group moved, a project shared... A
burst of such events enqueues the same job many times for one user, and all but
one run would redo identical work. A change that arrives *while* the job runs,
though, must cause one more run: the running job may already have read the old
memberships.

``until_executing`` gives exactly that: the lock is held from the first send
until that message starts. Every send in between is dropped (``send()``
returns normally and names the message it was folded into); once the job has
started, the next send is enqueued again and runs after it.

Run a worker, then the producer (from the repository root)::

    .venv/bin/dramatiq examples.authorizations
    .venv/bin/python -m examples.authorizations

Redis is ``DRAMATIQ_GUARD_REDIS_URL``, else ``redis://localhost:6379/0``.
"""

from __future__ import annotations

import os
import time

import dramatiq
from dramatiq.brokers.redis import RedisBroker

import dramatiq_guard
from dramatiq_guard.middleware.dedup import deduplicated_by

REDIS_URL = os.environ.get("DRAMATIQ_GUARD_REDIS_URL", "redis://localhost:6379/0")

broker = RedisBroker(url=REDIS_URL)
dramatiq_guard.install(broker)  # before the actors are declared
dramatiq.set_broker(broker)


@dramatiq.actor(dedup={"strategy": "until_executing", "key": ["user_id"]}, queue_name="authorizations")
def refresh_authorizations(user_id: int, reason: str = "") -> None:
    """Recompute ``user_id``'s project authorizations (here: pretend to, for a second)."""
    print(f"refreshing the authorizations of user {user_id} (first reason: {reason or '-'})", flush=True)
    time.sleep(1)  # the expensive part: read memberships, rewrite the authorization rows
    print(f"refreshed user {user_id}", flush=True)


def on_membership_change(user_id: int, reason: str) -> None:
    """What every code path that may change a user's authorizations calls."""
    message = refresh_authorizations.send(user_id, reason=reason)
    holder = deduplicated_by(message)
    if holder is None:
        print(f"{reason}: enqueued {message.message_id}")
    else:
        print(f"{reason}: already queued as {holder}")


if __name__ == "__main__":
    # A burst from many places: one job is enqueued, the rest are folded into it
    # (the key is user_id only, so the differing reasons do not matter).
    for event in ("member added", "group moved", "project shared", "role changed", "member added"):
        on_membership_change(42, event)
    print("Start a worker: one refresh runs for the burst. A change sent while it runs is enqueued")
    print("again (the lock went when the job started) and runs once after it.")
