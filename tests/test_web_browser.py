"""The web dashboard in a real browser (Debian's chromium driven by Playwright), on a real worker and Redis.

Waits are Playwright's own (``expect(...)`` retries until its timeout) and the
harness's recorder (events in Redis), never sleeps.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from dramatiq import Message
from harness import unavailable
from playwright import sync_api as playwright_sync  # a test dependency: missing, it fails (never skips)

from dramatiq_guard.backends import RedisBackend, Stake, Waiter
from dramatiq_guard.web import Access, Dashboard, make_app

expect = playwright_sync.expect

CHROMIUM = os.environ.get("DRAMATIQ_GUARD_TEST_CHROMIUM", "/usr/bin/chromium")
SECRET = "let-me-write"
KEY = "concurrency:webhooks:42"

ACTORS = """
import dramatiq
import dramatiq_guard
from harness import Gate, Recorder, broker_from_env

broker = broker_from_env()
dramatiq_guard.install(broker)
dramatiq.set_broker(broker)
rec = Recorder.from_env()


@dramatiq.actor(
    queue_name="{queue}",
    max_retries=0,
    concurrency={"limit": 2, "key": lambda customer_id, n: f"webhooks:{customer_id}"},
)
def deliver_webhook(customer_id, n):
    rec.record(n=n)
    Gate.from_env("hold").wait(timeout=120)


@dramatiq.actor(queue_name="{queue}", max_retries=0, mutex={"key": lambda n: "report", "on_busy": "park"})
def report(n):
    rec.record(n=n)
    Gate.from_env("hold").wait(timeout=120)
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not os.path.exists(CHROMIUM):
        unavailable(f"{CHROMIUM} is not installed (apt-get install chromium): the browser tests need it")
    with playwright_sync.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM)
        yield launched
        launched.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Dashboard], str]]:
    """Serve a dashboard on a free port of 127.0.0.1 (in a thread); returns its URL.

    Werkzeug's threaded server here, because it stops at once (``shutdown``);
    ``dramatiq-guard serve`` (waitress) is started for real in tests/test_web.py.
    """
    from werkzeug.serving import BaseWSGIServer, make_server

    servers: list[BaseWSGIServer] = []
    threads: list[threading.Thread] = []

    def start(app: Dashboard) -> str:
        server = make_server("127.0.0.1", 0, app, threaded=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        servers.append(server)
        threads.append(thread)
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
    for thread in threads:
        thread.join(timeout=10)


def _holders(page: Any) -> list[str]:
    return [text.split()[0] for text in page.locator("#holders tbody td.id").all_inner_texts()]


def _waiters(page: Any) -> list[str]:
    return page.locator("#waiters tbody td.id").all_inner_texts()  # type: ignore[no-any-return]


def _unlock(page: Any) -> None:
    page.fill("#unlock input[name=secret]", SECRET)
    page.click("#unlock button")
    expect(page.locator("header .mode")).to_contain_text("writes enabled")


def test_ten_parked_webhooks_then_a_limit_raised_from_the_page(
    redis_url: str,
    actor_module: Callable[..., Any],
    dramatiq_worker: Callable[..., Any],
    recorder: Any,
    unique_name: str,
    browser: Any,
    serve: Callable[[Dashboard], str],
) -> None:
    module = actor_module(ACTORS.replace("{queue}", unique_name), name="web_browser_actors")
    dramatiq_worker("web_browser_actors", processes=1, threads=8)
    sent = [module.deliver_webhook.send(42, n) for n in (1, 2)]
    assert sorted(r["n"] for r in recorder.take(2)) == [1, 2]  # both hold their slots, at the gate
    sent += [module.deliver_webhook.send(42, n) for n in range(3, 11)]  # the key is full: they park
    backend = RedisBackend.from_url(redis_url)
    url = serve(make_app(backend, broker=module.broker, access=Access(write_secret=SECRET)))

    viewer = browser.new_page()
    viewer.goto(f"{url}/")
    expect(viewer.locator("#keys tbody tr")).to_have_count(1)
    expect(viewer.locator("#keys a.key")).to_have_text(KEY)
    viewer.click("#keys a.key")
    expect(viewer.locator("#holders-count")).to_have_text("2")
    expect(viewer.locator("#waiters tbody tr")).to_have_count(8)
    assert sorted(_holders(viewer)) == sorted(m.message_id for m in sent[:2])
    assert _waiters(viewer) == [m.message_id for m in sent[2:]]  # in order
    assert viewer.locator("#waiters tbody tr").first.locator("td.args").inner_text() == "42, 3"
    viewer.evaluate("window.notReloaded = true")

    operator = browser.new_page()
    operator.goto(f"{url}/key?k={KEY}")
    assert operator.locator("#limit-form").count() == 0  # read-only until unlocked
    _unlock(operator)
    operator.fill("#limit-form input[name=limit]", "4")
    operator.click("#limit-form button")
    expect(operator.locator("#confirm-text")).to_contain_text(
        f"Set the run-time limit of {KEY} from none (the actor's own) to 4"
    )
    expect(operator.locator("#confirm-text")).to_contain_text("The first 2 waiter(s) get a slot at once")
    operator.click("#confirm button")
    expect(operator.locator("#flash")).to_contain_text("limit set to 4")
    expect(operator.locator("#flash")).to_contain_text("2 parked message(s) re-enqueued")

    assert sorted(r["n"] for r in recorder.take(2)) == [3, 4]  # the two oldest waiters run
    expect(viewer.locator("#holders-count")).to_have_text("4")  # the open page follows, no reload
    expect(viewer.locator("#waiters tbody tr")).to_have_count(6)
    expect(viewer.locator("#limit")).to_have_text("4")
    expect(viewer.locator("#holders tbody tr", has_text="deliver_webhook")).to_have_count(4)  # all started
    assert sorted(_holders(viewer)) == sorted(m.message_id for m in sent[:4])
    assert _waiters(viewer) == [m.message_id for m in sent[4:]]
    assert viewer.evaluate("window.notReloaded") is True
    screenshot = os.environ.get("DRAMATIQ_GUARD_SCREENSHOT")  # e.g. docs/img/dashboard.png
    if screenshot:
        viewer.set_viewport_size({"width": 1100, "height": 760})
        viewer.screenshot(path=screenshot, full_page=True)
    recorder.gate("hold").open(10)


def test_a_forced_release_from_the_page_hands_the_slot_to_the_oldest_waiter(
    redis_url: str,
    actor_module: Callable[..., Any],
    dramatiq_worker: Callable[..., Any],
    recorder: Any,
    unique_name: str,
    browser: Any,
    serve: Callable[[Dashboard], str],
) -> None:
    module = actor_module(ACTORS.replace("{queue}", unique_name), name="web_release_actors")
    dramatiq_worker("web_release_actors", processes=1, threads=3)
    first = module.report.send(1)
    assert recorder.take_one()["n"] == 1
    waiting = [module.report.send(n) for n in (2, 3)]
    url = serve(
        make_app(RedisBackend.from_url(redis_url), broker=module.broker, access=Access(write_secret=SECRET))
    )

    page = browser.new_page()
    page.goto(f"{url}/key?k=mutex:report")
    expect(page.locator("#waiters tbody tr")).to_have_count(2)
    _unlock(page)
    page.click("#release-form button")
    confirm = page.locator("#confirm-text")
    expect(confirm).to_contain_text(f"Release 1 holder(s) of mutex:report by force: {first.message_id}.")
    expect(confirm).to_contain_text("Their slots go to the first of its 2 waiter(s)")
    expect(confirm).to_contain_text("loses its lease")
    page.click("#confirm button")
    expect(page.locator("#flash")).to_contain_text("released 1 holder(s)")

    assert recorder.take_one()["n"] == 2  # the oldest waiter runs, while the released one still holds on
    expect(page.locator("#holders tbody tr", has_text="report")).to_have_count(1)
    assert _holders(page) == [waiting[0].message_id]
    assert _waiters(page) == [waiting[1].message_id]
    recorder.gate("hold").open(3)


def test_keys_and_arguments_with_markup_render_as_text_and_writes_need_secret_and_token(
    redis_url: str, browser: Any, serve: Callable[[Dashboard], str]
) -> None:
    backend = RedisBackend.from_url(redis_url)
    key = "concurrency:<script>window.pwned = 1</script>"
    argument = "<img src=x onerror='window.pwned = 2'><script>window.pwned = 3</script>"
    assert backend.acquire(Stake(key, "h1", limit=1, ttl_ms=60_000, info="<b>actor</b>")).acquired
    message: Message[Any] = Message(
        queue_name="q", actor_name="<i>deliver</i>", args=(argument,), kwargs={}, options={}
    )
    backend.acquire(
        Stake(key, message.message_id, limit=1, ttl_ms=60_000), wait=Waiter(payload=message.encode())
    )
    url = serve(make_app(backend, access=Access(write_secret=SECRET)))

    page = browser.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: dialogs.append(dialog.message))
    page.goto(f"{url}/")
    expect(page.locator("#keys a.key")).to_have_text(key)
    page.click("#keys a.key")
    expect(page.locator("h1#key")).to_have_text(key)
    expect(page.locator("#holders tbody td").nth(1)).to_have_text("<b>actor</b>")
    expect(page.locator("#waiters td.args")).to_have_text(f'"{argument}"')
    expect(page.locator("#waiters tbody td").nth(3)).to_have_text("<i>deliver</i>")
    assert page.evaluate("window.pwned") is None
    assert page.locator("script:not([src])").count() == 0 and page.locator("#waiters img").count() == 0
    assert dialogs == []

    # Read-only: a write with the form token but without the secret is refused.
    csrf = next(c["value"] for c in page.context.cookies() if c["name"] == "dg_csrf")
    same_site = {"Origin": url}
    refused = page.request.post(
        f"{url}/limit", form={"k": key, "limit": "0", "csrf": csrf}, headers=same_site
    )
    assert refused.status == 403 and "read-only" in refused.text()
    _unlock(page)
    # Unlocked: a write without the form token, or from another site, is refused.
    no_token = page.request.post(f"{url}/limit", form={"k": key, "limit": "0"}, headers=same_site)
    assert no_token.status == 403 and "token" in no_token.text()
    other_site = page.request.post(
        f"{url}/limit", form={"k": key, "limit": "0", "csrf": csrf}, headers={"Origin": "http://evil.example"}
    )
    assert other_site.status == 403
    assert backend.get_limit(key) is None  # nothing was written
    accepted = page.request.post(
        f"{url}/limit", form={"k": key, "limit": "0", "csrf": csrf}, headers=same_site
    )
    assert accepted.ok and backend.get_limit(key) == 0


def test_the_overview_of_ten_thousand_waiting_keys_is_paginated_and_quick(
    redis_url: str, browser: Any, serve: Callable[[Dashboard], str]
) -> None:
    """Reports the render time (the budget is 1 s; timing is measured in bench/, never asserted)."""
    from bench.scenarios.web import fill

    fill(redis_url, "dramatiq-guard", 10_000)
    url = serve(make_app(RedisBackend.from_url(redis_url)))
    page = browser.new_page()
    start = time.perf_counter()
    page.goto(f"{url}/")
    expect(page.locator("#keys tbody tr")).to_have_count(50)
    elapsed = time.perf_counter() - start
    expect(page.locator("nav.pages")).to_contain_text("page 1 of 200")
    expect(page.locator("#counts")).to_contain_text("10000 key(s)")
    served = page.evaluate("performance.getEntriesByType('navigation')[0].responseEnd")
    print(
        f"\noverview of 10,000 waiting keys: {elapsed * 1000:.0f} ms in chromium (response {served:.0f} ms)"
    )
    page.click("nav.pages a")
    expect(page.locator("nav.pages")).to_contain_text("page 2 of 200")
