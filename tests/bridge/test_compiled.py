"""The compiled hot path against its specification: the same messages and mappings, the same entries.

`cdc.bridge._changes.route_raw` must queue exactly what `cdc.bridge.changes.route_raw`
(the pure-Python reference) queues: every field of every entry byte for byte and of
the same type, the batcher's pending count and clock, the read counters, and, for a
value its type cannot print, the same exception after the same side effects.
Hypothesis generates the tables, the mappings and the changes; a sequence runs on a
fresh setup per path (its own decoder, batcher, targets and transaction).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
from datetime import datetime
from decimal import Decimal
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from cdc import speedups
from cdc.bridge import changes
from cdc.bridge.backfill import Windows
from cdc.bridge.batcher import Batcher
from cdc.bridge.positions import Transaction
from cdc.errors import ConfigError
from cdc.mapping.projector import CastRefused
from cdc.mapping.model import parse_mapping
from cdc.sink import lane
from cdc.source import pgoutput as po
from cdc.source.lsn import Lsn
from cdc.source.values import TypeCatalog, TypeInfo
from pgoutput_encoder import encode

# both twins side by side in one process, whichever path the run picked: once is enough (make test's pure pass
# runs only the tests marked both_paths: those that read the path the run picked)
pytestmark = pytest.mark.one_path

SALT_ENV = {"CDC_TEST_SALT": "p\u00e9pper"}
HASH_KEY = "k\u00e9y-for-the-twin-tests".encode()
RELID = 16500
XID = 9001
BEGIN = po.Begin(Lsn(0x2_0000_0100), 810_000_000_000_000, 4242)
HEADER = b"w" + bytes(24)  # XLogData: the pgoutput message starts at 25
OFFSET = len(HEADER)

INTEGERS = {21: (-(2**15), 2**15 - 1), 23: (-(2**31), 2**31 - 1), 20: (-(2**63), 2**63 - 1), 26: (0, 2**32 - 1)}
FLOATS = (700, 701)
NUMBER = INTEGERS.keys() | set(FLOATS) | {1700}
TIMES = {1082, 1114, 1184}
TYPES = (21, 23, 20, 26, 700, 701, 1700, 16, 25, 1043, 1114, 1184, 1082, 114, 3802, 17, 2950, 1007, 1009)
SLOW_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def compiled_changes():
    try:
        return importlib.import_module("cdc.bridge._changes")
    except ImportError as exc:
        pytest.skip(f"the compiled hot path is not built ({exc})")


# -- values as PostgreSQL prints them ------------------------------------------------------------


def pg_float(x: float) -> str:
    """A double as PostgreSQL prints it with extra_float_digits >= 1: the shortest exact form, %g style."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    if x == 0:
        return "-0" if math.copysign(1, x) < 0 else "0"
    sign, digits, exp = Decimal(repr(x)).as_tuple()
    ds = "".join(map(str, digits)).rstrip("0") or "0"
    point = len(digits) + exp  # the decimal point's place after the first digit run
    e10 = point - 1
    out = "-" if sign else ""
    if e10 < -4 or e10 >= 15:
        mant = ds[0] + ("." + ds[1:] if len(ds) > 1 else "")
        return f"{out}{mant}e{'-' if e10 < 0 else '+'}{abs(e10):02d}"
    if point <= 0:
        return f"{out}0.{'0' * -point}{ds}"
    if point >= len(ds):
        return out + ds + "0" * (point - len(ds))
    return f"{out}{ds[:point]}.{ds[point:]}"


def float32(x: float) -> float:
    return struct.unpack(">f", struct.pack(">f", x))[0] if abs(x) < 3e38 else x


digits = st.integers(1, 17).flatmap(lambda d: st.integers(1, 10**d - 1))
floats_text = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(pg_float),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.floats(width=32).map(lambda x: pg_float(float32(x))),
    st.decimals(places=3, min_value=-10**6, max_value=10**6, allow_nan=False).map(lambda d: pg_float(float(d))),
    st.integers(-(10**17), 10**17).map(lambda i: pg_float(float(i))),
    st.integers(1, 10**17 - 1).map(lambda i: f"{i / 10**17:.17g}"),  # 17 significant digits
    # plain decimals of 1 to 17 digits around where orjson starts writing an exponent (1e-5, 1e16)
    st.tuples(st.booleans(), digits, st.integers(-24, 4)).map(
        lambda t: ("-" if t[0] else "") + pg_float(float(Decimal(t[1]).scaleb(t[2])))),
    st.tuples(st.booleans(), digits, st.integers(-24, 4)).map(
        lambda t: ("-" if t[0] else "") + format(Decimal(t[1]).scaleb(t[2]), "f")),
    st.sampled_from(["1e+20", "1e-05", "1.5e-05", "-0", "0", "NaN", "Infinity", "-Infinity", "12.5", "0.00001",
                     "0.0001", "123456789012345", "1e+15", "999999999999999.9", "0.30000000000000004",
                     "1.7976931348623157e+308", "5e-324", "100", "-1", "3.14"]),
)

def pg_timestamp(moment: datetime) -> str:
    text = moment.isoformat(sep=" ")
    if "." in text:
        text = text.rstrip("0")
    return text


timestamps_text = st.one_of(
    st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31)).map(pg_timestamp),
    st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31)).map(
        lambda d: pg_timestamp(d.replace(microsecond=0))),
    st.sampled_from(["infinity", "-infinity", "0044-03-15 12:00:00 BC", "10000-01-01 00:00:00",
                     "2026-11-23 00:33:29.123456", "2026-11-23 00:33:29", "1999-12-31 23:59:59.5",
                     "0001-01-01 00:00:00 BC", "294276-12-31 23:59:59.999999"]),
)
offsets = st.one_of(
    st.just("+00"),
    st.sampled_from(["+05:30", "-08", "+01", "-03:30", "+05:53:28", "-00:01:15", "+14", "-12", "+10", "-00"]),
    st.tuples(st.sampled_from("+-"), st.integers(0, 15), st.sampled_from(["", ":00", ":30", ":45", ":53:28"])).map(
        lambda t: f"{t[0]}{t[1]:02d}{t[2]}"),
)
timestamptz_text = st.one_of(
    st.tuples(timestamps_text.filter(lambda t: t[:1].isdigit()), offsets).map("".join),
    st.sampled_from(["infinity", "-infinity", "0044-03-15 12:00:00+00 BC", "10000-01-01 00:00:00+00",
                     "2026-11-23 00:33:29.123456+00", "2026-11-23 00:33:29+05:30", "2026-11-23 00:33:29"]),
)
dates_text = st.one_of(
    st.dates().map(str),
    st.sampled_from(["infinity", "-infinity", "0044-03-15 BC", "10000-01-01"]),
)
unicode_text = st.text(st.characters(codec="utf-8"), max_size=20)
tricky_text = st.one_of(
    unicode_text,
    st.sampled_from(['"', "\\", '\\"', "\x00", "\x1f\x7f", "\u2028\u2029", "\U0001f600", "caf\u00e9", "",
                     "\b\t\n\f\r", "\ud7ff\ue000\uffff", "</script>"]),
    st.lists(st.sampled_from(['"', "\\", "a", "\x01", "\u00e9", "\U00010348", " ", "\n"]), max_size=12).map("".join),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.floats(allow_nan=False, allow_infinity=False)
    | unicode_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(unicode_text, inner, max_size=3),
    max_leaves=8,
)


def json_text(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def jsonb_text(value) -> str:
    # jsonb prints ', ' and ': ' between items; json keeps the text as it was written
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json_text(k)}: {jsonb_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(jsonb_text(v) for v in value) + "]"
    return json_text(value)


def array_element(text: str | None) -> str:
    if text is None:
        return "NULL"
    if text and not any(c in text for c in '{},"\\ \t\n') and text.upper() != "NULL":
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def array_text(elements) -> st.SearchStrategy[str]:
    flat = st.lists(elements, max_size=4).map(lambda xs: "{" + ",".join(map(array_element, xs)) + "}")
    nested = st.lists(st.lists(elements, min_size=2, max_size=2), min_size=1, max_size=2).map(
        lambda rows: "{" + ",".join("{" + ",".join(map(array_element, r)) + "}" for r in rows) + "}")
    return flat | nested


def well_formed(oid: int) -> st.SearchStrategy[str]:
    if oid in INTEGERS:
        lo, hi = INTEGERS[oid]
        return st.integers(lo, hi).map(str) | st.sampled_from(["0", "-1", str(lo), str(hi), "100000000000000000"])
    if oid in FLOATS:
        return floats_text
    if oid == 1700:
        return st.decimals(allow_nan=False, allow_infinity=False).map(str) | st.sampled_from(
            ["NaN", "Infinity", "-Infinity", "0.000", "-12.50", "1e+3"])
    if oid == 16:
        return st.sampled_from(["t", "f"])
    if oid in (25, 1043):
        return tricky_text
    if oid == 1114:
        return timestamps_text
    if oid == 1184:
        return timestamptz_text
    if oid == 1082:
        return dates_text
    if oid == 114:
        return json_values.map(json_text) | st.sampled_from(['{"a" : 1}', "  [1, 2]  ", "12345678901234567890123"])
    if oid == 3802:
        return json_values.map(jsonb_text)
    if oid == 17:
        return st.binary(max_size=12).map(lambda b: "\\x" + b.hex()) | st.sampled_from(["\\x", "ab\\\\c\\001"])
    if oid == 2950:
        return st.uuids().map(str)
    if oid == 1007:
        return array_text(st.none() | st.integers(-(2**31), 2**31 - 1).map(str))
    if oid == 1009:
        return array_text(st.none() | unicode_text)
    raise AssertionError(oid)


GARBAGE = st.one_of(
    st.sampled_from(["abc", "", " 1", "1.0.0", "tru", "2026-13-45 99:99:99", "2026-11-23 00:33:29.1234567890+0",
                     "1e400", "--1", "+1", "1_000", "0x10", "{1,2", "\\xZZ", "nan", "inf", "99999999999999999999999"]),
    unicode_text,
)


@st.composite
def damaged(draw, oid: int) -> str:
    """A value of the type cut short, or with one character changed, put in or taken out."""
    text = draw(well_formed(oid))
    at = draw(st.integers(0, len(text)))
    how = draw(st.sampled_from(["cut", "change", "insert", "delete"]))
    char = draw(st.sampled_from(" .-+:eE0159TZC\"\u00e9") | st.characters(codec="utf-8"))
    if how == "cut":
        return text[:at]
    if how == "change":
        return text[:at] + char + text[at + 1:]
    if how == "insert":
        return text[:at] + char + text[at:]
    return text[:at] + text[at + 1:]


def column_value(oid: int, garbage: bool) -> st.SearchStrategy:
    if garbage:  # now and then a value in binary format (bytes), which the compiled path leaves alone
        return st.one_of(well_formed(oid), GARBAGE, damaged(oid), st.none(), st.binary(max_size=6))
    text = well_formed(oid)
    return st.one_of(text, text, text, st.none())


# -- tables and mappings --------------------------------------------------------------------------


@st.composite
def relations(draw) -> po.Relation:
    n = draw(st.integers(1, 6))
    oids = draw(st.lists(st.sampled_from(TYPES), min_size=n, max_size=n))
    identity = draw(st.sampled_from("df"))
    keys = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    if not any(keys):
        keys[draw(st.integers(0, n - 1))] = True
    cols = tuple(po.Column(k, f"c{i}", oid, -1) for i, (oid, k) in enumerate(zip(oids, keys)))
    return po.Relation(RELID, "public", "t", identity, cols)


field_names = st.one_of(
    st.from_regex(r"\A[a-z_][a-z0-9_.-]{0,6}\Z"),
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=6),
    st.sampled_from(['"', 'a"b', "\\", "caf\u00e9", "\U0001f600", "\n", "key", "data", "op", "\u2028"]),
)


def casts_for(oid: int) -> list[str]:
    out = ["string"]
    if oid in NUMBER:
        out += ["float", "integer"]
    if oid in TIMES:
        out += ["epoch_ms", "epoch_s", "date"]
    return out


const_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), unicode_text,
)


@st.composite
def mappings(draw, rel: po.Relation, entity: str):
    """A mapping of `rel` as `parse_mapping` validates it, then its fields renamed to any names."""
    cols = rel.columns
    keyable = [c for c in cols if c.is_key or rel.replica_identity == "f"]
    mapped = draw(st.lists(st.sampled_from(cols), min_size=1, max_size=len(cols) + 1))
    key_cols = draw(st.lists(st.sampled_from(keyable), min_size=1, max_size=2, unique_by=lambda c: c.name))
    fields: dict[str, object] = {}
    key: list[str] = []
    for i, col in enumerate(key_cols):
        name = f"k{i}"
        cast = draw(st.none() | st.sampled_from(casts_for(col.type_oid)))
        fields[name] = col.name if cast is None else {"column": col.name, "cast": cast}
        key.append(name)
    for i, col in enumerate(mapped):
        how = draw(st.sampled_from(["plain", "plain", "cast", "hash", "keyed", "redact"]))
        if how == "plain":
            spec: object = col.name
        elif how == "cast":
            spec = {"column": col.name, "cast": draw(st.sampled_from(casts_for(col.type_oid)))}
        elif how == "hash":
            spec = {"column": col.name, "hash": "sha256", "unkeyed": True, "salt_env": "CDC_TEST_SALT"}
        elif how == "keyed":
            spec = {"column": col.name, "hash": "hmac-sha256"}
        else:
            spec = {"column": col.name, "redact": True}
        fields[f"f{i}"] = spec
    for i in range(draw(st.integers(0, 2))):
        fields[f"k{len(key_cols)}c{i}"] = {"const": draw(const_values)}
    # the key fields where they fall among the others
    order = draw(st.permutations(list(fields)))
    raw: dict[str, object] = {
        "entity": entity, "table": "public.t", "key": key, "fields": {name: fields[name] for name in order},
    }
    ops = draw(st.sets(st.sampled_from("cudtr"), min_size=1))
    if draw(st.booleans()):
        raw["ops"] = sorted(ops)
    if draw(st.booleans()):
        raw["before"] = draw(st.booleans())
    if draw(st.integers(0, 5)) == 0:
        col = draw(st.sampled_from(cols))
        if not (col.is_key or rel.replica_identity == "f"):  # a filter updates and deletes could not be judged on
            raw["ops"] = sorted(ops - {"u", "d"}) or ["c"]
        raw["filter"] = {col.name: draw(st.sampled_from([{"is_null": False}, {"is_null": True}, {"ne": "x"}]
                                                        if col.type_oid not in NUMBER | {16} else
                                                        [{"is_null": False}, {"gt": 0}, {"ne": 1}, {"in": [1, 2]}]))}
    if draw(st.booleans()):
        raw["partitions"] = {"count": draw(st.sampled_from([1, 3]))}
        if draw(st.booleans()):
            raw["partitions"]["by"] = draw(st.lists(st.sampled_from(key), min_size=1, max_size=len(key), unique=True))
    mapping = parse_mapping(raw, SALT_ENV, HASH_KEY)
    # public names that YAML would not allow: quotes, backslashes, any unicode (and now and then a repeat)
    names = draw(st.lists(field_names, min_size=len(mapping.fields), max_size=len(mapping.fields),
                          unique=draw(st.integers(0, 9)) > 0))
    rename = {spec.name: new for spec, new in zip(mapping.fields, names)}
    key_names = {rename[n] for n in mapping.key}
    for spec in mapping.fields:
        # a repeat must not make another field a key field (a delete would want its column in the identity)
        while spec.name not in mapping.key and rename[spec.name] in key_names:
            rename[spec.name] += "~"
    return dataclasses.replace(
        mapping,
        fields=tuple(dataclasses.replace(spec, name=rename[spec.name]) for spec in mapping.fields),
        key=tuple(rename[n] for n in mapping.key),
        partition_by=tuple(rename[n] for n in mapping.partition_by),
        field_lines={},
    )


# -- changes -------------------------------------------------------------------------------------


@st.composite
def tuples(draw, rel: po.Relation, garbage: bool, toast: bool, key_only: bool = False) -> tuple:
    values = []
    for col in rel.columns:
        if key_only and not col.is_key and draw(st.integers(0, 3)):
            values.append(None)  # an old key tuple: the other columns are null
        elif toast and draw(st.integers(0, 4)) == 0:
            values.append(po.UNCHANGED_TOAST)
        else:
            values.append(draw(column_value(col.type_oid, garbage)))
    if draw(st.integers(0, 40)) == 0:
        values = values[: draw(st.integers(0, len(values)))]  # a row shorter than the relation
    return tuple(values)


@st.composite
def change_messages(draw, rel: po.Relation, garbage: bool, xid: int | None = None):
    kind = draw(st.sampled_from("IUUD"))
    if kind == "I":
        return po.Insert(RELID, draw(tuples(rel, garbage, draw(st.integers(0, 9)) == 0)), xid)
    if kind == "U":
        old_kind = draw(st.sampled_from([None, "K", "O"]))
        old = None
        if old_kind is not None:
            old = draw(tuples(rel, garbage, draw(st.integers(0, 3)) == 0, key_only=old_kind == "K"))
        return po.Update(RELID, old_kind, old, draw(tuples(rel, garbage, True)), xid)
    old_kind = draw(st.sampled_from("KO"))
    toast = draw(st.integers(0, 9)) == 0
    return po.Delete(RELID, old_kind, draw(tuples(rel, garbage, toast, key_only=old_kind == "K")), xid)


@st.composite
def scenarios(draw, streamed: bool = False):
    rel = draw(relations())
    maps = [draw(mappings(rel, "e0"))]
    if draw(st.integers(0, 3)) == 0:
        maps.append(draw(mappings(rel, "e1")))
    garbage = draw(st.integers(0, 5)) == 0
    xid = XID if streamed else None
    msgs = draw(st.lists(change_messages(rel, garbage, xid), min_size=1, max_size=6))
    return rel, maps, msgs


# -- running both paths -------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def typed(value):
    return (type(value).__name__, value)


def run(route, rel, maps, msgs, window: bool = False, streamed: bool = False, catalog=TypeCatalog):
    """Every message through `route` on a fresh setup; what it queued and counted, and how it stopped."""
    decoder = po.PgOutputDecoder()
    relation = rel
    if streamed:
        decoder.decode(encode(po.StreamStart(XID, True)))
        relation = dataclasses.replace(rel, xid=XID)
    relation = decoder.decode(encode(relation))
    batcher = Batcher(max_entries=10**6, max_delay_s=60.0, clock=Clock())
    read = {m.entity: [0] for m in maps}
    targets = changes.bind(relation, maps, catalog(), batcher, read)
    tx = Transaction()
    tx.begin(po.PgOutputDecoder().decode(encode(BEGIN)))
    windows = Windows()
    if window:
        windows.low("chunk-1", ("public", "t"))
    error = None
    for msg in msgs:
        raw = HEADER + encode(msg)
        try:
            route(raw[OFFSET], raw, OFFSET, targets, tx, batcher, windows, decoder)
        except Exception as exc:  # a value its type cannot print: the bridge stops here
            error = (type(exc), str(exc))
            break
        tx.seq += 1
    queued = {stream: [[typed(v) for v in entry] for entry in batch.entries]
              for stream, batch in batcher.batches.items()}
    changed = windows.close("chunk-1") if window else None
    return {"queued": queued, "pending": batcher.pending, "first_at": batcher.first_at, "read": read,
            "error": error, "seq": tx.seq, "windows": changed}


def assert_same(rel, maps, msgs, **how):
    compiled = compiled_changes()
    want = run(changes.route_raw, rel, maps, msgs, **how)
    got = run(compiled.route_raw, rel, maps, msgs, **how)
    assert got == want
    return want


# -- the properties --------------------------------------------------------------------------------


@settings(max_examples=1000, **SLOW_SETTINGS)
@given(scenarios())
def test_compiled_route_raw_queues_what_the_reference_queues(scenario):
    assert_same(*scenario)


@settings(max_examples=60, **SLOW_SETTINGS)
@given(scenarios())
def test_changes_inside_an_open_backfill_window_match(scenario):
    assert_same(*scenario, window=True)


@settings(max_examples=60, **SLOW_SETTINGS)
@given(scenarios(streamed=True))
def test_changes_in_a_streamed_block_match(scenario):
    assert_same(*scenario, streamed=True)


# one column per type: a value of each type through every path
ALL_TYPES = po.Relation(RELID, "public", "t", "d", tuple(
    po.Column(i == 0, f"c{i}", oid, -1) for i, oid in enumerate((20,) + TYPES)))


def plain_mapping(rel: po.Relation, **extra) -> object:
    raw = {"entity": "e0", "table": "public.t", "key": ["id"],
           "fields": {"id": "c0", **{f"v{i}": c.name for i, c in enumerate(rel.columns[1:], 1)}}, **extra}
    return parse_mapping(raw, SALT_ENV, HASH_KEY)


# the types the compiled path writes itself, more often than the others
WRITTEN = (20, 23, 701, 700, 16, 25, 1114, 1114, 1184, 1184, 114, 3802)


@st.composite
def typed_values(draw, garbage: bool = False):
    oid = draw(st.sampled_from(TYPES + WRITTEN + WRITTEN))
    return oid, draw(well_formed(oid) | GARBAGE | damaged(oid) if garbage else well_formed(oid))


@settings(max_examples=600, **SLOW_SETTINGS)
@given(typed_values(garbage=True),
       st.sampled_from([None] * 6 + ["string", "float", "integer", "epoch_ms", "epoch_s", "date"]))
@example((701, "1e+20"), None)
@example((701, "1e-05"), None)
@example((701, "-0"), None)
@example((701, "0"), None)
@example((701, "NaN"), None)
@example((701, "Infinity"), None)
@example((701, "-Infinity"), None)
@example((701, "12.5"), None)
@example((701, "0.30000000000000004"), None)
@example((701, "12345678901234567"), None)
@example((700, "0.00001"), None)
@example((700, "0.000001"), None)
@example((700, "1e+15"), None)
@example((700, "999999999999999"), None)
@example((700, "9999999999999999"), None)
@example((20, "-9223372036854775808"), None)
@example((20, "9223372036854775807"), None)
@example((20, "-0"), None)
@example((20, "007"), None)
@example((23, "abc"), None)
@example((16, "t"), None)
@example((16, "f"), None)
@example((16, "true"), None)
@example((1114, "2026-11-23 00:33:29.123456"), None)
@example((1114, "2026-11-23 00:33:29"), "epoch_ms")
@example((1114, "infinity"), None)
@example((1114, "-infinity"), "epoch_s")
@example((1114, "0044-03-15 12:00:00 BC"), None)
@example((1114, "10000-01-01 00:00:00"), None)
@example((1114, "2026-11-23 0:33:29"), None)
@example((1114, "2026-11-23 00:33:2"), None)
@example((1184, "2026-11-23 00:33:29+10"), None)
@example((1184, "2026-11-23 +00"), None)
@example((1184, "2026-11-23  +00"), None)
@example((1184, "2026-11-23 00:33:29.123456+00"), None)
@example((1184, "2026-11-23 00:33:29+05:30"), None)
@example((1184, "2026-11-23 00:33:29+05:53:28"), None)
@example((1184, "2026-11-23 00:33:29"), None)
@example((1184, "0044-03-15 12:00:00+00 BC"), None)
@example((1184, "infinity"), "date")
@example((25, 'a "quoted" \\ back\x00\x01\x1f\x7f \u2028 \U0001f600'), None)
@example((114, '{"big": 123456789012345678901234567890, "k": [1, 2]}'), None)
@example((3802, '{"a": 1, "b": "\\u00e9"}'), None)
@example((17, "\\xdeadbeef"), None)
@example((1007, "{1,NULL,3}"), None)
@example((1009, '{"a b","c\\"d",NULL}'), None)
@example((1700, "NaN"), "integer")
@example((1700, "1e+30"), "integer")
@example((1700, "3.7"), "integer")
@example((1700, "3.000"), "integer")
@example((1700, "9223372036854775808"), "integer")
@example((1700, "0.1"), "float")
@example((1700, "12345678901234567890"), "float")
@example((701, "1e+20"), "integer")
@example((20, "9007199254740993"), "float")
@example((1082, "0044-03-15 BC"), "date")
@example((1082, "294276-12-31"), "date")
@example((1082, "0044-03-15 BC"), "epoch_s")
@example((1114, "2024-01-02 03:04:05"), "date")
@example((1114, "2024-01-02 00:00:00"), "date")
@example((1114, "294276-12-31 23:59:59.999999"), "epoch_ms")
@example((1114, "1969-12-31 23:59:59.999999"), "epoch_s")
@example((1184, "2026-11-23 05:30:00+05:30"), "date")
@example((1184, "0044-03-15 12:00:00+00 BC"), "epoch_ms")
def test_each_type_and_cast_matches(value, cast):
    oid, text = value
    cast = cast if cast in (["string"] + (["float", "integer"] if oid in NUMBER else [])
                            + (["epoch_ms", "epoch_s", "date"] if oid in TIMES else [])) else None
    rel = po.Relation(RELID, "public", "t", "d", (po.Column(True, "c0", 20, -1), po.Column(False, "c1", oid, -1)))
    field = "c1" if cast is None else {"column": "c1", "cast": cast}
    m = parse_mapping({"entity": "e0", "table": "public.t", "key": ["id"], "fields": {"id": "c0", "v": field}},
                      SALT_ENV)
    assert_same(rel, [m], [
        po.Insert(RELID, ("1", text)),
        po.Update(RELID, "O", ("1", text), ("1", po.UNCHANGED_TOAST)),
        po.Update(RELID, "K", ("1", None), ("2", text)),
        po.Delete(RELID, "O", ("2", text)),
    ])


@settings(max_examples=400, **SLOW_SETTINGS)
@given(st.data())
def test_every_cast_of_every_source_type_writes_or_refuses_alike(data):
    """Only the types casts apply to, and always a cast: what both paths write, or that both refuse (a
    value the cast cannot write exactly is refused, never rounded: tests/mapping/test_casts.py)."""
    oid = data.draw(st.sampled_from(sorted(NUMBER | TIMES)))
    cast = data.draw(st.sampled_from(casts_for(oid)))
    text = data.draw(well_formed(oid) | damaged(oid))
    rel = po.Relation(RELID, "public", "t", "d", (po.Column(True, "c0", 20, -1), po.Column(False, "c1", oid, -1)))
    m = parse_mapping({"entity": "e0", "table": "public.t", "key": ["id"],
                       "fields": {"id": "c0", "v": {"column": "c1", "cast": cast}}}, SALT_ENV)
    want = assert_same(rel, [m], [po.Insert(RELID, ("1", text)), po.Delete(RELID, "O", ("1", text))])
    assert want["error"] is None or want["error"][0] in (CastRefused, ValueError)


@settings(max_examples=200, **SLOW_SETTINGS)
@given(st.data())
def test_every_type_in_one_row_with_garbage_matches(data):
    values = tuple(data.draw(column_value(c.type_oid, garbage=data.draw(st.integers(0, 9)) == 0))
                   for c in ALL_TYPES.columns)
    assume(values[0] is not None)
    m = plain_mapping(ALL_TYPES, partitions={"count": 3})
    assert_same(ALL_TYPES, [m], [po.Insert(RELID, values), po.Delete(RELID, "O", values)])


# -- the cases the compiled path leaves to the reference, and the edges of the entry ------------------------

RIDES = po.Relation(RELID, "public", "t", "d", (
    po.Column(True, "c0", 20, -1), po.Column(False, "c1", 25, -1), po.Column(False, "c2", 701, -1),
))


def rides_mapping(**extra):
    raw = {"entity": "e0", "table": "public.t", "key": ["id"], "fields": {"id": "c0", "name": "c1", "x": "c2"}}
    return parse_mapping({**raw, **extra}, SALT_ENV, HASH_KEY)


# domains over the types the compiled path writes itself, an enum, an array of a domain
DOMAINS = {90001: 23, 90002: 701, 90003: 1184, 90004: 3802, 90005: 16, 90006: 90001}
ENUM, DOMAIN_ARRAY = 90010, 90011


def catalog_with_domains() -> TypeCatalog:
    catalog = TypeCatalog()
    for oid, base in DOMAINS.items():
        catalog.add(TypeInfo(oid, f"d{oid}", "d", base_oid=base))
    catalog.add(TypeInfo(ENUM, "mood", "e"))
    catalog.add(TypeInfo(DOMAIN_ARRAY, "_d90002", "b", elem_oid=90002))
    return catalog


@settings(max_examples=100, **SLOW_SETTINGS)
@given(st.data())
def test_domains_and_enums_match(data):
    oids = (20,) + tuple(DOMAINS) + (ENUM, DOMAIN_ARRAY)
    rel = po.Relation(RELID, "public", "t", "d", tuple(po.Column(i == 0, f"c{i}", oid, -1)
                                                       for i, oid in enumerate(oids)))
    base = {**DOMAINS, 90006: 23, ENUM: 25}
    garbage = data.draw(st.integers(0, 4)) == 0

    def value(oid: int):
        if oid == DOMAIN_ARRAY:
            return st.none() | array_text(st.none() | floats_text)
        return column_value(base.get(oid, oid), garbage)

    values = tuple(data.draw(value(oid)) for oid in oids)
    assume(values[0] is not None)
    m = plain_mapping(rel)
    assert_same(rel, [m], [po.Insert(RELID, values), po.Delete(RELID, "O", values)], catalog=catalog_with_domains)


def test_a_filtered_mapping_matches():
    full = po.Relation(RELID, "public", "t", "f", tuple(po.Column(True, c.name, c.type_oid, -1) for c in RIDES.columns))
    m = rides_mapping(filter={"c1": {"ne": "skip"}})
    assert_same(full, [m], [
        po.Insert(RELID, ("1", "keep", "1.5")), po.Insert(RELID, ("2", "skip", "2")),
        po.Update(RELID, "O", ("1", "keep", "1.5"), ("1", "skip", "1.5")),  # leaves the filter: d
        po.Update(RELID, "O", ("2", "skip", "2"), ("2", "keep", "2")),  # enters it: c
        po.Update(RELID, "O", ("2", "keep", "2"), ("2", "keep", "3")),  # stays: u
        po.Delete(RELID, "O", ("1", "skip", "1.5")), po.Delete(RELID, "O", ("2", "keep", "3")),
    ])


def test_invalid_utf8_and_binary_values_raise_or_match_alike():
    compiled = compiled_changes()
    for bad in (b"\xff", b"\xed\xa0\x80", b"ok\xc3"):
        msg = b"I" + struct.pack(">I", RELID) + b"N" + struct.pack(">H", 3) + b"t" + struct.pack(">i", 1) + b"1" \
            + b"t" + struct.pack(">i", len(bad)) + bad + b"n"
        results = []
        for route in (changes.route_raw, compiled.route_raw):
            batcher = Batcher(1000, 1.0, clock=Clock())
            decoder = po.PgOutputDecoder()
            targets = changes.bind(decoder.decode(encode(RIDES)), [rides_mapping()], TypeCatalog(), batcher,
                                   {"e0": [0]})
            raw = HEADER + msg
            with pytest.raises(po.DecodeError) as err:
                route(raw[OFFSET], raw, OFFSET, targets, Transaction(), batcher, Windows(), decoder)
            results.append((str(err.value), batcher.pending, targets[0].read))
        assert results[0] == results[1]
    binary = b"I" + struct.pack(">I", RELID) + b"N" + struct.pack(">H", 3) + b"b" + struct.pack(">i", 2) + b"12" \
        + b"n" + b"n"
    outs = []
    for route in (changes.route_raw, compiled.route_raw):
        batcher = Batcher(1000, 1.0, clock=Clock())
        decoder = po.PgOutputDecoder()
        targets = changes.bind(decoder.decode(encode(RIDES)), [rides_mapping()], TypeCatalog(), batcher, {"e0": [0]})
        tx = Transaction()
        raw = HEADER + binary
        route(raw[OFFSET], raw, OFFSET, targets, tx, batcher, Windows(), decoder)
        outs.append([list(e) for e in batcher.batch("cdc:e0").entries])
    assert outs[0] == outs[1] and outs[0]


def test_a_key_field_left_out_and_short_rows_raise_alike():
    m = rides_mapping()
    want = assert_same(RIDES, [m], [po.Insert(RELID, ("1", "a", "2")),
                                    po.Update(RELID, None, None, (po.UNCHANGED_TOAST, "b", "3"))])
    assert want["error"][0] is KeyError and want["pending"] == 1
    want = assert_same(RIDES, [m], [po.Insert(RELID, ("1", "a"))])
    assert want["error"][0] is IndexError


def test_an_error_in_a_later_mapping_leaves_the_same_entries_and_counts():
    """The reference queues the first mapping's entry before the second one's value fails."""
    first = rides_mapping(fields={"id": "c0"})
    second = parse_mapping({"entity": "e1", "table": "public.t", "key": ["id"],
                            "fields": {"id": "c0", "x": "c2"}}, SALT_ENV)
    want = assert_same(RIDES, [first, second], [po.Insert(RELID, ("1", "a", "not a float"))])
    assert want["error"][0] is ValueError and want["pending"] == 1 and want["read"] == {"e0": [1], "e1": [1]}


def test_a_cast_refusing_a_value_raises_alike_placed_at_its_change():
    """A value a cast cannot write exactly (a fraction, a number past 64 bits) stops both paths the same
    way, after the same entries, the error naming the change's LSN and the row's key."""
    rel = po.Relation(RELID, "public", "t", "d", (po.Column(True, "c0", 20, -1), po.Column(False, "c1", 1700, -1),
                                                   po.Column(False, "c2", 23, -1)))
    m = parse_mapping({"entity": "e0", "table": "public.t", "key": ["id"],
                       "fields": {"id": "c0", "big": {"column": "c1", "cast": "integer"}, "n": "c2"}}, SALT_ENV)
    for value, reason in (("1e+30", "beyond 64-bit integers"), ("3.7", "a fractional part"),
                          ("NaN", "NaN or infinity")):
        want = assert_same(rel, [m], [po.Insert(RELID, ("1", "3.0", "1")), po.Insert(RELID, ("2", value, "abc"))])
        kind, message = want["error"]
        assert kind is CastRefused and want["pending"] == 1
        assert reason in message and "column 'c1' (numeric) of public.t" in message
        assert f"committed at LSN {Lsn(BEGIN.final_lsn)}, change 1, row key {{\"id\":2}}" in message
        assert value == "NaN" or value not in message  # the value itself is not named


def test_a_const_orjson_cannot_write_raises_alike():
    m = rides_mapping(fields={"id": "c0", "big": {"const": 2**70}, "x": "c2"})
    want = assert_same(RIDES, [m], [po.Insert(RELID, ("1", "a", "abc"))])
    assert want["error"][0] is ValueError
    want = assert_same(RIDES, [m], [po.Insert(RELID, ("1", "a", "1"))])
    assert want["error"][0] is orjson.JSONEncodeError


def test_field_names_that_need_escaping_match():
    m = rides_mapping(fields={"id": "c0", "a": "c1", "b": "c2", "c": {"const": "k\u00e9"}})
    rename = {"id": 'i"d', "a": "\\", "b": "\U0001f600\n", "c": "\u2028"}
    m = dataclasses.replace(m, fields=tuple(dataclasses.replace(f, name=rename[f.name]) for f in m.fields),
                            key=('i"d',), field_lines={})
    want = assert_same(RIDES, [m], [po.Insert(RELID, ("1", "x", "1.5")),
                                    po.Update(RELID, None, None, ("1", po.UNCHANGED_TOAST, "2"))])
    assert want["error"] is None and len(want["queued"]["cdc:e0"]) == 2


def test_an_open_backfill_window_and_a_streamed_block_match():
    m = rides_mapping(partitions={"count": 3})
    msgs = [po.Insert(RELID, ("1", "a", "1.5")), po.Update(RELID, "K", ("1", None, None), ("2", "b", "2")),
            po.Delete(RELID, "K", ("2", None, None))]
    want = assert_same(RIDES, [m], msgs, window=True)
    assert want["windows"] == {("1",), ("2",)} and want["pending"] == 3
    streamed = [dataclasses.replace(msg, xid=XID) for msg in msgs]
    want = assert_same(RIDES, [m], streamed, streamed=True)
    assert want["pending"] == 3


def test_duplicate_field_names_and_consts_named_like_fields_match():
    m = rides_mapping(fields={"id": "c0", "a": "c1", "b": "c2", "c": {"const": 1}})
    rename = {"id": "id", "a": "x", "b": "x", "c": "id"}
    m = dataclasses.replace(m, fields=tuple(dataclasses.replace(f, name=rename[f.name]) for f in m.fields),
                            field_lines={})
    assert_same(RIDES, [m], [po.Insert(RELID, ("1", "x", "1.5")), po.Delete(RELID, "O", ("1", "x", "1.5"))])


def test_the_compiled_path_takes_ordinary_changes_itself(monkeypatch):
    """Else the properties above would only compare the reference with itself."""
    compiled = compiled_changes()
    m = plain_mapping(ALL_TYPES, partitions={"count": 3}, before=True)
    values = ("1", "2", "-3", "4", "5", "1.5", "0.25", "12.50", "t", "text \"q\" \u00e9", "v",
              "2026-11-23 00:33:29.5", "2026-11-23 00:33:29+00", "2026-11-23", '{"a":1}', '{"b": [1]}',
              "\\x00ff", "6f1c5a8e-0b1e-4c8a-9d1e-000000000001", "{1,2}", "{a,b}")
    msgs = [po.Insert(RELID, values), po.Update(RELID, "O", values, values[:3] + (po.UNCHANGED_TOAST,) + values[4:]),
            po.Delete(RELID, "K", values[:1] + (None,) * (len(values) - 1))]
    want = run(changes.route_raw, ALL_TYPES, [m], msgs)

    def reference_called(*args):
        raise AssertionError("the compiled path handed an ordinary change to the reference")

    monkeypatch.setattr(changes, "route_row", reference_called)
    got = run(compiled.route_raw, ALL_TYPES, [m], msgs)
    assert got == want and want["error"] is None and want["pending"] == 3


# -- whether the compiled path is there, and is used ---------------------------------------------------


def test_the_compiled_modules_are_built_where_they_can_be():
    """Where a C compiler and Python's headers exist, the install builds the compiled path: it must import."""
    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    if not (shutil.which("cc") and headers):
        pytest.skip("no C compiler or no Python headers: the pure-Python path is expected")
    for name in ("cdc.bridge._changes", "cdc.sink._resp", "cdc.sink._entries"):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            pytest.fail(f"{name} is not built although a compiler is here ({exc}): rebuild it, e.g. make install")


def test_describe_names_the_path_that_runs(monkeypatch):
    monkeypatch.delenv(speedups.IMPL_ENV, raising=False)
    monkeypatch.setenv(speedups.PURE_ENV, "1")
    assert speedups.describe() == "hot path: pure Python (CDC_PURE_PYTHON is set)"
    assert speedups.load("cdc.bridge._changes") is None
    monkeypatch.delenv(speedups.PURE_ENV)
    monkeypatch.setenv(speedups.IMPL_ENV, "pure")
    assert speedups.describe() == "hot path: pure Python (CDC_IMPL=pure)"
    assert speedups.load("cdc.bridge._changes") is None
    monkeypatch.delenv(speedups.IMPL_ENV)
    compiled_changes()
    try:
        importlib.import_module("cdc.sink._resp")
    except ImportError as exc:
        pytest.skip(f"cdc.sink._resp is not built ({exc})")
    assert speedups.describe() == "hot path: compiled"


def test_cdc_impl_compiled_where_it_is_not_built_stops_at_start(tmp_path):
    """Never a silent fall-back: `cdc` exits 2 with one line naming the fix (the build made unimportable
    in the child, as where no compiler was found)."""
    (tmp_path / "cdc.yaml").write_text("")
    unbuilt = ("import sys; sys.modules['cdc.sink._resp'] = None\n"
               "from cdc.cli import main; sys.exit(main(['check', '--config', 'cdc.yaml']))")
    env = {**os.environ, "CDC_IMPL": "compiled", "CDC_PURE_PYTHON": ""}
    done = subprocess.run([sys.executable, "-c", unbuilt], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    # the compiled loop packs into the compiled packer's batches: without it, neither imports
    assert lines[0].startswith("cdc: error: environment variable CDC_IMPL=compiled: the compiled hot path is not "
                               "built (cdc.bridge._changes: import of cdc.sink._resp halted")
    assert "; cdc.sink._resp: import of cdc.sink._resp halted" in lines[0]
    assert lines[0].endswith("; install a C compiler, then reinstall the package, e.g. make install; "
                             "or set CDC_IMPL=pure, or unset it to run the pure path")


def test_cdc_impl_compiled_is_refused_where_a_module_does_not_import(monkeypatch):
    monkeypatch.setattr(speedups, "_MODULES", ("cdc.bridge._changes", "cdc.sink._not_built"))
    with pytest.raises(ConfigError) as caught:
        speedups.check({"CDC_IMPL": "compiled"})
    assert caught.value.exit_code == 2
    assert str(caught.value).startswith("environment variable CDC_IMPL=compiled: the compiled hot path is not "
                                        "built (cdc.sink._not_built: ")
    with pytest.raises(ConfigError, match="ask for both implementations"):
        speedups.check({"CDC_IMPL": "compiled", "CDC_PURE_PYTHON": "1"})
    with pytest.raises(ConfigError, match="'fast' is not an implementation of the hot path"):
        speedups.check({"CDC_IMPL": "fast"})
    speedups.check({"CDC_IMPL": "pure"})
    speedups.check({})


@pytest.mark.parametrize("compiled_name, pure_name", [("cdc.bridge._changes", "cdc.bridge.changes"),
                                                      ("cdc.sink._resp", "cdc.sink.lane"),
                                                      ("cdc.sink._entries", "cdc.sink.entry")])
def test_the_stub_states_the_compiled_interface_and_the_pure_twins_match_it(compiled_name, pure_name):
    """The `.pyi` beside each `.pyx` lists its functions: the compiled module exports exactly those, with the
    stub's parameters, and each has a pure twin of the same name, parameters and annotations (`refusal`,
    the compiled module's own account of what it leaves to the reference, excepted)."""
    stub_path = Path(importlib.util.find_spec(pure_name).origin).with_name(compiled_name.rpartition(".")[2] + ".pyi")
    tree = ast.parse(stub_path.read_text())
    stub = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    classes = {c.name: {f.name for f in c.body if isinstance(f, ast.FunctionDef)} for c in tree.body
               if isinstance(c, ast.ClassDef)}
    (exported,) = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                   and n.targets[0].id == "__all__"]
    assert sorted(exported) == sorted([*stub, *classes])
    pure = importlib.import_module(pure_name)
    try:
        compiled = importlib.import_module(compiled_name)
    except ImportError:
        compiled = None  # the pure twins are still held to the stub
    if compiled is not None:
        routines = {n for n, v in vars(compiled).items() if not n.startswith("_") and inspect.isroutine(v)}
        assert sorted(compiled.__all__) == sorted([*stub, *classes]) and routines == set(stub)
    for name, members in classes.items():  # each class's public members, compiled and pure alike
        twins = [importlib.import_module(pure_name)] + ([compiled] if compiled is not None else [])
        for module in twins:
            cls = getattr(module, name)
            assert {m for m in members if not m.startswith("_")} <= {m for m in dir(cls) if not m.startswith("_")}
    for name, node in stub.items():
        params = [a.arg for a in node.args.args]
        if compiled is not None:
            assert list(inspect.signature(getattr(compiled, name)).parameters) == params, name
        if name == "refusal":
            continue
        twin = getattr(pure, name)
        assert list(inspect.signature(twin).parameters) == params, name
        want = {a.arg: ast.unparse(a.annotation) for a in node.args.args} | {"return": ast.unparse(node.returns)}
        assert twin.__annotations__ == want, name


@pytest.mark.both_paths
def test_route_change_is_the_compiled_one_unless_pure_is_forced():
    if speedups._forced_pure():
        assert changes.route_change is changes.route_raw
    else:
        assert changes.route_change is compiled_changes().route_raw


@pytest.mark.parametrize("packed", [False, True], ids=["lists", "packed"])
@pytest.mark.parametrize("path", ["pure", "compiled"])
def test_burst_queues_what_the_loop_queues_across_transactions(path, packed):
    """`burst`, both twins (libpq's memoryviews, Begins and Commits inline, each transaction's position
    fields, the message that ends it handed back), against the reference routing one message at a time;
    `packed`: into batches that pack their entries as they are queued (`StreamBatch.packed`), the same
    commands and positions as the reference's entries packed."""
    burst = changes.burst if path == "pure" else compiled_changes().burst
    if packed and lane.packer is None:
        pytest.skip("the compiled packer is not built")

    class Stream:  # libpq's reads: (size, memoryview), then (0, ...) when none is left
        def __init__(self, raws):
            self.items = iter([(len(r), memoryview(r)) for r in raws] + [(0, memoryview(b""))])

        def get_copy_data(self, _async):
            return next(self.items)

    class Streams:  # nothing held: the decoder is in no streamed block
        pass

    maps = [rides_mapping(partitions={"count": 3}), rides_mapping(entity="e1")]
    # commit times after 2000, and before 1970 (negative Unix milliseconds, floored)
    txs = [(po.Begin(Lsn(0x2_0000_0100 * k), ts, 4242 + k), po.Commit(0, Lsn(0x2_0000_0100 * k), Lsn(0x2_0000_0180 * k), 0))
           for k, ts in ((1, 810_000_000_000_001), (2, 810_000_000_000_002), (3, -946_684_800_000_001))]
    changes_of = [[po.Insert(RELID, ("1", "a", "1.5")), po.Update(RELID, None, None, ("1", "b", "2"))],
                  [po.Insert(RELID, ("2", "c", "3")), po.Delete(RELID, "K", ("1", None, None))],
                  [po.Insert(RELID, ("3", "d", "4"))]]
    raws = [HEADER + encode(m) for (begin, commit), chs in zip(txs, changes_of) for m in (begin, *chs, commit)]
    keepalive = b"k" + bytes(17)

    def setup(packer=None):
        decoder = po.PgOutputDecoder()
        batcher = Batcher(max_entries=10**6, max_delay_s=60.0, packer=packer)  # burst reads the real clock
        targets = changes.bind(decoder.decode(encode(RIDES)), maps, TypeCatalog(), batcher, {"e0": [0], "e1": [0]})
        return decoder, batcher, targets, Transaction()

    decoder, batcher, targets, tx = setup()
    want_ends = []
    for raw in raws:
        kind = raw[OFFSET]
        if kind in (changes.INSERT, changes.UPDATE, changes.DELETE):
            changes.route_raw(kind, raw, OFFSET, targets, tx, batcher, Windows(), decoder)
            tx.seq += 1
        elif kind == ord("B"):
            tx.begin(decoder.decode(raw[OFFSET:]))
        else:
            want_ends.append(tx.commit(decoder.decode(raw[OFFSET:])))
    want = {s: [[typed(v) for v in e] for e in b.entries] for s, b in batcher.batches.items()}
    want_packed = {s: [(lane.xadd_command(s.encode(), e), e[-1]) for e in b.entries] for s, b in batcher.batches.items()}
    want_state = [getattr(tx, name) for name in Transaction.__slots__], batcher.pending

    decoder, batcher, targets, tx = setup(lane.packer if packed else None)
    ends = []
    asking = b"k" + bytes(16) + b"\x01"  # a keepalive that asks for a reply
    # a keepalive after each transaction, as a walsender sends on live traffic: passed over while a batch is pending
    stream = Stream(raws[:4] + [keepalive] + raws[4:8] + [keepalive] + raws[8:] + [asking])
    count, raw = burst(stream, {RELID: targets}, tx, batcher, Windows(), decoder, ends.append, Streams)
    got = {s: [[typed(v) for v in e] for e in b.entries] for s, b in batcher.batches.items()}
    if packed:
        assert {s: [(lane.xadd_command(s.encode(), e), e[-1]) for e in b.queued()] for s, b in batcher.batches.items()} \
            == want_packed
        assert {s: b.count for s, b in batcher.batches.items()} == {s: len(e) for s, e in want.items()}
        if path == "compiled":
            assert not any(got.values()), "every entry packed as it was queued"
            got = want  # what the packing saw is compared above, as bytes
    assert (count, raw) == (5, asking), "stops at a message it does not take, handing it back"
    assert burst(stream, {RELID: targets}, tx, batcher, Windows(), decoder, ends.append, Streams) == (0, None)
    # before any change of the burst, the loop hears the server through the keepalive itself
    assert burst(Stream([keepalive]), {RELID: targets}, tx, batcher, Windows(), decoder, ends.append, Streams) \
        == (0, keepalive)
    assert got == want and ends == want_ends
    assert ([getattr(tx, name) for name in Transaction.__slots__], batcher.pending) == want_state, \
        "the transaction and the batcher as the reference leaves them"
    assert {e[-1][1][:20] for e in got["cdc:e1"]} == {f"{0x2_0000_0100 * k:020d}" for k in (1, 2, 3)}
    # with nothing pending, a keepalive may let the slot move (`Session.keepalive`): the loop's
    decoder, batcher, targets, tx = setup(lane.packer if packed else None)
    other = {RELID + 1: targets}  # the transaction's changes are of a table no mapping binds
    assert burst(Stream(raws[:4] + [keepalive]), other, tx, batcher, Windows(), decoder, [].append, Streams) \
        == (2, keepalive) and not batcher.pending


def test_entries_queued_into_a_list_keep_the_compiled_ones_behind_them_in_order():
    """A batch's packed entries come first, then its list: once anything else queued into the list (the
    reference, a snapshot chunk, an END record), the compiled loop queues behind it there, never before it
    in `packed`, so the batch stays in queue order; a cleared batch packs again."""
    if lane.packer is None:
        pytest.skip("the compiled packer is not built")
    route = compiled_changes().route_raw
    decoder = po.PgOutputDecoder()
    batcher = Batcher(1000, 60.0, clock=Clock(), packer=lane.packer)
    targets = changes.bind(decoder.decode(encode(RIDES)), [rides_mapping()], TypeCatalog(), batcher, {"e0": [0]})
    tx = Transaction()
    tx.begin(po.Begin(Lsn(0x1000), 0, 7))
    batch = batcher.batch("cdc:e0")

    def change(ride: str) -> None:
        raw = HEADER + encode(po.Insert(RELID, (ride, "a", "1.5")))
        route(raw[OFFSET], raw, OFFSET, targets, tx, batcher, Windows(), decoder)
        tx.seq += 1

    def ids() -> list[str]:
        return [orjson.loads(e[e.index(b"key") + 1])["id"] for e in batch.queued()]

    change("1")
    batcher.add(batch, [b"key", b'{"id": "python"}'], 1, tx)  # `Batcher.add`: the Python path queues
    tx.seq += 1
    change("2")
    assert ids() == [1, "python", 2] and (batch.packed.count, len(batch.entries)) == (1, 2)
    assert [e[-1] for e in batch.queued()] == sorted(e[-1] for e in batch.queued())
    assert batch.count == batcher.pending == 3 and batch.last_position == batch.entries[-1][-1]
    last = batch.last_position
    batcher.clear()
    assert (batch.sent, batch.last, batch.count, batch.queued()) == (3, last, 0, [])
    change("3")
    assert (batch.packed.count, batch.entries, ids()) == (1, [], [3])


@pytest.mark.parametrize("path", ["pure", "compiled"])
def test_burst_stops_at_a_full_batch_at_once_and_looks_at_its_age_every_age_every_messages(path):
    """The rule of `Batcher.due` inside `burst`, both twins: a full batch ends the burst at the change that
    filled it; a batch's age (the clock) is looked at once every `AGE_EVERY` messages leaving it pending."""
    burst = changes.burst if path == "pure" else compiled_changes().burst

    class Stream:
        def __init__(self, raws):
            self.items = iter([(len(r), memoryview(r)) for r in raws] + [(0, memoryview(b""))])

        def get_copy_data(self, _async):
            return next(self.items)

    class Streams:
        pass

    begin = HEADER + encode(po.Begin(Lsn(0x100), 810_000_000_000_001, 7))
    inserts = [HEADER + encode(po.Insert(RELID, (str(i), "a", "1.5"))) for i in range(100)]
    for max_entries, max_delay, want in ((10**6, 0.0, changes.AGE_EVERY), (5, 0.0, 5), (10**6, 60.0, 100)):
        decoder = po.PgOutputDecoder()
        batcher = Batcher(max_entries=max_entries, max_delay_s=max_delay)
        targets = changes.bind(decoder.decode(encode(RIDES)), [rides_mapping()], TypeCatalog(), batcher, {"e0": [0]})
        stream = Stream([begin, *inserts])
        assert burst(stream, {RELID: targets}, Transaction(), batcher, Windows(), decoder, None, Streams) == (want, None)
        assert batcher.pending == want
