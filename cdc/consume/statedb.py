"""The PostgreSQL connection a consumer keeps its state in: opened lazily, reopened after a failure."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

__all__ = ["StateConnection"]


class StateConnection:
    """Base of the handlers that write consumer state (`cdc.consume.checkpoint`, `cdc.consume.table_sink`)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn: psycopg.Connection | None = None

    def on_connect(self, conn: psycopg.Connection) -> None:
        """Called once per new connection (create tables, set session options)."""

    def connection(self) -> psycopg.Connection:
        if self.conn is None or self.conn.closed:
            self.conn = psycopg.connect(self.dsn, autocommit=True)
            self.on_connect(self.conn)
        return self.conn

    @contextmanager
    def transaction(self) -> Iterator[psycopg.Connection]:
        """One transaction on the state connection; a connection that broke in it is dropped."""
        conn = self.connection()
        try:
            with conn.transaction():
                yield conn
        except psycopg.OperationalError:
            self.forget()
            raise

    def forget(self) -> None:
        """Drop a broken connection; the next batch reconnects (its entries are still pending)."""
        if self.conn is not None:
            self.conn.close()
        self.conn = None

    def close(self) -> None:
        self.forget()
