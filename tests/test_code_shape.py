"""The shape of the package: what a newcomer must be able to hold in their head (issue #32).

The rules: no module over :data:`MODULE_LINES` lines, no function over :data:`FUNCTION_LINES`
(from ``def`` to its last line, docstring included), and no import cycle between the package's
modules (imports inside functions and under ``TYPE_CHECKING`` count). What breaks a rule today is
listed below with its size; a listed entry may only shrink, and one that keeps the rule is taken
off its list, so the lists can only get shorter. Signatures over seven parameters are ruff's rule
(``PLR0913``, ``pyproject.toml``).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dramatiq_guard"
MODULE_LINES = 500
FUNCTION_LINES = 60

#: Modules over MODULE_LINES today, with their lines: each may only shrink.
LONG_MODULES: dict[str, int] = {}
#: Functions over FUNCTION_LINES today ("module:qualified name"), with their lines (none).
LONG_FUNCTIONS: dict[str, int] = {}
#: Import cycles today, each as the sorted modules it runs through (none).
CYCLES: set[tuple[str, ...]] = set()


def relative(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def sources() -> Iterator[Path]:
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix in (".py", ".lua") and "__pycache__" not in path.parts:
            yield path


def functions(path: Path) -> Iterator[tuple[str, int]]:
    """Each function of ``path`` as (qualified name, lines)."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert child.end_lineno is not None
                yield prefix + child.name, child.end_lineno - child.lineno + 1
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")

    yield from walk(ast.parse(path.read_text()), "")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports, anywhere in it."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from package import module` imports that module (and runs the package's
            # __init__ first, as every import of a submodule does: that is not counted).
            names = [f"{base}.{alias.name}" for alias in node.names]
            targets = [target for target in names if target in modules] or [base]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def cycles() -> set[tuple[str, ...]]:
    """The groups of more than one module that import each other, directly or through others."""
    paths = [path for path in sources() if path.suffix == ".py"]
    modules = {module_name(path) for path in paths}
    graph = {module_name(path): imports_of(path, modules) for path in paths}

    def reachable(start: str) -> set[str]:
        seen: set[str] = set()
        todo = list(graph[start])
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(graph[node])
        return seen

    reach = {node: reachable(node) for node in graph}
    return {
        tuple(sorted({node} | {other for other in reach[node] if node in reach[other]}))
        for node in graph
        if node in reach[node]
    }


def assert_within(sizes: dict[str, int], rule: int, listed: dict[str, int], what: str) -> None:
    """Nothing in ``sizes`` is over ``rule`` but what ``listed`` names, each no larger than listed;
    and nothing ``listed`` keeps the rule now (it must come off the list)."""
    over = {name: lines for name, lines in sizes.items() if lines > rule}
    grown = {name: lines for name, lines in over.items() if lines > listed.get(name, rule)}
    assert not grown, f"{what} over {rule} lines (or over their listed size): {grown}"
    stale = {name: sizes.get(name) for name in listed if name not in over}
    assert not stale, f"take these {what} off their list, they keep the rule now (or are gone): {stale}"


def test_no_module_is_longer_than_the_rule_or_its_listed_size() -> None:
    sizes = {relative(path): len(path.read_text().splitlines()) for path in sources()}
    assert_within(sizes, MODULE_LINES, LONG_MODULES, "modules")


def test_no_function_is_longer_than_the_rule_or_its_listed_size() -> None:
    sizes = {
        f"{relative(path)}:{name}": lines
        for path in sources()
        if path.suffix == ".py"
        for name, lines in functions(path)
    }
    assert_within(sizes, FUNCTION_LINES, LONG_FUNCTIONS, "functions")


def test_no_import_cycle_but_the_listed_ones() -> None:
    found = cycles()
    assert found <= CYCLES, f"new import cycles: {found - CYCLES}"
    assert found >= CYCLES, f"take these off CYCLES, they are gone: {CYCLES - found}"


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checker itself: two modules importing each other, one of them inside a function."""
    package = tmp_path / "dramatiq_guard"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from dramatiq_guard import b\n")
    (package / "b.py").write_text("def f():\n    from . import a\n")
    modules = {"dramatiq_guard", "dramatiq_guard.a", "dramatiq_guard.b"}
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert imports_of(package / "b.py", modules) == {"dramatiq_guard.a"}
    assert cycles() == {("dramatiq_guard.a", "dramatiq_guard.b")}
