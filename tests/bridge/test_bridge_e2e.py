"""End to end: changes in PostgreSQL become entries in Redis streams, exactly."""

from __future__ import annotations

import hashlib
import hmac
import importlib.util
import json
from decimal import Decimal

import pytest

from cdc.demo.local import wait_for
from conftest import TEST_HASH_KEY, read_stream

pytestmark = pytest.mark.integration


def setup_rides(env) -> None:
    env.init_rides("ride.yaml", "rider.yaml")


@pytest.mark.one_path
def test_init_is_idempotent_and_reports(env):
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml", "rider.yaml")
    first = env.cdc("init", check=True).stdout
    assert "created publication cdc for 2 table(s)" in first
    assert f"created logical slot {env.slot} (pgoutput)" in first
    second = env.cdc("init", check=True).stdout
    assert "publication cdc already covers the mapped tables" in second
    assert f"slot {env.slot} already exists" in second


def test_inserts_updates_deletes_reach_streams_in_commit_order(env):
    setup_rides(env)
    with env.connect() as conn:
        conn.execute("INSERT INTO riders (id, name, email, phone) VALUES (1, 'Ann', 'ann@example.com', '555-1234')")
        with conn.transaction():
            conn.execute("INSERT INTO rides (id, rider_id, distance_m, internal_note) VALUES (10, 1, 1234.5, 'secret')")
            conn.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (11, 1, 0.001)")
        conn.execute("UPDATE rides SET distance_m = 99999999.999 WHERE id = 10")
        conn.execute("DELETE FROM rides WHERE id = 11")
        # rolled back: must never appear
        with pytest.raises(RuntimeError):
            with conn.transaction():
                conn.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (12, 1, 5)")
                raise RuntimeError("abort")
    result = env.cdc("run", "--until-caught-up", check=True)
    assert "caught up" in result.stderr

    rides = read_stream(env.redis, "cdc:ride")
    assert [(e["op"], e["key"]) for e in rides] == [
        ("c", {"id": 10}), ("c", {"id": 11}), ("u", {"id": 10}), ("d", {"id": 11}),
    ]
    assert rides[0]["data"] == {"id": 10, "distance": "1234.500", "rider": 1}
    assert rides[2]["data"] == {"id": 10, "distance": "99999999.999", "rider": 1}
    assert "data" not in rides[3]
    # the two inserts share a transaction: same lsn and xid, seq 0 and 1
    assert rides[0]["lsn"] == rides[1]["lsn"] and rides[0]["xid"] == rides[1]["xid"]
    assert (rides[0]["seq"], rides[1]["seq"]) == ("0", "1")
    lsns = [int(e["lsn"]) for e in rides]
    assert lsns == sorted(lsns) and len(set(lsns)) == 3
    assert all(e["v"] == "1" for e in rides)
    assert all(int(e["ts_ms"]) > 1_600_000_000_000 for e in rides)
    # the unmapped column never leaves the database
    raw = env.redis.xrange("cdc:ride")
    assert not any(b"secret" in v or b"internal_note" in v for _, f in raw for v in [*f.values(), *f.keys()])

    riders = read_stream(env.redis, "cdc:rider")
    assert len(riders) == 1
    data = riders[0]["data"]
    assert data["email"] == hmac.new(TEST_HASH_KEY.encode(), b"ann@example.com", hashlib.sha256).hexdigest()
    assert data["phone"] == "***"
    # epoch_ms of now(): exact to the microsecond, digit for digit (a fraction when it has one)
    since = json.loads(env.redis.xrange("cdc:rider")[0][1][b"data"], parse_float=Decimal)["since"]
    assert Decimal(since) == env.execute("SELECT extract(epoch FROM created_at) * 1000 FROM riders")[0][0]

    # the slot was acknowledged up to the end of what was published
    assert env.confirmed_flush() >= max(lsns)


@pytest.mark.one_path
def test_the_bridge_says_once_at_start_which_hot_path_runs(env):
    setup_rides(env)
    env.execute("INSERT INTO riders (id, name, email, phone) VALUES (1, 'Ann', 'ann@example.com', '555-1234')")
    pure = env.cdc("run", "--until-caught-up", check=True, env={"CDC_PURE_PYTHON": "1"}).stderr
    assert pure.count("hot path:") == 1 and "hot path: pure Python (CDC_PURE_PYTHON is set)" in pure
    asked = env.cdc("run", "--until-caught-up", check=True, env={"CDC_PURE_PYTHON": "", "CDC_IMPL": "pure"}).stderr
    assert asked.count("hot path:") == 1 and "hot path: pure Python (CDC_IMPL=pure)" in asked
    default = env.cdc("run", "--until-caught-up", check=True, env={"CDC_PURE_PYTHON": "", "CDC_IMPL": ""}).stderr
    built = importlib.util.find_spec("cdc.bridge._changes") is not None
    assert default.count("hot path:") == 1
    assert ("hot path: compiled" if built else "hot path: pure Python (the compiled extension is not built") in default
    assert len(read_stream(env.redis, "cdc:rider")) == 1


def test_truncate_and_rerun_publishes_nothing_twice(env):
    setup_rides(env)
    env.execute("INSERT INTO riders (id, name, email) VALUES (1, 'Ann', 'a@x')")
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1, g FROM generate_series(1, 50) g")
    env.cdc("run", "--until-caught-up", check=True)
    assert env.redis.xlen("cdc:ride") == 50
    env.execute("TRUNCATE rides")
    env.cdc("run", "--until-caught-up", check=True)
    rides = read_stream(env.redis, "cdc:ride")
    assert len(rides) == 51
    assert rides[-1]["op"] == "t" and rides[-1]["key"] == {}
    # nothing new: running again appends nothing
    env.cdc("run", "--until-caught-up", check=True)
    assert env.redis.xlen("cdc:ride") == 51


def test_a_live_flow_of_small_transactions_shares_batches_up_to_max_delay(env):
    """While single-row transactions keep coming faster than `batch.max_delay_ms`, a batch waits for more
    (also across the keepalive the walsender sends after each one) instead of going with one transaction:
    far fewer EXECs than transactions, every change still there once, in order. (How long a batch waits
    is not asserted: the delay bounds it.)"""
    setup_rides(env)
    env.execute("INSERT INTO riders (id, name, email) VALUES (1, 'Ann', 'e')")
    env.write_config("batch: {max_delay_ms: 5000}\n")
    proc = env.start_bridge()
    wait_for(lambda: env.redis.xlen("cdc:rider") == 1 or proc.poll() is not None, 60, "the bridge to stream")
    wait_for(lambda: env.confirmed_flush() >= env.current_wal() or proc.poll() is not None, 60, "the bridge to confirm")
    assert proc.poll() is None, proc.log_path.read_text()
    execs = env.redis.info("commandstats").get("cmdstat_exec", {}).get("calls", 0)
    n = 300
    with env.connect() as conn:  # autocommit
        for i in range(n):  # one transaction each, one after the other
            conn.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (%s, 1, 1)", (i,))
    wait_for(lambda: env.redis.xlen("cdc:ride") == n or proc.poll() is not None, 60, "every ride")
    sent = env.redis.info("commandstats")["cmdstat_exec"]["calls"] - execs
    assert [e["key"]["id"] for e in read_stream(env.redis, "cdc:ride")] == list(range(n))
    assert sent * 5 <= n, f"{sent} EXECs for {n} transactions"
