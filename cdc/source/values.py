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
from collections.abc import Callable

import orjson

from .arrays import array_converter, parse_array
from .pgtypes import (  # re-exported: the type catalog the converters read
    _MAX_DEPTH,
    _OID,
    BUILTIN_TYPES,
    TYPE_QUERY,
    TypeCatalog,
    TypeInfo,
    json_schema_for,
    type_info_from_row,
    type_name,
)

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


# --- per-type converters ------------------------------------------------------------

_NO_CATALOG = TypeCatalog()


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
        conv = array_converter(_build(info.elem_oid, catalog, depth + 1), info.delim)
    else:
        conv = _SCALARS.get(type_oid, str)
    catalog._converters[type_oid] = conv
    return conv


