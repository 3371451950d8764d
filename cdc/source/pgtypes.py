"""PostgreSQL types as the bridge knows them: built-ins, the catalog of the others, their names and JSON Schemas.

Built-in types are known statically (`BUILTIN_TYPES`).  Enums, domains,
composites, their array types and any other type are described by a
`TypeCatalog` that the caller fills from ``pg_type`` with `TYPE_QUERY` (see
`cdc.source.values` for how their values convert).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["BUILTIN_TYPES", "TYPE_QUERY", "TypeCatalog", "TypeInfo", "json_schema_for", "type_info_from_row", "type_name"]

Converter = Callable[[str], object]


@dataclass(frozen=True, slots=True)
class TypeInfo:
    """One row of ``pg_type``, as much of it as conversion needs."""

    oid: int
    name: str  # pg_type.typname: 'mood', '_mood'
    kind: str  # pg_type.typtype: 'b' base, 'e' enum, 'd' domain, 'c' composite,
    #            'r' range, 'm' multirange, 'p' pseudo
    base_oid: int = 0  # typbasetype, for domains
    elem_oid: int = 0  # element type, for array types (0 if not an array)
    delim: str = ","  # typdelim of the element type


# --- built-in types ---------------------------------------------------------

# (name, oid, array oid, delimiter), as in PostgreSQL's pg_type.dat.
_BUILTIN_ROWS: tuple[tuple[str, int, int, str], ...] = (
    ("bool", 16, 1000, ","),
    ("bytea", 17, 1001, ","),
    ("char", 18, 1002, ","),
    ("name", 19, 1003, ","),
    ("int8", 20, 1016, ","),
    ("int2", 21, 1005, ","),
    ("int4", 23, 1007, ","),
    ("text", 25, 1009, ","),
    ("oid", 26, 1028, ","),
    ("json", 114, 199, ","),
    ("xml", 142, 143, ","),
    ("box", 603, 1020, ";"),
    ("cidr", 650, 651, ","),
    ("float4", 700, 1021, ","),
    ("float8", 701, 1022, ","),
    ("money", 790, 791, ","),
    ("macaddr", 829, 1040, ","),
    ("inet", 869, 1041, ","),
    ("bpchar", 1042, 1014, ","),
    ("varchar", 1043, 1015, ","),
    ("date", 1082, 1182, ","),
    ("time", 1083, 1183, ","),
    ("timestamp", 1114, 1115, ","),
    ("timestamptz", 1184, 1185, ","),
    ("interval", 1186, 1187, ","),
    ("timetz", 1266, 1270, ","),
    ("numeric", 1700, 1231, ","),
    ("uuid", 2950, 2951, ","),
    ("jsonb", 3802, 3807, ","),
)


def _builtin_types() -> dict[int, TypeInfo]:
    types: dict[int, TypeInfo] = {}
    for name, oid, array_oid, delim in _BUILTIN_ROWS:
        types[oid] = TypeInfo(oid, name, "b", delim=delim)
        types[array_oid] = TypeInfo(array_oid, "_" + name, "b", elem_oid=oid, delim=delim)
    return types


BUILTIN_TYPES: Mapping[int, TypeInfo] = MappingProxyType(_builtin_types())
"""The built-in types known without asking the server, by OID."""

_OID = {name: oid for name, oid, _, _ in _BUILTIN_ROWS}


# --- the catalog --------------------------------------------------------------


class TypeCatalog:
    """Types the converter may need beyond the built-ins: filled by the caller from pg_type.

    `get` answers for the built-ins too.  Converters are built once per type
    and cached here; adding a type drops the cache, since it may change how
    types already asked for convert.
    """

    __slots__ = ("_types", "_converters")

    def __init__(self, types: Iterable[TypeInfo] = ()) -> None:
        self._types: dict[int, TypeInfo] = {}
        self._converters: dict[int, Converter] = {}
        for info in types:
            self.add(info)

    def add(self, info: TypeInfo) -> None:
        self._types[info.oid] = info
        self._converters.clear()

    def get(self, oid: int) -> TypeInfo | None:
        info = self._types.get(oid)
        return info if info is not None else BUILTIN_TYPES.get(oid)

    def missing(self, oids: Iterable[int]) -> set[int]:
        """OIDs neither built-in nor known, following known types' element and base types.

        The caller queries pg_type (with `TYPE_QUERY`) for these.
        """
        out: set[int] = set()
        seen: set[int] = set()
        todo = list(oids)
        while todo:
            oid = todo.pop()
            if oid in seen:
                continue
            seen.add(oid)
            info = self.get(oid)
            if info is None:
                out.add(oid)
                continue
            if info.kind == "d" and info.base_oid:
                todo.append(info.base_oid)
            if info.elem_oid:
                todo.append(info.elem_oid)
        return out

    def __contains__(self, oid: object) -> bool:
        return oid in self._types or oid in BUILTIN_TYPES

    def __iter__(self) -> Iterator[TypeInfo]:
        """The types added (not the built-ins)."""
        return iter(list(self._types.values()))

    def __len__(self) -> int:
        return len(self._types)

    def __repr__(self) -> str:
        return f"TypeCatalog({len(self._types)} types)"


TYPE_QUERY = """\
WITH RECURSIVE wanted(oid) AS (
    SELECT t.oid
    FROM pg_catalog.pg_type t
    WHERE t.oid = ANY(%s::pg_catalog.oid[])
  UNION
    SELECT CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.typelem END
    FROM pg_catalog.pg_type t
    JOIN wanted w ON t.oid = w.oid
    WHERE (t.typtype = 'd' AND t.typbasetype <> 0)
       OR (t.typtype <> 'd' AND t.typelem <> 0
           AND t.typoutput = 'pg_catalog.array_out'::pg_catalog.regproc)
)
SELECT t.oid::pg_catalog.int8,
       t.typname::pg_catalog.text,
       t.typtype::pg_catalog.text,
       t.typbasetype::pg_catalog.int8,
       CASE WHEN e.oid IS NULL THEN 0 ELSE e.oid END::pg_catalog.int8,
       COALESCE(e.typdelim, t.typdelim)::pg_catalog.text
FROM wanted w
JOIN pg_catalog.pg_type t ON t.oid = w.oid
LEFT JOIN pg_catalog.pg_type e
       ON t.typtype <> 'd' AND t.typelem <> 0
      AND t.typoutput = 'pg_catalog.array_out'::pg_catalog.regproc
      AND e.oid = t.typelem
ORDER BY t.oid
"""
"""One SELECT returning, for an array of type OIDs passed as its one parameter,
a row per type (see `type_info_from_row`) for those types and, recursively,
the element types of array types and the base types of domains.

Only types printed by ``array_out`` count as arrays: ``int2vector``,
``oidvector``, ``point``, ``name`` and the like have an element type but
print otherwise, and convert as text.
"""


def type_info_from_row(row: tuple) -> TypeInfo:
    """A `TypeInfo` from a row of `TYPE_QUERY`:
    ``(oid, typname, typtype, typbasetype, element oid or 0, element's typdelim)``."""
    oid, name, kind, base_oid, elem_oid, delim = row
    return TypeInfo(
        oid=int(oid),
        name=str(name),
        kind=str(kind),
        base_oid=int(base_oid or 0),
        elem_oid=int(elem_oid or 0),
        delim=str(delim) if delim else ",",
    )


# --- names and schemas ------------------------------------------------------------

_MAX_DEPTH = 16  # domains over domains over arrays ...; pg_type has no cycles


def _lookup(type_oid: int, catalog: TypeCatalog | None) -> TypeInfo | None:
    if catalog is None:
        return BUILTIN_TYPES.get(type_oid)
    return catalog.get(type_oid)


def type_name(type_oid: int, catalog: TypeCatalog | None = None) -> str:
    """A human name for a type: 'int4', 'numeric', 'mood', 'int4[]', 'mood[]'.

    A type neither built-in nor in the catalog is named 'oid N'.
    """
    return _name(type_oid, catalog, 0)


def _name(type_oid: int, catalog: TypeCatalog | None, depth: int) -> str:
    info = _lookup(type_oid, catalog)
    if info is None:
        return f"oid {type_oid}"
    if info.kind != "d" and info.elem_oid and depth < _MAX_DEPTH:
        if _lookup(info.elem_oid, catalog) is not None:
            return _name(info.elem_oid, catalog, depth + 1) + "[]"
    return info.name


_STRING = {"type": "string"}
_SCHEMAS: dict[int, dict] = {
    _OID["int2"]: {"type": "integer"},
    _OID["int4"]: {"type": "integer"},
    _OID["int8"]: {"type": "integer"},
    _OID["oid"]: {"type": "integer"},
    _OID["float4"]: {"type": ["number", "string"]},
    _OID["float8"]: {"type": ["number", "string"]},
    _OID["bool"]: {"type": "boolean"},
    _OID["timestamptz"]: {"type": "string", "format": "date-time"},
    _OID["date"]: {"type": "string", "format": "date"},
    _OID["uuid"]: {"type": "string", "format": "uuid"},
    _OID["json"]: {},
    _OID["jsonb"]: {},
    _OID["bytea"]: {"type": "string", "contentEncoding": "base64"},
}


def json_schema_for(type_oid: int, catalog: TypeCatalog | None = None) -> dict:
    """The JSON Schema fragment that values of this type satisfy once converted.

    - integers: ``{"type": "integer"}``; floats: ``{"type": ["number", "string"]}``
      (the strings being NaN and the infinities); bool: ``{"type": "boolean"}``;
      json/jsonb: ``{}``; bytea: ``{"type": "string", "contentEncoding": "base64"}``.
    - timestamptz: ``{"type": "string", "format": "date-time"}``, date:
      ``"format": "date"``, uuid: ``"format": "uuid"``.  The exceptions the
      converters let through as text (infinity, BC, years past 9999) do not
      match those formats.  timestamp has no format: RFC 3339 date-time
      needs an offset.
    - arrays: ``{"type": "array", "items": ...}`` where an item is an element,
      null, or (several dimensions) a nested array.
    - domains: their base type's; everything else (numeric, text, enums, ...):
      ``{"type": "string"}``.

    A new dict each call: the caller may change it.
    """
    return _schema(type_oid, catalog, 0)


def _schema(type_oid: int, catalog: TypeCatalog | None, depth: int) -> dict:
    info = _lookup(type_oid, catalog)
    if info is None or depth > _MAX_DEPTH:
        return dict(_STRING)
    if info.kind == "d":
        return _schema(info.base_oid, catalog, depth + 1) if info.base_oid else dict(_STRING)
    if info.elem_oid:
        item = _schema(info.elem_oid, catalog, depth + 1)
        if item:
            types = item.get("type", [])
            types = [types] if isinstance(types, str) else list(types)
            item["type"] = types + [t for t in ("array", "null") if t not in types]
        return {"type": "array", "items": item}
    schema = _SCHEMAS.get(type_oid, _STRING)
    return {k: (list(v) if isinstance(v, list) else v) for k, v in schema.items()}
