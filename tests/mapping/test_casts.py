"""Casts are exact or refused, value by value (pure: no server).

Each property draws values a column of the source type can hold, in PostgreSQL's text, and compares
what the cast writes with an oracle (Python's `Decimal` and `datetime`): the entry's JSON value, read
back as a decimal, is the column's value, or the cast refuses the value with `CastRefused`. The
compiled path agrees with these results (tests/bridge/test_compiled.py::test_each_type_and_cast_matches
feeds the same kinds of values through both).
"""

from __future__ import annotations

from datetime import date, datetime, timedelta, timezone
from decimal import Decimal

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cdc.errors import MappingError
from cdc.mapping.model import parse_mapping
from cdc.mapping.projector import CastRefused, Projector
from cdc.source.shapes import ColumnShape, TableShape
from cdc.source.values import TypeCatalog

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
INT64 = (-(2**63), 2**63 - 1)


def projector(oid: int, cast: str) -> Projector:
    shape = TableShape("public", "t", (ColumnShape("id", 20, key=True), ColumnShape("v", oid)))
    m = parse_mapping({"entity": "e", "table": "public.t", "key": ["id"],
                       "fields": {"id": "id", "v": {"column": "v", "cast": cast}}}, {})
    return Projector(m, shape, TypeCatalog())


def outcome(oid: int, cast: str, text: str):
    """The entry's raw JSON value (as written, not re-parsed) or "refused"."""
    p = projector(oid, cast)
    try:
        out = p.insert(("1", text))
    except CastRefused as exc:
        assert exc.exit_code == 3 and "cdc run again" in str(exc)
        return "refused"
    data = out.fields[out.fields.index(b"data") + 1]
    return data[data.index(b'"v":') + 4:-1].decode()


# -- integer ----------------------------------------------------------------------------------


@settings(max_examples=400)
@given(st.one_of(
    st.decimals(allow_nan=False, allow_infinity=False).map(str),
    st.integers(-(2**70), 2**70).map(str),
    st.tuples(st.integers(-(2**64), 2**64), st.integers(0, 6)).map(lambda t: f"{t[0]}.{'0' * t[1]}".rstrip(".")),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "3.7", "3.0", "-0.5", "9223372036854775807",
                     "9223372036854775808", "-9223372036854775808", "-9223372036854775809"]),
))
def test_integer_of_numeric_is_the_exact_integer_or_refused(text):
    got = outcome(1700, "integer", text)
    number = Decimal(text)
    exact = number.is_finite() and number == number.to_integral_value() and INT64[0] <= number <= INT64[1]
    if exact:
        assert Decimal(got) == number and "." not in got
    else:
        assert got == "refused"


@settings(max_examples=200)
@given(st.floats(allow_nan=True, allow_infinity=True).map(repr).map(lambda t: {"inf": "Infinity", "-inf": "-Infinity", "nan": "NaN"}.get(t, t)))
@example("3.7")
@example("1e+20")
@example("-0")
@example("4.0")
def test_integer_of_a_double_is_the_exact_integer_or_refused(text):
    """The number PostgreSQL prints (the shortest text that reads back as the double, as the entry without
    the cast shows it), as an integer: 4.630465924140619e+16 is 46304659241406190, which reads back as
    the same double."""
    got = outcome(701, "integer", text)
    number = Decimal(text)
    if number.is_finite() and number == number.to_integral_value() and INT64[0] <= number <= INT64[1]:
        assert Decimal(got) == number and float(got) == float(text)
    else:
        assert got == "refused"


def test_integer_of_an_integer_column_is_the_column_itself():
    for oid, text in ((21, "-32768"), (23, "2147483647"), (20, "-9223372036854775808"), (26, "4294967295")):
        assert outcome(oid, "integer", text) == text


# -- float ------------------------------------------------------------------------------------


@settings(max_examples=400)
@given(st.one_of(
    st.decimals(allow_nan=False, allow_infinity=False).map(str),
    st.decimals(places=3, min_value=-10**9, max_value=10**9).map(str),
    st.integers(-(2**64), 2**64).map(str),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "0.1", "1500.750", "9007199254740993", "9007199254740992"]),
))
def test_float_of_numeric_or_integers_writes_the_same_decimal_or_refuses(text):
    for oid in (1700,) + ((20,) if text.lstrip("-").isdigit() and INT64[0] <= int(text) <= INT64[1] else ()):
        got = outcome(oid, "float", text)
        number = Decimal(text)
        if number.is_finite() and Decimal(repr(float(text))) == number:
            assert Decimal(got) == number
        else:
            assert got == "refused"


@settings(max_examples=300)
@given(st.floats())
def test_float_of_a_double_is_the_double(value):
    text = {"inf": "Infinity", "-inf": "-Infinity", "nan": "NaN"}.get(repr(value), repr(value))
    got = outcome(701, "float", text)
    if value != value or value in (float("inf"), float("-inf")):
        assert got == "refused"
    else:
        assert float(got) == value and (str(float(got)) == repr(value))


# -- epoch_ms, epoch_s -----------------------------------------------------------------------


def pg_timestamp(m: datetime) -> str:
    text = f"{m.year:04d}-{m.month:02d}-{m.day:02d} {m.hour:02d}:{m.minute:02d}:{m.second:02d}"
    return text + (f".{m.microsecond:06d}".rstrip("0") if m.microsecond else "")


@settings(max_examples=400)
@given(st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)),
       st.integers(-15 * 3600, 15 * 3600).map(lambda s: s - s % 60))
@example(datetime(2026, 11, 21, 10, 15, 0, 500000), 0)
@example(datetime(1969, 12, 31, 23, 59, 59, 999999), 0)
@example(datetime(1, 1, 2), -15 * 3600)
def test_epoch_is_exact_to_the_microsecond(moment, offset_s):
    """timestamp (counted as UTC) and timestamptz with any offset: the exact count, whole or with its digits."""
    sign = "+" if offset_s >= 0 else "-"
    hours, minutes = divmod(abs(offset_s) // 60, 60)
    tz = f"{sign}{hours:02d}" + (f":{minutes:02d}" if minutes else "")
    utc = moment.replace(tzinfo=timezone(timedelta(seconds=offset_s)))
    micros = (utc - EPOCH) // timedelta(microseconds=1)
    plain_micros = (moment.replace(tzinfo=timezone.utc) - EPOCH) // timedelta(microseconds=1)
    for oid, text, want in ((1114, pg_timestamp(moment), plain_micros), (1184, pg_timestamp(moment) + tz, micros)):
        ms, s = outcome(oid, "epoch_ms", text), outcome(oid, "epoch_s", text)
        assert Decimal(ms) == Decimal(want) / 1000 and Decimal(s) == Decimal(want) / 1_000_000
        assert ("." in ms) == bool(want % 1000) and ("." in s) == bool(want % 1_000_000)


@given(st.dates())
def test_epoch_of_a_date_is_its_midnight_utc(day):
    seconds = (date.fromordinal(day.toordinal()) - date(1970, 1, 1)).days * 86400
    assert outcome(1082, "epoch_s", day.isoformat()) == str(seconds)
    assert outcome(1082, "epoch_ms", day.isoformat()) == str(seconds * 1000)


@given(st.dates(min_value=date(1, 1, 1), max_value=date(9999, 12, 31)), st.integers(1, 700))
def test_bc_dates_and_years_past_9999_keep_their_meaning_in_epochs(day, cycles):
    """The calendar repeats every 400 years (146,097 days): a date that many cycles before or after one
    Python knows is exactly that many days away. PostgreSQL numbers 1 BC, 2 BC ... as years 0, -1 ..."""
    shift = cycles * 400
    base = int(outcome(1082, "epoch_s", day.isoformat()))
    later = day.year + shift
    if later <= 294276:
        assert int(outcome(1082, "epoch_s", f"{later:04d}{day.isoformat()[4:]}")) == base + cycles * 146097 * 86400
    earlier = day.year - shift  # astronomical; PostgreSQL prints 1 - year with BC
    if earlier <= 0 and 1 - earlier <= 4713:
        text = f"{1 - earlier:04d}{day.isoformat()[4:]} BC"
        assert int(outcome(1082, "epoch_s", text)) == base - cycles * 146097 * 86400


def test_epochs_refuse_infinity():
    for oid, text in ((1082, "infinity"), (1114, "-infinity"), (1184, "infinity")):
        assert outcome(oid, "epoch_ms", text) == "refused" and outcome(oid, "epoch_s", text) == "refused"


# -- date ---------------------------------------------------------------------------------------


@given(st.dates(), st.times(), st.integers(-14, 14))
@example(date(2024, 1, 2), datetime.min.time(), 0)
@example(date(2024, 1, 2), datetime.min.time(), 5)
def test_date_is_the_day_when_nothing_is_dropped_else_refused(day, time, offset_h):
    assert outcome(1082, "date", day.isoformat()) == f'"{day.isoformat()}"'
    moment = datetime.combine(day, time)
    got = outcome(1114, "date", pg_timestamp(moment))
    assert got == (f'"{day.isoformat()}"' if time == datetime.min.time() else "refused")
    tz = f"{'+' if offset_h >= 0 else '-'}{abs(offset_h):02d}"
    utc = moment.replace(tzinfo=timezone(timedelta(hours=offset_h))).astimezone(timezone.utc)
    got = outcome(1184, "date", pg_timestamp(moment) + tz)
    if utc.time() == datetime.min.time() and utc.tzinfo and 1 <= utc.year <= 9999:
        assert got == f'"{utc.date().isoformat()}"'
    else:
        assert got == "refused"


@pytest.mark.parametrize("oid, text", [
    (1082, "0044-03-15 BC"), (1082, "294276-12-31"), (1082, "10000-01-01"), (1082, "infinity"),
    (1114, "0044-03-15 00:00:00 BC"), (1114, "10000-01-01 00:00:00"), (1184, "-infinity"),
    (1114, "2024-01-02 03:04:05"), (1184, "2024-01-02 00:00:00+05"),
])
def test_date_refuses_what_yyyy_mm_dd_cannot_write_or_would_cut(oid, text):
    assert outcome(oid, "date", text) == "refused"


def test_a_refusal_names_the_mapping_column_and_fix_not_the_value():
    with pytest.raises(CastRefused) as err:
        projector(1700, "integer").insert(("7", "3.7"))
    line = str(err.value)
    assert isinstance(err.value, MappingError) and err.value.exit_code == 3
    assert "cast 'integer' cannot write a value of column 'v' (numeric) of public.t exactly" in line
    assert "fractional part" in line and "drop the cast from field 'v'" in line and "3.7" not in line


def test_a_backfill_chunks_refused_row_is_named_by_its_watermarks_lsn_and_its_key():
    from cdc.bridge.batcher import Batcher
    from cdc.bridge.positions import Transaction
    from cdc.bridge.snapshot import queue_chunk

    tx = Transaction()
    tx.begin_at(0x1_0000_0040, 0, 7)
    tx.seq = 4
    batcher = Batcher(100, 60.0)
    info = {"columns": ["id", "v"], "rows": [["1", "2.000"], ["2", "2.5"], ["3", "3"]]}
    with pytest.raises(CastRefused) as err:
        queue_chunk(info, projector(1700, "integer"), set(), batcher, tx)
    assert "; in the transaction committed at LSN 1/40, change 5, row key {\"id\":2}; drop the cast" in str(err.value)
    assert batcher.pending == 1  # the row before it, as for the changes before a refused one


def test_a_refused_key_is_not_shown():
    shape = TableShape("public", "t", (ColumnShape("id", 1700, key=True),))
    m = parse_mapping({"entity": "e", "table": "public.t", "key": ["id"],
                       "fields": {"id": {"column": "id", "cast": "integer"}}}, {})
    p = Projector(m, shape, TypeCatalog())
    with pytest.raises(CastRefused) as err:
        p.insert(("2.5",))
    line = str(p.placed(err.value, ("2.5",), "4294967360", 0))
    assert "committed at LSN 1/40, change 0, row key not shown (a cast refuses it too)" in line and "2.5" not in line


@settings(max_examples=300)
@given(st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)),
       st.integers(-15 * 3600, 15 * 3600))
def test_the_parser_for_any_year_agrees_with_pythons_on_years_1_to_9999(moment, offset_s):
    """Epochs of years 1-9999 AD are parsed by Python; the others by `_micros`, which must agree on these."""
    from cdc.mapping.projector import _micros

    sign = "+" if offset_s >= 0 else "-"
    h, rest = divmod(abs(offset_s), 3600)
    m, s = divmod(rest, 60)
    tz = f"{sign}{h:02d}:{m:02d}:{s:02d}"
    aware = moment.replace(tzinfo=timezone(timedelta(seconds=offset_s)))
    assert _micros(pg_timestamp(moment) + tz, CastRefused) == (aware - EPOCH) // timedelta(microseconds=1)
    assert _micros(pg_timestamp(moment), CastRefused) == \
        (moment.replace(tzinfo=timezone.utc) - EPOCH) // timedelta(microseconds=1)
    assert _micros(moment.date().isoformat(), CastRefused) == \
        (date.fromordinal(moment.toordinal()) - date(1970, 1, 1)).days * 86_400_000_000
