"""Loading a handler named as ``module:function``."""

from __future__ import annotations

import importlib

from .errors import ConfigError

__all__ = ["load_callable"]


def load_callable(spec: str):
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ConfigError(f"handler {spec!r} must be module:function", hint="for example cdc.demo.rocketrides:ride_totals")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"cannot load handler {spec!r}: {exc}") from None
