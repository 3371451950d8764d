"""Consuming the streams: consumer groups with leases, exact state, replay and dead letters.

The public names a consumer needs are importable from here::

    from cdc.consume import Consumer, TransactionalHandler, TableSink
"""

from .checkpoint import Fenced, TransactionalHandler
from .consumer import Consumer
from .table_sink import TableSink
from ..sink.entry import Entry

__all__ = ["Consumer", "Entry", "Fenced", "TableSink", "TransactionalHandler"]
