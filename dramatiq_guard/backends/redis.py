"""The Redis guard backend: each operation is one Lua script on one Cluster slot (``docs/redis.md``)."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any, cast

from dramatiq_guard.backends import redis_enqueue
from dramatiq_guard.backends import redis_layout as layout
from dramatiq_guard.backends.checks import check_acquire, check_count, check_key, check_ms
from dramatiq_guard.backends.redis_client import ScriptCall, reachable, run_scripts, text
from dramatiq_guard.backends.redis_store import RedisStore, handoffs_of, release_of
from dramatiq_guard.backends.values import (
    HOLDERS_SHOWN,
    AcquireOutcome,
    AcquireResult,
    Due,
    Enqueue,
    Handoff,
    ReleaseResult,
    Stake,
    Waiter,
    Woken,
)

#: The most leases one ``renew.lua`` call renews (:meth:`RedisBackend.renew_many`).
RENEWALS_PER_CALL = 200


class RedisBackend(RedisStore):
    """The guard backend on Redis (or Redis Cluster).

    Each mutating operation is one Lua script: a function of the guard's library (FCALL) where
    the server allows, else EVALSHA (:mod:`~dramatiq_guard.backends.redis_scripts`). Works with
    clients made with or without ``decode_responses`` (with it, parked payloads must be UTF-8,
    as Dramatiq's JSON is). Every operation raises
    :class:`~dramatiq_guard.errors.BackendUnavailable` if Redis cannot be reached (or refuses
    writes when full).

    Parameters:
      client(Redis|RedisCluster): The redis-py client. It is not closed by
        :meth:`close` (it may be shared, e.g. with a RedisBroker); :meth:`from_url` makes one.
      namespace(str): The prefix of every key; must not contain braces.
      index_grace_ms(int): On a Redis Cluster only: how long an entry of the waiting-keys
        index is kept after its key has no waiter left (``docs/redis.md``). It must exceed the
        clock skew between clients plus the longest a park can be in flight.
      replica_waits(int): How many replicas must acknowledge every decision before it stands
        (Redis ``WAIT`` after each script, on its connection). 0 (the default): none, and a
        failover may lose the decisions of its last moments (``docs/redis.md``, "Failover").
      replica_wait_timeout_ms(int): How long the primary waits for them; fewer in time fail
        the operation closed (:class:`~dramatiq_guard.errors.ReplicasBehind`). Keep it below
        the client's ``socket_timeout``.
      **settings: ``handoff_ttl_ms``, ``max_payload_bytes``, ``stale_ttl_ms``, as for
        :class:`~dramatiq_guard.backends.GuardBackend`.

    Raises:
      ValueError: If ``namespace`` is empty or contains a brace, or a setting is out of range.
    """

    #: How many keys :meth:`sweep_many` sends in one pipelined round trip.
    SWEEP_BATCH = 100

    @staticmethod
    def _check_waiter(waiter_id: str) -> None:
        if "}" in waiter_id:
            raise ValueError(f"a waiter id must not contain '}}', got {waiter_id!r}")

    def _acquire_reply(self, key: str, reply: list[Any], sent: float) -> AcquireResult:
        """Decode acquire.lua's ``{acquired, token, limit, queued, holders, handoffs[, lapses_in_ms]}``."""
        acquired, token, in_force, queued, holders, handoffs, *lapses_in = reply
        outcome = AcquireOutcome.ACQUIRED if acquired else AcquireOutcome.refusal(text(queued))
        return AcquireResult(
            outcome,
            token=None if token is None else int(token),
            holders=tuple(text(h) for h in holders) if holders else (),
            limit=int(in_force),
            handoffs=handoffs_of(key, handoffs) if handoffs else (),
            valid_from=sent,
            lapses_in_ms=int(lapses_in[0]) if lapses_in else None,
        )

    def acquire(self, stake: Stake, wait: Waiter | None = None) -> AcquireResult:
        own = self._acquire_args(stake, wait)
        key = stake.key
        index = (self._index, key) if wait is not None and self._in_cluster() else None  # the entry first
        sent = time.monotonic()  # the result's valid_from: Redis counts the ttl from later
        call = self._script_call(key, stake.limit, own)
        [reply] = run_scripts(
            self.client, self.scripts, [call], zadd_first=index, replicas=self.replicas, own=self.clients
        )
        return self._acquire_reply(key, reply, sent)

    def acquire_many(self, stakes: Sequence[Stake]) -> list[AcquireResult]:
        """The acquires in one pipeline (one per node on a Redis Cluster)."""
        if not stakes:
            return []
        calls = [self._script_call(s.key, s.limit, self._acquire_args(s, None)) for s in stakes]
        sent = time.monotonic()
        replies = run_scripts(self.client, self.scripts, calls, replicas=self.replicas, own=self.clients)
        return [self._acquire_reply(s.key, reply, sent) for s, reply in zip(stakes, replies, strict=True)]

    def reserve_and_enqueue(self, stake: Stake, push: Enqueue) -> AcquireResult | None:
        """``lua/acquire.lua`` with the push (on a standalone Redis only: the queue is in another slot)."""
        own = self._acquire_args(stake, Waiter(payload=push.data))
        if self._in_cluster():
            return None
        key = stake.key
        script, args = self.scripts["acquire"], self._args(stake.limit, *own)
        sent = time.monotonic()
        reply = self._call(script, self._keys_with_push(key, push), [*args, push.message_id])
        return self._acquire_reply(key, reply, sent)

    def _keys_with_push(self, key: str, push: Enqueue) -> list[str]:
        """The KEYS of a per-key script that pushes to the broker (a standalone Redis only): the key's
        prefix, the index keys (``INDEX_KEYS``), then the broker queue's list and message hash."""
        queue = redis_enqueue.queue_keys(push.broker, push.queue_name)
        return [self._prefix(key), self._index, self._limits_index, *queue]

    def _acquire_args(self, stake: Stake, wait: Waiter | None) -> layout.AcquireArgs:
        """acquire.lua's own arguments, checked (the errors of :meth:`GuardBackend.acquire`)."""
        check_acquire(stake, wait)
        self.check_payload(stake.key, stake.holder, wait)
        if wait is not None:
            self._check_waiter(stake.holder)
        return layout.AcquireArgs(
            holder=stake.holder,
            ttl_ms=stake.ttl_ms,
            mode="" if wait is None else "park" if wait.payload is not None else "block",
            payload=b"" if wait is None or wait.payload is None else wait.payload,
            wait_ms=0 if wait is None else wait.wait_ms,
            info=stake.info or "",
            generation=_generation(stake.generation),
            fenced="1" if stake.fenced else "0",
            runner=stake.runner or "",
            priority=stake.priority,
        )

    def try_lock(self, key: str, holder: str, *, ttl_ms: int, info: str | None = None) -> AcquireResult:
        """``lua/lock.lua`` decides a free key and one held by another; the rest goes to :meth:`acquire`."""
        decided = self.lock_and_enqueue(key, holder, ttl_ms=ttl_ms, info=info or "", push=None)
        if decided is None:
            return self.acquire(Stake(key, holder, 1, ttl_ms, info=info, fenced=False))
        return decided

    def enqueues_on(self, broker: Any) -> bool:
        """Yes for a RedisBroker on this server and database whose layout the guard knows (decided once
        per broker: :mod:`~dramatiq_guard.backends.redis_enqueue`), never with replica waits."""
        known = self._enqueues.get(id(broker))
        if known is not None and known[0] is broker:
            return known[1]
        if not redis_enqueue.shares_server(broker, self.client) or self.replicas:
            self._enqueues[id(broker)] = (broker, False)
            return False
        with reachable():  # unreachable: raised, and asked again on the next send
            reason = redis_enqueue.refusal(broker, functools.partial(self._probe_push, broker))
        if reason is not None:
            redis_enqueue.logger.warning(
                "dramatiq-guard: a send's guard decision and its push take two steps on this broker: %s.",
                reason,
            )
        self._enqueues[id(broker)] = (broker, reason is None)
        return reason is None

    def _probe_push(self, broker: Any, queue: str, rid: str, data: bytes) -> None:
        push = Enqueue(broker, queue, rid, data)
        result = self.lock_and_enqueue(f"probe:{rid}", rid, ttl_ms=1_000, info="probe", push=push)
        if result is None or not result.acquired:
            raise RuntimeError("the probe's lock was not taken")
        self.release(f"probe:{rid}", rid, limit=1)

    def lock_and_enqueue(
        self, key: str, holder: str, *, ttl_ms: int, info: str, push: Enqueue | None
    ) -> AcquireResult | None:
        """Run ``lua/lock.lua`` (with ``push``: the broker's push too); None: not decided there."""
        check_ms(ttl_ms, "ttl_ms")
        sent = time.monotonic()
        keys: list[str] = [self._prefix(key)]
        args: list[Any] = [holder, ttl_ms, info]  # layout.LockArgs
        if push is not None:
            keys += redis_enqueue.queue_keys(push.broker, push.queue_name)
            args += (push.message_id, push.data)
        status, holders = self._call(self.scripts["lock"], keys, args)
        if int(status) < 0:
            return None
        if int(status) == 1:
            return AcquireResult(AcquireOutcome.ACQUIRED, token=None, holders=(), limit=1, valid_from=sent)
        shown = [text(h) for h in holders[:HOLDERS_SHOWN]]
        return AcquireResult(AcquireOutcome.BUSY, token=None, holders=tuple(shown), limit=1, valid_from=sent)

    def renew(self, key: str, holder: str, *, ttl_ms: int) -> bool:
        return self.renew_many([(key, holder, ttl_ms)])[0]

    def renew_many(self, leases: Sequence[tuple[str, str, int]]) -> list[bool]:
        """Up to :data:`RENEWALS_PER_CALL` leases per ``renew.lua`` call (on a Cluster: of one key)."""
        groups: dict[str, list[int]] = {}
        for i, (key, _, ttl_ms) in enumerate(leases):
            check_ms(ttl_ms, "ttl_ms", minimum=0)
            groups.setdefault(key if self._in_cluster() else "", []).append(i)
        chunks = [
            g[s : s + RENEWALS_PER_CALL] for g in groups.values() for s in range(0, len(g), RENEWALS_PER_CALL)
        ]
        calls: list[ScriptCall] = []
        for chunk in chunks:
            keys = [self._prefix(leases[i][0]) for i in chunk]
            args = [arg for i in chunk for arg in layout.LeaseArgs(holder=leases[i][1], ttl_ms=leases[i][2])]
            calls.append((self.scripts["renew"], keys, args))
        renewed = [False] * len(leases)
        replies = (
            run_scripts(self.client, self.scripts, calls, replicas=self.replicas, own=self.clients)
            if calls
            else []
        )
        for chunk, reply in zip(chunks, replies, strict=True):
            for i, answer in zip(chunk, reply, strict=True):
                renewed[i] = bool(answer)
        return renewed

    def release(self, key: str, holder: str, *, limit: int | None, send_ahead: int = 0) -> ReleaseResult:
        return release_of(key, self._call(*self._release_call(key, holder, limit, send_ahead)))

    def release_many(self, releases: Sequence[tuple[str, str, int | None, int]]) -> list[ReleaseResult]:
        if not releases:
            return []
        calls = [self._release_call(*release) for release in releases]
        replies = run_scripts(self.client, self.scripts, calls, replicas=self.replicas, own=self.clients)
        return [release_of(key, reply) for (key, *_), reply in zip(releases, replies, strict=True)]

    def give_back(self, key: str, holder: str, *, limit: int | None) -> ReleaseResult:
        own = layout.ReleaseArgs(holder=holder, standbys=0, reserved_only="1")
        return release_of(key, self._call(*self._script_call(key, limit, own)))

    def _release_call(self, key: str, holder: str, limit: int | None, send_ahead: int) -> ScriptCall:
        check_count(send_ahead, "send_ahead")
        return self._script_call(key, limit, layout.ReleaseArgs(holder=holder, standbys=send_ahead))

    def confirm_handoff(
        self, key: str, waiter_id: str, *, ttl_ms: int, generation: int | None = None
    ) -> bool:
        return self._confirm(key, layout.ConfirmArgs("handoff", waiter_id, ttl_ms, _generation(generation)))

    def confirm_standby(
        self, key: str, waiter_id: str, payload: bytes, *, ttl_ms: int, generation: int | None = None
    ) -> bool:
        own = layout.ConfirmArgs("standby", waiter_id, ttl_ms, _generation(generation), payload)
        return self._confirm(key, own)

    def enqueue_and_confirm(
        self, handoff: Handoff, push: Enqueue, *, ttl_ms: int, standby: bool = False
    ) -> bool | None:
        """``lua/confirm.lua`` with the push (on a standalone Redis only: the queue is in another slot)."""
        if self._in_cluster():
            check_ms(ttl_ms, "ttl_ms")
            return None
        own = layout.ConfirmArgs(
            "standby" if standby else "handoff", handoff.waiter_id, ttl_ms, _generation(handoff.generation),
            (handoff.payload or b"") if standby else b"", push.message_id, push.data,
        )  # fmt: skip
        return self._confirm(handoff.key, own, push)

    def _confirm(self, key: str, own: layout.ConfirmArgs, push: Enqueue | None = None) -> bool:
        """``lua/confirm.lua``: a hand-off's or standby's copy is on the broker (pushed first: ``push``)."""
        check_ms(own.ttl_ms, "ttl_ms")
        script, keys, args = self._script_call(key, 0, own)
        return bool(self._call(script, keys if push is None else self._keys_with_push(key, push), args))

    def send_standbys(
        self, key: str, *, limit: int | None, count: int
    ) -> tuple[tuple[Handoff, ...], tuple[Handoff, ...]]:
        check_count(count, "count")
        handoffs, sent = self._run(key, limit, layout.StandbyArgs(count))
        return handoffs_of(key, handoffs), handoffs_of(key, sent)

    def wait_for_handoff(self, key: str, waiter_id: str, *, timeout_ms: int) -> Woken | None:
        """BLPOPs on the waiter's wake list, each ending before the client's ``socket_timeout``."""
        self._check_waiter(waiter_id)
        check_key(key)
        check_ms(timeout_ms, "timeout_ms", minimum=0)
        wake = self._wake_prefix(key) + waiter_id
        # Each BLPOP ends before the socket_timeout in force (less 1 s, or half of it).
        socket_timeout = self.timeouts.socket_timeout
        chunk_s = None if socket_timeout is None else max(socket_timeout - 1.0, socket_timeout / 2)
        give_up = time.monotonic() + timeout_ms / 1000
        with reachable():
            while True:
                remaining = give_up - time.monotonic()
                if remaining < 0.001:  # BLPOP's resolution; 0 would block forever
                    token = cast("bytes | str | None", self.client.lpop(wake))
                    return None if token is None else self.woken(int(token))
                timeout = remaining if chunk_s is None else min(remaining, chunk_s)
                popped = cast("tuple[Any, bytes | str] | None", self.client.blpop([wake], timeout=timeout))
                if popped is not None:
                    return self.woken(int(popped[1]))

    def forget_parked_copy(self, key: str, waiter_id: str) -> bool:
        self._check_waiter(waiter_id)
        return bool(self._run(key, None, layout.ForgetCopyArgs(waiter=waiter_id)))

    def debounce(
        self, key: str, waiter_id: str, payload: bytes, *, wait_ms: int, max_wait_ms: int
    ) -> tuple[tuple[str, ...], int]:
        self._check_waiter(waiter_id)
        check_ms(wait_ms, "wait_ms")
        check_ms(max_wait_ms, "max_wait_ms")
        self.check_payload(key, waiter_id, Waiter(payload=payload))
        own = layout.DebounceArgs("send", waiter_id, payload, wait_ms, max_wait_ms)
        call = self._script_call(key, 1, own)
        index = (self._index, key) if self._in_cluster() else None  # the index entry first, as a park's
        [(superseded, due_in)] = run_scripts(
            self.client, self.scripts, [call], zadd_first=index, replicas=self.replicas, own=self.clients
        )
        return tuple(text(w) for w in superseded), int(due_in)

    def copy_is_live(self, key: str, waiter_id: str, generation: int) -> bool:
        self._check_waiter(waiter_id)
        return bool(self._run(key, None, layout.DebounceArgs("live", waiter_id, generation=generation)))

    def cancel_wait(
        self, key: str, waiter_id: str, *, limit: int | None, generation: int | None = None
    ) -> ReleaseResult:
        self._check_waiter(waiter_id)
        own = layout.CancelWaitArgs(waiter_id, _generation(generation))
        return release_of(key, self._run(key, limit, own))

    def sweep(self, key: str, *, limit: int | None) -> ReleaseResult:
        return release_of(key, self._run(key, limit, layout.SweepArgs()))

    def sweep_many(self, keys: Sequence[tuple[str, int | None]]) -> list[ReleaseResult]:
        """:meth:`sweep` each ``(key, limit)`` in pipelined batches of :attr:`SWEEP_BATCH`."""
        results: list[ReleaseResult] = []
        for first in range(0, len(keys), self.SWEEP_BATCH):
            batch = keys[first : first + self.SWEEP_BATCH]
            calls = [self._script_call(key, limit, layout.SweepArgs()) for key, limit in batch]
            replies = run_scripts(self.client, self.scripts, calls, own=self.clients)
            results.extend(release_of(key, r) for (key, _), r in zip(batch, replies, strict=True))
        return results

    def due_keys(self, prompt: Sequence[str] = (), *, within_ms: int = 0) -> Due:
        """On a standalone Redis, the index entries scored up to now (``_index.lua`` ``next_due``), and
        the first prompt one ahead, in the same script."""
        if self._in_cluster():
            return Due(self.waiting_keys())
        call = (self.scripts["due"], [self._index], [within_ms, *prompt])
        [(due, ahead)] = run_scripts(self.client, self.scripts, [call], own=self.clients)
        return Due([text(k) for k in due], None if ahead is None else int(ahead))

    def set_limit(self, key: str, limit: int | None, *, default: int | None = 1) -> ReleaseResult:
        if limit is not None:
            check_count(limit, "limit")
        check_count(default, "default")
        own = layout.SetLimitArgs(limit="" if limit is None else limit)
        if not self._in_cluster():
            script, keys, args = self._script_call(key, default, own)
            return release_of(key, self._call(script, [*keys, self._limits_index], args))
        # On a cluster the index is in another slot: a key is indexed before its limit is set and
        # unindexed after it is cleared, so a limit is never left unindexed by a failure between.
        check_key(key)
        if limit is not None:
            with reachable():
                self.client.sadd(self._limits_index, key)
        result = release_of(key, self._run(key, default, own))
        if limit is None:
            with reachable():
                self.client.srem(self._limits_index, key)
        return result


def _generation(generation: int | None) -> int | str:
    """A generation as the scripts take it: '' for none."""
    return "" if generation is None else generation
