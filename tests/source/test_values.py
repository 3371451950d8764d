"""Unit and property tests for cdc.source.values: text-format PostgreSQL values to JSON-ready values."""

from __future__ import annotations

import base64
import math
from datetime import datetime, timedelta, timezone

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cdc.source.values import (
    BUILTIN_TYPES,
    TYPE_QUERY,
    TypeCatalog,
    TypeInfo,
    converter_for,
    json_schema_for,
    parse_array,
    type_info_from_row,
    type_name,
)

# cdc.source.values has no compiled twin and runs the same on both paths (the compiled code's own reading is held to
# it by tests/bridge/test_compiled.py): once is enough
pytestmark = pytest.mark.one_path

INT2, INT4, INT8, OID = 21, 23, 20, 26
FLOAT4, FLOAT8, NUMERIC, BOOL = 700, 701, 1700, 16
TEXT, VARCHAR, BPCHAR, NAME, CHAR = 25, 1043, 1042, 19, 18
DATE, TIME, TIMETZ, TIMESTAMP, TIMESTAMPTZ, INTERVAL = 1082, 1083, 1266, 1114, 1184, 1186
UUID, JSON, JSONB, BYTEA = 2950, 114, 3802, 17
INET, CIDR, MACADDR, MONEY, XML, BOX = 869, 650, 829, 790, 142, 603

ARRAY_OF = {
    BOOL: 1000, BYTEA: 1001, CHAR: 1002, NAME: 1003, INT8: 1016, INT2: 1005, INT4: 1007,
    TEXT: 1009, OID: 1028, JSON: 199, XML: 143, BOX: 1020, CIDR: 651, FLOAT4: 1021,
    FLOAT8: 1022, MONEY: 791, MACADDR: 1040, INET: 1041, BPCHAR: 1014, VARCHAR: 1015,
    DATE: 1182, TIME: 1183, TIMESTAMP: 1115, TIMESTAMPTZ: 1185, INTERVAL: 1187,
    TIMETZ: 1270, NUMERIC: 1231, UUID: 2951, JSONB: 3807,
}

# A catalog as TYPE_QUERY would fill it for: enum mood, domain price over
# numeric, domain small_price over price, domain tags over text[], domain
# positive over int4, and their array types; a composite and a range.
MOOD, MOOD_ARR = 16400, 16399
PRICE, PRICE_ARR = 16410, 16409
SMALL_PRICE = 16420
TAGS, TAGS_ARR = 16430, 16429
POSITIVE, POSITIVE_ARR = 16440, 16439
PAIR, PAIR_ARR = 16450, 16449
INT4RANGE = 3904


def user_catalog() -> TypeCatalog:
    return TypeCatalog(
        [
            TypeInfo(MOOD, "mood", "e"),
            TypeInfo(MOOD_ARR, "_mood", "b", elem_oid=MOOD),
            TypeInfo(PRICE, "price", "d", base_oid=NUMERIC),
            TypeInfo(PRICE_ARR, "_price", "b", elem_oid=PRICE),
            TypeInfo(SMALL_PRICE, "small_price", "d", base_oid=PRICE),
            TypeInfo(TAGS, "tags", "d", base_oid=1009),
            TypeInfo(TAGS_ARR, "_tags", "b", elem_oid=TAGS),
            TypeInfo(POSITIVE, "positive", "d", base_oid=INT4),
            TypeInfo(POSITIVE_ARR, "_positive", "b", elem_oid=POSITIVE),
            TypeInfo(PAIR, "pair", "c"),
            TypeInfo(PAIR_ARR, "_pair", "b", elem_oid=PAIR),
            TypeInfo(INT4RANGE, "int4range", "r"),
        ]
    )


def conv(oid: int, text: str, catalog: TypeCatalog | None = None) -> object:
    return converter_for(oid, catalog)(text)


def dumps(value: object) -> bytes:
    return orjson.dumps(value)


# --- built-in table ------------------------------------------------------------


def test_builtin_array_types_point_at_their_elements():
    for elem, array in ARRAY_OF.items():
        assert BUILTIN_TYPES[array].elem_oid == elem
        assert BUILTIN_TYPES[array].name == "_" + BUILTIN_TYPES[elem].name
        assert BUILTIN_TYPES[elem].elem_oid == 0
    assert len(BUILTIN_TYPES) == 2 * len(ARRAY_OF)
    assert BUILTIN_TYPES[1020].delim == ";"
    assert {t.delim for oid, t in BUILTIN_TYPES.items() if oid not in (BOX, 1020)} == {","}


def test_builtin_table_is_read_only():
    with pytest.raises(TypeError):
        BUILTIN_TYPES[1] = TypeInfo(1, "x", "b")  # type: ignore[index]


# --- scalars ---------------------------------------------------------------------


@pytest.mark.parametrize("oid", [INT2, INT4, INT8, OID])
def test_integers(oid):
    assert conv(oid, "0") == 0
    assert conv(oid, "-32768") == -32768
    assert conv(oid, "9223372036854775807") == 9223372036854775807
    assert type(conv(oid, "42")) is int
    assert converter_for(oid) is int
    with pytest.raises(ValueError):
        conv(oid, "4x")


def test_numeric_stays_exact_text():
    for text in ["0", "1.50", "0.000000000000000000000000000001",
                 "123456789012345678901234567890.123", "-7", "NaN", "Infinity", "-Infinity"]:
        assert conv(NUMERIC, text) == text
    assert dumps(conv(NUMERIC, "123456789012345678901234567890.123")) == b'"123456789012345678901234567890.123"'


@pytest.mark.parametrize("oid", [FLOAT4, FLOAT8])
def test_floats(oid):
    assert conv(oid, "1.1") == 1.1
    assert conv(oid, "1e+308") == 1e308
    assert conv(oid, "5e-324") == 5e-324
    assert conv(oid, "-1.5e-07") == -1.5e-07
    zero = conv(oid, "-0")
    assert zero == 0.0 and math.copysign(1.0, zero) == -1.0
    assert dumps(zero) == b"-0.0"
    for special in ("NaN", "Infinity", "-Infinity"):
        assert conv(oid, special) == special
    assert dumps([conv(oid, "NaN"), conv(oid, "-Infinity")]) == b'["NaN","-Infinity"]'
    with pytest.raises(ValueError):
        conv(oid, "")
    with pytest.raises(ValueError):
        conv(oid, "one")


def test_bool():
    assert conv(BOOL, "t") is True
    assert conv(BOOL, "f") is False
    with pytest.raises(ValueError):
        conv(BOOL, "true")


@pytest.mark.parametrize("oid", [TEXT, VARCHAR, BPCHAR, NAME, CHAR, DATE, TIME, TIMETZ, INTERVAL,
                                 UUID, INET, CIDR, MACADDR, MONEY, XML, BOX])
def test_text_like_types_are_their_text(oid):
    assert converter_for(oid) is str
    for text in ["", "ab  ", "NULL", "P1Y2M3DT4H5M6S", "$1,234.56", "é\n\t"]:
        assert conv(oid, text) == text


def test_unknown_types_are_their_text():
    assert converter_for(999_999) is str
    assert conv(999_999, "(1,2)") == "(1,2)"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-11-23 00:33:29.123456", "2026-11-23T00:33:29.123456"),
        ("2026-11-23 00:33:29", "2026-11-23T00:33:29"),
        ("2026-11-23 00:33:29.5", "2026-11-23T00:33:29.5"),
        ("0099-01-01 00:00:00", "0099-01-01T00:00:00"),
        ("infinity", "infinity"),
        ("-infinity", "-infinity"),
        ("0044-03-15 12:00:00 BC", "0044-03-15 12:00:00 BC"),
        ("10000-01-01 00:00:00", "10000-01-01 00:00:00"),
        ("294276-12-31 23:59:59.999999", "294276-12-31 23:59:59.999999"),
    ],
)
def test_timestamp(text, expected):
    assert conv(TIMESTAMP, text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-11-23 00:33:29.123456+00", "2026-11-23T00:33:29.123456Z"),
        ("2026-11-23 00:33:29+00", "2026-11-23T00:33:29Z"),
        ("infinity", "infinity"),
        ("-infinity", "-infinity"),
        ("0044-03-15 12:00:00+00 BC", "0044-03-15 12:00:00+00 BC"),
        ("10000-01-01 00:00:00+00", "10000-01-01 00:00:00+00"),
        # Other sessions' time zones: the offset stays, as +hh:mm.
        ("2026-11-23 06:03:29.5+05:30", "2026-11-23T06:03:29.5+05:30"),
        ("2026-11-22 19:33:29-05", "2026-11-22T19:33:29-05:00"),
        ("1800-01-01 00:00:00+00:19:32", "1800-01-01T00:00:00+00:19:32"),
        ("10000-01-01 00:00:00-05", "10000-01-01 00:00:00-05"),
    ],
)
def test_timestamptz(text, expected):
    assert conv(TIMESTAMPTZ, text) == expected


def test_timestamptz_without_offset_is_an_error():
    with pytest.raises(ValueError):
        conv(TIMESTAMPTZ, "2026-11-23 00:33:29.123")


def pg_timestamp(moment: datetime) -> str:
    """As timestamp_out prints: 4-digit year, seconds always, fraction without trailing zeros."""
    text = f"{moment.year:04d}-{moment:%m-%d %H:%M:%S}"
    if moment.microsecond:
        text += f".{moment.microsecond:06d}".rstrip("0")
    return text


@settings(max_examples=300)
@given(st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31, 23, 59, 59, 999999)))
def test_timestamps_parse_back_to_the_same_instant(moment):
    text = pg_timestamp(moment)
    assert datetime.fromisoformat(conv(TIMESTAMP, text)) == moment
    zulu = conv(TIMESTAMPTZ, text + "+00")
    assert zulu.endswith("Z")
    assert datetime.fromisoformat(zulu) == moment.replace(tzinfo=timezone.utc)


@given(
    st.datetimes(min_value=datetime(1900, 1, 1), max_value=datetime(9999, 1, 1)),
    st.integers(min_value=-15 * 60, max_value=15 * 60).filter(lambda m: m != 0),
)
def test_timestamptz_offsets_parse_back(moment, minutes):
    sign = "+" if minutes > 0 else "-"
    hours, mins = divmod(abs(minutes), 60)
    offset = f"{sign}{hours:02d}" + (f":{mins:02d}" if mins else "")
    text = pg_timestamp(moment)
    result = conv(TIMESTAMPTZ, text + offset)
    tz = timezone(timedelta(minutes=minutes))
    assert datetime.fromisoformat(result) == moment.replace(tzinfo=tz)


@pytest.mark.parametrize("oid", [JSON, JSONB])
def test_json_is_embedded_exactly(oid):
    text = '{"b": 1, "a": [123456789012345678901234567890, 1.50, "x\\u0000y"],\n "c": null}'
    value = conv(oid, text)
    assert type(value) is orjson.Fragment
    assert dumps(value) == text.encode()
    assert dumps({"after": value}) == b'{"after":' + text.encode() + b"}"
    assert dumps(conv(oid, "null")) == b"null"


def test_bytea_hex_to_base64():
    everything = bytes(range(256))
    assert conv(BYTEA, "\\x" + everything.hex()) == base64.b64encode(everything).decode()
    assert conv(BYTEA, "\\x") == ""
    assert conv(BYTEA, "\\x0a0b") == "Cgs="
    assert conv(BYTEA, "\\xFF") == "/w=="
    with pytest.raises(ValueError):
        conv(BYTEA, "\\x0")


def test_bytea_escape_format_too():
    assert conv(BYTEA, "ab\\\\c\\000\\377") == base64.b64encode(b"ab\\c\x00\xff").decode()
    assert conv(BYTEA, "") == ""
    with pytest.raises(ValueError):
        conv(BYTEA, "\\9")


@given(st.binary(max_size=300))
def test_bytea_round_trip(data):
    assert base64.b64decode(conv(BYTEA, "\\x" + data.hex()), validate=True) == data


# --- arrays ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("oid", "text", "expected"),
    [
        (1007, "{}", []),
        (1007, "{1,NULL,3}", [1, None, 3]),
        (1007, "{null,Null}", [None, None]),
        (1007, "{{1,2},{3,4}}", [[1, 2], [3, 4]]),
        (1007, "{{{1},{2}},{{3},{4}}}", [[[1], [2]], [[3], [4]]]),
        (1007, "[0:1]={5,6}", [5, 6]),
        (1007, "[-2:-1][3:4]={{1,2},{3,4}}", [[1, 2], [3, 4]]),
        (1016, "{-9223372036854775808}", [-9223372036854775808]),
        (1022, "{NaN,Infinity,-Infinity,-0,1e+308}", ["NaN", "Infinity", "-Infinity", -0.0, 1e308]),
        (1231, "{NaN,1.50,NULL}", ["NaN", "1.50", None]),
        (1000, "{t,f,NULL}", [True, False, None]),
        (1009, '{NULL,"NULL","null",a}', [None, "NULL", "null", "a"]),
        (1009, '{"a\\"b","c\\\\d","e,f"," g ","","{x}"}', ['a"b', "c\\d", "e,f", " g ", "", "{x}"]),
        (1009, '{{a,"b c"},{NULL,d}}', [["a", "b c"], [None, "d"]]),
        (1009, "{é,日本}", ["é", "日本"]),
        (1009, "{a\\,b}", ["a,b"]),  # array_in accepts escapes in unquoted elements
        (1009, "{ a , b }", ["a", "b"]),  # and whitespace around them
        (1009, '{ { "a" } , { b } }', [["a"], ["b"]]),
        (1007, "{1, 2}", [1, 2]),
        (1009, "{a b}", ["a b"]),
        (1009, "{\\NULL}", ["NULL"]),
        (1009, "{a\\ }", ["a "]),
        (1015, '{"ab  "}', ["ab  "]),
        (1115, '{"2026-11-23 00:33:29.5",infinity}', ["2026-11-23T00:33:29.5", "infinity"]),
        (1185, '{"2026-11-23 00:33:29+00",NULL,-infinity}', ["2026-11-23T00:33:29Z", None, "-infinity"]),
        (1001, '{"\\\\x0a0b",NULL}', ["Cgs=", None]),
        (1020, "{(3,4),(1,2);(1,1),(0,0)}", ["(3,4),(1,2)", "(1,1),(0,0)"]),
        (1020, "{{(1,1),(0,0);(2,2),(0,0)}}", [["(1,1),(0,0)", "(2,2),(0,0)"]]),
        (1041, "{192.168.0.1,::1,10.0.0.0/8}", ["192.168.0.1", "::1", "10.0.0.0/8"]),
    ],
)
def test_arrays(oid, text, expected):
    assert conv(oid, text) == expected
    assert parse_array(text, converter_for(BUILTIN_TYPES[oid].elem_oid), BUILTIN_TYPES[oid].delim) == expected


def test_array_of_json_embeds_each_element():
    value = conv(3807, '{"{\\"a\\": 123456789012345678901234567890}",NULL,"[1, 2]"}')
    assert dumps(value) == b'[{"a": 123456789012345678901234567890},null,[1, 2]]'


@pytest.mark.parametrize(
    "text",
    ["", "1,2", "{1,2", "{1,2}}", "{1,,2}", "{,1}", "{1,}", '{"a}', '{"a"b}', "{a\"b}",
     "{1}x", "[0:1]{1}", "[a]={1}", "{{1}", "{a{b}}", "{1 {2}}", "{\\", '{"\\'],
)
def test_malformed_arrays_raise(text):
    with pytest.raises(ValueError):
        conv(1009, text)


def test_array_element_errors_surface():
    with pytest.raises(ValueError):
        conv(1007, "{1,x}")
    with pytest.raises(ValueError):
        conv(1000, "{t,maybe}")


# Hypothesis: render nested lists as array_out does, parse them back.

_ARRAY_SPECIALS = '{}"\\'
_ARRAY_SPACE = " \t\n\r\v\f"


def render_array(value: list, delim: str = ",") -> str:
    """An array literal as array_out prints it."""

    def item(v: object) -> str:
        if v is None:
            return "NULL"
        if isinstance(v, list):
            return "{" + delim.join(item(x) for x in v) + "}"
        assert isinstance(v, str)
        if (
            v == ""
            or (v.isascii() and v.upper() == "NULL")
            or any(c in _ARRAY_SPECIALS or c in _ARRAY_SPACE or c == delim for c in v)
        ):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return v

    return item(value)


def test_render_array_matches_array_out_examples():
    assert render_array([None, "NULL", "a b", 'q"', "", "x"]) == '{NULL,"NULL","a b","q\\"","",x}'
    assert render_array([["a", "b"], ["c", None]]) == "{{a,b},{c,NULL}}"
    assert render_array(["(1,1),(0,0)"], ";") == "{(1,1),(0,0)}"


_leaf = st.one_of(
    st.none(),
    st.text(max_size=8),
    st.sampled_from(["NULL", "null", "NuLl", "", " ", "\\", '"', "{", "}", ",", ";", "a b", "\u00a0", "\x00"]),
)
_nested = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=4), max_leaves=25)
_arrays = st.lists(_nested, max_size=6)
_flat = st.lists(_leaf, max_size=8)


@settings(max_examples=500)
@given(_arrays, st.sampled_from([",", ";"]))
@example([None, "NULL", 'a"b', "c\\d", "e,f", ""], ",")
@example([["a", "b"], [None, "d"]], ",")
@example([[], [[]]], ",")
def test_array_round_trip(value, delim):
    text = render_array(value, delim)
    assert parse_array(text, str, delim) == value
    array = 1009 if delim == "," else 1020
    assert conv(array, text) == value


@settings(max_examples=300)
@given(_flat, st.sampled_from([",", ";"]))
def test_flat_arrays_round_trip_through_both_paths(value, delim):
    text = render_array(value, delim)
    array = 1009 if delim == "," else 1020
    assert conv(array, text) == value == parse_array(text, str, delim)


@given(_arrays, st.integers(min_value=-5, max_value=5))
def test_dimension_decoration_is_dropped(value, lower):
    text = f"[{lower}:{lower + len(value) - 1}]=" + render_array(value)
    assert conv(1009, text) == value


@given(st.lists(st.one_of(st.none(), st.integers(min_value=-(2**63), max_value=2**63 - 1)), max_size=10))
def test_int_arrays_round_trip(value):
    text = "{" + ",".join("NULL" if v is None else str(v) for v in value) + "}"
    assert conv(1016, text) == value


@given(st.lists(st.lists(st.one_of(st.none(), st.floats()), min_size=2, max_size=2), max_size=4))
def test_float_arrays_round_trip(value):
    def out(v):
        if v is None:
            return "NULL"
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "Infinity" if v > 0 else "-Infinity"
        return repr(v)

    text = "{" + ",".join("{" + ",".join(out(v) for v in row) + "}" for row in value) + "}"
    got = conv(1022, text)
    expected = [[None if v is None else (out(v) if not math.isfinite(v) else v) for v in row] for row in value]
    assert got == expected
    orjson.dumps(got)


# --- catalog: enums, domains, other kinds ---------------------------------------------------


def test_enums_domains_and_their_arrays():
    cat = user_catalog()
    assert conv(MOOD, "happy", cat) == "happy"
    assert conv(MOOD_ARR, '{sad,"NULL",NULL,"with space"}', cat) == ["sad", "NULL", None, "with space"]
    assert conv(PRICE, "12.50", cat) == "12.50"
    assert conv(SMALL_PRICE, "1.00", cat) == "1.00"
    assert conv(PRICE_ARR, "{1.50,NULL}", cat) == ["1.50", None]
    assert conv(POSITIVE, "7", cat) == 7
    assert conv(POSITIVE_ARR, "{7,NULL}", cat) == [7, None]
    assert conv(TAGS, "{a,b}", cat) == ["a", "b"]
    assert conv(TAGS_ARR, '{"{a,b}","{c}",NULL}', cat) == [["a", "b"], ["c"], None]
    assert conv(PAIR, '(1,"x y")', cat) == '(1,"x y")'
    assert conv(PAIR_ARR, '{"(1,\\"x y\\")",NULL}', cat) == ['(1,"x y")', None]
    assert conv(INT4RANGE, "[1,5)", cat) == "[1,5)"


def test_without_the_catalog_user_types_are_text():
    assert conv(MOOD_ARR, "{sad}") == "{sad}"
    assert conv(POSITIVE, "7", TypeCatalog()) == "7"


def test_array_with_unknown_element_type_yields_strings():
    cat = TypeCatalog([TypeInfo(20001, "_mystery", "b", elem_oid=20000)])
    assert conv(20001, '{a,"b c",NULL}', cat) == ["a", "b c", None]


def test_converters_are_cached_and_cache_follows_catalog_changes():
    cat = TypeCatalog()
    assert converter_for(INT4, cat) is converter_for(INT4, cat) is int
    assert converter_for(TEXT, cat) is str
    assert converter_for(1007, cat) is converter_for(1007, cat)
    assert converter_for(POSITIVE, cat) is str
    cat.add(TypeInfo(POSITIVE, "positive", "d", base_oid=INT4))
    assert converter_for(POSITIVE, cat) is int


def test_catalog_get_answers_for_builtins_and_added_types():
    cat = user_catalog()
    assert cat.get(INT4) == TypeInfo(INT4, "int4", "b")
    assert cat.get(MOOD) == TypeInfo(MOOD, "mood", "e")
    assert cat.get(424242) is None
    assert MOOD in cat and INT4 in cat and 424242 not in cat
    assert len(cat) == 12
    assert {t.oid for t in cat} >= {MOOD, PAIR}


def test_missing_follows_known_types_to_what_they_point_at():
    cat = TypeCatalog()
    assert cat.missing([INT4, 1007, TEXT, BOX, 1020]) == set()
    assert cat.missing([MOOD_ARR, INT4]) == {MOOD_ARR}
    cat.add(TypeInfo(MOOD_ARR, "_mood", "b", elem_oid=MOOD))
    assert cat.missing([MOOD_ARR]) == {MOOD}
    cat.add(TypeInfo(SMALL_PRICE, "small_price", "d", base_oid=PRICE))
    assert cat.missing(iter([SMALL_PRICE, MOOD_ARR])) == {PRICE, MOOD}
    assert user_catalog().missing([MOOD_ARR, SMALL_PRICE, TAGS_ARR, POSITIVE_ARR, PAIR_ARR]) == set()


def test_cycles_are_reported_not_looped():
    cat = TypeCatalog([TypeInfo(30000, "a", "d", base_oid=30001), TypeInfo(30001, "b", "d", base_oid=30000)])
    with pytest.raises(ValueError):
        converter_for(30000, cat)
    assert cat.missing([30000]) == set()
    assert type_name(30000, cat) == "a"
    assert json_schema_for(30000, cat) == {"type": "string"}


def test_type_info_from_row():
    assert type_info_from_row((16399, "_mood", "b", 0, 16400, ",")) == TypeInfo(16399, "_mood", "b", 0, 16400, ",")
    assert type_info_from_row((16410, "price", "d", 1700, 0, ",")) == TypeInfo(16410, "price", "d", base_oid=1700)
    assert type_info_from_row((1, "x", "b", None, None, None)).delim == ","


def test_type_query_shape():
    assert TYPE_QUERY.count("%s") == 1
    assert "WITH RECURSIVE" in TYPE_QUERY
    assert "= ANY(%s" in TYPE_QUERY


def test_type_info_is_frozen_and_slotted():
    info = TypeInfo(1, "x", "b")
    with pytest.raises(AttributeError):
        info.name = "y"  # type: ignore[misc]
    assert not hasattr(info, "__dict__")


# --- names and schemas ------------------------------------------------------------------------


def test_type_names():
    cat = user_catalog()
    assert type_name(INT4) == "int4"
    assert type_name(NUMERIC, cat) == "numeric"
    assert type_name(1007) == "int4[]"
    assert type_name(3807, cat) == "jsonb[]"
    assert type_name(MOOD, cat) == "mood"
    assert type_name(MOOD_ARR, cat) == "mood[]"
    assert type_name(PRICE, cat) == "price"
    assert type_name(TAGS, cat) == "tags"
    assert type_name(MOOD_ARR) == "oid 16399"
    assert type_name(20001, TypeCatalog([TypeInfo(20001, "_mystery", "b", elem_oid=20000)])) == "_mystery"


def test_json_schemas():
    cat = user_catalog()
    assert json_schema_for(INT4) == {"type": "integer"}
    assert json_schema_for(INT8) == {"type": "integer"}
    assert json_schema_for(OID) == {"type": "integer"}
    assert json_schema_for(FLOAT8) == {"type": ["number", "string"]}
    assert json_schema_for(NUMERIC) == {"type": "string"}
    assert json_schema_for(BOOL) == {"type": "boolean"}
    assert json_schema_for(TEXT) == {"type": "string"}
    assert json_schema_for(TIMESTAMPTZ) == {"type": "string", "format": "date-time"}
    assert json_schema_for(TIMESTAMP) == {"type": "string"}
    assert json_schema_for(DATE) == {"type": "string", "format": "date"}
    assert json_schema_for(UUID) == {"type": "string", "format": "uuid"}
    assert json_schema_for(JSONB) == {}
    assert json_schema_for(BYTEA) == {"type": "string", "contentEncoding": "base64"}
    assert json_schema_for(1007) == {"type": "array", "items": {"type": ["integer", "array", "null"]}}
    assert json_schema_for(1022) == {"type": "array", "items": {"type": ["number", "string", "array", "null"]}}
    assert json_schema_for(3807) == {"type": "array", "items": {}}
    assert json_schema_for(1185) == {
        "type": "array",
        "items": {"type": ["string", "array", "null"], "format": "date-time"},
    }
    assert json_schema_for(MOOD, cat) == {"type": "string"}
    assert json_schema_for(MOOD_ARR, cat) == {"type": "array", "items": {"type": ["string", "array", "null"]}}
    assert json_schema_for(POSITIVE, cat) == {"type": "integer"}
    assert json_schema_for(TAGS, cat) == {"type": "array", "items": {"type": ["string", "array", "null"]}}
    assert json_schema_for(999_999) == {"type": "string"}


def test_json_schemas_are_fresh_dicts():
    first = json_schema_for(FLOAT8)
    first["type"].append("null")
    first["x"] = 1
    assert json_schema_for(FLOAT8) == {"type": ["number", "string"]}


@pytest.mark.parametrize("oid", sorted(BUILTIN_TYPES))
def test_every_builtin_has_a_name_schema_and_converter(oid):
    assert type_name(oid)
    assert isinstance(json_schema_for(oid), dict)
    assert callable(converter_for(oid))
