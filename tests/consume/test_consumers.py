"""Consumers: exact totals under double sends, crashes before commit and SIGKILL."""

from __future__ import annotations

import random
import signal
import time
from decimal import Decimal

import psycopg
import pytest

from cdc.demo.local import wait_for

from ride_consumers import Supervisor, state, truth

# the consumer parses replies on the path the run picked (cdc.sink._entries or cdc.sink.entry): both run
pytestmark = [pytest.mark.integration, pytest.mark.both_paths]


@pytest.mark.slow
def test_totals_are_exact_despite_double_sends_crashes_and_kills(env):
    env.init_rides("ride.yaml", sql=("10_rocket_rides.sql", "20_consumer_state.sql"), riders=20)
    bridge = env.start_bridge(env={"CDC_FAULT_DOUBLE_SEND": "0.1"})
    faults = {"CDC_FAULT_CRASH_BEFORE_COMMIT": "0.1"}
    groups = [Supervisor(env, "totals-a", 2, faults), Supervisor(env, "totals-b", 1, faults)]
    for g in groups:
        g.start()
    rng = random.Random(5)
    rides = 3000
    with psycopg.connect(env.dsn, autocommit=True) as conn:
        next_kill = time.monotonic() + 1
        written = 0
        written_at_kills: list[int] = []
        while written < rides:
            with conn.transaction():
                for _ in range(rng.randint(1, 10)):
                    conn.execute("INSERT INTO rides (rider_id, distance_m) VALUES (%s, %s)",
                                 (rng.randint(1, 20), Decimal(rng.randint(1, 10**7)) / 1000))
                    written += 1
                roll = rng.random()
                if roll < 0.2:
                    conn.execute("UPDATE rides SET distance_m = distance_m * 2, rider_id = %s "
                                 "WHERE id = (SELECT max(id) FROM rides)", (rng.randint(1, 20),))
                elif roll < 0.3:
                    conn.execute("DELETE FROM rides WHERE id = (SELECT min(id) FROM rides)")
            if time.monotonic() > next_kill:
                groups[len(written_at_kills) % len(groups)].kill_one(rng)
                written_at_kills.append(written)
                next_kill = time.monotonic() + rng.uniform(0.3, 1.2)
            time.sleep(0.005)  # pacing: keep the workload running while faults happen
    for g in groups:  # every group is killed at least twice, whatever the writer's speed
        while g.kills < 2:
            g.kill_one(rng)
            time.sleep(0.5)
    expected = truth(env)
    try:
        for g in groups:
            wait_for(lambda: state(env, g.group) == expected, 180, f"group {g.group} to reach the exact totals")
    finally:
        for g in groups:
            g.stop()
        bridge.send_signal(signal.SIGTERM)
        bridge.wait(30)
    stream_len = env.redis.xlen("cdc:ride")
    changes = env.execute("SELECT count(*) FROM rides")[0][0]
    assert stream_len > changes, "the producer fault must have sent some batches twice"
    for g in groups:
        assert 86 in g.exits, f"{g.group}: no crash before commit happened"
        assert -signal.SIGKILL in g.exits, f"{g.group}: no consumer was killed"
    assert "fault injection: sending a batch" in bridge.log_path.read_text()
