"""MkDocs hooks of the docs site (mkdocs.yml ``hooks:``); not part of the package.

The pages in ``docs/`` are written to read well on GitHub too, so they link to the repository's
own files (``../examples/tour.py``, ``../CHANGELOG.md``) with relative links. MkDocs knows only
the files under ``docs/`` and, under ``--strict``, fails on a link to anything else. These hooks:

- copy every repository file a page links to into the site, at the same path (``examples/tour.py``),
  and point the link at that copy; a link to a file that does not exist is reported as a warning,
  which fails a ``--strict`` build like any broken link;
- make ``changelog.md`` show ``CHANGELOG.md`` (kept at the repository's root), its links rewritten
  from the root to ``docs/``.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.site")

#: A Markdown inline link or image target: ``](target)`` or ``](target "title")``.
_LINK = re.compile(r"(\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
#: Fenced code blocks, whose links are examples, not links.
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)

CHANGELOG_PAGE = "changelog.md"
CHANGELOG = "CHANGELOG.md"

_state: dict[str, Any] = {}


def _root() -> Path:
    root: Path = _state["root"]
    return root


def _outside(page_uri: str, target: str) -> str | None:
    """The repository path ``target`` (linked from docs page ``page_uri``) names outside ``docs/``."""
    if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target, re.I):
        return None
    path = target.split("#", 1)[0].split("?", 1)[0]
    if not path:
        return None
    joined = posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_uri), path))
    if joined.startswith("docs/") or joined.startswith("../"):
        return None
    return joined


def _links(markdown: str) -> list[str]:
    return [m.group(2) for m in _LINK.finditer(_FENCE.sub("", markdown))]


def _sub_outside_fences(markdown: str, rewrite: Any) -> str:
    """``_LINK.sub(rewrite, ...)`` on the text between fenced code blocks, the blocks left as they are."""
    out, last = [], 0
    for fence in _FENCE.finditer(markdown):
        out.append(_LINK.sub(rewrite, markdown[last : fence.start()]))
        out.append(fence.group(0))
        last = fence.end()
    out.append(_LINK.sub(rewrite, markdown[last:]))
    return "".join(out)


def _changelog(markdown: str) -> str:
    """CHANGELOG.md as a page of ``docs/``: its links, relative to the root, made relative to docs/."""

    def rewrite(match: re.Match[str]) -> str:
        target = match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target, re.I):
            return match.group(0)
        return f"{match.group(1)}{posixpath.relpath(posixpath.normpath(target), 'docs')}{match.group(3)}"

    return _sub_outside_fences(markdown, rewrite)


def on_config(config: Any) -> Any:
    _state["root"] = Path(config.config_file_path).resolve().parent
    return config


def on_files(files: Files, config: Any) -> Files:
    """Add each repository file a page links to, so that the link resolves and the file is served."""
    wanted: set[str] = set()
    for file in files.documentation_pages():
        text = Path(file.abs_src_path or "").read_text(encoding="utf-8")
        if file.src_uri == CHANGELOG_PAGE:
            text = _changelog((_root() / CHANGELOG).read_text(encoding="utf-8"))
        for target in _links(text):
            repo_path = _outside(file.src_uri, target)
            if repo_path is not None:
                wanted.add(repo_path)
    for repo_path in sorted(wanted):
        if not (_root() / repo_path).is_file():
            continue  # the link stays broken: MkDocs reports it (an error under --strict)
        if files.get_file_from_path(repo_path) is None:
            files.append(File(repo_path, str(_root()), config.site_dir, use_directory_urls=False))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Point links to repository files at their copies; show CHANGELOG.md on the changelog page."""
    if page.file.src_uri == CHANGELOG_PAGE:
        markdown = _changelog((_root() / CHANGELOG).read_text(encoding="utf-8"))
    base = posixpath.dirname(page.file.src_uri) or "."

    def rewrite(match: re.Match[str]) -> str:
        target = match.group(2)
        repo_path = _outside(page.file.src_uri, target)
        if repo_path is None:
            return match.group(0)
        if not (_root() / repo_path).is_file():
            log.warning("Doc file '%s' links to '%s': no such file", page.file.src_uri, target)
            return match.group(0)
        anchor = target[len(target.split("#", 1)[0]) :]
        return f"{match.group(1)}{posixpath.relpath(repo_path, base)}{anchor}{match.group(3)}"

    return _sub_outside_fences(markdown, rewrite)
