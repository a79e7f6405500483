"""The pytest plugin (``dramatiq_guard_pytest``), run as a user runs it: real pytest sessions.

Each test writes a small test file that uses the plugin's fixtures by name and runs pytest on it
(``pytester``): in this process, or in a subprocess where what the plugin imports matters. The
actors run in real ``dramatiq.Worker`` threads, on a StubBroker with the in-memory backend or a
RedisBroker on a real Redis; nothing is mocked.
"""

from __future__ import annotations

import dramatiq.broker
import pytest
import redis

from dramatiq_guard import events

pytest_plugins = ["pytester"]

#: The plugin's fixtures, each by name.
FIXTURES = (
    "guarded_stub_broker",
    "guarded_redis_broker",
    "guard_worker",
    "guard_join",
    "guard_limits",
    "guard_assert_idempotent",
    "guard_redis_url",
    "guard_ledger",
    "guard_settings",
)

RUN = ("-p", "no:cacheprovider", "-q")


def test_a_session_that_names_no_fixture_sees_no_change(pytester: pytest.Pytester) -> None:
    """Loaded by its entry point, the plugin imports no broker, no Redis client, no pytest-redis."""
    pytester.makepyfile(
        test_users_plain="""
        import sys

        def test_untouched(request):
            assert request.config.pluginmanager.has_plugin("dramatiq_guard")
            assert "dramatiq_guard_pytest" in sys.modules
            heavy = {"dramatiq_guard", "dramatiq", "redis", "sqlalchemy", "pytest_redis"}
            assert not heavy & set(sys.modules)

            import dramatiq.broker
            from dramatiq_guard import events

            assert dramatiq.broker.global_broker is None
            assert events.get_sink() is None
        """
    )
    result = pytester.runpytest_subprocess(*RUN, "-p", "no:pytest_redis")
    result.assert_outcomes(passed=1)


def test_it_reads_the_environment_variable_install_reads() -> None:
    import dramatiq_guard_pytest
    from dramatiq_guard import resolve

    assert dramatiq_guard_pytest.REDIS_URL_ENV == resolve.REDIS_URL_ENV


def test_its_fixtures_are_listed_by_name(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_users_nothing="def test_nothing(): pass")
    result = pytester.runpytest(*RUN, "--fixtures")
    assert result.ret == 0
    listed = result.stdout.str()
    for name in FIXTURES:
        assert f"\n{name} " in listed or f"\n{name}\n" in listed, name
    result = pytester.runpytest(*RUN, "--help")
    result.stdout.fnmatch_lines(["*--guard-redis-url=URL*"])


def test_deduplication_stays_on_in_tests(pytester: pytest.Pytester) -> None:
    """A duplicate send is dropped, the actor runs once; the global broker and sink are put back."""
    saved_broker, saved_sink = dramatiq.broker.global_broker, events.get_sink()
    pytester.makepyfile(
        test_users_dedup="""
        import dramatiq
        import dramatiq.broker
        import dramatiq_guard
        from dramatiq_guard import events

        BEFORE = dramatiq.broker.global_broker, events.get_sink()
        used = []

        def test_a_duplicate_is_dropped(guarded_stub_broker, guard_worker, guard_join, guard_limits):
            used.append(guarded_stub_broker)
            assert dramatiq.broker.global_broker is guarded_stub_broker
            runs = []

            @dramatiq.actor(dedup="until_executed")
            def refresh(user_id):
                runs.append(user_id)

            first = refresh.send(42)
            again = refresh.send(42)
            assert dramatiq_guard.deduplicated_by(first) is None
            assert dramatiq_guard.deduplicated_by(again) == first.message_id
            guard_worker()
            guard_join(refresh)
            assert runs == [42]

        def test_the_session_is_as_it_was():
            assert (dramatiq.broker.global_broker, events.get_sink()) == BEFORE
            assert used and dramatiq.broker.global_broker is not used[0]
        """
    )
    result = pytester.runpytest(*RUN)
    result.assert_outcomes(passed=2)
    assert dramatiq.broker.global_broker is saved_broker
    assert events.get_sink() is saved_sink


LIMITS = """
import threading

import dramatiq
import pytest


def webhooks(limit):
    # Every message waits for `limit` of them to run at once: the peak is `limit`, no less.
    together = threading.Barrier(limit, timeout=60)

    key = lambda customer, n: f"webhooks:{customer}"

    @dramatiq.actor(max_retries=0, concurrency={"limit": limit, "key": key})
    def deliver_webhook(customer, n):
        together.wait()

    return deliver_webhook


def test_the_limit_held(guarded_stub_broker, guard_worker, guard_join, guard_limits):
    deliver_webhook = webhooks(2)
    for n in range(6):
        deliver_webhook.send(42, n)
    guard_worker(threads=4)
    guard_join(deliver_webhook)
    guard_limits.assert_held("webhooks:42", limit=2)
    guard_limits.assert_held("concurrency:webhooks:42", limit=2)
    assert guard_limits.peak("webhooks:42") == 2
    assert guard_limits.peaks == {"concurrency:webhooks:42": 2}


def test_an_actor_over_the_limit_fails(guarded_stub_broker, guard_worker, guard_join, guard_limits):
    deliver_webhook = webhooks(3)  # its option lets 3 run at once; the test expects 2
    for n in range(3):
        deliver_webhook.send(42, n)
    guard_worker(threads=3)
    guard_join(deliver_webhook)
    guard_limits.assert_held("webhooks:42", limit=2)


def test_a_key_never_held_fails(guarded_stub_broker, guard_worker, guard_join, guard_limits):
    deliver_webhook = webhooks(1)
    deliver_webhook.send(42, 0)
    guard_worker()
    guard_join(deliver_webhook)
    guard_limits.assert_held("webhooks:7", limit=1)
"""


def test_a_limit_held_and_a_limit_exceeded(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_users_limits=LIMITS)
    result = pytester.runpytest(*RUN)
    result.assert_outcomes(passed=1, failed=2)
    out = result.stdout.str()
    assert (
        "the limit of guard key 'concurrency:webhooks:42' did not hold: "
        "peak 3 holders at once, over its limit of 2" in out
    ), out
    assert (
        "no message held the guard key 'webhooks:7' while holders were recorded; "
        "the keys held were: concurrency:webhooks:42" in out
    ), out


IDEMPOTENCY = """
import dramatiq
import pytest
import sqlalchemy as sa

import dramatiq_guard

metadata = sa.MetaData()
emails = sa.Table(
    "emails", metadata, sa.Column("id", sa.Integer, primary_key=True), sa.Column("ticket", sa.String(50))
)


@pytest.fixture
def db(guard_ledger):
    # The ledger's own database: ledger_session() writes there, with the ledger's row.
    engine = sa.create_engine(guard_ledger)
    metadata.create_all(engine)
    yield engine
    engine.dispose()


def sent(engine):
    with engine.connect() as conn:
        return [row.ticket for row in conn.execute(sa.select(emails.c.ticket))]


def test_an_idempotent_actor(guarded_stub_broker, guard_assert_idempotent, db):
    @dramatiq.actor(max_retries=0, idempotency_key=lambda ticket: f"triage:{ticket}")
    def triage(ticket):
        dramatiq_guard.ledger_session().execute(sa.insert(emails).values(ticket=ticket))

    guard_assert_idempotent(triage, "T-1", effects=lambda: sent(db))
    assert sent(db) == ["T-1"]


def test_an_actor_without_idempotency(guarded_stub_broker, guard_assert_idempotent, db):
    @dramatiq.actor(max_retries=0)
    def triage(ticket):
        with db.begin() as conn:
            conn.execute(sa.insert(emails).values(ticket=ticket))

    guard_assert_idempotent(triage, "T-1", effects=lambda: sent(db))
"""


def test_assert_idempotent_passes_and_fails(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_users_idempotency=IDEMPOTENCY)
    result = pytester.runpytest(*RUN)
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "FAILED test_users_idempotency.py::test_an_actor_without_idempotency" in out, out
    assert "triage is not idempotent: its effects changed again on the second run" in out, out
    assert "after one run:  ['T-1']" in out, out
    assert "after two runs: ['T-1', 'T-1']" in out, out


ON_REDIS = """
import threading

import dramatiq
import redis

import dramatiq_guard


def test_guarded_on_redis(guarded_redis_broker, guard_redis_url, guard_worker, guard_join, guard_limits):
    assert dramatiq.broker.global_broker is guarded_redis_broker
    together = threading.Barrier(2, timeout=60)
    exported, refreshed = [], []

    @dramatiq.actor(max_retries=0, concurrency={"limit": 2, "key": lambda n: "exports"})
    def export(n):
        together.wait()
        exported.append(n)

    @dramatiq.actor(dedup="until_executed")
    def refresh(user_id):
        refreshed.append(user_id)

    for n in range(4):
        export.send(n)
    first, again = refresh.send(1), refresh.send(1)
    assert dramatiq_guard.deduplicated_by(again) == first.message_id
    guard_worker(threads=4)
    guard_join(export)
    guard_join(refresh)
    assert sorted(exported) == [0, 1, 2, 3]
    assert refreshed == [1]
    guard_limits.assert_held("exports", limit=2)
    assert guard_limits.peak("exports") == 2
    namespace = guarded_redis_broker.namespace.partition(":")[0]
    assert namespace.startswith("guard-test-")
    with redis.Redis.from_url(guard_redis_url) as client:
        assert client.keys(f"{namespace}:*")  # the test's own keys, deleted after it
"""


def test_a_guarded_broker_on_a_real_redis(
    pytester: pytest.Pytester, redis_url: str, redisdb: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--guard-redis-url``: the test's keys live under a namespace of its own, deleted after it."""
    monkeypatch.delenv("DRAMATIQ_GUARD_REDIS_URL", raising=False)
    redisdb.set("someone-else", "kept")
    pytester.makepyfile(test_users_on_redis=ON_REDIS)
    result = pytester.runpytest(*RUN, f"--guard-redis-url={redis_url}")
    result.assert_outcomes(passed=1)
    assert redisdb.keys("*") == [b"someone-else"]


@pytest.mark.redis
def test_a_private_redis_from_pytest_redis(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a URL, pytest-redis (the ``pytest`` extra) starts a private redis-server."""
    monkeypatch.delenv("DRAMATIQ_GUARD_REDIS_URL", raising=False)
    pytester.makepyfile(test_users_on_redis=ON_REDIS)
    result = pytester.runpytest(*RUN)
    result.assert_outcomes(passed=1)


def test_no_redis_to_be_had_says_what_to_do(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DRAMATIQ_GUARD_REDIS_URL", raising=False)
    pytester.makepyfile(test_users_on_redis=ON_REDIS)
    result = pytester.runpytest(*RUN, "-p", "no:pytest_redis")
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    assert (
        "guarded_redis_broker needs a Redis: pass --guard-redis-url URL, set DRAMATIQ_GUARD_REDIS_URL "
        "or the guard_redis_url ini setting, or install pytest-redis "
        "(pip install 'dramatiq-guard[pytest]') to start a private redis-server" in out
    ), out
    assert "During handling" not in out, out
