"""The compiled hot path: whether it is built, and whether it runs.

The per-change work (reading a change's tuples, converting and projecting its
values, packing its entry) has two implementations: the pure-Python modules,
which are the specification, and optional compiled twins built from ``.pyx``
files beside them (`cdc.bridge._changes`, `cdc.sink._resp`) where a C compiler
was found at install time. Both give the same bytes. Setting ``CDC_PURE_PYTHON=1``
runs the pure-Python path even where the compiled one is built.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["PURE_ENV", "load", "describe"]

PURE_ENV = "CDC_PURE_PYTHON"
_MODULES = ("cdc.bridge._changes", "cdc.sink._resp")


def _forced_pure() -> bool:
    return os.environ.get(PURE_ENV, "").strip().lower() not in ("", "0", "no", "false")


def load(name: str) -> ModuleType | None:
    """The compiled module `name`, or None when it is not built or ``CDC_PURE_PYTHON`` is set."""
    if _forced_pure():
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def describe() -> str:
    """One line for the start-up log: which implementation runs the hot path, and why."""
    if _forced_pure():
        return f"hot path: pure Python ({PURE_ENV} is set)"
    absent = [name for name in _MODULES if load(name) is None]
    if not absent:
        return "hot path: compiled"
    return ("hot path: pure Python (the compiled extension is not built: install a C compiler, "
            "then reinstall the package, e.g. make install)")
