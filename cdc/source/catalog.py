"""Reading PostgreSQL's catalog on an ordinary connection: types and table shapes.

Used when a Relation message names types the converter does not know (enums,
domains, their arrays) and by `cdc check` / `cdc schema` to bind mappings to the
live schema with the same code the stream uses.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import psycopg

from ..errors import MappingError
from .shapes import ColumnShape, TableShape
from .values import TYPE_QUERY, TypeCatalog, type_info_from_row

__all__ = ["live_shape", "load_types", "partition_root", "table_shape"]

TABLE_QUERY = """
SELECT c.relreplident::text, c.relkind = 'p', a.attname, a.atttypid::int,
       COALESCE(a.attnum = ANY(i.indkey::int2[]), false) AS is_key
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
LEFT JOIN LATERAL (
    SELECT x.indkey FROM pg_index x
    WHERE x.indrelid = c.oid
      AND ((c.relreplident = 'd' AND x.indisprimary) OR (c.relreplident = 'i' AND x.indisreplident))
    LIMIT 1
) i ON true
WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')
ORDER BY a.attnum
"""

# a partition of a partitioned table that is not REPLICA IDENTITY FULL, and its identity columns
PARTIAL_LEAF_QUERY = """
SELECT format('%%I.%%I', ln.nspname, lc.relname),
       ARRAY(SELECT a.attname::text FROM pg_index x JOIN pg_attribute a ON a.attrelid = lc.oid
             AND a.attnum = ANY(x.indkey::int2[])
             WHERE x.indrelid = lc.oid
               AND ((lc.relreplident = 'd' AND x.indisprimary) OR (lc.relreplident = 'i' AND x.indisreplident)))
FROM pg_partition_tree(format('%%I.%%I', %s::text, %s::text)::regclass) t
JOIN pg_class lc ON lc.oid = t.relid JOIN pg_namespace ln ON ln.oid = lc.relnamespace
WHERE t.isleaf AND lc.relreplident <> 'f'
ORDER BY 1 LIMIT 1
"""

if TYPE_CHECKING:
    from ..mapping.model import Mapping


def load_types(conn: psycopg.Connection, catalog: TypeCatalog, oids: Iterable[int]) -> None:
    """Add to `catalog` every type among `oids` it does not know, with what they point to."""
    missing = catalog.missing(oids)
    if not missing:
        return
    for row in conn.execute(TYPE_QUERY, (sorted(missing),)).fetchall():
        catalog.add(type_info_from_row(row))


def table_shape(conn: psycopg.Connection, schema: str, name: str) -> TableShape | None:
    """The table's columns and replica identity as pgoutput would describe them; None if absent."""
    rows = conn.execute(TABLE_QUERY, (schema, name)).fetchall()
    if not rows:
        return None
    identity, partitioned = rows[0][0], rows[0][1]
    columns = tuple(
        ColumnShape(name=attname, type_oid=typid, key=(identity == "f" or bool(is_key)))
        for _, _, attname, typid, is_key in rows
    )
    leaf = conn.execute(PARTIAL_LEAF_QUERY, (schema, name)).fetchone() if partitioned and identity == "f" else None
    return TableShape(schema=schema, name=name, columns=columns, replica_identity=identity,
                      partial_leaf=leaf[0] if leaf else "", leaf_identity=tuple(leaf[1]) if leaf else ())


def partition_root(conn: psycopg.Connection, relid: int) -> tuple[str, str, str] | None:
    """(schema, name, replica identity) of the partitioned table at the top of the partition `relid`'s tree; None
    when it is no partition (or gone)."""
    row = conn.execute(
        "SELECT n.nspname::text, c.relname::text, c.relreplident::text FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.oid = pg_partition_root(%s::oid::regclass) AND c.oid <> %s::oid", (relid, relid)).fetchone()
    return None if row is None else (row[0], row[1], row[2])


def live_shape(conn: psycopg.Connection, mapping: Mapping, catalog: TypeCatalog) -> TableShape:
    """The shape of a mapping's table now, its column types added to `catalog`; a missing table is refused
    (`MappingError`, the mapping's file:line)."""
    assert mapping.table is not None
    schema, name = mapping.table
    shape = table_shape(conn, schema, name)
    if shape is None:
        raise MappingError(f"{mapping.where}: entity {mapping.entity!r}: table {schema}.{name} does not exist",
                           hint="create it or fix table:")
    load_types(conn, catalog, [c.type_oid for c in shape.columns])
    return shape
