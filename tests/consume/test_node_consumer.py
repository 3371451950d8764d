"""Any language can consume: the Node.js example keeps the exact total against the real pipeline."""

from __future__ import annotations

import shutil
import signal
import subprocess
from decimal import Decimal
from pathlib import Path

import pytest

from cdc.demo.local import wait_for

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "node-consumer"


@pytest.fixture(scope="session")
def node_example():
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.fail("node and npm are needed: apt-get install nodejs npm")
    if not (EXAMPLE / "node_modules" / "redis").exists():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=EXAMPLE, check=True, capture_output=True, timeout=300)
    return node


def test_node_consumer_total_matches_the_database_across_a_kill(env, node_example):
    env.init_rides("ride.yaml", riders=5)
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1 + g % 5, g * 1.125 FROM generate_series(1, 20000) g")
    env.execute("UPDATE rides SET distance_m = distance_m + 0.001 WHERE id % 7 = 0")
    env.execute("DELETE FROM rides WHERE id % 11 = 0")
    env.cdc("run", "--until-caught-up", check=True)
    expected = env.execute("SELECT sum(distance_m) FROM rides")[0][0] * 1000
    cmd = [node_example, str(EXAMPLE / "consumer.js"), "--redis", env.redis_server.url, "--name", "n1"]
    total = lambda: env.redis.get("cdc:example:node-total:total")  # noqa: E731

    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: total() is not None, 30, "the node consumer to apply a batch")
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    assert Decimal(total().decode()) != expected, "killed before finishing, to exercise the restart"

    second = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: Decimal(total().decode()) == expected, 60, "the node consumer's total to match the database")
        wait_for(lambda: env.redis.xpending("cdc:ride", "node-total")["pending"] == 0, 30, "every entry acknowledged")
    finally:
        second.send_signal(signal.SIGTERM)
        out, _ = second.communicate(timeout=30)
    assert second.returncode == 0, out
