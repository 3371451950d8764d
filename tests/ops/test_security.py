"""Least privilege and secrets: the bridge runs as a REPLICATION role with SELECT only,
its password comes from a file and never shows up in logs, metrics or errors."""

from __future__ import annotations

import signal
import urllib.request

import pytest

from cdc.demo.local import free_port, wait_for
from conftest import SQL

pytestmark = pytest.mark.integration

PASSWORD = "s3cret-Bridge-pw-7781"


def test_bridge_runs_least_privileged_with_password_from_a_file(env, tmp_path):
    # the tables' owner creates publication and slot
    env.init_rides("ride.yaml", "rider.yaml", sql=tuple(sorted(p.name for p in SQL.glob("*.sql"))), riders=1)  # all of sql/
    env.execute(f"ALTER ROLE cdc_bridge PASSWORD '{PASSWORD}'")
    role = env.execute("SELECT rolsuper, rolreplication, rolcreaterole, rolcreatedb FROM pg_roles WHERE rolname = 'cdc_bridge'")
    assert role == [(False, True, False, False)]

    secret = tmp_path / "postgres_dsn"
    secret.write_text(f"postgresql://cdc_bridge:{PASSWORD}@127.0.0.1:{env.postgres.port}/{env.dbname}\n")
    port = free_port()
    env.write_config(f"http: {{host: 127.0.0.1, port: {port}}}\n", dsn="postgresql://unused@127.0.0.1:1/none")
    secret_env = {"CDC_POSTGRES_DSN_FILE": str(secret)}
    env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, 5)")

    proc = env.start_bridge(env=secret_env)
    wait_for(lambda: env.redis.xlen("cdc:ride") == 1, 30, "the ride, published by the least-privileged role")
    active = env.execute("SELECT usename FROM pg_stat_replication")
    assert ("cdc_bridge",) in active
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        metrics = response.read().decode()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    status = env.cdc("status", "--json", env=secret_env, check=True)

    # a wrong password: one clear line, no secret in it
    secret.write_text(f"postgresql://cdc_bridge:wrong-{PASSWORD}@127.0.0.1:{env.postgres.port}/{env.dbname}\n")
    failed = env.cdc("run", "--until-caught-up", env=secret_env)
    assert failed.returncode == 4 and "password authentication failed" in failed.stderr

    for text in (proc.log_path.read_text(), metrics, status.stdout, status.stderr, failed.stdout, failed.stderr):
        assert PASSWORD not in text
    assert "bridge stopped" in proc.log_path.read_text()
