"""Crash at any instant: nothing lost, nothing duplicated, order kept."""

from __future__ import annotations

import random
import signal
import time

import pytest

from cdc.demo.local import wait_for
from conftest import read_stream
from workload import MixedWorkload

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RIDER_MAPPING = """
entity: rider
table: public.riders
key: [id]
fields: {id: id, name: name}
"""


def assert_streams_exact(env, workload: MixedWorkload) -> None:
    for stream, expected in workload.expected.items():
        entries = read_stream(env.redis, stream)
        got = [(e["op"], e["key"], e.get("data")) for e in entries]
        positions = [(int(e["lsn"]), int(e["seq"])) for e in entries]
        assert len(set(positions)) == len(positions), f"{stream}: duplicate source positions"
        assert positions == sorted(positions), f"{stream}: entries out of source order"
        assert len(got) == len(expected), f"{stream}: {len(got)} entries, expected {len(expected)}"
        assert got == expected, f"{stream}: content differs"


def kill_bridge_at_random(env, rng: random.Random, low_s: float, high_s: float) -> None:
    """Start a bridge; once it attached to the slot, kill -9 it at a random moment low_s..high_s later."""
    proc = env.start_bridge()
    wait_for(lambda: env.slot_active() or proc.poll() is not None, 30, "the bridge to attach to the slot")
    time.sleep(rng.uniform(low_s, high_s))  # a random crash instant, not a wait for a condition
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    env.wait_slot_inactive()


def test_kill_9_at_random_moments_loses_and_duplicates_nothing(env):
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml")
    env.write_mapping("rider.yaml", RIDER_MAPPING)
    env.write_config("batch: {max_entries: 40, max_delay_ms: 5}\n")
    env.cdc("init", check=True)
    workload = MixedWorkload(env.dsn, transactions=2500, seed=42, big_every=50, big_size=400, rate=120)
    workload.start()
    rng = random.Random(1234)
    kills = 0
    published_between_kills = []
    for _ in range(22):
        before = env.redis.xlen("cdc:ride")
        kill_bridge_at_random(env, rng, 0.05, 0.6)
        kills += 1
        published_between_kills.append(env.redis.xlen("cdc:ride") - before)
    workload.done.wait(300)
    assert workload.error is None, workload.error
    assert kills >= 20
    assert sum(1 for n in published_between_kills if n > 0) >= 5, published_between_kills
    env.cdc("run", "--until-caught-up", check=True, timeout=300)
    assert_streams_exact(env, workload)


def test_redis_restart_and_postgres_restart_are_retried_without_loss(env):
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml")
    env.write_mapping("rider.yaml", RIDER_MAPPING)
    env.cdc("init", check=True)
    proc = env.start_bridge()
    first = MixedWorkload(env.dsn, transactions=100, seed=1)
    first.run()
    wait_for(lambda: env.redis.xlen("cdc:ride") == len(first.expected["cdc:ride"]), 60, "the first batch to arrive")

    # Redis goes away: the slot must not move past what Redis has not confirmed
    env.redis_server.stop()
    acked_before = env.confirmed_flush()
    env.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (100000, 1, 1)")
    written_at = env.current_wal()
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:  # observe a window in which nothing may be acknowledged
        assert env.confirmed_flush() < written_at
        time.sleep(0.1)
    assert env.confirmed_flush() >= acked_before
    env.redis_server.start()
    wait_for(lambda: env.redis.xlen("cdc:ride") == len(first.expected["cdc:ride"]) + 1, 60, "the entry written while redis was down")
    wait_for(lambda: env.confirmed_flush() >= written_at, 30, "the slot to be acknowledged after redis came back")

    # Postgres restarts under the bridge
    env.postgres.restart()
    env.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (100001, 1, 2)")
    wait_for(lambda: env.redis.xlen("cdc:ride") == len(first.expected["cdc:ride"]) + 2, 90, "the entry written after postgres restarted")
    assert proc.poll() is None, "the bridge must survive both restarts"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    log = proc.log_path.read_text()
    assert "transient failure, retrying" in log
    entries = read_stream(env.redis, "cdc:ride")
    assert [e["key"]["id"] for e in entries[-2:]] == [100000, 100001]
    positions = [(int(e["lsn"]), int(e["seq"])) for e in entries]
    assert len(set(positions)) == len(positions)


@pytest.mark.one_path
def test_a_silently_dead_connection_is_detected_and_replaced(env):
    from proxy import FreezableProxy

    env.init_rides("ride.yaml")
    proxy = FreezableProxy(env.postgres.port)
    try:
        dsn = f"postgresql://postgres@127.0.0.1:{proxy.port}/{env.dbname}"
        env.config_path.write_text(
            f"postgres: {{dsn: '{dsn}', slot: {env.slot}, publication: cdc, receive_timeout_s: 3}}\n"
            f"redis: {{url: '{env.redis_server.url}'}}\nmappings: mappings/\nbatch: {{status_interval_s: 0.5}}\nhttp: {{port: 0}}\n"
        )
        proc = env.start_bridge()
        env.execute("INSERT INTO riders (id, name, email) VALUES (1, 'a', 'b')")
        env.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (1, 1, 1)")
        wait_for(lambda: env.redis.xlen("cdc:ride") == 1, 30, "the first ride")
        proxy.freeze()  # the network silently drops everything on the open connections
        env.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (2, 1, 2)")
        wait_for(lambda: env.redis.xlen("cdc:ride") == 2, 60, "the ride written after the network froze")
        # the replication connection's silence, or the other connection's, whose ack gate reads the
        # catalog every status interval: whichever is noticed first
        log = proc.log_path.read_text()
        assert "no message from postgres in 3s" in log or "no answer from postgres in 3s" in log, log
        assert [e["key"]["id"] for e in read_stream(env.redis, "cdc:ride")] == [1, 2]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proxy.close()


def test_a_frozen_bridge_that_wakes_after_another_took_over_appends_nothing_twice(env):
    """Two bridges on one slot and one Redis: the first freezes (SIGSTOP) with a batch in hand, its
    walsender times out, a second bridge takes the slot over and writes the same changes, then the
    first wakes up and sends its stale batch. The watched marks make that batch append nothing twice."""
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml")
    env.write_mapping("rider.yaml", RIDER_MAPPING)
    env.write_config("batch: {max_entries: 40, max_delay_ms: 5}\n")
    env.execute("ALTER SYSTEM SET wal_sender_timeout = '1s'")
    env.execute("SELECT pg_reload_conf()")
    env.cdc("init", check=True)
    workload = MixedWorkload(env.dsn, transactions=1500, seed=7, big_every=40, big_size=300, rate=150)
    workload.start()
    rng = random.Random(99)
    first = env.start_bridge()
    try:
        for _ in range(6):
            wait_for(lambda: env.slot_active() or first.poll() is not None, 30, "the first bridge to attach")
            time.sleep(rng.uniform(0.05, 0.5))  # a random instant to freeze at, not a wait for a condition
            first.send_signal(signal.SIGSTOP)
            env.wait_slot_inactive()  # its walsender gave up on it
            second = env.start_bridge()
            wait_for(lambda: env.slot_active() or second.poll() is not None, 30, "the second bridge to attach")
            time.sleep(rng.uniform(0.2, 0.8))  # the second bridge writes what the first had in hand
            first.send_signal(signal.SIGCONT)  # the stale bridge wakes up and sends its batch
            time.sleep(rng.uniform(0.2, 0.5))
            second.send_signal(signal.SIGKILL)
            second.wait(10)
        workload.done.wait(300)
        assert workload.error is None, workload.error
        first.send_signal(signal.SIGTERM)
        first.wait(30)
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGCONT)
    env.wait_slot_inactive()
    env.cdc("run", "--until-caught-up", check=True, timeout=300)
    assert_streams_exact(env, workload)
