"""Idempotent sinks: state that is safe to re-apply, in any order.

`TableSink` mirrors an entity into a PostgreSQL table keyed by the public key.
Every row remembers the source position ``(lsn, seq)`` of the change it holds; a
change is applied only if it is newer, and deletes leave a tombstone, so a
redelivered, duplicated or reordered entry never regresses a row or resurrects
a deleted one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import orjson
import psycopg
from psycopg import sql

from ..errors import PrivilegeError
from ..sink.entry import Entry
from .statedb import WHERE, StateConnection, StateTable

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
        self.schema = schema or "public"
        self.table = sql.Identifier(self.schema, name)
        self.name = f"{self.schema}.{name}"
        self.applied = 0

    def state_tables(self) -> list[StateTable]:
        return [StateTable(self.name, ("SELECT", "INSERT", "UPDATE"), "the consumer creates it when allowed to")]

    def on_connect(self, conn: psycopg.Connection) -> None:
        """Create the table if it is missing (only then: CREATE ... IF NOT EXISTS would need CREATE on the
        schema even when the table exists)."""
        if conn.execute("SELECT to_regclass(%s) IS NULL", (self.table.as_string(conn),)).fetchone()[0]:
            try:
                conn.execute(sql.SQL(_SCHEMA).format(table=self.table))
            except psycopg.errors.InsufficientPrivilege as exc:
                raise PrivilegeError(
                    f"table {self.name} does not exist and role {conn.info.user} may not create it {WHERE}",
                    hint=f"run: GRANT CREATE ON SCHEMA {_ident(self.schema)} TO {conn.info.user}, "
                         "or create the table as the owner (cdc.consume.table_sink has its definition)") from exc

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
                    if e.op == "u" and e.before:
                        moved = _old_key(e)
                        if moved is not None:  # the key changed: the row under the old key is gone
                            rows.append((moved, None, e.lsn, e.seq, True, False))
                    data = None if deleted else orjson.dumps(e.data).decode()
                    rows.append((orjson.dumps(e.key, option=orjson.OPT_SORT_KEYS).decode(), data, e.lsn, e.seq, deleted, bool(e.unchanged)))
            if rows:
                cur.executemany(upsert, rows)
        self.applied += len(entries)


def _old_key(e: Entry) -> str | None:
    """The update's old key as the table stores keys, when its `before` shows the key changed; else None."""
    before = e.before or {}
    if not all(name in before for name in e.key):
        return None
    old = {name: before[name] for name in e.key}
    return None if old == e.key else orjson.dumps(old, option=orjson.OPT_SORT_KEYS).decode()


def _ident(name: str) -> str:
    """`name` as SQL writes it: bare when it can be, else quoted."""
    return name if re.fullmatch(r"[a-z_][a-z0-9_$]*", name) else '"' + name.replace('"', '""') + '"'
