"""The Host names the dashboard answers to (``allowed_hosts``): its defence against DNS rebinding.

Entries are written as Django's ``ALLOWED_HOSTS`` (no port). Not Werkzeug's
``trusted_hosts``, which cuts each name at its first colon (no IPv6 address).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from werkzeug.sansio.utils import host_is_trusted

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
    """The Host names a dashboard answers to.

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
