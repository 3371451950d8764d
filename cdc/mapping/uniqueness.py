"""Whether a mapping's key names at most one row of its table, as the catalog proves it.

A key is provably unique when its columns cover those of the primary key, of the replica
identity index, or of a unique index (valid, not partial, on columns only, checked at once
rather than deferred) whose columns are all NOT NULL. A key field cast other than to
`string` does not count: a cast may give two values the same public form. Consumers
that keep state by key (the table sink, any read model) need this: two rows under one
key overwrite each other, and a delete of one tombstones the other.
"""

from __future__ import annotations

from typing import NamedTuple

import psycopg

from ..errors import MappingError
from .model import Mapping

__all__ = ["key_uniqueness_problem"]

_INDEXES = """
SELECT x.indisprimary, x.indisreplident, x.indimmediate,
       array_agg(a.attname::text ORDER BY k.ord), bool_and(a.attnotnull)
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_index x ON x.indrelid = c.oid
CROSS JOIN LATERAL unnest(x.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum
WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')
  AND x.indisunique AND x.indisvalid AND x.indpred IS NULL AND x.indexprs IS NULL AND k.ord <= x.indnkeyatts
GROUP BY x.indexrelid, x.indisprimary, x.indisreplident, x.indimmediate
ORDER BY NOT x.indisprimary, x.indexrelid
"""


class _Index(NamedTuple):
    primary: bool
    identity: bool
    immediate: bool
    columns: tuple[str, ...]
    not_null: bool


def _ident(name: str) -> str:
    return name if name.isidentifier() and name == name.lower() else '"' + name.replace('"', '""') + '"'


def key_uniqueness_problem(conn: psycopg.Connection, mapping: Mapping) -> MappingError | None:
    """Why `mapping`'s key may name two rows of its table (the error to report), or None when it cannot.

    None too for a message mapping or a table that does not exist (reported where the mapping is bound).
    """
    if mapping.table is None:
        return None
    schema, name = mapping.table
    absent = conn.execute("SELECT to_regclass(format('%%I.%%I', %s::text, %s::text)) IS NULL", (schema, name)).fetchone()
    if absent is None or absent[0]:
        return None
    indexes = [_Index(p, r, i, tuple(cols), bool(nn)) for p, r, i, cols, nn in conn.execute(_INDEXES, (schema, name))]
    by_name = {f.name: f for f in mapping.fields}
    key_columns = [by_name[k].column for k in mapping.key]
    exact = {c for k, c in zip(mapping.key, key_columns) if c is not None and by_name[k].cast in (None, "string")}
    for ix in indexes:
        if set(ix.columns) <= exact and ix.immediate and (ix.primary or ix.identity or ix.not_null):
            return None
    table = f"{_ident(schema)}.{_ident(name)}"
    listed = ", ".join(mapping.key)
    why = "no primary key or unique index with NOT NULL columns is among its columns"
    covered = [ix for ix in indexes if set(ix.columns) <= exact]
    if covered:
        ix = covered[0]
        why = (
            "the unique index on its columns ("
            + ", ".join(ix.columns)
            + ") "
            + ("is deferrable" if not ix.immediate else "allows NULLs, which never collide")
        )
    elif len(exact) < len(set(c for c in key_columns if c is not None)):
        why += " (a key field cast other than to string does not count)"
    columns = [c for c in dict.fromkeys(key_columns) if c is not None]
    nullable = {
        c
        for (c,) in conn.execute(
            "SELECT attname::text FROM pg_attribute WHERE attrelid = to_regclass(format('%%I.%%I', %s::text, %s::text)) "
            "AND attnum > 0 AND NOT attisdropped AND NOT attnotnull",
            (schema, name),
        )
    }
    actions = [f"ALTER COLUMN {_ident(c)} SET NOT NULL" for c in columns if c in nullable]
    actions.append(f"ADD UNIQUE ({', '.join(_ident(c) for c in columns)})")
    fix = f"run: ALTER TABLE {table} {', '.join(actions)}"
    primary = next((ix for ix in indexes if ix.primary), None)
    if primary is not None:
        fix += f", or key on the primary key ({', '.join(primary.columns)})"
    else:
        fix += ", or choose a key that is a primary key or such a unique index"
    return MappingError(
        f"{mapping.key_where or mapping.where}: entity {mapping.entity!r}: key [{listed}] may name several rows "
        f"of {schema}.{name}: {why}, so a consumer keeping state by key would merge rows",
        hint=fix,
    )
