"""Snapshots and online backfills, consistent with the change stream, through watermarks.

A backfill reads its table in keyset chunks while the bridge keeps streaming. Each
chunk is bracketed by two logical messages in the WAL (prefix ``cdc.wm``):

1. a *low* watermark, committed on its own;
2. one transaction that reads the chunk, records the backfill's progress
   (`cdc_backfills.last_key`), and emits the *high* watermark carrying the chunk's
   rows (their text, as pgoutput would send them).

The bridge decodes both in commit order. Keys of that table changed between the
two watermarks are dropped from the chunk (their newer change is already in the
stream, so a snapshot row never overwrites it); the rest are published as
``op: r`` at the high watermark's position. Because the rows travel inside the
WAL, a crash at any instant replays the same message at the same position, and
the streams' high-water marks drop what was already written: no chunk is read
twice into a stream, and progress is committed with the chunk itself. No
transaction stays open longer than one chunk. The cost is that snapshot rows are
written to the WAL once more.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson
import psycopg
from psycopg import sql

from ..errors import ConfigError, PrivilegeError
from ..mapping.model import Mapping
from ..operator_sql import WHERE_HINT, Condition, SqlRefused, parse_where
from ..source.privileges import fix_for

__all__ = ["BACKFILL_DDL", "WATERMARK_PREFIX", "BackfillDriver", "Windows", "enqueue", "ensure_table"]

log = logging.getLogger("cdc.backfill")

WATERMARK_PREFIX = "cdc.wm"
#: a logical message telling the running bridge a backfill was queued (no polling needed)
REQUEST_PREFIX = "cdc.bridge.backfill"
TRUNCATED = ("<truncated>",)  # in a window's changed keys: every row of the chunk is stale

BACKFILL_DDL = """
CREATE TABLE IF NOT EXISTS public.cdc_backfills (
    id          bigserial PRIMARY KEY,
    slot        text NOT NULL,
    entity      text NOT NULL,
    where_sql   text,
    status      text NOT NULL DEFAULT 'pending',   -- pending, running, done
    last_key    jsonb,                              -- resume after this key (text values, key order)
    chunks      bigint NOT NULL DEFAULT 0,
    rows_done   bigint NOT NULL DEFAULT 0,
    rows_total  bigint,                             -- estimate, for progress (exact once done)
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
)
"""


def ensure_table(conn: psycopg.Connection) -> None:
    """Create `cdc_backfills` unless it exists (sql/25_backfills.sql creates it too).

    Only a missing table is created: CREATE ... IF NOT EXISTS would need the CREATE
    privilege on the schema even when the table is there, which the bridge's role lacks.
    """
    if conn.execute("SELECT to_regclass('public.cdc_backfills') IS NOT NULL").fetchone()[0]:
        return
    try:
        conn.execute(BACKFILL_DDL)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise PrivilegeError(
            f"table public.cdc_backfills does not exist, and role {conn.info.user} may not create it: "
            f"{str(exc).strip().splitlines()[0]}",
            hint="run cdc init as the tables' owner (or apply sql/25_backfills.sql), then sql/30_grants.sql",
        ) from None


def _refused(exc: psycopg.Error, conn: psycopg.Connection, need: str) -> PrivilegeError:
    text = str(exc).strip().splitlines()[0]
    return PrivilegeError(f"postgres refused: {text}", hint=fix_for(text, conn.info.user, need))


def table_columns(conn: psycopg.Connection, schema: str, table: str) -> list[str]:
    """The live columns of a table (none when it does not exist)."""
    return [r[0] for r in conn.execute(
        "SELECT attname FROM pg_catalog.pg_attribute WHERE attrelid = to_regclass(quote_ident(%s) || '.' || quote_ident(%s)) "
        "AND attnum > 0 AND NOT attisdropped ORDER BY attnum", (schema, table),
    )]


def where_condition(conn: psycopg.Connection, mapping: Mapping, where: str) -> Condition:
    """An operator's --where, parsed into the allowlisted grammar against the table's columns
    (`cdc.operator_sql`): the SQL that runs is composed from the parse, never the text itself."""
    schema, table = mapping.table
    return parse_where(where, table_columns(conn, schema, table), f"{schema}.{table}")


def enqueue(conn: psycopg.Connection, slot: str, mapping: Mapping, where: str | None = None) -> int:
    """Ask the bridge on `slot` to (re)publish `mapping`'s table as `r` entries.

    A condition is only validated here (parsed, then planned without running in a
    READ ONLY transaction, which also estimates the rows for progress): the bridge
    alone evaluates it, from the text recorded in `cdc_backfills`, parsed again.
    """
    if mapping.table is None:
        raise ConfigError(f"entity {mapping.entity!r} has no table to backfill")
    schema, table = mapping.table
    ident = sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(table))
    condition = where_condition(conn, mapping, where) if where is not None else None  # "" too: refused as empty
    try:
        if condition is None:
            total = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(ident)).fetchone()[0]
        else:
            with conn.transaction():
                conn.execute("SET TRANSACTION READ ONLY")
                plan = conn.execute(sql.SQL("EXPLAIN (FORMAT JSON) SELECT 1 FROM {} WHERE ").format(ident)
                                    + condition.sql, condition.params).fetchone()[0]
            total = int(plan[0]["Plan"]["Plan Rows"])
    except psycopg.errors.InsufficientPrivilege as exc:
        raise _refused(exc, conn, "SELECT") from None
    except psycopg.OperationalError:
        raise
    except psycopg.Error as exc:
        raise ConfigError(f"backfill of {mapping.entity}: --where on {schema}.{table}: "
                          f"{str(exc).strip().splitlines()[0]}", hint=WHERE_HINT) from None
    try:
        with conn.transaction():
            backfill_id = conn.execute(
                "INSERT INTO cdc_backfills (slot, entity, where_sql, rows_total) VALUES (%s, %s, %s, %s) RETURNING id",
                (slot, mapping.entity, where, total),
            ).fetchone()[0]
            conn.execute("SELECT pg_logical_emit_message(true, %s, %s)", (REQUEST_PREFIX, str(backfill_id)))
    except psycopg.errors.InsufficientPrivilege as exc:
        raise _refused(exc, conn, "INSERT") from None
    return backfill_id


@dataclass
class _Window:
    table: tuple[str, str]
    changed: set = field(default_factory=set)


class Windows:
    """Watermark windows seen in the stream (pure): which keys changed inside each."""

    def __init__(self) -> None:
        self.open: dict[str, _Window] = {}  # chunk id -> window
        self.tables: dict[tuple[str, str], list[_Window]] = {}

    def low(self, chunk: str, table: tuple[str, str]) -> None:
        self.close(chunk)
        window = self.open[chunk] = _Window(table)
        self.tables.setdefault(table, []).append(window)

    def changed(self, table: tuple[str, str], key: tuple) -> None:
        for window in self.tables.get(table, ()):
            window.changed.add(key)

    def truncated(self, table: tuple[str, str]) -> None:
        for window in self.tables.get(table, ()):
            window.changed.add(TRUNCATED)

    def close(self, chunk: str) -> set | None:
        """Close a window; the keys changed inside it (None if its low watermark was not seen)."""
        window = self.open.pop(chunk, None)
        if window is None:
            return None
        windows = self.tables[window.table]
        windows.remove(window)
        if not windows:
            del self.tables[window.table]
        return window.changed


class BackfillDriver:
    """Reads chunks for pending backfills of one slot and writes them into the WAL (runs in the bridge)."""

    def __init__(self, slot: str, mappings: Sequence[Mapping], chunk_rows: int = 1000) -> None:
        self.slot = slot
        self.mappings = {m.entity: m for m in mappings if m.table is not None}
        self.chunk_rows = chunk_rows
        self.waiting_for: str | None = None  # chunk id whose high watermark the stream has not shown yet
        self.disabled = False
        self.idle = False  # the last look found no unfinished backfill

    def tick(self, conn: psycopg.Connection) -> bool:
        """Write the next chunk of the oldest unfinished backfill; False when there is none."""
        if self.waiting_for is not None:
            return True
        if not conn.execute("SELECT to_regclass('public.cdc_backfills') IS NOT NULL").fetchone()[0]:
            self.disabled = self.idle = True  # `cdc init` creates it
            return False
        row = conn.execute(
            "SELECT id, entity, where_sql, last_key, chunks FROM cdc_backfills "
            "WHERE slot = %s AND status IN ('pending', 'running') ORDER BY id LIMIT 1",
            (self.slot,),
        ).fetchone()
        self.idle = row is None
        if row is None:
            return False
        backfill_id, entity, where, last_key, chunks = row
        mapping = self.mappings.get(entity)
        if mapping is None:
            log.error("backfill %d: no mapping for entity %r; cancelled", backfill_id, entity)
            conn.execute("UPDATE cdc_backfills SET status = 'cancelled', updated_at = now() WHERE id = %s", (backfill_id,))
            return True
        try:  # parsed again: what runs is composed from the parse, whoever wrote the row
            condition = where_condition(conn, mapping, where) if where else None
        except SqlRefused as exc:
            log.error("backfill %d: %s; cancelled", backfill_id, exc)
            conn.execute("UPDATE cdc_backfills SET status = 'cancelled', updated_at = now() WHERE id = %s", (backfill_id,))
            return True
        chunk_id = f"{backfill_id}:{chunks}"
        schema, table = mapping.table
        key_columns = [next(f.column for f in mapping.fields if f.name == k) for k in mapping.key]
        low = {"kind": "low", "chunk": chunk_id, "schema": schema, "table": table}
        conn.execute("SELECT pg_logical_emit_message(true, %s, %s)", (WATERMARK_PREFIX, orjson.dumps(low).decode()))
        ident = sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(table))
        keys_sql = sql.SQL(", ").join(sql.Identifier(c) for c in key_columns)
        conditions = []
        params: list = []
        if last_key is not None:
            conditions.append(sql.SQL("({}) > ({})").format(keys_sql, sql.SQL(", ").join(sql.Placeholder() * len(key_columns))))
            params += last_key
        if condition is not None:
            conditions.append(condition.sql)
            params += condition.params
        query = sql.SQL("SELECT * FROM {}").format(ident)
        if conditions:
            query += sql.SQL(" WHERE ") + sql.SQL(" AND ").join(conditions)
        query += sql.SQL(" ORDER BY {} LIMIT {}").format(keys_sql, sql.Literal(self.chunk_rows))
        with conn.transaction(), conn.cursor() as cur:
            # the read (and so the --where) runs read-only: a savepoint can turn a transaction read-only,
            # and rolling back to it makes it writable again for the progress row and the watermark
            cur.execute("SAVEPOINT cdc_chunk_read")
            cur.execute("SET LOCAL transaction_read_only = on")
            cur.execute(query, params, prepare=False)
            result = cur.pgresult  # the text the server sent, as pgoutput would send it
            names = [result.fname(i).decode() for i in range(result.nfields)]
            rows = [
                [None if (v := result.get_value(r, c)) is None else v.decode() for c in range(result.nfields)]
                for r in range(result.ntuples)
            ]
            cur.execute("ROLLBACK TO SAVEPOINT cdc_chunk_read")
            positions = [names.index(c) for c in key_columns]
            done = len(rows) < self.chunk_rows
            new_key = [rows[-1][i] for i in positions] if rows else last_key
            cur.execute(
                "UPDATE cdc_backfills SET last_key = %s, chunks = chunks + 1, rows_done = rows_done + %s, "
                "rows_total = CASE WHEN %s THEN rows_done + %s ELSE rows_total END, "  # an estimate until done
                "status = %s, updated_at = now() WHERE id = %s",
                (orjson.dumps(new_key).decode() if new_key is not None else None, len(rows), done, len(rows),
                 "done" if done else "running", backfill_id),
            )
            high = {"kind": "high", "chunk": chunk_id, "schema": schema, "table": table, "entity": entity,
                    "columns": names, "rows": rows, "last": done}
            cur.execute("SELECT pg_logical_emit_message(true, %s, %s)", (WATERMARK_PREFIX, orjson.dumps(high).decode()))
        self.waiting_for = chunk_id
        if done:
            log.info("backfill %d of %s: last chunk written (%d chunks)", backfill_id, entity, chunks + 1)
        return True

    def seen(self, chunk_id: str) -> None:
        """The stream showed this chunk's high watermark: the next chunk may be read."""
        if self.waiting_for == chunk_id:
            self.waiting_for = None
