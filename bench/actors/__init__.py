"""Actor modules that the bench's worker subprocesses import (``python -m dramatiq bench.actors.X``).

They find Redis through ``BENCH_REDIS_URL`` (set by the bench for itself and its workers).
"""

from __future__ import annotations

import os
import time

import redis

REDIS_URL_ENV = "BENCH_REDIS_URL"


def redis_url() -> str:
    url = os.environ.get(REDIS_URL_ENV)
    if not url:
        raise RuntimeError(f"{REDIS_URL_ENV} is not set: bench actor modules run under `python -m bench`")
    return url


def finish_key(run_id: str) -> str:
    return f"bench:finished:{run_id}"


def cross_finish_line(client: redis.Redis, run_id: str, total: int) -> None:
    """Count one completion of run ``run_id``; the ``total``-th pushes its time.time() for the bench.

    One INCR per completion (plus one RPUSH for the last): the same cost in every
    scenario, so ratios are unaffected.
    """
    if int(client.incr(f"bench:done:{run_id}")) == total:
        client.rpush(finish_key(run_id), repr(time.time()))
