"""The dashboard mounted in a Django site (examples/django_site): staff only, writes for staff."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
from werkzeug.test import Client

from dramatiq_guard.backends import RedisBackend, Stake, Waiter


def _session(user: Any) -> str:
    """A logged-in session of ``user``, as Django's login() makes it; returns its key."""
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
    from django.contrib.sessions.backends.db import SessionStore

    session = SessionStore()
    session[SESSION_KEY] = str(user.pk)
    session[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
    session[HASH_SESSION_KEY] = user.get_session_auth_hash()
    session.save()
    assert session.session_key is not None
    return str(session.session_key)


def test_the_dashboard_in_a_django_site_is_for_staff_only(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXAMPLE_DJANGO_DB", str(tmp_path / "site.sqlite3"))
    monkeypatch.setenv("DRAMATIQ_GUARD_REDIS_URL", redis_url)
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "examples.django_site.settings")
    wsgi = importlib.import_module("examples.django_site.wsgi")
    from django.contrib.auth.models import User
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)
    staff = User.objects.create_user("staff", password="x", is_staff=True)
    plain = User.objects.create_user("plain", password="x")
    backend = RedisBackend.from_url(redis_url)
    assert backend.acquire(Stake("mutex:report", "m1", limit=1, ttl_ms=60_000)).acquired
    assert backend.acquire(
        Stake("mutex:report", "m2", limit=1, ttl_ms=60_000), wait=Waiter(payload=b"{}")
    ).parked

    client = Client(wsgi.application)
    assert client.get("/").get_data(as_text=True) == "The site's own page."  # Django serves the rest
    assert client.get("/guard/").status_code == 403  # anonymous
    client.set_cookie("sessionid", _session(plain))
    assert client.get("/guard/").status_code == 403  # not staff
    client.set_cookie("sessionid", _session(staff))
    page = client.get("/guard/")
    assert page.status_code == 200
    text = page.get_data(as_text=True)
    assert "writes enabled" in text and 'href="/guard/key?k=mutex%3Areport"' in text
    csrf = client.get_cookie("dg_csrf", path="/guard")
    assert csrf is not None
    done = client.post(
        "/guard/limit",
        data={"k": "mutex:report", "limit": "0", "csrf": csrf.value},
        headers={"Origin": "http://localhost"},
    )
    assert done.status_code == 303 and done.headers["Location"] == "/guard/key?k=mutex%3Areport"
    assert backend.get_limit("mutex:report") == 0
    backend.close()
