"""Benchmark scenarios: every module in this package is imported by :func:`load_all`."""

from __future__ import annotations

import importlib
import pkgutil


def load_all() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
