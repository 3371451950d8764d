"""What the publication covers of each mapped table, read from the catalog in one query.

pgoutput sends a change only for a table the publication covers, judged as of the
change's WAL position: a table missing from it sends nothing at all, so the stream
cannot tell the bridge that a mapped table left the publication, was dropped and
re-created (a new table, not in it), renamed, or lost its replica identity. The
catalog can: `cdc init`, `cdc check` and the bridge's ack gate (`cdc.bridge.gate`)
all judge a table with this one reading.

What counts as covered is what pgoutput actually publishes under the table's own
name (``pg_publication_tables``): a partitioned table only with
``publish_via_partition_root``, else its changes come as those of its partitions.
Membership (``pg_publication_rel``) is a different thing: a partitioned table can be a
member and still publish nothing under its name, and adding a member again fails.

The same reading gives what `cdc.source.pubcolumns` judges the column lists by: the table's
columns, the replica identity columns of it and its partitions (or that one is FULL), the
publication's column list for it and whether a row filter applies (PostgreSQL 15 and later).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import psycopg

from ..errors import SlotError, SourceError

__all__ = ["PUBLISH", "Publication", "TableCoverage", "identity_problem", "operations_problem", "publication_problem",
           "publish_value", "read_coverage", "read_publication", "where_is"]

#: a mapping's op and the publication's ``publish`` operation that sends it (pg_publication's pubinsert, ...)
PUBLISH = {"c": "insert", "u": "update", "d": "delete", "t": "truncate"}

PUBLICATION_QUERY = """
SELECT puballtables, pubviaroot, pubupdate OR pubdelete, {schemas}, pubinsert, pubupdate, pubdelete, pubtruncate,
       p.oid::int8
FROM pg_publication p WHERE pubname = %s
"""
# PostgreSQL 15 and later: FOR TABLES IN SCHEMA (no column list may then be given)
_SCHEMAS = "EXISTS (SELECT 1 FROM pg_publication_namespace s WHERE s.pnpubid = p.oid)"
# PostgreSQL 15 and later: the member's column list (NULL: every column) and whether it has a row filter
_LIST = """(SELECT array_agg(a.attname::text ORDER BY a.attnum) FROM pg_publication_rel r JOIN pub ON pub.oid = r.prpubid
        JOIN pg_attribute a ON a.attrelid = r.prrelid AND a.attnum = ANY(r.prattrs::int2[])
        WHERE r.prrelid = f.oid AND r.prattrs IS NOT NULL)"""
_ROW_FILTER = "EXISTS (SELECT 1 FROM pg_publication_rel r JOIN pub ON pub.oid = r.prpubid WHERE r.prrelid = f.oid AND r.prqual IS NOT NULL)"

# one row per (schema, name) asked; oid NULL when no such table. `leaves`: the tables that hold its
# rows (itself, or its leaf partitions); `bad_identity`: the first of them whose replica identity
# cannot carry updates and deletes, as "<qualified name> <relreplident>".
COVERAGE_QUERY = """
WITH asked(schema, name) AS (SELECT * FROM unnest(%(schemas)s::text[], %(names)s::text[])),
pub AS (SELECT oid, puballtables, pubviaroot FROM pg_publication WHERE pubname = %(pub)s),
found AS (
    SELECT a.schema, a.name, c.oid, c.relkind, c.relispartition, c.relpersistence
    FROM asked a
    LEFT JOIN pg_namespace n ON n.nspname = a.schema
    LEFT JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = a.name AND c.relkind IN ('r', 'p')
),
leaves AS (
    SELECT f.oid AS root, f.oid AS leaf FROM found f WHERE f.relkind = 'r'
    UNION ALL
    SELECT f.oid, t.relid FROM found f, pg_partition_tree(f.oid) t WHERE f.relkind = 'p' AND t.isleaf
      AND t.relid <> f.oid
)
SELECT f.schema, f.name, f.oid::int8, f.relkind = 'p',
       ARRAY(SELECT l.leaf::int8 FROM leaves l WHERE l.root = f.oid ORDER BY 1),
       CASE WHEN (SELECT puballtables FROM pub) THEN
           -- what pg_publication_tables would say, without listing every table of the database
           f.relpersistence = 'p' AND CASE WHEN f.relkind = 'p' THEN (SELECT pubviaroot FROM pub) AND NOT f.relispartition
                                           ELSE NOT (f.relispartition AND (SELECT pubviaroot FROM pub)) END
       ELSE EXISTS (SELECT 1 FROM pg_publication_tables p
                    WHERE p.pubname = %(pub)s AND p.schemaname = f.schema AND p.tablename = f.name) END,
       EXISTS (SELECT 1 FROM pg_publication_rel r JOIN pub ON pub.oid = r.prpubid WHERE r.prrelid = f.oid),
       (SELECT format('%%I.%%I', ln.nspname, lc.relname) || ' ' || lc.relreplident::text
        FROM leaves l JOIN pg_class lc ON lc.oid = l.leaf JOIN pg_namespace ln ON ln.oid = lc.relnamespace
        WHERE l.root = f.oid AND NOT (
            lc.relreplident = 'f'
            OR (lc.relreplident = 'd' AND EXISTS (SELECT 1 FROM pg_index x WHERE x.indrelid = lc.oid AND x.indisprimary))
            OR (lc.relreplident = 'i' AND EXISTS (SELECT 1 FROM pg_index x WHERE x.indrelid = lc.oid AND x.indisreplident)))
        ORDER BY 1 LIMIT 1),
       ARRAY(SELECT a.attname::text FROM pg_attribute a WHERE a.attrelid = f.oid AND a.attnum > 0 AND NOT a.attisdropped
             AND a.attgenerated = '' ORDER BY a.attnum),
       -- the replica identity of every table holding its rows: any FULL one needs every column
       EXISTS (SELECT 1 FROM leaves l JOIN pg_class lc ON lc.oid = l.leaf WHERE l.root = f.oid AND lc.relreplident = 'f'),
       ARRAY(SELECT DISTINCT a.attname::text FROM leaves l JOIN pg_class lc ON lc.oid = l.leaf
             JOIN pg_index x ON x.indrelid = lc.oid
                  AND ((lc.relreplident = 'd' AND x.indisprimary) OR (lc.relreplident = 'i' AND x.indisreplident))
             JOIN pg_attribute a ON a.attrelid = lc.oid AND a.attnum = ANY(x.indkey::int2[])
             WHERE l.root = f.oid),
       {column_list}, {row_filter}
FROM found f
"""


@dataclass(frozen=True)
class Publication:
    name: str
    exists: bool
    all_tables: bool = False
    via_root: bool = False
    updates: bool = True  # publishes updates or deletes: then every covered table needs a usable replica identity
    schemas: bool = False  # FOR TABLES IN SCHEMA: then no table of it may have a column list
    lists: bool = True  # the server takes column lists (PostgreSQL 15 and later)
    publishes: frozenset[str] = frozenset(PUBLISH)  # the ops its ``publish`` sends: c, u, d, t (`PUBLISH`)
    oid: int | None = None  # a publication dropped and re-created has another


@dataclass(frozen=True)
class TableCoverage:
    schema: str
    name: str
    oid: int | None  # None: no table of that name
    partitioned: bool
    leaves: tuple[int, ...]  # the tables holding its rows: itself, or its leaf partitions
    covered: bool  # pgoutput publishes its changes under this name
    member: bool  # listed in pg_publication_rel (adding it again fails)
    bad_identity: str | None  # "<table> <relreplident>" of the first table of it whose identity cannot carry updates
    columns: tuple[str, ...] = ()  # its columns pgoutput can send (not generated ones), in table order
    full_identity: bool = False  # it, or a partition of it, has REPLICA IDENTITY FULL: updates need every column
    identity: tuple[str, ...] = ()  # the replica identity columns of it and its partitions (by name)
    published: tuple[str, ...] | None = None  # the publication's column list for it; None: every column
    row_filter: bool = False  # the publication filters its rows (WHERE)

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"


def _lists(conn: psycopg.Connection) -> bool:
    """Whether the server takes publication column lists and row filters (PostgreSQL 15 and later)."""
    return conn.info.server_version >= 150000


def read_publication(conn: psycopg.Connection, publication: str) -> Publication:
    lists = _lists(conn)
    row = conn.execute(PUBLICATION_QUERY.format(schemas=_SCHEMAS if lists else "false"), (publication,)).fetchone()
    if row is None:
        return Publication(publication, exists=False, lists=lists)
    publishes = frozenset(op for op, on in zip(PUBLISH, row[4:8]) if on)
    return Publication(publication, True, bool(row[0]), bool(row[1]), bool(row[2]), bool(row[3]), lists, publishes,
                       int(row[8]))


def read_coverage(conn: psycopg.Connection, publication: str,
                  tables: Iterable[tuple[str, str]]) -> dict[tuple[str, str], TableCoverage]:
    """How `publication` covers each of `tables` ((schema, name)), in one statement (one snapshot)."""
    tables = sorted(set(tables))
    if not tables:
        return {}
    lists = _lists(conn)
    query = COVERAGE_QUERY.format(column_list=_LIST if lists else "NULL::text[]", row_filter=_ROW_FILTER if lists else "false")
    rows = conn.execute(query, {"schemas": [s for s, _ in tables], "names": [t for _, t in tables],
                                         "pub": publication}).fetchall()
    return {
        (schema, name): TableCoverage(schema, name, oid, bool(partitioned), tuple(leaves or ()), bool(covered),
                                      bool(member), bad, tuple(columns or ()), bool(full), tuple(sorted(identity or ())),
                                      None if published is None else tuple(published), bool(row_filter))
        for schema, name, oid, partitioned, leaves, covered, member, bad, columns, full, identity, published, row_filter
        in rows
    }


def where_is(conn: psycopg.Connection, oid: int) -> str | None:
    """The qualified name the table with `oid` has now; None if it no longer exists."""
    row = conn.execute(
        "SELECT format('%%I.%%I', n.nspname, c.relname) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.oid = %s::oid", (oid,)).fetchone()
    return row[0] if row else None


_IDENTITIES = {"n": "REPLICA IDENTITY NOTHING", "d": "no primary key (REPLICA IDENTITY DEFAULT)",
               "i": "a replica identity index that no longer exists"}


def identity_problem(table: TableCoverage, publication: Publication) -> SourceError | None:
    """A table whose replica identity cannot carry updates and deletes, in a publication that publishes them.

    PostgreSQL refuses the application's own UPDATE and DELETE on such a table once it is published.
    """
    if table.bad_identity is None or not publication.updates:
        return None
    name, kind = table.bad_identity.rsplit(" ", 1)
    part = "" if name == table.qualified else f" (its partition {name})"
    return SourceError(
        f"table {table.qualified}{part} has {_IDENTITIES.get(kind, kind)}: once published, PostgreSQL refuses "
        f"UPDATE and DELETE on it (publication {publication.name!r})",
        hint=f"run: ALTER TABLE {name} REPLICA IDENTITY FULL (or add a primary key to it)")


def publication_problem(table: TableCoverage, publication: Publication, fix: str) -> SlotError | None:
    """A table whose changes the publication does not send under its name; `fix` says what to run."""
    if table.covered:
        return None
    if not publication.exists:
        return SlotError(f"publication {publication.name!r} does not exist", hint=fix)
    if table.partitioned and not publication.via_root:
        what = (f"partitioned table {table.qualified} is not published under its own name: publication "
                f"{publication.name!r} lacks publish_via_partition_root")
    else:
        what = f"table {table.qualified} is not in publication {publication.name!r}"
    return SlotError(what, hint=fix)


def publish_value(publication: Publication, needed: Iterable[str]) -> str:
    """The ``publish`` option sending what `publication` sends now and every op in `needed`."""
    ops = publication.publishes | set(needed)
    return ", ".join(name for op, name in PUBLISH.items() if op in ops)


def operations_problem(publication: Publication, needed: dict[str, list[str]], fix: str) -> SlotError | None:
    """The operations mappings publish that the publication's ``publish`` leaves out, if any.

    `needed`: op (c, u, d, t) -> the entities whose ops hold it. pgoutput sends nothing of an operation the
    publication leaves out, judged as of each change's WAL position: such changes are simply absent.
    `fix` names what to run; it is given the ALTER PUBLICATION that repairs it (``{alter}``).
    """
    if not publication.exists:
        return None
    missing = [op for op in PUBLISH if op in needed and op not in publication.publishes]
    if not missing:
        return None
    entities = sorted({e for op in missing for e in needed[op]})
    who = f"entity {entities[0]}" + (f" and {len(entities) - 1} more" if len(entities) > 1 else "")
    alter = (f"ALTER PUBLICATION {_ident(publication.name)} SET (publish = "
             f"'{publish_value(publication, needed)}')")
    return SlotError(
        f"publication {publication.name!r} does not publish {', '.join(PUBLISH[op] for op in missing)} "
        f"(its publish option), which {who} map{'' if len(entities) > 1 else 's'} (ops {', '.join(missing)})",
        hint=fix.format(alter=alter))


def _ident(name: str) -> str:
    return name if name.isidentifier() and name.islower() and name.isascii() else '"' + name.replace('"', '""') + '"'
