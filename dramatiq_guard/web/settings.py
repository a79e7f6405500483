"""What a dashboard is given beside its backend: who it answers and who may write, and how it pages."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from dramatiq_guard.web.hosts import LOCAL_HOSTS, AllowedHosts

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIEnvironment

Authorize = Callable[["WSGIEnvironment"], bool]


@dataclasses.dataclass(frozen=True)
class Access:
    """Who the dashboard answers, and who may write (with neither secret nor ``authorize``: nobody).

    Parameters:
      write_secret(str|None): The secret a browser session gives to unlock writes.
      authorize(Callable|None): ``authorize(environ) -> bool``, whether a
        request may write (the host site's own auth, e.g. staff only).
      allowed_hosts(Iterable[str]): The Host names it answers to, as Django's
        ``ALLOWED_HOSTS`` (``.example.com`` for a domain and its subdomains,
        ``"*"`` for any); default: the loopback names. Another Host gets a 400.

    Raises:
      ValueError: If ``allowed_hosts`` is a str or empty, or an entry is not a host name.
    """

    write_secret: str | None = None
    authorize: Authorize | None = None
    allowed_hosts: Iterable[str] = LOCAL_HOSTS

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_hosts", AllowedHosts(self.allowed_hosts).entries)


@dataclasses.dataclass(frozen=True)
class Page:
    """How the dashboard's pages show (``make_app(page=...)``).

    Parameters:
      refresh_ms(int): How often an open page updates itself.
      per_page(int): Keys per page of the overview.
    """

    refresh_ms: int = 1500
    per_page: int = 50


def settings_of(access: Access | None, page: Page | None, keywords: dict[str, Any]) -> tuple[Access, Page]:
    """``access`` and ``page`` (default if None), with 0.1.0's keywords (deprecated) put in their fields.

    Raises:
      TypeError: If a keyword is none of them.
      ValueError: As :class:`Access` does.
    """
    access = Access() if access is None else access
    page = Page() if page is None else page
    if not keywords:
        return access, page
    fields = {f.name: cls for cls in (Access, Page) for f in dataclasses.fields(cls)}
    unknown = sorted(set(keywords) - set(fields))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(unknown)}")
    warnings.warn(
        f"{', '.join(f'{name}=' for name in keywords)} are deprecated: pass access=Access(...) "
        "and page=Page(...) (dramatiq_guard.web)",
        DeprecationWarning,
        stacklevel=3,
    )
    given = {cls: {k: v for k, v in keywords.items() if fields[k] is cls} for cls in (Access, Page)}
    return dataclasses.replace(access, **given[Access]), dataclasses.replace(page, **given[Page])
