"""The bridge follows a promoted standby (PostgreSQL 18, failover slots).

Two PostgreSQL 18 servers: a primary and a physical standby made with pg_basebackup that
keeps a synced copy of the failover slot (sync_replication_slots, hot_standby_feedback,
primary_slot_name, dbname in primary_conninfo; the primary waits for it with
synchronized_standby_slots). The standby is asynchronous: what the primary acknowledged to
a writer may never reach it. Writers commit, the primary is crashed at a random moment and
the standby promoted; the bridge, on a DSN naming both hosts with
target_session_attrs=read-write, reconnects to the new primary and resumes from the synced
slot. Every transaction the new primary has is in the streams exactly once, nothing it lacks
is, and the streams replay to its tables.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import urllib.request

import orjson
import psycopg
import pytest

from cdc.demo.local import free_port, wait_for
from conftest import Env, read_stream
from pg_pair import STANDBY_SLOT, PrimaryStandby, env_on, running_pair
from workload import ResilientWorkload

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.pg18, pytest.mark.one_path]

RIDER_MAPPING = """
entity: rider
table: public.riders
key: [id]
fields: {id: id, name: name}
"""
LEDGER_MAPPING = """
entity: ledger
table: public.workload_ledger
key: [n]
fields: {n: n}
"""


@pytest.fixture
def pair(servers_root, tmp_path):
    with running_pair(servers_root, tmp_path, "ha", wait_for_standby=True) as p:
        yield p


@pytest.fixture
def ha_env(pair, redis_server, tmp_path):
    with env_on(pair, redis_server, tmp_path) as e:
        yield e


def failover_ready_metric(port: int) -> float | None:
    """cdc_slot_failover_ready as the bridge serves it (None: not reported yet)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("cdc_slot_failover_ready "):
                return float(line.split()[1])
    return None


def _setup(env: Env, pair: PrimaryStandby, postgres: str = "", extra: str = "") -> None:
    env.apply_sql("10_rocket_rides.sql")
    env.execute("CREATE TABLE workload_ledger (n int PRIMARY KEY)")
    env.copy_mappings("ride.yaml")
    env.write_mapping("rider.yaml", RIDER_MAPPING)
    env.write_mapping("ledger.yaml", LEDGER_MAPPING)
    env.write_config("batch: {max_entries: 40, max_delay_ms: 5}\n" + extra, dsn=pair.dsn,
                     postgres=", receive_timeout_s: 5, slot_check_interval_s: 1" + postgres)
    env.cdc("init", check=True)


def _new_primary_state(pair: PrimaryStandby) -> tuple[set[int], dict[int, str], dict[int, str]]:
    with psycopg.connect(pair.dsn_for(pair.standby), autocommit=True) as conn:
        ledger = {r[0] for r in conn.execute("SELECT n FROM workload_ledger")}
        rides = {r[0]: f"{r[1]:.3f}" for r in conn.execute("SELECT id, distance_m FROM rides")}
        riders = {r[0]: r[1] for r in conn.execute("SELECT id, name FROM riders")}
    return ledger, rides, riders


def _replay(entries: list[dict], field: str) -> dict:
    table: dict = {}
    for e in entries:
        (key,) = e["key"].values()
        if e["op"] == "d":
            table.pop(key, None)
        else:
            table[key] = e["data"][field]
    return table


def assert_streams_are_the_new_primary(env: Env, pair: PrimaryStandby) -> None:
    ledger, rides, riders = _new_primary_state(pair)
    streams = {s: read_stream(env.redis, f"cdc:{s}") for s in ("ledger", "ride", "rider")}
    for name, entries in streams.items():
        positions = [(int(e["lsn"]), int(e["seq"])) for e in entries]
        assert len(set(positions)) == len(positions), f"cdc:{name}: duplicate source positions"
        assert positions == sorted(positions), f"cdc:{name}: entries out of source order"
    published = [e["key"]["n"] for e in streams["ledger"]]
    assert len(published) == len(set(published)), "a transaction was published twice"
    assert set(published) - ledger == set(), "published transactions the new primary does not have"
    assert ledger - set(published) == set(), "transactions of the new primary missing from the stream"
    assert _replay(streams["ride"], "distance") == rides
    assert _replay(streams["rider"], "name") == riders


def _last_lsn(env: Env) -> int:
    last = [env.redis.xrevrange(f"cdc:{s}", count=1) for s in ("ledger", "ride", "rider")]
    return max((int(e[0][1][b"lsn"]) for e in last if e), default=0)


def _crash_and_promote(env: Env, pair: PrimaryStandby, rng: random.Random, proc) -> tuple[float, float]:
    """Crash the primary at a random moment, promote the standby; return (fault→first new entry, promote→it) in s."""
    time.sleep(rng.uniform(0.5, 2.5))  # a random crash instant while the writers commit, not a wait for a condition
    fault = time.monotonic()
    pair.primary.stop("immediate")
    with psycopg.connect(pair.dsn_for(pair.standby), autocommit=True) as conn:
        replayed = int(conn.execute("SELECT pg_last_wal_replay_lsn() - '0/0'::pg_lsn").fetchone()[0])
    pair.standby.promote()
    promoted = time.monotonic()
    wait_for(lambda: _last_lsn(env) > replayed or proc.poll() is not None, 90,
             "the first entry from the promoted standby")
    assert proc.poll() is None, proc.log_path.read_text()[-3000:]
    first = time.monotonic()
    return first - fault, first - promoted


def test_the_bridge_follows_a_promoted_standby_and_loses_and_duplicates_nothing(ha_env, pair):
    env = ha_env
    port = free_port()
    _setup(env, pair, extra=f"http: {{host: 127.0.0.1, port: {port}}}\n")
    workload = ResilientWorkload(pair.dsn, transactions=100000, seed=11, rate=150, big_every=60, big_size=200)
    proc = env.start_bridge()
    workload.start()
    wait_for(lambda: env.redis.xlen("cdc:ledger") >= 100, 60, "the bridge to publish")
    synced = time.monotonic()
    wait_for(lambda: pair.standby_has_synced(env.slot), 90, "the standby to hold a synced copy of the slot")
    print(f"\nthe standby synced the slot in {time.monotonic() - synced:.1f}s")
    wait_for(lambda: "failover-ready yes" in proc.log_path.read_text(), 30, "the bridge to find the slot failover-ready")
    assert failover_ready_metric(port) == 1
    ready = orjson.loads(env.cdc("status", "--json", check=True).stdout)["slot"]["failover"]
    assert ready["ready"] is True and ready["slot_failover"] is True, ready
    assert [(c["synced"], c["temporary"]) for c in ready["standbys"]] == [(True, False)], ready
    assert [(s["name"], s["active"]) for s in ready["standby_slots"]] == [(STANDBY_SLOT, True)]

    recovery, after_promote = _crash_and_promote(env, pair, random.Random(os.getpid()), proc)
    print(f"\nfailover: first new entry {recovery:.2f}s after the primary crashed, {after_promote:.2f}s after promote")
    committed = workload.committed
    wait_for(lambda: workload.committed >= committed + 50, 60, "the writers to commit on the new primary")
    workload.stopped.set()
    workload.done.wait(60)
    assert workload.error is None, workload.error
    assert workload.reconnects >= 1
    # the new primary has no standby: the slot would not survive another failover
    wait_for(lambda: failover_ready_metric(port) == 0, 30, "cdc_slot_failover_ready to drop to 0")
    assert "failover-ready no: no physical replication slot for a standby" in proc.log_path.read_text()

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.log_path.read_text()[-3000:]
    env.cdc("run", "--until-caught-up", check=True, timeout=300)
    assert_streams_are_the_new_primary(env, pair)
    after = orjson.loads(env.cdc("status", "--json", check=True).stdout)["slot"]["failover"]
    assert after["ready"] is False  # the new primary has no standby yet


BIG_FIRST_ID, BIG_ROWS, BIG_N = 10_000_001, 50_000, 10_000_000


def _big_transaction(dsn: str, committed: threading.Event, errors: list) -> None:
    """One large transaction: BIG_ROWS rides and ledger row BIG_N; `committed` is set once COMMIT returned."""
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            with conn.transaction():
                conn.execute("INSERT INTO rides (id, rider_id, distance_m) SELECT g, 1, 1 FROM generate_series(%s::int, %s::int) g",
                             (BIG_FIRST_ID, BIG_FIRST_ID + BIG_ROWS - 1))
                conn.execute("INSERT INTO workload_ledger (n) VALUES (%s)", (BIG_N,))
        committed.set()
    except psycopg.OperationalError as exc:  # the primary crashed before the commit returned
        errors.append(exc)
    finally:
        committed.set()


def test_a_large_transaction_published_halfway_at_the_failover_ends_whole_or_absent(ha_env, pair):
    """The primary crashes while the bridge publishes a large transaction. The new primary has it
    (the standby flushed its commit) or not: the streams hold it whole and once, or not at all."""
    env = ha_env
    _setup(env, pair)
    workload = ResilientWorkload(pair.dsn, transactions=100000, seed=5, rate=100)
    proc = env.start_bridge()
    workload.start()
    wait_for(lambda: env.redis.xlen("cdc:ledger") >= 50, 60, "the bridge to publish")
    wait_for(lambda: pair.standby_has_synced(env.slot), 90, "the standby to hold a synced copy of the slot")
    rng = random.Random(os.getpid())
    committed, errors = threading.Event(), []
    big = threading.Thread(target=_big_transaction, args=(pair.dsn, committed, errors), daemon=True)
    big.start()
    committed.wait(120)
    time.sleep(rng.uniform(0.0, 1.0))  # a random crash instant while the bridge publishes it, not a wait for a condition
    length_at_crash = env.redis.xlen("cdc:ride")
    pair.primary.stop("immediate")
    pair.standby.promote()
    big.join(30)
    done = workload.committed
    wait_for(lambda: workload.committed >= done + 30 or proc.poll() is not None, 90, "the writers on the new primary")
    workload.stopped.set()
    workload.done.wait(60)
    assert workload.error is None, workload.error
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.log_path.read_text()[-3000:]
    env.cdc("run", "--until-caught-up", check=True, timeout=300)
    assert_streams_are_the_new_primary(env, pair)
    ledger, _, _ = _new_primary_state(pair)
    published_at_crash = sum(1 for e in read_stream(env.redis, "cdc:ride")[:length_at_crash] if e["key"]["id"] >= BIG_FIRST_ID)
    print(f"\nlarge transaction: {published_at_crash} of {BIG_ROWS} rows published at the crash; "
          f"the new primary {'has' if BIG_N in ledger else 'lacks'} it")


def test_without_a_failover_slot_the_bridge_stops_at_the_missing_slot_and_holds_redis(ha_env, pair):
    """postgres.failover_slot: false (or a server older than 17): the promoted standby has no slot.
    The bridge must stop with the slot error (exit 4) rather than create a slot and skip what was lost."""
    env = ha_env
    _setup(env, pair, ", failover_slot: false")
    check = env.cdc("check")
    assert "postgres.failover_slot is false, so the slot would not survive a failover" in check.stdout + check.stderr
    env.execute("INSERT INTO riders (id, name, email) VALUES (1, 'a', 'b')")
    proc = env.start_bridge()
    wait_for(lambda: env.redis.xlen("cdc:rider") == 1, 60, "the first rider")
    pair.primary.stop("immediate")
    pair.standby.promote()
    with psycopg.connect(pair.dsn_for(pair.standby), autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (env.slot,)).fetchone()[0] == 0
        conn.execute("INSERT INTO riders (id, name, email) VALUES (2, 'c', 'd')")
    assert proc.wait(90) == 4, proc.log_path.read_text()[-3000:]
    log = proc.log_path.read_text()
    (error,) = [line for line in log.splitlines() if line.startswith("cdc: error: ")]
    assert env.slot in error and "cdc init" in error, log[-3000:]  # the missing slot, and how to recover
    assert env.redis.xlen("cdc:rider") == 1
