"""Conversion of PostgreSQL text-format column values into JSON-ready values.

The pgoutput plugin delivers each column as the text its type's output
function prints, under the replication session's settings::

    DateStyle=ISO  TimeZone=UTC  IntervalStyle=iso_8601
    extra_float_digits=3  bytea_output=hex

`converter_for` returns, for a type OID, a function from that text to a
value `orjson.dumps` writes as the product's stream entries promise:

=====================================  =========================================
PostgreSQL type                        JSON
=====================================  =========================================
int2, int4, int8, oid                  number (``int``)
numeric                                string, exactly as printed, including
                                       ``'NaN'``, ``'Infinity'``, ``'-Infinity'``
float4, float8                         number (``float``); ``'NaN'``,
                                       ``'Infinity'``, ``'-Infinity'`` stay
                                       strings (orjson would write ``null``)
bool                                   ``true`` / ``false``
timestamp                              ``'2026-11-23T00:33:29.123456'``
timestamptz                            ``'2026-11-23T00:33:29.123456Z'``
json, jsonb                            the JSON itself, embedded byte for byte
                                       (``orjson.Fragment``): big numbers and
                                       key order survive
bytea                                  base64 string (standard alphabet, padded)
arrays                                 arrays (nested for several dimensions)
                                       of the element type's values; NULL
                                       elements become ``null``
domains                                as their base type
enums, text-like, date, time, timetz,  string, exactly as printed
interval, uuid, inet, cidr, macaddr,
money, xml, composites, ranges, and
any type not known here
=====================================  =========================================

Timestamps that ISO 8601 cannot carry in the usual form stay as PostgreSQL's
text: ``'infinity'``, ``'-infinity'``, dates before Christ (printed with a
trailing ``' BC'``, e.g. ``'0044-03-15 12:00:00 BC'``) and years after 9999
(``'10000-01-01 00:00:00'``).  A timestamptz printed with an offset other
than UTC (only when the session's TimeZone is not UTC) keeps its offset,
written ``+hh:mm`` (or ``+hh:mm:ss`` for historical local mean time).

Built-in types are known statically (`BUILTIN_TYPES`).  Enums, domains,
composites, their array types and any other type are described by a
`TypeCatalog` that the caller fills from ``pg_type`` with `TYPE_QUERY`:

    catalog = TypeCatalog()
    oids = catalog.missing(column_type_oids)
    if oids:
        rows = conn.execute(TYPE_QUERY, [sorted(oids)]).fetchall()
        for row in rows:
            catalog.add(type_info_from_row(row))

Converters raise `ValueError` for text their type cannot print.
"""

from __future__ import annotations

import binascii
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import orjson

__all__ = [
    "BUILTIN_TYPES",
    "TYPE_QUERY",
    "Converter",
    "TypeCatalog",
    "TypeInfo",
    "converter_for",
    "json_schema_for",
    "parse_array",
    "type_info_from_row",
    "type_name",
]

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


# --- scalar converters ----------------------------------------------------------


def _float(text: str) -> object:
    # float() reads 'NaN', 'Infinity' and '-Infinity' too; for those three
    # (and only those) v - v is not 0, and the contract wants the text.
    value = float(text)
    return value if value - value == 0.0 else text


class _BoolTable(dict):
    __slots__ = ()

    def __missing__(self, key: str) -> bool:
        raise ValueError(f"invalid bool {key!r}: expected 't' or 'f'")


_bool = _BoolTable(t=True, f=False).__getitem__


def _timestamp(text: str) -> str:
    # '2026-11-23 00:33:29.123456'; 'infinity', '-infinity', '... BC' and
    # years past 9999 (space not at index 10) stay as they are.
    if len(text) > 18 and text[10] == " " and text[-1] != "C":
        return text[:10] + "T" + text[11:]
    return text


def _timestamptz(text: str) -> str:
    # '2026-11-23 00:33:29.123456+00' under TimeZone=UTC.
    if text[-3:] == "+00" and text[10:11] == " ":
        return f"{text[:10]}T{text[11:-3]}Z"
    return _timestamptz_offset(text)


def _timestamptz_offset(text: str) -> str:
    if len(text) < 22 or text[10] != " " or text[-1] == "C":
        return text  # infinity, -infinity, BC, year > 9999
    sign = max(text.rfind("+"), text.rfind("-"))
    if sign < 19:
        raise ValueError(f"invalid timestamptz {text!r}: no UTC offset")
    offset = text[sign:]
    if len(offset) == 3:
        offset += ":00"
    return text[:10] + "T" + text[11:sign] + offset


_b2a_base64 = binascii.b2a_base64
_fromhex = bytes.fromhex


def _bytea(text: str) -> str:
    if text[:2] == "\\x":
        return _b2a_base64(_fromhex(text[2:]), newline=False).decode("ascii")
    return _b2a_base64(_bytea_unescape(text), newline=False).decode("ascii")


def _bytea_unescape(text: str) -> bytes:
    """bytea's 'escape' output format: backslash-doubled backslashes, \\ooo octal."""
    out = bytearray()
    i, n = 0, len(text)
    while i < n:
        j = text.find("\\", i)
        if j < 0:
            out += text[i:].encode("latin-1")
            break
        out += text[i:j].encode("latin-1")
        if text[j + 1 : j + 2] == "\\":
            out.append(0x5C)
            i = j + 2
            continue
        octal = text[j + 1 : j + 4]
        if len(octal) != 3 or not all(c in "01234567" for c in octal):
            raise ValueError(f"invalid bytea escape at {j} in {text[:40]!r}")
        out.append(int(octal, 8) & 0xFF)
        i = j + 4
    return bytes(out)


_SCALARS: dict[int, Converter] = {
    _OID["int2"]: int,
    _OID["int4"]: int,
    _OID["int8"]: int,
    _OID["oid"]: int,
    _OID["float4"]: _float,
    _OID["float8"]: _float,
    _OID["bool"]: _bool,
    _OID["timestamp"]: _timestamp,
    _OID["timestamptz"]: _timestamptz,
    _OID["json"]: orjson.Fragment,
    _OID["jsonb"]: orjson.Fragment,
    _OID["bytea"]: _bytea,
}
# Everything else prints as the string the contract wants: `str` returns its
# argument itself.


# --- arrays -------------------------------------------------------------------------

_WS = " \t\n\r\v\f"  # what array_in skips and array_out quotes (array_isspace)


def parse_array(text: str, convert: Converter = str, delim: str = ",") -> list:
    """Parse an array literal as ``array_out`` prints it into nested lists.

    Handles ``{}``, nesting for several dimensions, unquoted ``NULL`` (any
    case) as None against quoted ``"NULL"`` as a string, double-quoted
    elements with backslash escapes, a leading dimension decoration such as
    ``[0:1]=`` (dropped), the element type's delimiter, and, as ``array_in``
    does, whitespace around elements and backslash escapes in unquoted ones.
    Every non-NULL element is passed through ``convert``.
    """
    n = len(text)
    i = 0
    while i < n and text[i] in _WS:
        i += 1
    if i < n and text[i] == "[":
        eq = text.find("=", i)
        if eq < 0 or text[i:eq].strip(_WS).strip("[]0123456789:+-") != "":
            raise _malformed(text, i, "bad dimension decoration")
        i = eq + 1
        while i < n and text[i] in _WS:
            i += 1
    if i >= n or text[i] != "{":
        raise _malformed(text, i, "expected '{'")
    i += 1
    root: list = []
    cur = root
    stack: list[list] = []
    at_item = True  # just after '{' or a delimiter: an element or '{' comes next
    opened = True  # just after '{': '}' may close an empty array
    while True:
        while i < n and text[i] in _WS:
            i += 1
        if i >= n:
            raise _malformed(text, i, "unterminated array")
        c = text[i]
        if at_item and c != "}":
            if c == "{":
                new: list = []
                cur.append(new)
                stack.append(cur)
                cur = new
                i += 1
                opened = True
                continue
            if c == '"':
                value, i = _quoted(text, i + 1)
                cur.append(convert(value))
            else:
                value, is_null, i = _unquoted(text, i, delim)
                cur.append(None if is_null else convert(value))
            at_item = opened = False
            continue
        if c == "}":
            if at_item and not opened:
                raise _malformed(text, i, "missing element")
            i += 1
            if not stack:
                while i < n and text[i] in _WS:
                    i += 1
                if i != n:
                    raise _malformed(text, i, "junk after array")
                return root
            cur = stack.pop()
            at_item = opened = False
            continue
        if c == delim:
            i += 1
            at_item = True
            continue
        raise _malformed(text, i, f"expected {delim!r} or '}}'")


def _quoted(text: str, i: int) -> tuple[str, int]:
    """The element starting after an opening quote at i-1, and the index after its closing quote."""
    q = text.find('"', i)
    b = text.find("\\", i, q) if q >= 0 else -1
    if b < 0 <= q:
        return text[i:q], q + 1
    parts = []
    n = len(text)
    while True:
        q = text.find('"', i)
        if q < 0:
            raise _malformed(text, i, "unterminated quoted element")
        b = text.find("\\", i, q)
        if b < 0:
            parts.append(text[i:q])
            return "".join(parts), q + 1
        if b + 1 >= n:
            raise _malformed(text, b, "backslash at end")
        parts.append(text[i:b])
        parts.append(text[b + 1])
        i = b + 2


def _unquoted(text: str, i: int, delim: str) -> tuple[str, bool, int]:
    """An unquoted element starting at i (not whitespace): (value, is NULL, index of its end)."""
    close = text.find("}", i)
    if close < 0:
        raise _malformed(text, i, "unterminated array")
    d = text.find(delim, i, close)
    end = close if d < 0 else d
    token = text[i:end]
    if "\\" in token:
        return _unquoted_escaped(text, i, delim)
    if '"' in token or "{" in token:
        raise _malformed(text, i, "stray quote or brace")
    token = token.rstrip(_WS)
    if not token:
        raise _malformed(text, i, "missing element")
    return token, len(token) == 4 and token.upper() == "NULL", end


def _unquoted_escaped(text: str, i: int, delim: str) -> tuple[str, bool, int]:
    chars: list[str] = []
    keep = 0  # length of chars up to the last escaped or non-space character
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            if i + 1 >= n:
                raise _malformed(text, i, "backslash at end")
            chars.append(text[i + 1])
            keep = len(chars)
            i += 2
            continue
        if c == delim or c == "}":
            return "".join(chars[:keep]), False, i
        if c == '"' or c == "{":
            raise _malformed(text, i, "stray quote or brace")
        chars.append(c)
        if c not in _WS:
            keep = len(chars)
        i += 1
    raise _malformed(text, i, "unterminated array")


def _malformed(text: str, at: int, why: str) -> ValueError:
    shown = text if len(text) <= 80 else text[:77] + "..."
    return ValueError(f"malformed array literal at {at}: {why}: {shown!r}")


def _array_converter(convert: Converter, delim: str) -> Converter:
    """A converter for array text whose elements convert with ``convert``."""
    doubled = delim + delim

    def simple(inner: str) -> bool:
        # One dimension, nothing quoted or escaped, no whitespace, no empty
        # element: a plain split is exact.  Anything else (quoted elements,
        # nesting, odd characters) takes the general parser.
        return (
            '"' not in inner
            and "{" not in inner
            and "}" not in inner
            and "\\" not in inner
            and " " not in inner
            and inner.isprintable()
            and doubled not in inner
            and inner[0] != delim
            and inner[-1] != delim
        )

    if convert is str:

        def convert_array(text: str) -> list:
            if text[:1] == "{" and text[-1:] == "}":
                inner = text[1:-1]
                if not inner:
                    return []
                if simple(inner):
                    return [
                        None if len(x) == 4 and x.upper() == "NULL" else x
                        for x in inner.split(delim)
                    ]
            return parse_array(text, str, delim)

    else:

        def convert_array(text: str) -> list:
            if text[:1] == "{" and text[-1:] == "}":
                inner = text[1:-1]
                if not inner:
                    return []
                if simple(inner):
                    return [
                        None if len(x) == 4 and x.upper() == "NULL" else convert(x)
                        for x in inner.split(delim)
                    ]
            return parse_array(text, convert, delim)

    return convert_array


# --- per-type lookups --------------------------------------------------------------

_MAX_DEPTH = 16  # domains over domains over arrays ...; pg_type has no cycles
_NO_CATALOG = TypeCatalog()


def _lookup(type_oid: int, catalog: TypeCatalog | None) -> TypeInfo | None:
    if catalog is None:
        return BUILTIN_TYPES.get(type_oid)
    return catalog.get(type_oid)


def converter_for(type_oid: int, catalog: TypeCatalog | None = None) -> Converter:
    """The converter for values of a type; built once per type and catalog, then cached.

    Types neither built-in nor in the catalog convert as their text.
    """
    if catalog is None:
        catalog = _NO_CATALOG
    conv = catalog._converters.get(type_oid)
    if conv is None:
        conv = _build(type_oid, catalog, 0)
    return conv


def _build(type_oid: int, catalog: TypeCatalog, depth: int) -> Converter:
    conv = catalog._converters.get(type_oid)
    if conv is not None:
        return conv
    if depth > _MAX_DEPTH:
        raise ValueError(f"type {type_oid}: element/base types nest too deeply (a cycle?)")
    info = catalog.get(type_oid)
    if info is None:
        conv = str
    elif info.kind == "d":
        conv = _build(info.base_oid, catalog, depth + 1) if info.base_oid else str
    elif info.elem_oid:
        conv = _array_converter(_build(info.elem_oid, catalog, depth + 1), info.delim)
    else:
        conv = _SCALARS.get(type_oid, str)
    catalog._converters[type_oid] = conv
    return conv


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
