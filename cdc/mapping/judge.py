"""The one judge of a mapping against its table: what `cdc init`, `cdc check` and `cdc run` refuse.

`judge` takes a mapping and one shape of its table (the live catalog's, for `cdc init`,
`cdc check` and `cdc run` at start, or a Relation message's, while `cdc run` streams) and
raises the `MappingError` that stops each of them, with the same line: a mapped column the
table lacks, a cast that does not apply to its column's type, a key that deletes would not
carry, a filter that updates or deletes would not let the bridge judge exactly. `Projector`
calls it before binding, so no change is ever projected through a mapping it refuses.
Pure: no I/O.
"""

from __future__ import annotations

from ..errors import MappingError
from ..source.shapes import TableShape
from ..source.values import TypeCatalog, type_name
from .model import FieldSpec, Mapping

__all__ = ["CAST_TYPES", "INTEGER_OIDS", "NUMBER_OIDS", "TIME_OIDS", "InexactFilter", "OldRowMissing", "base_oid", "changed_while_running",
           "before_refusal", "filter_refusal", "judge", "key_refusal", "partition_refusal", "old_row_missing", "uncarried_filter"]

INTEGER_OIDS = frozenset({20, 21, 23, 26})
NUMBER_OIDS = INTEGER_OIDS | {700, 701, 1700}
TIME_OIDS = frozenset({1082, 1114, 1184})
#: the base types each cast applies to (string: every type)
CAST_TYPES = {"float": NUMBER_OIDS, "integer": NUMBER_OIDS, "epoch_ms": TIME_OIDS, "epoch_s": TIME_OIDS,
              "date": TIME_OIDS}


class InexactFilter(MappingError):
    """A filter (or, under a partition not FULL, a key or a before-image) on columns the table's updates or deletes
    do not carry (its replica identity lacks them); `table`: the table whose identity to change."""

    def __init__(self, message: str, hint: str, table: str) -> None:
        super().__init__(message, hint=hint)
        self.table = table


class OldRowMissing(InexactFilter):
    """An update without its old row on a table described as REPLICA IDENTITY FULL (`old_row_missing`)."""


def base_oid(oid: int, catalog: TypeCatalog) -> int:
    """A domain's base type (through domains of domains); any other type itself."""
    seen = 0
    while seen < 32:
        info = catalog.get(oid)
        if info is None or info.kind != "d" or not info.base_oid:
            return oid
        oid, seen = info.base_oid, seen + 1
    return oid


def uncarried_filter(mapping: Mapping, shape: TableShape) -> str | None:
    """The first filter column an update's or delete's old row lacks, when the mapping publishes updates or
    deletes: the bridge could not tell whether the row passed the filter before the change."""
    if not mapping.filter or not mapping.ops & {"u", "d"} or (shape.replica_identity == "f" and not shape.partial_leaf):
        return None
    carried = set(shape.leaf_identity) if shape.partial_leaf else {c.name for c in shape.columns if c.key}
    return next((c.column for c in mapping.filter if c.column not in carried), None)


def old_row_missing(mapping: Mapping, shape: TableShape) -> OldRowMissing:
    """The refusal of an update that came without its old row though `shape` says REPLICA IDENTITY FULL (which
    always sends it): a partition's own replica identity is not full, and the filter cannot be judged on it."""
    table = f"{shape.schema}.{shape.name}"
    cond = mapping.filter[0]
    return OldRowMissing(
        f"{cond.where}: entity {mapping.entity!r}: filter on column {cond.column!r} cannot be judged on the updates "
        f"and deletes of {table}: an update came without its old row though the table is REPLICA IDENTITY FULL (the "
        "replica identity of one of its partitions is not full), so the bridge cannot tell whether the row passed "
        "the filter before the change",
        hint=f"run: ALTER TABLE on each partition of {table}: REPLICA IDENTITY FULL", table=table)


def _cast_problem(spec: FieldSpec, shape: TableShape, catalog: TypeCatalog, mapping: Mapping) -> MappingError | None:
    col = next(c for c in shape.columns if c.name == spec.column)
    allowed = CAST_TYPES.get(spec.cast or "")
    if allowed is None or base_oid(col.type_oid, catalog) in allowed:
        return None
    return MappingError(
        f"{spec.where}: entity {mapping.entity!r}: cast {spec.cast!r} does not apply to column "
        f"{col.name!r} of type {type_name(col.type_oid, catalog)}",
        hint="use cast: string, or remove the cast",
    )


def judge(mapping: Mapping, shape: TableShape, catalog: TypeCatalog) -> None:
    """Raise the `MappingError` that refuses `mapping` on this shape of its table; None when it binds.

    `catalog` must know the shape's column types (`cdc.source.catalog.load_types`).
    """
    table = f"{shape.schema}.{shape.name}"
    names = [c.name for c in shape.columns]
    missing = [c for c in mapping.columns if c not in names]
    if missing:
        spec = next((f for f in mapping.fields if f.column == missing[0]), None)
        cond = next((c for c in mapping.filter if c.column == missing[0]), None)
        place = spec.where if spec else cond.where if cond and cond.where else mapping.where
        raise MappingError(
            f"{place}: entity {mapping.entity!r}: column {missing[0]!r} is not in table {table} "
            f"(columns: {', '.join(names)})",
            hint="it was dropped or renamed: map an existing column or remove the field",
        )
    for spec in mapping.fields:
        if spec.column is not None and spec.cast is not None:
            problem = _cast_problem(spec, shape, catalog, mapping)
            if problem is not None:
                raise problem
    by_column = {c.name: c for c in shape.columns}
    if ("d" in mapping.ops or "u" in mapping.ops) and shape.replica_identity != "f":
        # the server sends the old row's key only for its replica identity columns
        what = "deletes would carry no key" if "d" in mapping.ops else "an update changing it would carry no old key"
        fields = {f.name: f for f in mapping.fields}
        for name in mapping.key:
            column = fields[name].column
            if column is not None and not by_column[column].key:
                raise MappingError(
                    f"{mapping.where}: entity {mapping.entity!r}: key field {name!r} (column {column!r}) "
                    f"is not in the replica identity of {table}, so {what}",
                    hint=f"key on the primary key columns, or run ALTER TABLE {table} REPLICA IDENTITY FULL",
                )
    problem = partition_refusal(mapping, shape)
    if problem is not None:
        raise problem


def partition_refusal(mapping: Mapping, shape: TableShape) -> InexactFilter | None:
    """What the identity of a table's partition not FULL (`shape.partial_leaf`; for a table's own, the
    table's) refuses of the mapping: a filter, a key or a before-image its old rows do not carry."""
    return filter_refusal(mapping, shape) or key_refusal(mapping, shape) or before_refusal(mapping, shape)


def before_refusal(mapping: Mapping, shape: TableShape) -> InexactFilter | None:
    """The refusal of `before: true` under a partition not FULL (`shape.partial_leaf`) when the mapping publishes
    updates or deletes: the server marks that partition's old rows as whole rows (its parent is FULL) though they
    carry only the partition's identity columns (the others null), so the before-image would show values the row
    never had. None otherwise."""
    if not shape.partial_leaf or not mapping.before or not mapping.ops & {"u", "d"}:
        return None
    table = f"{shape.schema}.{shape.name}"
    return InexactFilter(
        f"{mapping.where}: entity {mapping.entity!r}: the before-image (before: true) cannot be written exactly for "
        f"the updates and deletes of {table}: the replica identity of its partition {shape.partial_leaf} (not full) "
        f"carries only ({', '.join(shape.leaf_identity) or 'none'}) of the old row, which the server sends as a whole "
        "row (its parent is REPLICA IDENTITY FULL), the other columns null",
        hint=f"run: ALTER TABLE {shape.partial_leaf} REPLICA IDENTITY FULL; or set before: false",
        table=shape.partial_leaf)


def key_refusal(mapping: Mapping, shape: TableShape) -> InexactFilter | None:
    """The refusal of a key a partition not FULL (`shape.partial_leaf`) does not carry, when the mapping publishes
    updates or deletes: the server describes the table by its FULL parent, but that partition's deletes carry only
    its own identity's columns (the others null), so their key would be wrong. None otherwise (a table's own
    identity is judged by `judge`)."""
    if not shape.partial_leaf or not mapping.ops & {"u", "d"}:
        return None
    columns = {f.name: f.column for f in mapping.fields}
    for name in mapping.key:
        column = columns[name]
        if column is not None and column not in shape.leaf_identity:
            what = "deletes would carry no key" if "d" in mapping.ops else "an update changing it would carry no old key"
            return InexactFilter(
                f"{mapping.where}: entity {mapping.entity!r}: key field {name!r} (column {column!r}) is not in the "
                f"replica identity of partition {shape.partial_leaf} of {shape.schema}.{shape.name} (not full), so "
                f"{what}",
                hint=f"run: ALTER TABLE {shape.partial_leaf} REPLICA IDENTITY FULL; or key on its replica identity "
                     f"columns ({', '.join(shape.leaf_identity) or 'none'})",
                table=shape.partial_leaf)
    return None


def filter_refusal(mapping: Mapping, shape: TableShape) -> InexactFilter | None:
    """The refusal of a filter the table's updates or deletes do not carry (`uncarried_filter`), or None."""
    table = f"{shape.schema}.{shape.name}"
    column = uncarried_filter(mapping, shape)
    if column is not None:
        cond = next(c for c in mapping.filter if c.column == column)
        ops = "updates and deletes" if {"u", "d"} <= mapping.ops else "updates" if "u" in mapping.ops else "deletes"
        holder, whose = (shape.partial_leaf, f"the replica identity of its partition {shape.partial_leaf}") \
            if shape.partial_leaf else (table, "its replica identity")
        identity = shape.leaf_identity if shape.partial_leaf else tuple(c.name for c in shape.columns if c.key)
        kind = "not full" if shape.partial_leaf else _IDENTITY.get(shape.replica_identity, "?")
        return InexactFilter(
            f"{cond.where}: entity {mapping.entity!r}: filter on column {column!r} cannot be judged "
            f"on the {ops} of {table}: {whose} ({kind}) does not "
            "carry the column, so the bridge cannot tell whether the row passed the filter before the change",
            hint=f"run: ALTER TABLE {holder} REPLICA IDENTITY FULL; or filter only on replica identity columns "
                 f"({', '.join(identity) or 'none'}); or publish only inserts (ops: [c])",
            table=holder,
        )
    return None


def changed_while_running(exc: InexactFilter, slot: str) -> InexactFilter:
    """The refusal of a replica identity changed after the bridge accepted the mapping: the changes written
    since carry no old row to judge, so the fix rebuilds the streams from the tables."""
    return InexactFilter(
        f"{exc.message}; the replica identity changed after the mapping was accepted: the changes written since "
        f"carry no old row, slot {slot} held before them",
        hint=f"run: ALTER TABLE {exc.table} REPLICA IDENTITY FULL; then, as the changes written meanwhile cannot be "
             f"judged, SELECT pg_drop_replication_slot('{slot}'), cdc init and cdc recover (which rebuilds the "
             "streams from the tables) before cdc run", table=exc.table)


_IDENTITY = {"d": "default: the primary key", "i": "an index", "n": "nothing", "f": "full"}
