"""A snapshot of the source with an exact position in the change stream.

A temporary logical slot is created on a replication connection with
``CREATE_REPLICATION_SLOT ... TEMPORARY LOGICAL pgoutput (SNAPSHOT 'export')``.
The server answers with ``consistent_point`` (the *position*) and the name of an
exported snapshot, which other sessions import with ``SET TRANSACTION SNAPSHOT``
for as long as this connection stays open (closing it drops the slot).

The rule, exactly: a transaction whose commit record starts before the
position is visible in the snapshot; one whose commit record starts at or after
it is not, and logical decoding (our bridge's slot included) delivers it. Every
stream entry carries its transaction's commit LSN (``lsn``, the start of the
commit record, pgoutput's ``final_lsn``), so an entry is *after* the snapshot
exactly when ``lsn >= position``. ``tests/test_reconcile.py`` tests the boundary
with a writer committing throughout the slot's creation.
"""

from __future__ import annotations

import logging
import os
import time

import psycopg

from ..errors import CdcError, SourceError
from ..source.lsn import Lsn
from ..source.replication import SESSION_OPTIONS, classify_pg_error, quote_ident

__all__ = ["ExportedSnapshot", "import_snapshot"]

log = logging.getLogger("cdc.snapshot")


class ExportedSnapshot:
    """Context manager: `position` (Lsn) and `name` (the snapshot to import) while open."""

    def __init__(self, dsn: str, label: str = "reconcile") -> None:
        self.dsn = dsn
        self.label = label  # the cdc command taking the snapshot
        self.slot = f"cdc_{label}_{os.getpid()}_{int(time.time() * 1000) % 10**9}".replace("-", "_")
        self.conn: psycopg.Connection | None = None
        self.position = Lsn(0)
        self.name = ""

    def __enter__(self) -> "ExportedSnapshot":
        try:
            self.conn = psycopg.connect(
                self.dsn, replication="database", autocommit=True, options=SESSION_OPTIONS, connect_timeout=10
            )
            row = self.conn.execute(
                f"CREATE_REPLICATION_SLOT {quote_ident(self.slot)} TEMPORARY LOGICAL pgoutput (SNAPSHOT 'export')"
            ).fetchone()
        except psycopg.Error as exc:
            self.close()
            err = classify_pg_error(exc)
            if "replication slots are in use" in str(exc) or "max_replication_slots" in str(exc):
                err = SourceError(f"cannot take the snapshot: {str(exc).strip()}",
                                  hint=f"raise max_replication_slots by one for the temporary slot of cdc {self.label}")
            raise err from None
        if row is None or row[2] is None:
            self.close()
            raise CdcError("the server did not export a snapshot for the temporary slot")
        self.position = Lsn.parse(row[1])
        self.name = row[2]
        log.debug("snapshot %s exported at position %s (temporary slot %s)", self.name, self.position, self.slot)
        return self

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def __exit__(self, *exc) -> None:
        self.close()


def import_snapshot(conn: psycopg.Connection, name: str) -> str:
    """Begin a REPEATABLE READ transaction on `conn` that sees exactly the exported snapshot `name`;
    returns it as ``pg_current_snapshot()`` shows it, to compare other importers with."""
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")  # it reads the operator's source.query
    conn.execute(f"SET TRANSACTION SNAPSHOT '{name}'")
    return conn.execute("SELECT pg_current_snapshot()::text").fetchone()[0]


def session_init_statement(name: str) -> str:
    """What each JDBC connection runs first to read under the snapshot (needs autocommit off), read-only."""
    return f"SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY; SET TRANSACTION SNAPSHOT '{name}'"
