"""`postgres.dsn` changed to another database of the same server: every command says so with the slot's
database and this one, never an endless retry or a table "dropped and re-created"; the fixes the messages
name, followed literally, lead to a bridge streaming the new database exactly."""

from __future__ import annotations

import re
import subprocess

import psycopg
import pytest

from conftest import read_stream
from replay import replay, ride_rows

pytestmark = pytest.mark.integration


def last_line(result: subprocess.CompletedProcess) -> str:
    return result.stderr.strip().splitlines()[-1]


def test_a_dsn_moved_to_another_database_is_named_and_its_fixes_lead_to_an_exact_stream(env):
    env.init_rides("ride.yaml", riders=2)
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1 + g % 2, g FROM generate_series(1, 5) g")
    env.cdc("run", "--until-caught-up", check=True)
    first = env.dbname
    other = first + "_b"
    with psycopg.connect(env.postgres.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{other}"')
    moved = env.dsn.replace(f"/{first}", f"/{other}")
    try:
        with psycopg.connect(moved, autocommit=True) as conn:
            conn.execute("CREATE TABLE riders (id bigint PRIMARY KEY, name text, email text)")
            conn.execute("CREATE TABLE rides (id bigserial PRIMARY KEY, rider_id bigint, distance_m numeric(12,3)) ")
            conn.execute("ALTER TABLE rides REPLICA IDENTITY FULL")
            conn.execute("INSERT INTO rides (rider_id, distance_m) VALUES (7, 70), (8, 80)")
        env.write_config(dsn=moved)

        # the registration names both databases and the step that comes first
        init = env.cdc("init")
        assert init.returncode == 2 and f"of database '{first}'" in init.stderr and f"of database '{other}'" in init.stderr
        hdel = re.search(r"run: redis-cli (HDEL [^ ,]+ [^ ,]+)", last_line(init))
        assert hdel, last_line(init)
        env.redis.execute_command(*hdel.group(1).split())

        # then each command names the slot's database, and how to move
        slot_error = (f"replication slot '{env.slot}' belongs to database '{first}', but postgres.dsn connects to "
                      f"database '{other}'")
        run = env.cdc("run", "--until-caught-up", timeout=120)
        assert run.returncode == 4 and slot_error in last_line(run), run.stderr
        assert "transient failure" not in run.stderr
        check = env.cdc("check")
        assert check.returncode == 4 and slot_error in check.stderr, check.stderr
        assert "dropped and re-created" not in check.stderr, "the OIDs recorded are the other database's"
        for command in ("init", "recover"):
            result = env.cdc(command)
            assert result.returncode == 4 and slot_error in last_line(result), result.stderr
        assert f"SELECT pg_drop_replication_slot('{env.slot}'), connected to '{first}'" in last_line(run)

        # the move, as the message says: drop the old slot in its database, cdc init, cdc recover, cdc run
        env.execute(f"SELECT pg_drop_replication_slot('{env.slot}')")
        init = env.cdc("init")
        assert init.returncode == 0, init.stderr
        recovered = env.cdc("recover")
        assert recovered.returncode == 0, recovered.stderr
        with psycopg.connect(moved, autocommit=True) as conn:
            conn.execute("INSERT INTO rides (rider_id, distance_m) VALUES (9, 90)")
            conn.execute("UPDATE rides SET distance_m = 1 WHERE rider_id = 7")
        env.cdc("run", "--until-caught-up", check=True)
        env.dbname = other
        entries = read_stream(env.redis, "cdc:ride")
        tail = entries[max(i for i, e in enumerate(entries) if e["op"] == "x") + 1:]
        assert replay(tail) == ride_rows(env)
        assert env.cdc("check").returncode == 0
    finally:
        env.dbname = first
        with psycopg.connect(env.postgres.dsn, autocommit=True) as conn:
            for (slot,) in conn.execute("SELECT slot_name FROM pg_replication_slots WHERE database = %s", (other,)).fetchall():
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            conn.execute(f'DROP DATABASE IF EXISTS "{other}" WITH (FORCE)')
