"""Consuming the streams: consumer groups with leases, exact state, replay and dead letters.

The public names a consumer needs are importable from here::

    from cdc.consume import Consumer, TransactionalHandler, TableSink

Each is imported on first use: the command line reads the consumer's defaults
(`cdc.consume.defaults`) without loading the consumer, Redis' asyncio client or psycopg's.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .checkpoint import Fenced, TransactionalHandler
    from .consumer import Consumer
    from .table_sink import TableSink
    from ..sink.entry import Entry

__all__ = ["Consumer", "Entry", "Fenced", "TableSink", "TransactionalHandler"]

#: public name -> the module defining it
_WHERE = {"Consumer": ".consumer", "Entry": "..sink.entry", "Fenced": ".checkpoint", "TableSink": ".table_sink",
          "TransactionalHandler": ".checkpoint"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value
