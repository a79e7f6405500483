"""Helper processes (and the shared contention loop) for ``tests/test_backend_contract.py``.

Run as ``python backend_procs.py MODE REDIS_URL NAMESPACE HANDOFF_TTL_MS KEY [ARGS...]``; each mode prints one
JSON line per step on stdout (the test reads them) and, where the test kills it, then blocks.

Modes:
  contend KEY LIMIT THREADS ROUNDS  run :func:`contend` on Redis, print {"max", "count", "tokens"};
                                    holders count themselves in ``test:{KEY}:inside`` and log
                                    their tokens in ``test:{KEY}:tokens``
  hold KEY HOLDER TTL_MS            acquire, register with the process's renewer, print
                                    {"token", "deadline"}, then block (the test SIGKILLs it)
  woken KEY WAITER                  queue WAITER as a blocking waiter (limit 1), print {"queued"};
                                    wait for the hand-off, print {"token"} and block before its
                                    lease is renewed (the test SIGKILLs it)
  handoff KEY HOLDER LIMIT STAGE    release HOLDER, print the hand-offs; with STAGE "confirmed",
                                    re-enqueue (nothing to do here) and confirm them, print
                                    {"confirmed"}; then block (the test SIGKILLs it)
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from dramatiq_guard.backends import GuardBackend, RedisBackend, Stake, Waiter


def contend(
    backend: GuardBackend,
    key: str,
    *,
    limit: int,
    threads: int,
    rounds: int,
    enter: Callable[[int], int],
    leave: Callable[[], object],
) -> dict[str, Any]:
    """Have ``threads`` threads take a slot of ``key`` ``rounds`` times each, as blocking waiters.

    ``enter`` is called with the fencing token right after acquiring and returns how many
    holders are inside (counting this one); ``leave`` right before releasing. Returns the
    largest count seen, how many times a slot was taken, and the fencing tokens.
    """
    seen: list[int] = []
    tokens: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        try:
            for _ in range(rounds):
                holder = uuid.uuid4().hex
                result = backend.acquire(
                    Stake(key, holder, limit=limit, ttl_ms=30_000), wait=Waiter(wait_ms=30_000)
                )
                while not result.acquired:
                    woken = backend.wait_for_handoff(key, holder, timeout_ms=30_000)
                    if woken is None:
                        raise AssertionError(f"{holder} was never woken")
                    result = woken.result(limit)  # the slot and token came with the wake
                assert result.token is not None
                inside = enter(result.token)
                time.sleep(0.001)  # the work done under the slot
                leave()
                with lock:
                    seen.append(inside)
                    tokens.append(result.token)
                if not backend.release(key, holder, limit=limit).released:
                    raise AssertionError(f"{holder} could not release its slot")
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return {"max": max(seen), "count": len(seen), "tokens": tokens}


def _emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main(argv: list[str]) -> None:
    mode, url, namespace, handoff_ttl, key, *args = argv
    backend = RedisBackend.from_url(url, namespace=namespace, handoff_ttl_ms=int(handoff_ttl))
    if mode == "contend":
        limit, threads, rounds = (int(a) for a in args)
        counter, log = f"test:{{{key}}}:inside", f"test:{{{key}}}:tokens"
        client = backend.client

        def enter(token: int) -> int:
            # Count the holders inside, and log the token while holding the slot (with a
            # limit of 1 the log is in acquisition order across every process).
            pipe = client.pipeline(transaction=False)
            pipe.incr(counter)
            pipe.rpush(log, token)
            return int(pipe.execute()[0])

        _emit(
            **contend(
                backend,
                key,
                limit=limit,
                threads=threads,
                rounds=rounds,
                enter=enter,
                leave=lambda: client.decr(counter),
            )
        )
    elif mode == "hold":
        from dramatiq_guard.renewer import get_renewer

        holder, ttl = args[0], int(args[1])
        result = backend.acquire(Stake(key, holder, limit=1, ttl_ms=ttl))
        assert result.acquired
        get_renewer().register(backend, key, holder, ttl)
        _emit(token=result.token, deadline=dict(backend.inspect(key).holders)[holder])
        threading.Event().wait()
    elif mode == "woken":
        waiter = args[0]
        queued = backend.acquire(Stake(key, waiter, limit=1, ttl_ms=60_000), wait=Waiter(wait_ms=60_000))
        assert queued.parked
        _emit(queued=True)
        woken = backend.wait_for_handoff(key, waiter, timeout_ms=60_000)
        assert woken is not None
        _emit(token=woken.token)
        threading.Event().wait()
    elif mode == "handoff":
        holder, limit, stage = args[0], int(args[1]), args[2]
        released = backend.release(key, holder, limit=limit)
        _emit(
            released=released.released,
            handoffs=[
                [h.waiter_id, None if h.payload is None else h.payload.decode()] for h in released.handoffs
            ],
        )
        if stage == "confirmed":
            # The payloads would be re-enqueued on the broker here.
            confirmed = [backend.confirm_handoff(key, h.waiter_id, ttl_ms=60_000) for h in released.handoffs]
            _emit(confirmed=confirmed)
        threading.Event().wait()
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
