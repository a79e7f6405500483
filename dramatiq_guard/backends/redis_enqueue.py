"""A guard decision and the RedisBroker's push in one script, where the broker shares the guard's Redis.

Dramatiq's queue layout (a message hash ``<namespace>:<queue>.msgs``, a list of ids) is not a public
contract: a broker is trusted with it only on a Dramatiq version the tests pin (:data:`KNOWN_DRAMATIQ`)
*and* once a probe passed (:func:`probe`); anything else takes two steps (lock, then the broker's push).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import dramatiq
import redis
from dramatiq import Broker, Message

from dramatiq_guard.errors import BackendUnavailable

logger = logging.getLogger("dramatiq_guard.backends.redis")

#: The Dramatiq versions (major.minor) whose RedisBroker layout the tests pin.
KNOWN_DRAMATIQ = ("1.17", "1.18", "2.0", "2.1", "2.2")


def queue_keys(broker: Any, queue_name: str) -> tuple[str, str]:
    """The broker's list and message hash of ``queue_name`` (a delay queue's name included)."""
    full = f"{broker.namespace}:{queue_name}"
    return full, f"{full}.msgs"


def shares_server(broker: Broker, client: Any) -> bool:
    """Whether ``broker`` is a RedisBroker on ``client``'s server and database."""
    try:
        from dramatiq.brokers.redis import RedisBroker
    except ImportError:  # pragma: no cover - the redis extra of dramatiq is missing
        return False
    if not isinstance(broker, RedisBroker) or broker.client is client:
        return isinstance(broker, RedisBroker)
    theirs: Any = broker.client
    try:
        a, b = client.connection_pool.connection_kwargs, theirs.connection_pool.connection_kwargs
    except AttributeError:
        return False
    return type(client) is type(theirs) and all(a.get(n) == b.get(n) for n in ("host", "port", "path", "db"))


def refusal(broker: Any, push: Any) -> str | None:
    """Why ``broker``'s queue layout is not trusted (its Dramatiq version, else :func:`probe`), or None."""
    if ".".join(dramatiq.__version__.split(".")[:2]) not in KNOWN_DRAMATIQ:
        return f"Dramatiq {dramatiq.__version__}'s queue layout is not one the guard knows"
    return probe(broker, push)


def probe(broker: Any, push: Any) -> str | None:
    """Write two messages with ``push`` and have ``broker`` fetch, ack and dead-letter them.

    ``push(queue_name, message_id, data)`` writes one message the one-step way. Returns None if
    the broker handled both like its own, else what went wrong. Leaves nothing behind.

    Raises:
      BackendUnavailable: Redis could not be reached: nothing was learnt (ask again later).
    """
    queue = f"dramatiq-guard-probe-{uuid.uuid4().hex}"
    keys = [*queue_keys(broker, queue), *queue_keys(broker, f"{queue}.XQ")]
    try:
        for finish in ("ack", "nack"):
            message: Message[Any] = Message(queue, "probe", (), {}, {"redis_message_id": str(uuid.uuid4())})
            rid, data = message.options["redis_message_id"], message.encode()
            push(queue, rid, data)
            fetched = broker.do_fetch(queue, 1)
            if [bytes(f) if isinstance(f, (bytes, bytearray)) else f.encode() for f in fetched] != [data]:
                return f"the broker fetched {fetched!r}, not the message written"
            getattr(broker, f"do_{finish}")(queue, rid)
        if broker.client.hlen(keys[1]) or broker.client.llen(keys[0]):
            return "the broker's ack left the message in its queue"
        if not broker.client.hexists(keys[3], rid):
            return "the broker's nack did not dead-letter the message"
        return None
    except (BackendUnavailable, redis.ConnectionError, redis.TimeoutError):
        raise
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        try:
            broker.client.delete(*keys)
        except Exception:
            logger.debug("Could not delete the probe's keys %r.", keys, exc_info=True)
