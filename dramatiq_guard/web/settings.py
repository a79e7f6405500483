"""What a dashboard is given beside its backend: who it answers and who may write, and how it pages."""

from __future__ import annotations

import dataclasses
import ipaddress
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from werkzeug.sansio.utils import host_is_trusted

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIEnvironment

Authorize = Callable[["WSGIEnvironment"], bool]

#: The names of this machine's loopback interface: the default of ``make_app`` and ``serve``.
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")

_FORMS = (
    "each is a host name or IP address without a port ('guard.example.com', '10.0.0.5', '[::1]'), "
    "'.example.com' for that domain and its subdomains, or '*' for any Host"
)


def _ipv6(text: str) -> str | None:
    """``[address]`` in its compressed form if ``text`` is an IPv6 address (bracketed or not), else None."""
    inner = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        return f"[{ipaddress.IPv6Address(inner).compressed}]"
    except ValueError:
        return None


class AllowedHosts:
    """The Host names a dashboard answers to (``allowed_hosts``): its defence against DNS rebinding.

    Entries are written as Django's ``ALLOWED_HOSTS`` (no port); not Werkzeug's ``trusted_hosts``,
    which cuts each name at its first colon (no IPv6 address).

    Parameters:
      hosts(Iterable[str]): The entries: names, IP addresses, ``.domain``, or ``*``.
      what(str): What the entries are called where they come from, for errors.

    Raises:
      ValueError: If ``hosts`` is a str or empty, or an entry is none of the forms above.
    """

    def __init__(self, hosts: Iterable[str], *, what: str = "allowed_hosts") -> None:
        if isinstance(hosts, str):
            raise ValueError(f"{what} must be a list of host names, not the str {hosts!r}; {_FORMS}")
        self.what = what
        self.entries = tuple(hosts)
        if not self.entries:
            raise ValueError(f"{what} needs at least one entry; {_FORMS}")
        self.any = False
        names: set[str] = set()
        domains: list[str] = []
        for entry in self.entries:
            if entry == "*":
                self.any = True
            elif isinstance(entry, str) and entry.startswith("."):
                domains.append(self._name(entry[1:], entry))
            else:
                names.add(self._name(entry, entry))
        self.names = frozenset(names)
        self.domains = tuple(domains)

    def _name(self, text: object, entry: object) -> str:
        """The normalised form of one name or address (``entry`` is what was given, for the error)."""
        if not isinstance(text, str):
            raise ValueError(f"{self.what}: {entry!r} is not a str; {_FORMS}")
        if text.startswith("*."):
            raise ValueError(f"{self.what}: {entry!r} is not allowed: write '{text[1:]}' instead; {_FORMS}")
        name = text.lower().removesuffix(".")
        address = _ipv6(name)
        if address is not None:
            return address
        if ":" in name and name.rpartition(":")[2].isdigit():
            raise ValueError(f"{self.what}: {entry!r} has a port: give the name without a port; {_FORMS}")
        if not name or ":" in name or not host_is_trusted(name):
            raise ValueError(f"{self.what}: {entry!r} is not a host name or IP address; {_FORMS}")
        return name

    def allows(self, host: str) -> bool:
        """Whether to answer a request for ``host`` (Werkzeug's ``Request.host``, ``""`` if invalid)."""
        if not host:
            return False
        if host.startswith("["):
            name = _ipv6(host[: host.find("]") + 1]) or ""
        else:
            name = host.partition(":")[0].removesuffix(".")
        if not name:
            return False
        if self.any or name in self.names:
            return True
        return any(name == domain or name.endswith("." + domain) for domain in self.domains)

    def __str__(self) -> str:
        return ", ".join(self.entries)


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
