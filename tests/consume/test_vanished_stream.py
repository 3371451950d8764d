"""A consumer whose stream or group vanished while it ran (Redis emptied): it says so, exit 6, never blaming
the ACL; the way its message names (cdc recover once the bridge stopped on it, then the consumer again)
ends with the group's totals exact."""

from __future__ import annotations

import signal

import pytest

from cdc.demo.local import wait_for
from ride_consumers import state, truth

pytestmark = pytest.mark.integration


def test_a_redis_emptied_under_a_consumer_is_a_loss_it_names_and_recover_makes_it_exact(env):
    env.init_rides("ride.yaml", sql=("10_rocket_rides.sql", "20_consumer_state.sql"), riders=3)
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1 + g % 3, g FROM generate_series(1, 30) g")
    bridge = env.start_bridge()
    consumer = env.start_consumer("g")
    try:
        wait_for(lambda: state(env, "g") == truth(env), 60, "the consumer to reach the totals")
        env.redis.flushall()
        env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, 5)")
        assert consumer.wait(60) == 6, consumer.log_path.read_text()
        line = consumer.log_path.read_text().strip().splitlines()[-1]
        assert line.startswith("cdc: error: a stream this consumer reads, or its group, vanished from Redis"), line
        assert "ACL" not in line and "cdc recover" in line
        assert bridge.wait(60) == 6, bridge.log_path.read_text()  # as the message says, the bridge stops on it
    finally:
        for proc in (bridge, consumer):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
    recovered = env.cdc("recover")
    assert recovered.returncode == 0, recovered.stderr
    bridge = env.start_bridge()
    consumer = env.start_consumer("g")
    try:
        env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (2, 7)")
        wait_for(lambda: state(env, "g") == truth(env), 60, "the consumer to reach the totals again")
    finally:
        for proc in (bridge, consumer):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, proc.log_path.read_text()
