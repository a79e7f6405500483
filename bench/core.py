"""The bench's building blocks: the scenario registry, figures, and the run context."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import os
import random
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Literal, TypeVar

import redis
from redis.connection import AbstractConnection

ROOT = Path(__file__).resolve().parent.parent
TESTS_DIR = ROOT / "tests"
#: The commands that run a Lua script (INFO commandstats names): the guard's are FCALLs (EVALSHAs on a
#: Redis that refuses functions), Dramatiq's own EVALSHAs.
SCRIPT_COMMANDS = ("evalsha", "eval", "fcall", "fcall_ro")
if str(TESTS_DIR) not in sys.path:  # the test harness (``harness``) is shared with the tests
    sys.path.insert(0, str(TESTS_DIR))

from harness import DramatiqWorker, RedisServer  # noqa: E402

from bench.actors import REDIS_URL_ENV, finish_key  # noqa: E402

# --- registry -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Figure:
    """One measured figure of a scenario.

    Parameters:
      key: Stable id within the scenario (``"send_rate"``); other scenarios refer
        to it as ``"<scenario>/<key>"``.
      label: What it is, for the report.
      value: The figure.
      unit: Its unit (``"msg/s"``), or ``""``.
      vs: ``"<scenario>/<key>"`` of the figure to compare with (usually a baseline one).
      compare: ``"ratio"`` (value / that figure) or ``"delta"`` (value - that figure).
      better: Which direction is better, for the reader.
      detail: How it was obtained (sizes, repeats, breakdowns).
    """

    key: str
    label: str
    value: float
    unit: str = ""
    vs: str | None = None
    compare: Literal["ratio", "delta"] = "ratio"
    better: Literal["higher", "lower"] = "higher"
    detail: str = ""


ScenarioFn = Callable[["Context"], Iterable[Figure]]


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    fn: ScenarioFn
    title: str
    quick: bool
    order: int

    @property
    def description(self) -> str:
        """The function's docstring, as Markdown (reST double backticks become single)."""
        return inspect.cleandoc(self.fn.__doc__ or "").replace("``", "`")


SCENARIOS: dict[str, Scenario] = {}


def scenario(
    name: str, *, title: str = "", quick: bool = True, order: int = 100
) -> Callable[[ScenarioFn], ScenarioFn]:
    """Register a scenario function under ``name``.

    Parameters:
      title: A one-line title for the report (default: the name).
      quick: Whether ``--quick`` runs it (with the small sizes of :meth:`Context.n`).
      order: Scenarios run by ``order``, then name; the baseline is 0.
    """

    def register(fn: ScenarioFn) -> ScenarioFn:
        if name in SCENARIOS and SCENARIOS[name].fn is not fn:
            raise ValueError(f"bench scenario {name!r} registered twice")
        SCENARIOS[name] = Scenario(name, fn, title or name, quick, order)
        return fn

    return register


# --- measuring ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CallCounts:
    """Redis traffic caused by ``calls`` calls of a function, per call.

    ``commands`` counts every command Redis executed (INFO commandstats deltas,
    so the commands run inside a Lua script count too); ``round_trips`` counts
    the requests the calling thread sent (a pipeline or a script call is one):
    what the caller waits for; ``background_round_trips`` the requests other
    threads of this process sent meanwhile (batched work off the call's path).
    """

    calls: int
    commands: float
    round_trips: float
    by_command: dict[str, float]
    background_round_trips: float = 0.0

    def breakdown(self) -> str:
        parts = sorted(self.by_command.items(), key=lambda kv: (-kv[1], kv[0]))
        return ", ".join(f"{name} {count:.3g}" for name, count in parts)


class _RequestCounter:
    """Counts requests written by every redis-py connection of this process (a patch, undone on exit)."""

    def __init__(self) -> None:
        self.count = 0  # by the thread that installed the counter
        self.background = 0  # by the other threads
        self._caller = threading.get_ident()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def installed(self) -> Iterator[_RequestCounter]:
        original = AbstractConnection.send_packed_command
        counter = self

        def send_packed_command(self: AbstractConnection, command: object, check_health: bool = True) -> None:
            with counter._lock:
                if threading.get_ident() == counter._caller:
                    counter.count += 1
                else:
                    counter.background += 1
            original(self, command, check_health)  # type: ignore[no-untyped-call]

        AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]
        try:
            yield self
        finally:
            AbstractConnection.send_packed_command = original  # type: ignore[method-assign]


class Context:
    """What a scenario gets: the run's Redis, sizes, workers and measuring tools."""

    def __init__(self, server: RedisServer, *, quick: bool) -> None:
        self.server = server
        self.quick = quick
        self.redis_url = server.url
        self.client = redis.Redis.from_url(self.redis_url)
        self._workers: list[DramatiqWorker] = []
        os.environ[REDIS_URL_ENV] = self.redis_url

    # sizes

    def n(self, full: int, quick: int) -> int:
        """A size: ``full`` in a normal run, ``quick`` with ``--quick``."""
        return quick if self.quick else full

    @property
    def repeats(self) -> int:
        """How many times a timed measurement is repeated (the median is reported)."""
        return 1 if self.quick else 3

    # state

    def flush(self) -> None:
        """Empty the run's Redis (the scenario's keys and queues)."""
        self.client.flushall()

    def import_actors(self, module: str) -> ModuleType:
        """Import a worker-side actor module into this process too (to send its actors)."""
        return importlib.import_module(module)

    # workers

    def worker(
        self,
        modules: str | Sequence[str],
        *,
        processes: int = 2,
        threads: int = 8,
        env: dict[str, str] | None = None,
        queues: Sequence[str] | None = None,
    ) -> DramatiqWorker:
        """Start a real ``dramatiq`` worker on the run's Redis and wait until it is ready.

        ``queues``: the queues it consumes (default: every queue of its actors). Stopped by
        :meth:`stop_workers` (the runner calls it after each scenario).
        """
        full_env = dict(os.environ)
        full_env[REDIS_URL_ENV] = self.redis_url
        full_env.setdefault("DRAMATIQ_GUARD_REDIS_URL", self.redis_url)
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), str(TESTS_DIR), full_env.get("PYTHONPATH", "")) if p
        )
        full_env.update(env or {})
        worker = DramatiqWorker(
            modules, processes=processes, threads=threads, env=full_env, cwd=ROOT, queues=queues
        )
        self._workers.append(worker)
        worker.start()
        worker.wait_ready(120)
        return worker

    def stop_workers(self) -> None:
        while self._workers:
            self._workers.pop().stop()

    # measurements

    def send_rate(
        self,
        send: Callable[[int], object],
        n: int,
        *,
        setup: Callable[[], object] | None = None,
        repeats: int | None = None,
    ) -> float:
        """Messages per second for ``n`` calls of ``send(i)``: the median of ``repeats`` runs.

        ``repeats`` defaults to :attr:`repeats`.

        Redis is flushed before each run, then ``setup()`` is called (to put back
        state such as limits); no worker should be consuming.
        """
        rates = []
        for _ in range(self.repeats if repeats is None else repeats):
            self.flush()
            if setup is not None:
                setup()
            start = time.perf_counter()
            for i in range(n):
                send(i)
            rates.append(n / (time.perf_counter() - start))
        self.flush()
        return statistics.median(rates)

    def count_calls(self, call: Callable[[int], object], n: int) -> CallCounts:
        """The Redis commands and round trips per call of ``call(i)``, over ``n`` calls.

        Call it while nothing else uses the run's Redis (no worker running):
        INFO commandstats counts every client's commands. One warm-up call is
        made first and not counted (it loads scripts, opens connections).
        """
        self.flush()
        call(-1)
        before = self._commandstats()
        with _RequestCounter().installed() as requests:
            for i in range(n):
                call(i)
        after = self._commandstats()
        self.flush()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        delta = {k: v for k, v in delta.items() if v > 0 and k not in {"info", "flushall"}}
        total = sum(delta.values())
        return CallCounts(
            calls=n,
            commands=total / n,
            round_trips=requests.count / n,
            by_command={k: v / n for k, v in delta.items()},
            background_round_trips=requests.background / n,
        )

    def _commandstats(self) -> Counter[str]:
        stats = self.client.info("commandstats")
        return Counter({key.removeprefix("cmdstat_"): int(value["calls"]) for key, value in stats.items()})

    def drain_rate(self, send: Callable[[str, int, int], object], n: int) -> float:
        """Messages per second from the first of ``n`` sends to the last completion; median of repeats.

        ``send(run_id, total, i)`` sends the ``i``-th message of a run; its actor must call
        :func:`bench.actors.cross_finish_line` with ``run_id`` and ``total`` when done. A
        worker must be running (:meth:`worker`). The clock stops at the time the last
        actor recorded, not when the bench noticed.
        """
        rates = []
        for _ in range(self.repeats):
            run_id = self.new_run_id()
            start = time.time()
            for i in range(n):
                send(run_id, n, i)
            rates.append(n / (self.wait_finish(run_id) - start))
        return statistics.median(rates)

    def new_run_id(self) -> str:
        return uuid.uuid4().hex

    def wake_up(self, send: Callable[[str, int], object], count: int) -> None:
        """Drain ``count`` messages (``send(run_id, count)`` each) and wait for them, outside any figure.

        A Dramatiq consumer that found its queue empty backs off, up to the worker's timeout (a
        second), before it looks again. A drain measured on a worker that sat idle (while another
        worker had its turn) would wait up to that long for its first messages: call this first,
        with one message per worker thread, so the consumers are polling when the clock starts.
        """
        run_id = self.new_run_id()
        for _ in range(count):
            send(run_id, count)
        self.wait_finish(run_id)

    def wait_finish(self, run_id: str, timeout: float = 600.0) -> float:
        """Wait (BLPOP) until run ``run_id`` crossed its finish line; return the time.time() it did.

        See :func:`bench.actors.cross_finish_line`. On a client of its own without a socket
        timeout: redis-py 8's default 5 s would end a BLPOP of a drain that takes longer.
        """
        with redis.Redis.from_url(self.redis_url, socket_timeout=None) as client:
            item = client.blpop([finish_key(run_id)], timeout=timeout)
        if item is None:
            raise TimeoutError(f"bench run {run_id} did not finish within {timeout:g}s")
        return float(item[1])

    def close(self) -> None:
        self.stop_workers()
        self.client.close()


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


R = TypeVar("R", bound=tuple[float, ...])


def median_run(runs: Sequence[R]) -> R:
    """The median run by its first figure, with that run's other figures.

    Of an even count, the upper one: a run that happened, not an average of two.
    """
    return sorted(runs)[len(runs) // 2]


T = TypeVar("T")


def in_turns(items: Sequence[T], rounds: int) -> Iterator[T]:
    """``items`` once per round for ``rounds`` rounds, in a new order each round (the same every run).

    Measurements that take turns this way share the machine's drift, and none is always the
    one that comes right after a given other (whose aftermath, such as Redis expiring the keys
    it left, would otherwise fall on the same row every round). A rotation would not do: each
    item would still always follow the same one.
    """
    for r in range(rounds):
        order = list(range(len(items)))
        random.Random(r).shuffle(order)
        for i in order:
            yield items[i]
