"""The demo's options, shared by `cdc demo` and `python -m cdc.demo` (`make run`); light to import, so the
command line's parser can hold them without loading the demo."""

from __future__ import annotations

import argparse
import math
import os

__all__ = ["add_arguments", "DEFAULT_ROOT", "ports"]

#: where the demo keeps its servers' files unless told otherwise: a folder of the current directory
DEFAULT_ROOT = "cdc-demo"


def _port(text: str) -> int:
    value = int(text)  # a ValueError: argparse says "invalid _port value"
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0 to 65535; 0: a free one)")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate (more than 0 per second)")
    return value


def ports(args: argparse.Namespace) -> tuple[int, int, int]:
    """(PostgreSQL, Redis, HTTP) ports: each option, else its CDC_DEMO_* variable, else 0 (a free port).
    The variables are read when the demo starts (never while any other command builds its parser)."""
    found = []
    for option, name in (("pg_port", "CDC_DEMO_PG_PORT"), ("redis_port", "CDC_DEMO_REDIS_PORT"), ("http_port", "CDC_DEMO_HTTP_PORT")):
        value = getattr(args, option)
        if value is None:
            try:
                value = _port(os.environ.get(name, "") or "0")
            except (ValueError, argparse.ArgumentTypeError):
                from ..errors import ConfigError

                raise ConfigError(f"{name}={os.environ[name]!r} is not a TCP port", hint="give 0 to 65535 (0: a free port)") from None
        found.append(value)
    return found[0], found[1], found[2]


def add_arguments(parser: argparse.ArgumentParser, root: str = DEFAULT_ROOT) -> None:
    parser.add_argument("--root", default=root, help="the folder where the servers keep their files (kept between runs)")
    parser.add_argument("--pg-port", type=_port,
                        help="PostgreSQL's port (default: a free port; CDC_DEMO_PG_PORT)")
    parser.add_argument("--redis-port", type=_port,
                        help="Redis' port (default: a free port; CDC_DEMO_REDIS_PORT)")
    parser.add_argument("--http-port", type=_port,
                        help="where /metrics, /healthz, /readyz are served (default: a free port; CDC_DEMO_HTTP_PORT)")
    parser.add_argument("--rate", type=_rate, default=2.0, help="writer transactions per second")
    parser.add_argument("--seconds", type=_seconds, default=0, help="stop after this long (0: until Ctrl-C)")
