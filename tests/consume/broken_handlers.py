"""Handlers that cannot work, for `cdc consume --handler broken_handlers:...` (this folder on PYTHONPATH):
each must be refused at start, never counted against an entry."""

from __future__ import annotations

not_callable = 42


def two_arguments(conn, entries) -> None:
    """One argument short of apply(conn, entries, consumer)."""


def keyword_only(*, conn, entries, consumer) -> None:
    """The right names, but not positional."""
