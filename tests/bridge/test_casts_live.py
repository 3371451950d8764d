"""Casts against a real server: a value a cast cannot write exactly stops the bridge at its change, the slot
held before it, and the fix the error names delivers the row; epoch casts agree with PostgreSQL's own
`extract(epoch ...)` to the microsecond, BC dates and years past 9999 included."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest

from conftest import read_stream

pytestmark = pytest.mark.integration

RIDE_WITH_CAST = """\
entity: ride
table: public.rides
key: [id]
fields:
  id: id
  rider: rider_id
  distance: {column: distance_m, cast: integer}
"""


def test_a_value_a_cast_would_cut_stops_the_bridge_at_its_change_and_dropping_the_cast_delivers_it(env):
    env.apply_sql("10_rocket_rides.sql")
    path = env.write_mapping("ride.yaml", RIDE_WITH_CAST)
    env.cdc("init", check=True)
    env.execute("INSERT INTO riders (id, name, email) VALUES (1, 'a', 'b')")
    env.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (1, 1, 10)")
    before = env.current_wal()
    with env.connect() as conn, conn.transaction():  # a change before it in its transaction
        conn.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (4, 1, 8)")
        conn.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (2, 1, 3.7)")
    after = env.current_wal()
    env.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (3, 1, 5)")

    result = env.cdc("run", "--until-caught-up")
    assert result.returncode == 3, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("cdc: error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    line = lines[0]
    assert f"{path}:7: entity 'ride': cast 'integer' cannot write a value of column 'distance_m' (numeric) " \
           "of public.rides exactly: a value with a fractional part" in line
    assert 'change 1, row key {"id":2}' in line and "3.7" not in line
    assert "drop the cast from field 'distance'" in line and "cdc run again" in line
    hi, lo = line.split("committed at LSN ")[1].split(",")[0].split("/")
    assert before <= (int(hi, 16) << 32 | int(lo, 16)) <= after  # ride 2's transaction
    # nothing past the change was published, nothing of its transaction acknowledged
    assert [(e["key"], e["data"]) for e in read_stream(env.redis, "cdc:ride")] == [
        ({"id": 1}, {"id": 1, "rider": 1, "distance": 10}), ({"id": 4}, {"id": 4, "rider": 1, "distance": 8})]
    env.wait_slot_inactive()
    assert env.confirmed_flush() <= before
    # the same again: the refusal is the change's, not the run's
    assert env.cdc("run", "--until-caught-up").returncode == 3

    # the fix the error names: drop the cast, run again
    path.write_text(RIDE_WITH_CAST.replace("{column: distance_m, cast: integer}", "distance_m"))
    env.cdc("run", "--until-caught-up", check=True)
    entries = read_stream(env.redis, "cdc:ride")
    assert [(e["key"], e["data"]) for e in entries] == [
        ({"id": 1}, {"id": 1, "rider": 1, "distance": 10}),
        ({"id": 4}, {"id": 4, "rider": 1, "distance": 8}),  # once: the run after the fix resumes at ride 2
        ({"id": 2}, {"id": 2, "rider": 1, "distance": "3.700"}),
        ({"id": 3}, {"id": 3, "rider": 1, "distance": "5.000"}),
    ]
    assert env.confirmed_flush() > after


MOMENTS = """\
CREATE TABLE moments (id int PRIMARY KEY, ts timestamp, tstz timestamptz, d date);
"""

MOMENTS_MAPPING = """\
entity: moment
table: public.moments
key: [id]
fields:
  id: id
  ts_s: {column: ts, cast: epoch_s}
  ts_ms: {column: ts, cast: epoch_ms}
  tstz_s: {column: tstz, cast: epoch_s}
  tstz_ms: {column: tstz, cast: epoch_ms}
  d_s: {column: d, cast: epoch_s}
"""

VALUES = [
    ("2026-11-21 10:15:00.5", "2026-11-21 10:15:00.123456+05:30", "2026-11-21"),
    ("1969-12-31 23:59:59.999999", "1969-12-31 23:59:59.000001+00", "1969-12-31"),
    ("0044-03-15 12:00:00.25 BC", "0044-03-15 12:00:00.000007+00 BC", "0044-03-15 BC"),
    ("4713-01-01 00:00:00 BC", "4713-01-01 00:00:00+00 BC", "4713-01-01 BC"),
    ("294276-12-31 23:59:59.999999", "294276-12-31 23:59:59.999999+00", "294276-12-31"),
    ("10000-01-01 00:00:00.001", "1582-10-04 23:59:59.999+01", "5874897-12-31"),
]


def test_epoch_casts_are_postgresqls_own_epoch_to_the_microsecond(env):
    env.execute(MOMENTS)
    env.write_mapping("moment.yaml", MOMENTS_MAPPING)
    env.cdc("init", check=True)
    for i, (ts, tstz, d) in enumerate(VALUES):
        env.execute("INSERT INTO moments VALUES (%s, %s, %s, %s)", (i, ts, tstz, d))
    env.cdc("run", "--until-caught-up", check=True)
    # past about 292277 AD extract rounds its quotient to 4 places (numeric division's scale): there it
    # is taken of the moment 400 years (146,097 days, 12,622,780,800 s) earlier
    exact = ("CASE WHEN {c} > '200000-01-01' THEN extract(epoch FROM {c} - interval '400 years') + 12622780800 "
             "ELSE extract(epoch FROM {c}) END")
    want = env.execute(f"SELECT id, {exact.format(c='ts')}, {exact.format(c='tstz')}, extract(epoch FROM d) "
                       "FROM moments ORDER BY id")
    got = {}
    for _, fields in env.redis.xrange("cdc:moment"):
        data = json.loads(fields[b"data"], parse_float=Decimal)  # digit for digit, no double between
        got[data["id"]] = data
    assert len(got) == len(VALUES)
    for i, ts, tstz, d in want:
        data = got[i]
        assert Decimal(data["ts_s"]) == ts and Decimal(data["ts_ms"]) == ts * 1000
        assert Decimal(data["tstz_s"]) == tstz and Decimal(data["tstz_ms"]) == tstz * 1000
        assert Decimal(data["d_s"]) == d
