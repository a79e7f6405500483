"""What the model tests (Hypothesis state machines) share: a budget read from the environment, and
the settings they run with."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelBudget:
    """How many runs of how many steps a model test makes, derandomized (the same runs every
    time) unless ``random``.

    Read by :meth:`from_env` from ``DRAMATIQ_GUARD_<NAME>_MODEL_EXAMPLES``, ``..._STEPS`` and
    ``..._RANDOM=1`` (e.g. 500 runs of 100 steps for a longer look).
    """

    examples: int
    steps: int
    random: bool = False

    @classmethod
    def from_env(cls, name: str, *, examples: int, steps: int) -> ModelBudget:
        """The budget of the model ``name`` (e.g. ``"THROTTLE"``): these defaults, or the environment's."""
        prefix = f"DRAMATIQ_GUARD_{name}_MODEL_"
        return cls(
            examples=int(os.environ.get(prefix + "EXAMPLES", str(examples))),
            steps=int(os.environ.get(prefix + "STEPS", str(steps))),
            random=os.environ.get(prefix + "RANDOM", "") not in ("", "0"),
        )

    def run(self, machine: type[Any], *args: Any) -> None:
        """Run the state machine ``machine`` (made with ``args``) within this budget."""
        from hypothesis.stateful import run_state_machine_as_test

        def init(self: Any) -> None:
            machine.__init__(self, *args)

        bound = type(machine.__name__, (machine,), {"__init__": init})
        run_state_machine_as_test(bound, settings=self.settings())

    def settings(self) -> Any:
        """The ``hypothesis.settings`` of a run: no deadline, no example database, the blob of a
        failure printed, and no health check for slow or much-filtered data."""
        from hypothesis import HealthCheck, settings  # here: the bench imports harness without it

        return settings(
            max_examples=self.examples,
            stateful_step_count=self.steps,
            deadline=None,
            derandomize=not self.random,
            database=None,
            print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        )


class MarksFailure:
    """A state machine that marks itself failed when a step raises (:meth:`marking_failure`), so its
    ``teardown`` does not drain over the failure (``if not self.failed: ...``)."""

    failed = False

    @contextlib.contextmanager
    def marking_failure(self) -> Iterator[None]:
        """Marks the run failed if the body raises."""
        try:
            yield
        except BaseException:
            self.failed = True
            raise
