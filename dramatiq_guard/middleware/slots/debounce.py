"""The ``debounce`` actor option: a burst of sends of a key runs once, with its last (docs/debounce.md).

A debounce key is a one-slot key whose slot a timer holder keeps until the pending run is due: a
send parks its message as the key's only waiter (superseding the one parked before) and moves the
timer to ``min(last send + wait, first send + max_wait)``; when the timer lapses, the sweep hands
the slot to the waiter as to any parked one (reservation, push, confirmation, generation), and the
confirmed hand-off lets the slot go at once, so a send during the run starts the next pending run
(docs/flow-control-design.md, "Debounce").
"""

from __future__ import annotations

import logging
from typing import Any

from dramatiq import Broker, Message
from dramatiq.broker import MessageProxy

from dramatiq_guard import events
from dramatiq_guard.delivery import generation_of
from dramatiq_guard.errors import BackendUnavailable
from dramatiq_guard.gate import Diverted, Outcome
from dramatiq_guard.middleware.base import ActorGuard, execution_state, fail_open
from dramatiq_guard.middleware.slots.execution import skip_stale
from dramatiq_guard.middleware.slots.middleware import SlotsMiddleware
from dramatiq_guard.policies import DebouncePolicy, OnBusy

logger = logging.getLogger("dramatiq_guard.middleware.slots")


class Debounce(SlotsMiddleware[DebouncePolicy]):
    """A burst of sends of one key runs once, with the last send's message (the ``debounce`` option).

    ``debounce={"wait": 500, "max_wait": 5_000, "key": ...}``, ``debounce=500`` or a
    :class:`~dramatiq_guard.DebouncePolicy`. Every send returns normally; a superseded message is
    logged and counted. See ``docs/debounce.md``, and
    :class:`~dramatiq_guard.middleware.slots.SlotsMiddleware` for the parameters.
    """

    policy_class = DebouncePolicy
    prefix = "debounce"
    #: A run starts when its key comes due: the sweep wakes for it then, not only each interval.
    prompt_prefix = "debounce:"
    #: Before deduplication: a superseded send takes no dedup lock; the run goes through the rest.
    gate_priority = 5
    one_step_sends = False
    #: A run that another guard parks on its way is on its way: the pending record is taken.
    keeps_when_parked = True
    #: Its sends and pickups are its own (a pending run, a stale copy): it takes no slot with the others.
    composes = False

    def on_busy(self, policy: DebouncePolicy) -> OnBusy:
        return "park"

    def default_limit(self, guard: ActorGuard[DebouncePolicy]) -> int:
        return 1

    @property
    def handoff_hold_ms(self) -> int:
        """A run holds nothing: its confirmed hand-off lets the key go at once."""
        return 1

    def before_push(
        self, broker: Broker, message: Message[Any], delay: int | None, *, holds: str | None = None
    ) -> None:
        """Make ``message`` its key's pending run, superseding the one before (a delayed message is
        debounced when it comes due; a run going back passes).

        Raises:
          Diverted: Always, but if the backend is unreachable and the policy fails open.
          BackendUnavailable: The backend is unreachable (unless ``fail_open``).
        """
        guard = self.guard_of(message)
        if guard is None or delay is not None or (holds is not None and self.claims(holds)):
            return
        key, policy = self.guard_key_of(guard, message), guard.policy
        try:
            superseded, due_in_ms = self.backend(broker).debounce(
                key,
                message.message_id,
                message.encode(),
                wait_ms=policy.wait_ms,
                max_wait_ms=policy.max_wait_ms,
            )
        except BackendUnavailable as e:
            fail_open(policy.fail_open, e, f"{message} is enqueued undebounced")
            return
        for message_id in superseded:
            logger.info(
                "Debounced %s(%s): superseded on %r by %s.", message.actor_name, message_id, key, message
            )
            events.debounced(message.actor_name)
        if self._sweeper is not None:  # a worker's send: its sweep thread runs the key when due
            self._sweeper.soon(due_in_ms / 1000)
        raise Diverted(message, Outcome.PARKED)

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        """Skip a stale copy of a run (a newer hand-off of it runs instead)."""
        msg = message._message  # its fields, read without the proxy's __getattr__ (a call each)
        if msg.actor_name not in self.guard_lists or message.failed:
            return  # (every message passes here: an undebounced one costs no call)
        guards = self.guard_lists.get(msg.actor_name)
        if not guards:
            return
        guard = guards[0]
        key = self.guard_key_of(guard, msg)
        generation = generation_of(msg, key)
        if generation is None:
            return  # sent undebounced (fail_open), or before the actor was debounced
        try:
            live = self.backend(broker).copy_is_live(key, message.message_id, generation)
        except BackendUnavailable as e:
            fail_open(guard.policy.fail_open, e, f"{message} runs unchecked")
            return
        if not live:
            skip_stale(message, execution_state(message), self.option, key)
