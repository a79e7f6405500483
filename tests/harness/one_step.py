"""What the one-step send tests share: the server's command counts, and a middleware that records
the enqueue hooks each message gets."""

from __future__ import annotations

from typing import Any

import redis
from dramatiq.middleware import Middleware


def command_counts(client: redis.Redis) -> dict[str, int]:
    """The server's command counts by name (INFO commandstats)."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): entry["calls"] for name, entry in stats.items()}


class EnqueueHooks(Middleware):
    """Records the enqueue hooks each message id gets, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        self.seen.append(("before", message.message_id))

    def after_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        self.seen.append(("after", message.message_id))
