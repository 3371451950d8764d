"""Least privilege, in the how-to's order: a superuser applies what `cdc sql` prints for the config's
mappings, the owner runs `cdc init`; cdc_bridge (REPLICATION, the grants `cdc sql` wrote, a scram
password from a file) runs `cdc check`, `cdc run`, `cdc backfill`, `cdc status` and `cdc trim`,
snapshots and backfills included. A missing grant stops with the exact GRANT to run."""

from __future__ import annotations

import re
import signal

import pytest

from cdc.demo.local import wait_for

from conftest import SQL, read_stream

pytestmark = pytest.mark.integration

PASSWORD = "Lp-s3cret-4417"
RIDE = """\
entity: ride
table: public.rides
key: [id]
snapshot: initial
fields: {id: id, distance: distance_m, rider: rider_id}
"""


def _as_owner_then_bridge(env, tmp_path) -> dict:
    """`cdc sql`'s output and `cdc init` as the owner; the environment that makes cdc_bridge the role from then on."""
    env.apply_sql("10_rocket_rides.sql", "20_consumer_state.sql")  # the application's tables, the consumers' tables
    env.execute("INSERT INTO riders (id, name, email) VALUES (1, 'a', 'e')")
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1, g FROM generate_series(1, 30) g")
    env.write_mapping("ride.yaml", RIDE)
    env.write_config("batch: {backfill_chunk_rows: 7}\n")
    printed = env.cdc("sql", check=True).stdout  # the how-to: cdc sql, applied as a superuser
    assert "GRANT SELECT ON public.rides TO cdc_bridge;" in printed and "riders" not in printed  # the mapped tables only
    env.execute(printed)
    env.execute(f"ALTER ROLE cdc_bridge PASSWORD '{PASSWORD}'")
    env.cdc("init", check=True)  # the owner
    secret = tmp_path / "bridge_dsn"
    secret.write_text(f"postgresql://cdc_bridge:{PASSWORD}@127.0.0.1:{env.postgres.port}/{env.dbname}\n")
    return {"CDC_POSTGRES_DSN_FILE": str(secret)}


def _ops(stream: list[dict]) -> list[str]:
    return [e["op"] for e in stream]


@pytest.mark.slow
def test_the_readme_flow_runs_as_cdc_bridge_with_snapshots_and_backfills(env, tmp_path):
    bridge = _as_owner_then_bridge(env, tmp_path)
    checked = env.cdc("check", env=bridge)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    proc = env.start_bridge(env=bridge)
    wait_for(lambda: env.redis.xlen("cdc:ride") >= 30, 60, "the initial snapshot, published by cdc_bridge")
    assert _ops(read_stream(env.redis, "cdc:ride")) == ["r"] * 30

    backfill = env.cdc("backfill", "--entity", "ride", "--where", "distance_m <= 10", "--wait", env=bridge, timeout=120)
    assert backfill.returncode == 0, backfill.stdout + backfill.stderr
    assert "done, 10 row(s) read" in backfill.stdout
    env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, 99)")
    wait_for(lambda: env.redis.xlen("cdc:ride") == 41, 30, "the backfill and a new ride")
    assert _ops(read_stream(env.redis, "cdc:ride"))[30:] == ["r"] * 10 + ["c"]

    status = env.cdc("status", env=bridge)
    assert status.returncode == 0, status.stderr
    assert "ride" in status.stdout and "done" in status.stdout
    assert "decoded: " in status.stdout and "spilled to the server's disk: " in status.stdout  # visible to any role
    env.redis.xgroup_create("cdc:ride", "billing", id="0")
    trim = env.cdc("trim", env=bridge)
    assert trim.returncode == 0 and "cdc:ride: trimmed" in trim.stdout, trim.stderr
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert "backfill paused" not in proc.log_path.read_text()
    for text in (checked.stdout, checked.stderr, backfill.stderr, status.stdout, proc.log_path.read_text()):
        assert PASSWORD not in text


def test_a_missing_grant_names_the_exact_grant(env, tmp_path):
    bridge = _as_owner_then_bridge(env, tmp_path)
    env.execute("REVOKE INSERT ON public.cdc_backfills FROM cdc_bridge")
    failed = env.cdc("backfill", "--entity", "ride", env=bridge)
    assert failed.returncode == 4
    assert "GRANT SELECT, INSERT, UPDATE ON public.cdc_backfills TO cdc_bridge" in failed.stderr
    assert failed.stderr.startswith("cdc: error: ") and failed.stderr.count("\n") == 1

    env.execute("REVOKE UPDATE ON public.cdc_backfills FROM cdc_bridge")  # the bridge records snapshot progress
    run = env.cdc("run", "--until-caught-up", env=bridge, timeout=60)
    assert run.returncode == 4, run.stderr
    assert "GRANT SELECT, INSERT, UPDATE ON public.cdc_backfills TO cdc_bridge" in run.stderr
    assert "Traceback" not in run.stderr

    env.execute("REVOKE SELECT ON public.rides FROM cdc_bridge")
    backfill = env.cdc("backfill", "--entity", "ride", env=bridge)
    assert backfill.returncode == 4 and "GRANT SELECT ON TABLE rides TO cdc_bridge" in backfill.stderr


def test_a_revoked_grant_fails_the_snapshot_visibly_and_streaming_goes_on(env, tmp_path):
    """The initial snapshot cannot read its table: failed, with the refusal; the slot moves on."""
    bridge = _as_owner_then_bridge(env, tmp_path)  # the initial snapshot is queued
    env.execute("REVOKE SELECT ON public.rides FROM cdc_bridge")
    proc = env.start_bridge(env=bridge)
    wait_for(lambda: env.execute("SELECT status FROM cdc_backfills")[0][0] == "failed", 60, "the snapshot to fail")
    assert env.execute("SELECT error FROM cdc_backfills") == [("permission denied for table rides",)]
    env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, 99)")
    target = env.current_wal()
    wait_for(lambda: env.confirmed_flush() >= target, 60, "the slot to move on")
    assert _ops(read_stream(env.redis, "cdc:ride")) == ["c"]
    env.execute("GRANT SELECT ON public.rides TO cdc_bridge")
    waited = env.cdc("backfill", "--entity", "ride", "--wait", env=bridge, timeout=60)
    assert waited.returncode == 0 and "done, 31 row(s) read" in waited.stdout, waited.stderr
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def test_init_as_a_role_that_does_not_own_the_tables_says_who_must_run_it(env, tmp_path):
    bridge = _as_owner_then_bridge(env, tmp_path)
    env.write_mapping("rider.yaml", "entity: rider\ntable: public.riders\nkey: [id]\nfields: {id: id}\n")
    failed = env.cdc("init", env=bridge)  # riders must be added to the publication: owner only
    assert failed.returncode == 4, failed.stderr
    assert "must be owner of publication cdc" in failed.stderr
    assert "run cdc init as the owner" in failed.stderr and "REPLICATION" not in failed.stderr
    assert "Traceback" not in failed.stderr


def test_sql_and_cdc_init_create_the_same_backfill_table():
    from cdc.bridge.backfill import BACKFILL_DDL

    def shape(text: str) -> str:
        body = re.search(r"CREATE TABLE IF NOT EXISTS public\.cdc_backfills \((.*)\)", text, re.S)[1]
        return " ".join(re.sub(r"--[^\n]*", "", body).split())

    assert shape((SQL / "25_backfills.sql").read_text()) == shape(BACKFILL_DDL)
