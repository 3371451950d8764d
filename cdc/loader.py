"""Loading a handler named as ``module:function``, checked before the first entry.

A handler that cannot work (its module missing or raising at import, the attribute missing,
not callable, or called with the wrong arguments) is a broken setup, not a bad entry: it is
refused at start with exit 2 and what to fix, so that no entry is ever dead-lettered for it.

Modules are looked up in the current directory, then on ``PYTHONPATH``, then in the installed
packages (the current directory is put first on the path if it is not there yet, as when
``cdc`` runs as an installed script).
"""

from __future__ import annotations

import importlib
import inspect
import os
import site
import sys
from collections.abc import Callable, Sequence

from .errors import ConfigError

__all__ = ["check_signature", "load_callable", "search_places"]

#: the arguments `cdc consume --handler` calls its function with (see `cdc.consume.checkpoint.Apply`)
APPLY_PARAMETERS = ("conn", "entries", "consumer")


def search_places() -> str:
    """Where a handler's module is looked for, in words (not the whole sys.path)."""
    places = [f"the current directory ({os.getcwd()})"]
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    places.append(f"PYTHONPATH ({os.pathsep.join(pythonpath)})" if pythonpath else "PYTHONPATH (not set)")
    packages = [p for p in site.getsitepackages() if os.path.isdir(p)]
    places.append(f"the installed packages ({', '.join(packages) or sys.prefix})")
    return ", ".join(places[:-1]) + " and " + places[-1]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _import(module_name: str, spec: str):
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and module_name != missing and not module_name.startswith(missing + "."):
            # the module exists but imports something that does not
            raise ConfigError(f"handler {spec}: importing module {module_name} failed: {_one_line(exc)}",
                              hint=f"install {missing.split('.')[0]} or fix the module's imports "
                                   "(CDC_TRACEBACK=1 shows where)") from exc
        raise ConfigError(f"handler {spec}: no module named {module_name}, searched {search_places()}",
                          hint=f"run from the folder holding {module_name.replace('.', '/')}.py, add that folder "
                               "to PYTHONPATH, or install its package") from None
    except Exception as exc:  # noqa: BLE001 (whatever the module raised while importing)
        raise ConfigError(f"handler {spec}: importing module {module_name} failed: {_one_line(exc)}",
                          hint="fix the module (CDC_TRACEBACK=1 shows where)") from exc


def load_callable(spec: str, parameters: Sequence[str] = APPLY_PARAMETERS) -> Callable:
    """The callable named by `spec` ("module:function"), checked to accept `parameters` positionally."""
    module_name, _, attr = spec.partition(":")
    if not attr or not module_name:
        raise ConfigError(f"handler {spec!r} must be module:function", hint="for example cdc.demo.rocketrides:ride_totals")
    module = _import(module_name, spec)
    where = getattr(module, "__file__", None) or "built in"
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"handler {spec}: module {module_name} ({where}) has no attribute {attr}",
                              hint=f"name a function defined in {module_name}, as module:function") from None
    check_signature(obj, parameters, f"handler {spec} (module {module_name}, {where})")
    return obj


def check_signature(func, parameters: Sequence[str], what: str) -> None:
    """Refuse (ConfigError) a `func` that cannot be called with len(`parameters`) positional arguments."""
    wanted = f"({', '.join(parameters)})"
    if not callable(func):
        raise ConfigError(f"{what} is not callable (type {type(func).__name__})",
                          hint=f"name a function taking {wanted}")
    try:
        signature = inspect.signature(func).replace(return_annotation=inspect.Signature.empty)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: its signature cannot be read", hint=f"wrap it in a Python function {wanted}") from None
    try:
        signature.bind(*parameters)
    except TypeError as exc:
        raise ConfigError(f"{what} has the signature {signature}, cannot be called with ({', '.join(parameters)}): {exc}",
                          hint=f"the function must take {wanted}") from None
