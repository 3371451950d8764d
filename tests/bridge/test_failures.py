"""Permanent failures stop the bridge with one clear line; schema changes are handled."""

from __future__ import annotations

import pytest

from cdc.demo.local import LocalPostgres, wait_for
from conftest import read_stream

pytestmark = pytest.mark.integration


def one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("cdc: error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.fixture
def rides(env):
    return env.init_rides("ride.yaml")


@pytest.mark.one_path
def test_missing_slot_says_run_init(env):
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml")
    result = env.cdc("run", "--until-caught-up")
    assert result.returncode == 4
    line = one_error_line(result)
    assert f"replication slot '{env.slot}' does not exist" in line and "cdc init" in line


@pytest.mark.one_path
def test_role_without_replication_privilege(rides):
    rides.execute("CREATE ROLE reader LOGIN")
    rides.write_config(dsn=rides.postgres.dsn_for("reader", dbname=rides.dbname))
    result = rides.cdc("run", "--until-caught-up")
    assert result.returncode == 4
    line = one_error_line(result)
    assert "REPLICATION" in line


@pytest.mark.one_path
def test_unreachable_postgres_is_reported_as_transient(env):
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml")
    env.write_config(dsn="postgresql://postgres@127.0.0.1:1/postgres")
    result = env.cdc("init")
    assert result.returncode == 75
    assert "postgres unavailable" in one_error_line(result)


@pytest.mark.one_path
def test_wrong_wal_level_is_reported_with_the_fix(servers_root, env):
    server = LocalPostgres(servers_root / "replica-wal", settings={"wal_level": "replica"})
    server.start()
    try:
        env.copy_mappings("ride.yaml")
        env.write_config(dsn=server.dsn)
        for command in ("init", "run"):
            result = env.cdc(command)
            assert result.returncode == 4, result.stderr
            line = one_error_line(result)
            assert "wal_level" in line and "wal_level = logical" in line and "restart" in line
    finally:
        server.stop("immediate")


@pytest.mark.one_path
def test_bad_mapping_names_file_and_line(rides):
    path = rides.write_mapping("broken.yaml", """\
        entity: broken
        table: public.rides
        key: [id]
        fields:
          id: id
          size: {column: distance_m, cast: sideways}
        """)
    result = rides.cdc("check")
    assert result.returncode == 3
    line = one_error_line(result)
    assert f"{path}:6" in line and "unknown cast 'sideways'" in line and "casts are:" in line


@pytest.mark.one_path
def test_check_reports_every_problem_against_the_live_schema(rides):
    rides.write_mapping("ghost.yaml", """\
        entity: ghost
        table: public.rides
        key: [id]
        fields:
          id: id
          speed: warp_factor
        """)
    rides.write_mapping("nothing.yaml", """\
        entity: nothing
        table: public.no_such_table
        key: [id]
        fields: {id: id}
        """)
    result = rides.cdc("check")
    assert result.returncode == 3
    assert "column 'warp_factor' is not in table public.rides" in result.stderr
    assert "ghost.yaml:6" in result.stderr
    assert "table public.no_such_table does not exist" in result.stderr
    assert "ok: entity ride" in result.stdout


@pytest.mark.one_path
def test_check_passes_on_valid_setup(rides):
    result = rides.cdc("check")
    assert result.returncode == 0, result.stderr
    assert "cdc check: 1 mapping(s) valid" in result.stdout


def test_added_column_keeps_flowing_and_dropped_mapped_column_stops_with_clear_error(rides):
    rides.execute("INSERT INTO riders (id, name, email) VALUES (1, 'a', 'b')")
    proc = rides.start_bridge()
    rides.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (1, 1, 10)")
    rides.execute("ALTER TABLE rides ADD COLUMN secret_score int")
    rides.execute("INSERT INTO rides (id, rider_id, distance_m, secret_score) VALUES (2, 1, 20, 99)")
    wait_for(lambda: rides.redis.xlen("cdc:ride") == 2, 30, "rows before and after the added column")
    entries = read_stream(rides.redis, "cdc:ride")
    assert entries[1]["data"] == {"id": 2, "distance": "20.000", "rider": 1}

    rides.execute("ALTER TABLE rides RENAME COLUMN distance_m TO dist")
    rides.execute("INSERT INTO rides (id, rider_id, dist) VALUES (3, 1, 30)")
    assert proc.wait(30) == 3
    log = proc.log_path.read_text()
    assert "column 'distance_m' is not in table public.rides" in log
    assert "ride.yaml:6" in log and "dropped or renamed" in log
    assert rides.redis.xlen("cdc:ride") == 2  # no silent nulls

    # the fix: map the renamed column; the bridge resumes exactly at the failed change
    (rides.mappings_dir / "ride.yaml").write_text(
        "entity: ride\ntable: public.rides\nkey: [id]\nfields: {id: id, distance: dist, rider: rider_id}\n"
    )
    rides.cdc("run", "--until-caught-up", check=True)
    entries = read_stream(rides.redis, "cdc:ride")
    assert [e["key"]["id"] for e in entries] == [1, 2, 3]
    assert entries[2]["data"] == {"id": 3, "distance": "30.000", "rider": 1}


def test_logical_messages_with_a_configured_prefix_are_published(rides):
    rides.copy_mappings("ride_event.yaml")
    with rides.connect() as conn:
        with conn.transaction():
            conn.execute("INSERT INTO riders (id, name, email) VALUES (1, 'a', 'b')")
            conn.execute("SELECT pg_logical_emit_message(true, 'ride_events', '{\"ride\": 1, \"big\": 123456789012345678901234567890}')")
            conn.execute("SELECT pg_logical_emit_message(true, 'other_prefix', 'ignored')")
        conn.execute("SELECT pg_logical_emit_message(false, 'ride_events.audit', 'plain text')")
        with pytest.raises(RuntimeError):
            with conn.transaction():
                conn.execute("SELECT pg_logical_emit_message(true, 'ride_events', 'rolled back')")
                raise RuntimeError
    rides.cdc("run", "--until-caught-up", check=True)
    raw = rides.redis.xrange("cdc:ride_event")
    assert len(raw) == 2
    first, second = (f for _, f in raw)
    assert first[b"op"] == b"m"
    assert first[b"data"] == b'{"prefix":"ride_events","content":{"ride": 1, "big": 123456789012345678901234567890}}'
    assert second[b"data"] == b'{"prefix":"ride_events.audit","content":"plain text"}'
    assert int(first[b"lsn"]) < int(second[b"lsn"])
