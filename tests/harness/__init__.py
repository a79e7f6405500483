"""Test helpers for dramatiq-guard: real services, real workers, waiting by events.

``tests/`` is on ``sys.path`` (``tests/conftest.py`` puts it there, and the
``dramatiq_worker`` fixture puts it on the workers' ``PYTHONPATH``), so both
tests and actor modules import this package as ``harness``::

    from harness import Recorder, Gate, broker_from_env, wait_until

Nothing here imports pytest: the bench (``bench/``) uses it too. The pytest
fixtures live in ``tests/conftest.py``.
"""

from .env import (
    BROKER_URL_ENV,
    GUARD_REDIS_URL_ENV,
    MARIADB_URL_ENV,
    POSTGRES_URL_ENV,
    RABBITMQ_URL_ENV,
    REDIS_URL_ENV,
    broker_from_env,
    broker_url_from_env,
    in_ci,
    redis_client_from_env,
    redis_url_from_env,
    unavailable,
)
from .fake_clock import FakeClock, SettableClock, fakeredis_clock, libfaketime, model_clock
from .models import MarksFailure, ModelBudget
from .proxy import SilentProxy
from .recorder import Gate, Recorder
from .redis_server import REDIS_SERVER_ENV, RedisServer, free_port, redis_server_executable
from .waiting import (
    WaitTimeout,
    guard_leftovers,
    redis_broker_dead,
    redis_broker_pending,
    wait_for_redis_broker_drain,
    wait_until,
)
from .worker import DramatiqWorker, WorkerFailed, pid_alive

__all__ = [
    "BROKER_URL_ENV",
    "GUARD_REDIS_URL_ENV",
    "MARIADB_URL_ENV",
    "POSTGRES_URL_ENV",
    "RABBITMQ_URL_ENV",
    "REDIS_SERVER_ENV",
    "REDIS_URL_ENV",
    "DramatiqWorker",
    "FakeClock",
    "Gate",
    "MarksFailure",
    "ModelBudget",
    "Recorder",
    "RedisServer",
    "SettableClock",
    "SilentProxy",
    "WaitTimeout",
    "WorkerFailed",
    "broker_from_env",
    "broker_url_from_env",
    "fakeredis_clock",
    "free_port",
    "guard_leftovers",
    "in_ci",
    "libfaketime",
    "model_clock",
    "pid_alive",
    "redis_broker_dead",
    "redis_broker_pending",
    "redis_client_from_env",
    "redis_server_executable",
    "redis_url_from_env",
    "unavailable",
    "wait_for_redis_broker_drain",
    "wait_until",
]
