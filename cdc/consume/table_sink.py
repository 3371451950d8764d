"""Idempotent sinks: state that is safe to re-apply, in any order.

`TableSink` mirrors an entity into a PostgreSQL table keyed by the public key.
Every row remembers the source position ``(lsn, seq)`` of the change it holds; a
change is applied only if it is newer, and deletes leave a tombstone, so a
redelivered, duplicated or reordered entry never regresses a row or resurrects
a deleted one.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson
import psycopg
from psycopg import sql

from ..sink.entry import Entry
from .statedb import StateConnection

__all__ = ["TableSink"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS {table} (
    key      jsonb PRIMARY KEY,
    data     jsonb,
    lsn      numeric(20) NOT NULL,
    seq      bigint NOT NULL,
    deleted  boolean NOT NULL DEFAULT false
)
"""
_UPSERT = """
INSERT INTO {table} AS t (key, data, lsn, seq, deleted) VALUES (%s, %s, %s, %s, %s)
ON CONFLICT (key) DO UPDATE SET
    data = CASE WHEN %s AND NOT t.deleted THEN t.data || EXCLUDED.data ELSE EXCLUDED.data END,
    lsn = EXCLUDED.lsn, seq = EXCLUDED.seq, deleted = EXCLUDED.deleted
WHERE (t.lsn, t.seq) < (EXCLUDED.lsn, EXCLUDED.seq)
"""
_TRUNCATE = "UPDATE {table} SET data = NULL, deleted = true, lsn = %s, seq = %s WHERE (lsn, seq) < (%s, %s)"


class TableSink(StateConnection):
    """Upserts entries into `table` (created if missing); call with a batch of entries."""

    def __init__(self, dsn: str, table: str) -> None:
        super().__init__(dsn)
        schema, _, name = table.rpartition(".")
        self.table = sql.Identifier(schema or "public", name)
        self.applied = 0

    def on_connect(self, conn: psycopg.Connection) -> None:
        conn.execute(sql.SQL(_SCHEMA).format(table=self.table))

    def __call__(self, entries: Sequence[Entry]) -> None:
        upsert = sql.SQL(_UPSERT).format(table=self.table)
        truncate = sql.SQL(_TRUNCATE).format(table=self.table)
        with self.transaction() as conn, conn.cursor() as cur:
            rows = []
            for e in entries:
                if e.op in ("t", "x"):  # x: the stream was rebuilt; the rows after it are the whole table
                    if rows:
                        cur.executemany(upsert, rows)
                        rows = []
                    cur.execute(truncate, (e.lsn, e.seq, e.lsn, e.seq))
                elif e.op in ("c", "u", "r", "d"):
                    deleted = e.op == "d"
                    data = None if deleted else orjson.dumps(e.data).decode()
                    rows.append((orjson.dumps(e.key, option=orjson.OPT_SORT_KEYS).decode(), data, e.lsn, e.seq, deleted, bool(e.unchanged)))
            if rows:
                cur.executemany(upsert, rows)
        self.applied += len(entries)
