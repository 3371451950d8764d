"""Sidecar guardrails: metrics and probes, data loss, backpressure, slot health, heartbeats, replicas."""

from __future__ import annotations

import signal
import urllib.error
import urllib.request

import orjson
import pytest
import redis

from cdc.demo.local import LocalPostgres, LocalRedis, free_port, wait_for

pytestmark = pytest.mark.integration


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not found")


@pytest.fixture
def rides(env):
    return env.init_rides("ride.yaml", riders=1)


@pytest.mark.one_path
def test_metrics_health_and_readiness(rides):
    port = free_port()
    rides.write_config(f"http: {{host: 127.0.0.1, port: {port}}}\n")
    rides.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '64MB'")
    rides.execute("SELECT pg_reload_conf()")
    try:
        _metrics_health_and_readiness(rides, port)
    finally:
        rides.execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
        rides.execute("SELECT pg_reload_conf()")


def _metrics_health_and_readiness(rides, port: int) -> None:
    proc = rides.start_bridge()
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: get(base + "/readyz")[0] == 200, 30, "the bridge to be ready")
    assert get(base + "/healthz") == (200, "ok\n")
    rides.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1, g FROM generate_series(1, 25) g")
    wait_for(lambda: rides.redis.xlen("cdc:ride") == 25, 30, "the rides")
    text = wait_for(lambda: (t := get(base + "/metrics")[1]) and 'cdc_entries_published_total{stream="cdc:ride"} 25' in t and t,
                    30, "the published counter")
    assert 'cdc_changes_read_total{entity="ride"} 25' in text
    assert metric(text, "cdc_batch_entries_count") >= 1
    assert metric(text, "cdc_commit_to_publish_seconds_count") >= 1
    assert metric(text, "cdc_retained_wal_bytes") > 0
    assert metric(text, "cdc_confirmed_flush_lsn") > 0
    assert metric(text, "cdc_up") == 1
    assert metric(text, "cdc_ready") == 1
    # the server's limit, and the alarm levels the bridge derives from it (half and four fifths)
    assert metric(text, "cdc_slot_wal_keep_size_bytes") == 64 << 20
    assert metric(text, 'cdc_retained_wal_alarm_bytes{level="warning"}') == 32 << 20
    assert metric(text, 'cdc_retained_wal_alarm_bytes{level="critical"}') == (64 << 20) * 4 // 5
    # Redis goes away: not ready, retries counted, and back
    rides.redis_server.stop()
    wait_for(lambda: get(base + "/readyz")[0] == 503, 30, "readiness to drop while redis is down")
    assert get(base + "/healthz")[0] == 200
    assert metric(get(base + "/metrics")[1], "cdc_ready") == 0
    rides.redis_server.start()
    wait_for(lambda: get(base + "/readyz")[0] == 200, 60, "readiness to come back")
    assert metric(get(base + "/metrics")[1], 'cdc_transient_failures_total{side="redis"}') >= 1
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


@pytest.mark.one_path
def test_redis_that_lost_data_is_detected_with_the_missing_range(rides, servers_root):
    volatile = LocalRedis(servers_root / "volatile-redis", appendonly=False)
    volatile.start()
    try:
        rides.write_config(redis_url=volatile.url)
        rides.cdc("init", check=True)
        rides.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, 1), (1, 2)")
        rides.cdc("run", "--until-caught-up", check=True)
        acked = rides.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (rides.slot,))[0][0]
        volatile.restart()  # no persistence: everything is gone
        result = rides.cdc("run", "--until-caught-up")
        assert result.returncode == 6
        assert f"redis has no record of slot '{rides.slot}'" in result.stderr and acked in result.stderr
        # a Redis that kept an older state (a lagging replica, a restore) names the exact range
        client = redis.Redis.from_url(volatile.url)
        client.set(f"cdc:bridge:{rides.slot}:flushed", 100)
        result = rides.cdc("run", "--until-caught-up")
        assert result.returncode == 6
        assert f"redis lost entries: it holds changes up to 0/64, but slot '{rides.slot}' was acknowledged up to {acked}" in result.stderr
        assert f"committed in (0/64, {acked}]" in result.stderr
        # cdc status shows the loss and its range, until cdc init accepts it
        loss = orjson.loads(rides.cdc("status", "--json", check=True).stdout)["bridge"]["data_loss"]
        assert (loss["from_lsn"], loss["to_lsn"]) == ("0/64", acked) and loss["detected_at"].endswith("Z")
        assert f"REDIS DATA LOSS detected at {loss['detected_at']}: entries of transactions committed in (0/64, {acked}]" \
            in rides.cdc("status", check=True).stdout
        assert "accepted the loss" in rides.cdc("init", check=True).stdout
        assert orjson.loads(rides.cdc("status", "--json", check=True).stdout)["bridge"]["data_loss"] is None
        assert "DATA LOSS" not in rides.cdc("status", check=True).stdout
        client.close()
    finally:
        volatile.stop()


def test_backpressure_pauses_when_redis_memory_is_full_and_loses_nothing(rides):
    client = rides.redis
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used + 5_000_000)
    client.config_set("maxmemory-policy", "noeviction")
    try:
        rides.write_config(redis=", pause_at_memory_fraction: 0.8, resume_at_memory_fraction: 0.7")
        proc = rides.start_bridge()
        rides.execute("INSERT INTO rides (rider_id, distance_m, status) SELECT 1, g, 'done' FROM generate_series(1, 150000) g")
        wait_for(lambda: "pausing reading" in proc.log_path.read_text(), 60, "the bridge to pause")
        paused_at = client.xlen("cdc:ride")
        assert paused_at < 150000
        bridge = orjson.loads(rides.cdc("status", "--json", check=True).stdout)["bridge"]
        assert bridge["paused_for_memory"] is True and bridge["memory_ratio"] >= 0.8 and bridge["paused_since"].endswith("Z")
        assert "bridge: PAUSED for Redis memory at " in rides.cdc("status", check=True).stdout
        client.config_set("maxmemory", 0)  # room again
        wait_for(lambda: client.xlen("cdc:ride") == 150000, 90, "every ride after resuming")
        log = proc.log_path.read_text()
        assert "resuming" in log
        # it paused before Redis had to refuse a write: no retry for Redis (the busy suite's pure-Python pass once
        # saw the server close the replication connection after the pause, a reconnect that owes nothing to Redis)
        retries = [line for line in log.splitlines() if "transient failure" in line]
        assert "refused the write" not in log and not [line for line in retries if "redis" in line], retries
        assert orjson.loads(rides.cdc("status", "--json", check=True).stdout)["bridge"]["paused_for_memory"] is False
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        client.config_set("maxmemory", 0)


def test_heartbeats_keep_a_quiet_slot_advancing(rides):
    rides.write_config(postgres=", heartbeat_interval_s: 0.5")
    proc = rides.start_bridge()
    start = rides.current_wal()
    # nobody writes: the heartbeats do, and the slot follows them
    wait_for(lambda: rides.current_wal() > start and rides.confirmed_flush() > start, 30, "heartbeat WAL to be confirmed")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


@pytest.mark.one_path
def test_lost_slot_stops_with_the_way_to_recover(servers_root, env):
    server = LocalPostgres(servers_root / "small-wal", settings={"max_slot_wal_keep_size": "1MB", "max_wal_size": "32MB", "min_wal_size": "32MB"})
    server.start()
    try:
        import psycopg

        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
        env.write_mapping("t.yaml", "entity: t\ntable: public.t\nkey: [id]\nfields: {id: id}\n")
        env.write_config(dsn=server.dsn)
        env.cdc("init", check=True)
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            for _ in range(4):  # push the slot's WAL past max_slot_wal_keep_size
                conn.execute("INSERT INTO t SELECT g FROM generate_series(1, 30000) g ON CONFLICT DO NOTHING")
                conn.execute("DELETE FROM t")
                conn.execute("SELECT pg_switch_wal()")
            conn.execute("CHECKPOINT")
            wait_for(lambda: conn.execute("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (env.slot,)).fetchone()[0] == "lost",
                     30, "the slot to be invalidated")
        lost = (f"replication slot '{env.slot}' was invalidated (wal_status lost): the WAL it needed was removed, so "
                f"changes were lost to it; run SELECT pg_drop_replication_slot('{env.slot}'); then cdc init, then cdc "
                "recover before cdc run (the streams then replay to the tables' current state; the individual changes "
                "in between cannot be restored); raise max_slot_wal_keep_size to avoid it")
        result = env.cdc("run", "--until-caught-up")
        assert result.returncode == 4
        assert result.stderr.strip().endswith(f"cdc: error: {lost}"), result.stderr
        checked = env.cdc("check")  # never "ok: slot exists"
        assert checked.returncode == 4 and f"problem: {lost}" in checked.stderr, checked.stderr
        assert f"slot {env.slot} (pgoutput) exists" not in checked.stdout
        assert "holds the source up to" not in checked.stdout  # no comparison of Redis with a broken slot
        status = env.cdc("status")  # an alarm, never "None bytes"
        assert status.returncode == 4 and status.stderr.strip() == f"cdc: error: {lost}", status.stderr
        assert status.stdout.startswith(f"slot {env.slot}: INVALIDATED (wal_status lost), inactive: ")
        assert "None" not in status.stdout
        assert env.cdc("init").returncode == 4  # it does not stream on from the broken slot either
    finally:
        server.stop("immediate")


@pytest.mark.one_path
def test_wait_for_replicas_before_acknowledging(rides, servers_root):
    replica = LocalRedis(servers_root / "replica", extra=["--replicaof", "127.0.0.1", str(rides.redis_server.port)])
    replica.start()
    try:
        wait_for(lambda: rides.redis.info("replication")["connected_slaves"] == 1,
                 30, "the replica to attach")
        rides.write_config(redis=", wait_replicas: 1, wait_timeout_ms: 500")
        rides.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, 1)")
        rides.cdc("run", "--until-caught-up", check=True)
        assert redis.Redis.from_url(replica.url).xlen("cdc:ride") == 1
        replica.stop()
        rides.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, 2)")
        written = rides.current_wal()
        proc = rides.start_bridge()
        wait_for(lambda: "only 0 of 1 redis replicas acknowledged" in proc.log_path.read_text(), 30, "the missing replica to be noticed")
        assert rides.confirmed_flush() < written, "the slot must wait for the replica"
        replica.start()
        wait_for(lambda: rides.confirmed_flush() >= written, 60, "the slot to move once the replica is back")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        replica.stop()
