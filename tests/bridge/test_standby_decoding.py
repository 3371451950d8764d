"""Decoding on a standby (postgres.slot_dsn, PostgreSQL 16+): the primary pays no walsender for the bridge.

A primary and a physical standby (PostgreSQL 18, hot_standby_feedback, a physical slot);
`cdc init` creates the publication on the primary and the slot on the standby; the bridge
decodes from the standby while its heartbeats and the initial snapshot's watermarks go to
the primary. Writers commit on the primary and the bridge is killed (-9) at random moments:
every transaction is in the streams once, in order, the snapshot's rows included, and the
streams replay to the primary's tables.
"""

from __future__ import annotations

import random
import signal
import time

import orjson
import psycopg
import pytest

from cdc.demo.local import wait_for
from conftest import Env, read_stream
from replay import replay
from pg_pair import PrimaryStandby, env_on, running_pair
from workload import ResilientWorkload

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.pg18, pytest.mark.one_path]

RIDE = ("entity: ride\ntable: public.rides\nkey: [id]\nsnapshot: initial\n"
        "fields: {id: id, distance: distance_m, rider: rider_id}\n")
RIDER = "entity: rider\ntable: public.riders\nkey: [id]\nsnapshot: initial\nfields: {id: id, name: name}\n"
LEDGER = "entity: ledger\ntable: public.workload_ledger\nkey: [n]\nfields: {n: n}\n"


@pytest.fixture
def pair(servers_root, tmp_path):
    with running_pair(servers_root, tmp_path, "decode", wait_for_standby=False) as p:
        yield p


@pytest.fixture
def senv(pair, redis_server, tmp_path):
    with env_on(pair, redis_server, tmp_path) as e:
        yield e


def _slots(pair: PrimaryStandby, server) -> dict[str, bool]:
    """The logical slots of `server`: name -> active."""
    with psycopg.connect(pair.dsn_for(server), autocommit=True) as conn:
        return dict(conn.execute("SELECT slot_name, active FROM pg_replication_slots WHERE slot_type = 'logical'").fetchall())


def _logical_walsenders(pair: PrimaryStandby, server) -> int:
    with psycopg.connect(pair.dsn_for(server), autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_replication r JOIN pg_replication_slots s "
                            "ON s.active_pid = r.pid WHERE s.slot_type = 'logical'").fetchone()[0]


def _replay(entries: list[dict], field: str) -> dict:
    """The stream applied by its `id` key, as `field` per row."""
    return {key: row[field] for key, row in replay(entries).items()}


def _setup(env: Env, pair: PrimaryStandby, extra: str = "") -> None:
    env.apply_sql("10_rocket_rides.sql")
    env.execute("CREATE TABLE workload_ledger (n int PRIMARY KEY)")
    # ids the writers below never take
    env.execute("INSERT INTO riders (id, name, email) SELECT g, 'r' || g, 'e' FROM generate_series(1000001, 1000050) g")
    env.execute("INSERT INTO rides (id, rider_id, distance_m) SELECT 2000000 + g, 1000001 + g % 50, g "
                "FROM generate_series(1, 3000) g")
    env.write_mapping("ride.yaml", RIDE)
    env.write_mapping("rider.yaml", RIDER)
    env.write_mapping("ledger.yaml", LEDGER)
    standby = pair.dsn_for(pair.standby)
    env.write_config("batch: {max_entries: 40, max_delay_ms: 5, backfill_chunk_rows: 500}\n" + extra,
                     dsn=pair.dsn,  # both servers, the writable one: after a promotion, the standby
                     postgres=f', receive_timeout_s: 5, slot_check_interval_s: 1, heartbeat_interval_s: 1, '
                              f'slot_dsn: "{standby}"')


def test_the_bridge_decodes_on_the_standby_exactly_through_kills_a_restart_and_its_promotion(senv, pair):
    env = senv
    _setup(env, pair)
    init = env.cdc("init", check=True)
    assert "on the standby of postgres.slot_dsn" in init.stdout + init.stderr, init.stdout + init.stderr
    assert env.slot in _slots(pair, pair.standby) and env.slot not in _slots(pair, pair.primary)
    check = env.cdc("check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "postgres.slot_dsn: the standby can decode" in check.stdout

    workload = ResilientWorkload(pair.dsn, transactions=100000, seed=3, rate=150, big_every=50, big_size=200)
    workload.start()
    rng = random.Random(77)
    try:
        for _ in range(3):
            proc = env.start_bridge()
            wait_for(lambda: _slots(pair, pair.standby).get(env.slot) or proc.poll() is not None, 60,
                     "the bridge to attach to the standby's slot")
            assert proc.poll() is None, proc.log_path.read_text()[-3000:]
            assert _logical_walsenders(pair, pair.primary) == 0  # the primary decodes nothing
            time.sleep(rng.uniform(0.5, 2.0))  # a random crash instant, not a wait for a condition
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            wait_for(lambda: not _slots(pair, pair.standby).get(env.slot), 60, "the killed walsender to end")
        status = orjson.loads(env.cdc("status", "--json", check=True).stdout)
        assert status["slot"] is not None and "lives on a standby" in status["slot"]["failover"]["reason"]

        # the standby restarts under the running bridge, which retries and goes on
        proc = env.start_bridge()
        wait_for(lambda: _slots(pair, pair.standby).get(env.slot), 60, "the bridge to attach")
        pair.standby.restart("fast")
        before = env.redis.xlen("cdc:ledger")
        wait_for(lambda: env.redis.xlen("cdc:ledger") > before + 20 or proc.poll() is not None, 120,
                 "the bridge to publish again after the standby's restart")
        assert proc.poll() is None, proc.log_path.read_text()[-3000:]

        # the standby is promoted (the primary crashed): its slot is the new primary's, the bridge goes on
        pair.primary.stop("immediate")
        pair.standby.promote()
        committed = workload.committed
        wait_for(lambda: workload.committed >= committed + 30, 90, "the writers to commit on the new primary")
        before = env.redis.xlen("cdc:ledger")
        wait_for(lambda: env.redis.xlen("cdc:ledger") > before or proc.poll() is not None, 120,
                 "the bridge to publish the new primary's transactions")
        assert proc.poll() is None, proc.log_path.read_text()[-3000:]
    finally:
        workload.stopped.set()
        workload.done.wait(60)
    assert workload.error is None, workload.error
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.log_path.read_text()[-3000:]
    env.cdc("run", "--until-caught-up", check=True, timeout=300)

    streams = {s: read_stream(env.redis, f"cdc:{s}") for s in ("ledger", "ride", "rider")}
    for name, entries in streams.items():
        positions = [(int(e["lsn"]), int(e["seq"])) for e in entries]
        assert len(set(positions)) == len(positions), f"cdc:{name}: duplicate source positions"
        assert positions == sorted(positions), f"cdc:{name}: entries out of source order"
    with psycopg.connect(pair.dsn_for(pair.standby), autocommit=True) as conn:  # the new primary
        ledger = {r[0] for r in conn.execute("SELECT n FROM workload_ledger")}
        rides = {r[0]: f"{r[1]:.3f}" for r in conn.execute("SELECT id, distance_m FROM rides")}
        riders = {r[0]: r[1] for r in conn.execute("SELECT id, name FROM riders")}
    published = [e["key"]["n"] for e in streams["ledger"]]
    assert len(published) == len(set(published)), "a transaction was published twice"
    assert set(published) == ledger
    assert sum(1 for e in streams["ride"] if e["op"] == "r") >= 3000  # the initial snapshot, read on the primary
    assert _replay(streams["ride"], "distance") == rides
    assert _replay(streams["rider"], "name") == riders


def test_check_and_init_refuse_a_standby_that_cannot_decode(senv, pair):
    env = senv
    _setup(env, pair)
    with psycopg.connect(pair.dsn_for(pair.standby), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET hot_standby_feedback = off")
        conn.execute("SELECT pg_reload_conf()")
        wait_for(lambda: conn.execute("SHOW hot_standby_feedback").fetchone()[0] == "off", 30, "the reload")
    init = env.cdc("init")
    assert init.returncode != 0
    (error,) = [line for line in init.stderr.splitlines() if line.startswith("cdc: error: ")]
    assert "hot_standby_feedback off" in error and "hot_standby_feedback = on" in init.stderr, init.stderr
    assert env.slot not in _slots(pair, pair.standby)
    check = env.cdc("check")
    assert check.returncode != 0 and "hot_standby_feedback off" in check.stdout + check.stderr

    # the fix the error names
    with psycopg.connect(pair.dsn_for(pair.standby), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET hot_standby_feedback = on")
        conn.execute("SELECT pg_reload_conf()")
        wait_for(lambda: conn.execute("SHOW hot_standby_feedback").fetchone()[0] == "on", 30, "the reload")
    env.cdc("init", check=True)
    assert env.slot in _slots(pair, pair.standby)


def test_cdc_init_changing_the_publication_while_the_standby_lags_is_no_gap(senv, pair):
    """cdc init (on the primary) sets a wider column list for a mapping that reads one more column while the
    running bridge's standby has not replayed it: the standby's readings still show the publication as it was,
    which is no change by hand; once it replayed init's change, its reading agrees with what init recorded."""
    env = senv
    _setup(env, pair)
    env.cdc("init", check=True)
    proc = env.start_bridge()
    wait_for(lambda: _slots(pair, pair.standby).get(env.slot), 60, "the bridge to attach")
    with psycopg.connect(pair.dsn_for(pair.standby), autocommit=True) as standby:
        standby.execute("SELECT pg_wal_replay_pause()")
        try:
            env.write_mapping("rider.yaml", RIDER.replace("name: name}", "name: name, email: email}"))
            init = env.cdc("init", check=True)
            assert "set the columns of 1 mapped table" in init.stdout, init.stdout + init.stderr
            since = standby.execute("SELECT now()").fetchone()[0]
            # a reading of the ack gate on the standby after init, with init's change not replayed there
            wait_for(lambda: standby.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%%pg_publication_rel%%' AND query_start > %s "
                "AND pid <> pg_backend_pid()", (since,)).fetchone()[0], 60, "a reading of the ack gate")
            assert proc.poll() is None, proc.log_path.read_text()[-3000:]
        finally:
            standby.execute("SELECT pg_wal_replay_resume()")
    env.execute("INSERT INTO workload_ledger (n) VALUES (1)")
    wait_for(lambda: env.redis.xlen("cdc:ledger") >= 1 or proc.poll() is not None, 60, "the bridge to publish")
    assert proc.poll() is None, proc.log_path.read_text()[-3000:]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.log_path.read_text()[-3000:]
    check = env.cdc("check")
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_slot_lost_with_its_standby_stops_the_bridge_and_init_then_recover_bring_the_streams_back(senv, pair):
    """The standby's slot gone (the standby rebuilt, the slot dropped): the bridge stops with the missing slot's
    error naming the fix; cdc init creates it on the standby again and cdc recover rebuilds every stream from the
    primary's tables, the changes made meanwhile included."""
    env = senv
    _setup(env, pair)
    env.cdc("init", check=True)
    env.cdc("run", "--until-caught-up", check=True, timeout=300)
    proc = env.start_bridge()
    wait_for(lambda: _slots(pair, pair.standby).get(env.slot), 60, "the bridge to attach")
    with psycopg.connect(pair.dsn_for(pair.standby), autocommit=True) as standby:
        pid = standby.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (env.slot,)).fetchone()[0]
        standby.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_for(lambda: standby.execute("SELECT pg_drop_replication_slot(%s)", (env.slot,)) or True, 30,
                 "the slot to be dropped")
    env.execute("UPDATE riders SET name = 'while lost' WHERE id = 1000001")
    assert proc.wait(120) == 4, proc.log_path.read_text()[-3000:]
    (error,) = [line for line in proc.log_path.read_text().splitlines() if line.startswith("cdc: error: ")]
    assert "does not exist" in error and "cdc init" in error and "cdc recover" in error, error
    env.cdc("init", check=True)
    env.cdc("recover", check=True, timeout=300)
    env.execute("UPDATE riders SET name = 'after' WHERE id = 1000002")
    env.cdc("run", "--until-caught-up", check=True, timeout=300)
    riders = read_stream(env.redis, "cdc:rider")
    marker = max(i for i, e in enumerate(riders) if e["op"] == "x")
    after = _replay(riders[marker + 1:], "name")
    with psycopg.connect(pair.dsn_for(pair.primary), autocommit=True) as conn:
        assert after == {r[0]: r[1] for r in conn.execute("SELECT id, name FROM riders")}
    assert after[1000001] == "while lost" and after[1000002] == "after"
