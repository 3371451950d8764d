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
#: the same for many keys at once, each at most once: a JSON array of [key, data, lsn, seq, deleted]
#: (`{data}`: EXCLUDED.data, or for updates listing `unchanged` fields the old row's data merged with it)
_UPSERT_SET = """
INSERT INTO {table} AS t (key, data, lsn, seq, deleted)
SELECT r->0, CASE WHEN (r->>4)::boolean THEN NULL ELSE r->1 END, (r->>2)::numeric(20), (r->>3)::bigint, (r->>4)::boolean
FROM jsonb_array_elements(%s::jsonb) AS r
ON CONFLICT (key) DO UPDATE SET
    data = {data}, lsn = EXCLUDED.lsn, seq = EXCLUDED.seq, deleted = EXCLUDED.deleted
WHERE (t.lsn, t.seq) < (EXCLUDED.lsn, EXCLUDED.seq)
"""
_REPLACED = "EXCLUDED.data"
_MERGED = "CASE WHEN NOT t.deleted THEN t.data || EXCLUDED.data ELSE EXCLUDED.data END"
_TRUNCATE = "UPDATE {table} SET data = NULL, deleted = true, lsn = %s, seq = %s WHERE (lsn, seq) < (%s, %s)"

#: a row to write: (key, data, lsn, seq, deleted, merge the data into the row's)
_Row = tuple[dict, dict | None, int, int, bool, bool]
#: a row as `_Fold` keeps it under its key's JSON text: (data as JSON text, lsn, seq, deleted, merge)
_Folded = tuple[bytes | None, int, int, bool, bool]
#: the ops that write a key's row
_WRITES = frozenset(("c", "u", "r", "d"))


class _SameKeyTwice(Exception):
    """Two keys the batch told apart are one key to the table (equal as jsonb): apply row by row."""


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
        """Apply `entries` in one transaction, as if one by one in their order (each newer change of a key
        replaces the row, a truncate tombstones every older row), but a few statements for the batch: each
        key's changes are folded in Python first (`_Fold`), so every key is written once per statement.
        Keys and data go to the server as the entries carry them (their JSON text in `Entry.fields`, not
        parsed and written again; an entry without them, made in code, has its values written); a key whose
        text differs between entries while equal as jsonb shows up as two rows for one key in a statement,
        and the batch is then written row by row."""
        try:
            with self.transaction() as conn, conn.cursor() as cur:
                fold = _Fold()
                add = fold.add
                for e in entries:
                    op = e.op
                    if op in _WRITES:  # as _rows, inline: this loop is most of the sink's own CPU
                        fields = e.fields
                        key = fields.get(b"key") or _json(e.key)
                        if op == "d":
                            add(key, (None, e.lsn, e.seq, True, False))
                            continue
                        if op == "u" and e.before:
                            moved = _old_key(e)
                            if moved is not None:  # the key changed: the row under the old key is gone
                                add(_json(moved), (None, e.lsn, e.seq, True, False))
                        data = fields.get(b"data")
                        if data is None and e.data is not None:  # an entry made in code, without its fields
                            data = _json(e.data)
                        add(key, (data, e.lsn, e.seq, False, bool(e.unchanged)))
                    elif op in ("t", "x"):  # x: the stream was rebuilt; the rows after it are the whole table
                        self._write(cur, fold)
                        fold = _Fold()
                        add = fold.add
                        cur.execute(sql.SQL(_TRUNCATE).format(table=self.table), (e.lsn, e.seq, e.lsn, e.seq))
                self._write(cur, fold)
        except _SameKeyTwice:
            self._row_by_row(entries)
        self.applied += len(entries)

    def _write(self, cur: psycopg.Cursor, fold: _Fold) -> None:
        """The fold's rows: one statement per round (a key's rows that cannot be folded into one go in
        successive rounds), the rows merging `unchanged` fields apart."""
        for round_ in fold.rounds():
            for merge in (False, True):
                rows = [b"[%s,%s,%d,%d,%s]" % (key, b"null" if data is None else data, lsn, seq,
                                               b"true" if deleted else b"false")
                        for key, (data, lsn, seq, deleted, merged) in round_ if merged is merge]
                if not rows:
                    continue
                statement = sql.SQL(_UPSERT_SET).format(table=self.table, data=sql.SQL(_MERGED if merge else _REPLACED))
                try:
                    cur.execute(statement, ((b"[" + b",".join(rows) + b"]").decode(),))
                except psycopg.errors.CardinalityViolation:
                    raise _SameKeyTwice from None

    def _row_by_row(self, entries: Sequence[Entry]) -> None:
        """The same effect, one statement per row (for a batch whose keys `_Fold` cannot tell apart)."""
        upsert = sql.SQL(_UPSERT).format(table=self.table)
        truncate = sql.SQL(_TRUNCATE).format(table=self.table)
        with self.transaction() as conn, conn.cursor() as cur:
            rows = []
            for e in entries:
                if e.op in ("t", "x"):
                    if rows:
                        cur.executemany(upsert, rows)
                        rows = []
                    cur.execute(truncate, (e.lsn, e.seq, e.lsn, e.seq))
                elif e.op in ("c", "u", "r", "d"):
                    for key, data, lsn, seq, deleted, merge in _rows(e):
                        rows.append((orjson.dumps(key, option=orjson.OPT_SORT_KEYS).decode(),
                                     None if data is None else orjson.dumps(data).decode(), lsn, seq, deleted, merge))
            if rows:
                cur.executemany(upsert, rows)


def _rows(e: Entry) -> list[_Row]:
    """The rows a change writes: its key's, and for an update that changed the key, the old key's tombstone
    (at the same position) first."""
    rows: list[_Row] = []
    if e.op == "u" and e.before:
        moved = _old_key(e)
        if moved is not None:  # the key changed: the row under the old key is gone
            rows.append((moved, None, e.lsn, e.seq, True, False))
    deleted = e.op == "d"
    rows.append((e.key, None if deleted else e.data, e.lsn, e.seq, deleted, bool(e.unchanged)))
    return rows


class _Fold:
    """Each key's rows of a batch (between truncates) folded into as few as give the same table as writing
    them one by one in order, whatever the table holds: a row is written only over an older position, so

    - a row at or below a position already folded for its key never changes anything: dropped;
    - a newer row that replaces the data makes every earlier one moot: it alone is kept;
    - a newer row that merges into the data (an update listing `unchanged` fields) depends on the row
      before it: kept after it, written in the next round.

    A row is (data as JSON text or None, lsn, seq, deleted, merge the data into the row's), under its key's
    JSON text.
    """

    def __init__(self) -> None:
        self.keys: dict[bytes, list[_Folded]] = {}  # the key's JSON text -> its rows, oldest first

    def add(self, key: bytes, row: _Folded) -> None:
        rows = self.keys.get(key)
        if rows is None:
            self.keys[key] = [row]
            return
        newest = rows[-1]  # each kept row is newer than the one before
        if (row[1], row[2]) <= (newest[1], newest[2]):
            return
        if row[4]:
            rows.append(row)
        else:
            self.keys[key] = [row]

    def rounds(self) -> list[list[tuple[bytes, _Folded]]]:
        """The rows with their keys, a key at most once in each round, each key's in its order across rounds."""
        out: list[list[tuple[bytes, _Folded]]] = []
        for key, rows in self.keys.items():
            for i, row in enumerate(rows):
                if i == len(out):
                    out.append([])
                out[i].append((key, row))
        return out


def _json(value: dict) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def _old_key(e: Entry) -> dict | None:
    """The update's old key, when its `before` shows the key changed; else None."""
    before = e.before or {}
    try:
        old = {name: before[name] for name in e.key}
    except KeyError:  # no old key: it did not change
        return None
    return None if old == e.key else old


def _ident(name: str) -> str:
    """`name` as SQL writes it: bare when it can be, else quoted."""
    return name if re.fullmatch(r"[a-z_][a-z0-9_$]*", name) else '"' + name.replace('"', '""') + '"'
