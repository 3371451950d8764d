"""The compiled hot path: whether it is built, and which implementation runs.

The per-change work (reading a change's tuples, converting and projecting its
values, packing its entry) has two implementations with the same interface: the
pure-Python modules, which are the specification (`cdc.bridge.changes`,
`cdc.sink.lane`), and optional compiled twins built from ``.pyx`` files beside
them (`cdc.bridge._changes`, `cdc.sink._resp`, their interface in the ``.pyi``
stubs beside them) where a C compiler was found at install time. Both give the
same bytes.

``CDC_IMPL`` picks one: ``pure``, or ``compiled`` (an error at start when it is not
built, never a silent fall-back); unset, the compiled one where it is built, else the
pure one, said in the start-up log line (`describe`). ``CDC_PURE_PYTHON=1`` is a
synonym of ``CDC_IMPL=pure``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from types import ModuleType

from .errors import ConfigError

__all__ = ["IMPL_ENV", "PURE_ENV", "check", "chosen", "load", "describe"]

IMPL_ENV = "CDC_IMPL"
PURE_ENV = "CDC_PURE_PYTHON"
_IMPLS = ("pure", "compiled")
_MODULES = ("cdc.bridge._changes", "cdc.sink._resp", "cdc.sink._entries")
_BUILD_HINT = "install a C compiler, then reinstall the package, e.g. make install"


def _forced_pure(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(PURE_ENV, "").strip().lower() not in ("", "0", "no", "false")


def chosen(env: Mapping[str, str] = os.environ) -> str | None:
    """The implementation asked for: "pure", "compiled", or None (unset: compiled where built)."""
    impl = env.get(IMPL_ENV, "").strip().lower()
    if _forced_pure(env):
        return "pure"
    return impl if impl in _IMPLS else None


def _missing() -> list[str]:
    """The compiled modules that do not import, each with why."""
    absent = []
    for name in _MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            absent.append(f"{name}: {exc}")
    return absent


def check(env: Mapping[str, str] = os.environ) -> None:
    """Raise `ConfigError` when ``CDC_IMPL`` is not a known value, contradicts ``CDC_PURE_PYTHON``, or
    asks for the compiled path where it is not built."""
    impl = env.get(IMPL_ENV, "").strip().lower()
    if impl and impl not in _IMPLS:
        raise ConfigError(f"environment variable {IMPL_ENV}: {impl!r} is not an implementation of the hot path",
                          hint=f"set {IMPL_ENV}=pure or {IMPL_ENV}=compiled, or unset it (compiled where built)")
    if impl == "compiled" and _forced_pure(env):
        raise ConfigError(f"environment variables {IMPL_ENV}=compiled and {PURE_ENV} ask for both implementations",
                          hint=f"unset {PURE_ENV}, or set {IMPL_ENV}=pure")
    if impl == "compiled":
        absent = _missing()
        if absent:
            raise ConfigError(f"environment variable {IMPL_ENV}=compiled: the compiled hot path is not built "
                              f"({'; '.join(absent)})",
                              hint=f"{_BUILD_HINT}; or set {IMPL_ENV}=pure, or unset it to run the pure path")


def load(name: str) -> ModuleType | None:
    """The compiled module `name`, or None when the pure path runs (asked for, or not built).

    Never raises, so importing the package does not fail: `check`, at start (every
    command's settings load), refuses ``CDC_IMPL=compiled`` where it is not built.
    """
    if chosen() == "pure":
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def describe() -> str:
    """One line for the start-up log: which implementation runs the hot path, and why."""
    impl = chosen()
    if impl == "pure":
        return f"hot path: pure Python ({PURE_ENV} is set)" if _forced_pure() else f"hot path: pure Python ({IMPL_ENV}=pure)"
    if not _missing():
        return "hot path: compiled" if impl is None else f"hot path: compiled ({IMPL_ENV}=compiled)"
    return f"hot path: pure Python (the compiled extension is not built: {_BUILD_HINT})"
