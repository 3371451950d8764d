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
``op: r`` at the high watermark's position.

A window always closes, so the slot (held at a window's low watermark) never stays
pinned:

- a chunk whose read fails (any SQL error but a lost connection) is rolled back; one
  transaction then marks the backfill ``failed`` with its error and emits a *failed*
  watermark, which closes the window with no rows at its position;
- a chunk whose backfill changed meanwhile (superseded by `cdc recover`, failed, raced
  by a writer that had lost the slot) emits a *drop* watermark instead of its rows;
- a writer that died between its low watermark and its high (a crash, a lost
  connection) can never send its high. Each session's driver, once its own replication
  connection holds the slot, first emits a *resume* watermark: every window still open
  when the stream reaches it was opened by an earlier writer, which is gone, and is
  closed with no rows. Chunk ids carry their writer's token, so a late high of such a
  writer never closes a newer window: it is dropped, and its backfill marked failed.

Every watermark names the slot whose bridge wrote it: bridges on other slots (which
decode the same WAL) ignore it and never hold their acknowledgements for it. Because the rows travel inside the
WAL, a crash at any instant replays the same message at the same position, and
the streams' high-water marks drop what was already written: no chunk is read
twice into a stream, and progress is committed with the chunk itself. No
transaction stays open longer than one chunk. The cost is that snapshot rows are
written to the WAL once more.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson
import psycopg
from psycopg import sql

from ..errors import ConfigError, PrivilegeError
from .introductions import Introduction
from ..mapping.model import Mapping
from ..operator_sql import WHERE_HINT, Condition, SqlRefused, parse_where
from ..source.privileges import fix_for

__all__ = ["BACKFILL_DDL", "IDLE_POLL_S", "REQUEST_RETRY_S", "WATERMARK_PREFIX", "BackfillDriver", "Windows", "enqueue",
           "ensure_table", "parse_request", "request_slot", "supersede"]

log = logging.getLogger("cdc.backfill")

WATERMARK_PREFIX = "cdc.wm"
#: a logical message telling the running bridge a backfill was queued, transactional with its row. It is
#: decoded once that row's commit is flushed to the WAL, which comes before the commit is visible to
#: other sessions (a moment, or as long as a synchronous standby takes to answer): the bridge's
#: lookup can miss the row, and looks again (`BackfillDriver.request`)
REQUEST_PREFIX = "cdc.bridge.backfill"
#: while a requested backfill's row is not visible yet, the bridge looks again this often (s)
REQUEST_RETRY_S = 0.2
#: for this long (s); then it warns, and the idle look finds the row if it ever appears
REQUEST_PATIENCE_S = 60.0
#: a bridge with no backfill to write looks at `cdc_backfills` this often anyway (s): a request it
#: could not see (its row invisible, an old bridge's message form) is never left pending for good
IDLE_POLL_S = 5.0
TRUNCATED = ("<truncated>",)  # in a window's changed keys: every row of the chunk is stale

BACKFILL_DDL = """
CREATE TABLE IF NOT EXISTS public.cdc_backfills (
    id          bigserial PRIMARY KEY,
    slot        text NOT NULL,
    entity      text NOT NULL,
    where_sql   text,
    status      text NOT NULL DEFAULT 'pending',   -- pending, running, done, failed, superseded, cancelled
    error       text,                               -- why it failed or was superseded
    last_key    jsonb,                              -- resume after this key (text values, key order)
    chunks      bigint NOT NULL DEFAULT 0,
    rows_done   bigint NOT NULL DEFAULT 0,
    rows_total  bigint,                             -- estimate, for progress (exact once done)
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
)
"""


def ensure_table(conn: psycopg.Connection) -> None:
    """Create `cdc_backfills` unless it exists (cdc/sql/25_backfills.sql creates it too).

    Only a missing table is created: CREATE ... IF NOT EXISTS would need the CREATE
    privilege on the schema even when the table is there, which the bridge's role lacks.
    """
    if conn.execute("SELECT to_regclass('public.cdc_backfills') IS NOT NULL").fetchone()[0]:
        if not has_error_column(conn):  # a table from before failures were recorded: its owner adds the column
            try:
                conn.execute(ADD_ERROR_COLUMN)
            except psycopg.errors.InsufficientPrivilege:
                pass  # failures are then recorded by their status alone, until cdc init runs as the owner
        return
    try:
        conn.execute(BACKFILL_DDL)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise PrivilegeError(
            f"table public.cdc_backfills does not exist, and role {conn.info.user} may not create it: "
            f"{str(exc).strip().splitlines()[0]}",
            hint="run cdc init as the tables' owner (or what cdc sql --file 25_backfills.sql prints), "
                 f"then what cdc sql --role {conn.info.user} prints",
        ) from None


ADD_ERROR_COLUMN = "ALTER TABLE public.cdc_backfills ADD COLUMN IF NOT EXISTS error text"


def has_error_column(conn: psycopg.Connection) -> bool:
    return conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'public.cdc_backfills'::regclass "
        "AND attname = 'error' AND NOT attisdropped)"
    ).fetchone()[0]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


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
            conn.execute("SELECT pg_logical_emit_message(true, %s, %s)", (REQUEST_PREFIX, f"{slot}:{backfill_id}"))
    except psycopg.errors.InsufficientPrivilege as exc:
        raise _refused(exc, conn, "INSERT") from None
    return backfill_id


def parse_request(content: bytes | str) -> tuple[str | None, int | None]:
    """The slot a backfill request (`REQUEST_PREFIX` message) is for (None in the old form, an id alone),
    and the id of its `cdc_backfills` row (None if unreadable)."""
    text = content.decode() if isinstance(content, bytes) else content
    slot, sep, backfill_id = text.rpartition(":")
    return (slot if sep else None), (int(backfill_id) if backfill_id.isdigit() else None)


def request_slot(content: bytes | str) -> str | None:
    """The slot a backfill request (`REQUEST_PREFIX` message) is for; None in the old form (an id alone)."""
    return parse_request(content)[0]


def supersede(conn: psycopg.Connection, slot: str, entities: Sequence[str], why: str) -> list[tuple[int, str]]:
    """Mark the unfinished snapshots and backfills of `slot` for `entities` superseded; (id, entity) of each.

    `cdc recover` calls it once its rebuild holds every row of those entities: re-publishing
    them afterwards would put each row twice after the rebuild's marker.
    """
    if not entities or not conn.execute("SELECT to_regclass('public.cdc_backfills') IS NOT NULL").fetchone()[0]:
        return []
    error = ", error = %s" if has_error_column(conn) else ""
    params = [why] if error else []
    return [tuple(r) for r in conn.execute(
        f"UPDATE cdc_backfills SET status = 'superseded'{error}, updated_at = now() "
        "WHERE slot = %s AND entity = ANY(%s) AND status IN ('pending', 'running') RETURNING id, entity",
        (*params, slot, list(entities)),
    ).fetchall()]


@dataclass
class _Window:
    table: tuple[str, str]
    changed: set = field(default_factory=set)


class Windows:
    """Watermark windows seen in the stream (pure): which keys changed inside each."""

    def __init__(self) -> None:
        self.open: dict[str, _Window] = {}  # chunk id -> window
        self.tables: dict[tuple[str, str], list[_Window]] = {}
        #: entity -> the rows its stream brought since its resync marker, until the resync's last chunk
        #: (`cdc.bridge.introductions`); like an open window, it sends its table's changes the reference's way
        self.introducing: dict[str, Introduction] = {}

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

    def close_all(self) -> list[str]:
        """Close every open window (their writer is gone); the chunk ids closed."""
        chunks = list(self.open)
        self.open.clear()
        self.tables.clear()
        return chunks

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
    """Reads chunks for pending backfills of one slot and writes them into the WAL (runs in the bridge).

    One driver per session: its token names its chunks, so that a window is only ever
    closed by the writer that opened it.
    """

    def __init__(self, slot: str, mappings: Sequence[Mapping], chunk_rows: int = 1000) -> None:
        self.slot = slot
        self.mappings = {m.entity: m for m in mappings if m.table is not None}
        self.chunk_rows = chunk_rows
        self.token = secrets.token_hex(4)
        self.waiting_for: str | None = None  # chunk id whose high (or failed/drop) watermark the stream has not shown yet
        self.resumed = False  # the resume watermark is written (first thing, once per session)
        self.disabled = False
        self.idle = False  # the last look found no unfinished backfill
        self.requested: dict[int, float] = {}  # id named by a request -> when (monotonic s), until a look sees its row
        self.failed = 0
        self._error_column: bool | None = None

    def _emit(self, conn_or_cur, info: dict) -> None:
        info["slot"] = self.slot
        conn_or_cur.execute("SELECT pg_logical_emit_message(true, %s, %s)", (WATERMARK_PREFIX, orjson.dumps(info).decode()))

    def resume(self, conn: psycopg.Connection) -> None:
        """Close, at this point of the WAL, every window an earlier writer left open (see the module)."""
        if self.resumed:
            return
        try:
            self._emit(conn, {"kind": "resume", "writer": self.token})
        except psycopg.errors.InsufficientPrivilege as exc:
            # it can write no low watermark either: no window of its own can open (cdc check reports it)
            log.warning("backfills disabled: %s; a window an earlier bridge left open would hold the slot until "
                        "GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) TO %s",
                        _first_line(exc), conn.info.user)
            self.disabled = self.idle = True
        self.resumed = True

    def request(self, backfill_id: int | None) -> None:
        """The stream showed a request for this slot: its row is committed, but maybe not visible yet.

        Until a look sees that row, the driver is not idle and the session looks again every
        `REQUEST_RETRY_S`: the row shows up as soon as its commit is visible.
        """
        if backfill_id is not None:
            self.requested.setdefault(backfill_id, time.monotonic())
            self.idle = False

    def _look_for_requested(self, conn: psycopg.Connection) -> None:
        """Forget the requests whose row is visible now (whatever its status); warn of one that stays invisible."""
        visible = {r[0] for r in conn.execute("SELECT id FROM cdc_backfills WHERE id = ANY(%s)", (list(self.requested),))}
        now = time.monotonic()
        for backfill_id, since in list(self.requested.items()):
            if backfill_id in visible:
                del self.requested[backfill_id]
            elif now - since > REQUEST_PATIENCE_S:
                log.warning("backfill %d was requested %.0fs ago and its row is still not in cdc_backfills (deleted, "
                            "or its commit waits for a synchronous standby); looking for it every %.0fs from now on",
                            backfill_id, now - since, IDLE_POLL_S)
                del self.requested[backfill_id]

    def tick(self, conn: psycopg.Connection) -> bool:
        """Write the next chunk of the oldest unfinished backfill; False when there is none (yet)."""
        self.resume(conn)
        if self.waiting_for is not None or self.disabled:
            return True
        if not conn.execute("SELECT to_regclass('public.cdc_backfills') IS NOT NULL").fetchone()[0]:
            self.idle = True  # `cdc init` or `cdc backfill` creates it: the next look sees it
            return False
        if self.requested:  # first: a row seen here is seen by the next statement's snapshot too
            self._look_for_requested(conn)
        row = conn.execute(
            "SELECT id, entity, where_sql, last_key, chunks FROM cdc_backfills "
            "WHERE slot = %s AND status IN ('pending', 'running') ORDER BY id LIMIT 1",
            (self.slot,),
        ).fetchone()
        self.idle = row is None and not self.requested
        if row is None:
            return False
        backfill_id, entity, where, last_key, chunks = row
        mapping = self.mappings.get(entity)
        if mapping is None:
            log.error("backfill %d: no mapping for entity %r; cancelled", backfill_id, entity)
            conn.execute("UPDATE cdc_backfills SET status = 'cancelled', updated_at = now() WHERE id = %s", (backfill_id,))
            return self.tick(conn)  # the next one
        try:  # parsed again: what runs is composed from the parse, whoever wrote the row
            condition = where_condition(conn, mapping, where) if where else None
        except SqlRefused as exc:
            log.error("backfill %d: %s; cancelled", backfill_id, exc)
            conn.execute("UPDATE cdc_backfills SET status = 'cancelled', updated_at = now() WHERE id = %s", (backfill_id,))
            return self.tick(conn)  # the next one
        chunk_id = f"{backfill_id}:{chunks}:{self.token}"
        schema, table = mapping.table
        self._emit(conn, {"kind": "low", "chunk": chunk_id, "schema": schema, "table": table})
        self.waiting_for = chunk_id  # from here on, the window must close: with rows, dropped, or failed
        try:
            with conn.transaction():
                self._chunk(conn, mapping, backfill_id, chunk_id, condition, last_key, chunks)
        except psycopg.Error as exc:
            if conn.broken or conn.closed:
                raise  # a lost connection: the next session's resume watermark closes the window
            self.fail(conn, backfill_id, entity, chunk_id, exc)
        return True

    def _chunk(self, conn: psycopg.Connection, mapping: Mapping, backfill_id: int, chunk_id: str,
               condition: Condition | None, last_key: list | None, chunks: int) -> None:
        """Read one chunk, record the progress and emit its high watermark, all in the caller's transaction."""
        entity = mapping.entity
        schema, table = mapping.table
        key_columns = [next(f.column for f in mapping.fields if f.name == k) for k in mapping.key]
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
        with conn.cursor() as cur:
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
            # only if the backfill is still where this writer read it: not superseded, failed, or
            # advanced by a writer that had lost the slot (its row lock serialises the two)
            cur.execute(
                "UPDATE cdc_backfills SET last_key = %s, chunks = chunks + 1, rows_done = rows_done + %s, "
                "rows_total = CASE WHEN %s THEN rows_done + %s ELSE rows_total END, "  # an estimate until done
                "status = %s, updated_at = now() WHERE id = %s AND chunks = %s AND status IN ('pending', 'running')",
                (orjson.dumps(new_key).decode() if new_key is not None else None, len(rows), done, len(rows),
                 "done" if done else "running", backfill_id, chunks),
            )
            if cur.rowcount != 1:
                log.warning("backfill %d of %s changed while chunk %s was read; its rows are dropped", backfill_id,
                            entity, chunk_id)
                self._emit(cur, {"kind": "drop", "chunk": chunk_id})
                return
            high = {"kind": "high", "chunk": chunk_id, "schema": schema, "table": table, "entity": entity,
                    "columns": names, "rows": rows, "last": done}
            self._emit(cur, high)
        if done:
            log.info("backfill %d of %s: last chunk written (%d chunks)", backfill_id, entity, chunks + 1)

    def fail(self, conn: psycopg.Connection, backfill_id: int, entity: str, chunk_id: str | None,
             exc: BaseException | str) -> None:
        """Mark the backfill failed with its error and, for an open window, emit the failed watermark closing it.

        One transaction, so the failure and the window's end are in the WAL together.
        """
        error = exc if isinstance(exc, str) else _first_line(exc)
        log.error("backfill %d of %s failed: %s; streaming goes on (run cdc backfill again once fixed)",
                  backfill_id, entity, error)
        if self._error_column is None:
            self._error_column = has_error_column(conn)
        with conn.transaction():
            if self._error_column:
                conn.execute("UPDATE cdc_backfills SET status = 'failed', error = %s, updated_at = now() "
                             "WHERE id = %s AND status IN ('pending', 'running')", (error, backfill_id))
            else:
                conn.execute("UPDATE cdc_backfills SET status = 'failed', updated_at = now() "
                             "WHERE id = %s AND status IN ('pending', 'running')", (backfill_id,))
            if chunk_id is not None:
                self._emit(conn, {"kind": "failed", "chunk": chunk_id, "error": error})
        self.failed += 1

    def ours(self, chunk_id: str) -> bool:
        """A chunk this driver wrote (its token)."""
        return chunk_id.rpartition(":")[2] == self.token

    def seen(self, chunk_id: str) -> None:
        """The stream showed this chunk's closing watermark: the next chunk may be read."""
        if self.waiting_for == chunk_id:
            self.waiting_for = None
