"""A Griffe extension of the docs site (mkdocs.yml, mkdocstrings): Sphinx roles as Markdown code.

The package's docstrings cross-reference with Sphinx roles (``:class:`~dramatiq_guard.lease.Lease```,
``:meth:`acquire```), which Markdown would show as they are written. Each becomes inline code
naming the target as a reader would write it: the last component after ``~``, the explicit title
of ``:role:`title <target>```, else the target.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|exc|data|obj|const):`([^`]+)`")


def _plain(match: re.Match[str]) -> str:
    text = match.group(1).strip()
    titled = re.fullmatch(r"(.+?)\s*<([^>]+)>", text)
    if titled:
        text = titled.group(1)
    elif text.startswith("~"):
        text = text[1:].rsplit(".", 1)[-1]
    return f"`{text}`"


def plain_roles(text: str) -> str:
    """``text`` with every Sphinx cross-reference role made inline code."""
    return _ROLE.sub(_plain, text)


class SphinxRoles(griffe.Extension):
    """Rewrites the Sphinx roles of every docstring Griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain_roles(obj.docstring.value)
