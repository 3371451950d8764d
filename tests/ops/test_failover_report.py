"""Whether the slot would survive a failover: `cdc init` makes it a failover slot (PostgreSQL 17+),
`cdc check` warns with the settings to add, `cdc status` says failover-ready yes or no and why.

On its own server (it sets synchronized_standby_slots, which holds every logical walsender back),
of the version the run was given (--pg): the same tests assert what each version does."""

from __future__ import annotations

import os
import shutil

import orjson
import psycopg
import pytest
import redis

from cdc.demo.local import LocalPostgres, wait_for
from conftest import Env

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(servers_root):
    root = servers_root / f"failover-report-{os.getpid()}"
    root.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    pg = LocalPostgres(root)
    pg.start()
    yield pg
    pg.stop("immediate")


@pytest.fixture
def fenv(server, redis_server, tmp_path):
    redis.Redis.from_url(redis_server.url).flushall()
    dbname = f"f{tmp_path.name[-20:]}".replace("-", "_").lower()
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    e = Env(server, redis_server, dbname, tmp_path)
    yield e
    e.close()
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        if conn.info.server_version >= 170000:
            conn.execute("ALTER SYSTEM RESET synchronized_standby_slots")
            conn.execute("SELECT pg_reload_conf()")
        for (slot,) in conn.execute("SELECT slot_name FROM pg_replication_slots").fetchall():
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


def version(env: Env) -> int:
    return int(env.execute("SHOW server_version_num")[0][0])


def lines(result, kind: str) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if line.startswith(f"{kind}: ")]


def failover_flag(env: Env) -> bool:
    return env.execute("SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (env.slot,))[0][0]


def test_without_a_standby_check_warns_of_nothing_and_says_why_the_slot_would_not_survive(fenv):
    fenv.init_rides("ride.yaml")
    result = fenv.cdc("check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert not [w for w in lines(result, "warning") if "failover" in w], lines(result, "warning")
    if version(fenv) >= 170000:
        assert failover_flag(fenv) is True
        assert any("failover-ready: no standby (no physical replication slot)" in line for line in lines(result, "ok"))
    else:
        assert any("postgres.failover_slot is ignored: PostgreSQL 15 has no failover slots" in line
                   for line in lines(result, "ok"))
    status = orjson.loads(fenv.cdc("status", "--json", check=True).stdout)["slot"]["failover"]
    assert status["ready"] is False and status["reason"]


def test_a_standby_in_evidence_turns_each_missing_setting_into_a_warning(fenv):
    fenv.init_rides("ride.yaml")
    fenv.execute("SELECT pg_create_physical_replication_slot('standby1')")
    result = fenv.cdc("check")
    warnings = lines(result, "warning")
    assert result.returncode == 0, result.stdout + result.stderr
    assert any("postgres.dsn names one host" in w for w in warnings) or version(fenv) < 170000
    if version(fenv) < 170000:
        assert any("postgres.failover_slot is ignored: PostgreSQL 15 has no failover slots" in w and "cdc recover" in w
                   for w in warnings), warnings
        return
    assert any("synchronized_standby_slots is not set on the primary: the bridge may receive changes the standby "
               "has not flushed" in w and "set synchronized_standby_slots = 'standby1' on the primary" in w
               for w in warnings), warnings
    fenv.execute("ALTER SYSTEM SET synchronized_standby_slots = 'standby1'")
    fenv.execute("SELECT pg_reload_conf()")
    wait_for(lambda: fenv.execute("SHOW synchronized_standby_slots")[0][0] == "standby1", 10, "the reload")
    result = fenv.cdc("check")
    warnings = [w for w in lines(result, "warning") if "would not survive a failover" in w]
    assert len(warnings) == 1, warnings
    assert ("standby slot standby1 is not active (inactive, never confirmed)" in warnings[0]
            and "sync_replication_slots = on, hot_standby_feedback = on, primary_slot_name = 'standby1', "
                f"dbname={fenv.dbname} in primary_conninfo" in warnings[0]), warnings[0]
    status = fenv.cdc("status", check=True).stdout
    assert "failover-ready: no: standby slot standby1 is not active" in status
    report = orjson.loads(fenv.cdc("status", "--json", check=True).stdout)["slot"]["failover"]
    assert report["ready"] is False and report["slot_failover"] is True
    assert report["synchronized_standby_slots"] == ["standby1"]
    assert report["standby_slots"] == [{"name": "standby1", "active": False, "behind_bytes": None}]


def test_init_makes_an_existing_slot_a_failover_slot_but_not_while_a_bridge_reads_it(fenv):
    if version(fenv) < 170000:
        fenv.init_rides("ride.yaml")
        assert "failover" not in fenv.cdc("init", check=True).stdout
        return
    fenv.write_config(postgres=", failover_slot: false")
    fenv.init_rides("ride.yaml")
    assert failover_flag(fenv) is False
    check = fenv.cdc("check")
    assert any("postgres.failover_slot is false, so the slot would not survive a failover" in line
               for line in lines(check, "ok"))

    fenv.write_config()
    bridge = fenv.start_bridge()
    wait_for(lambda: fenv.slot_active() or bridge.poll() is not None, 30, "the bridge to attach")
    busy = fenv.cdc("init", check=True)
    assert f"slot {fenv.slot} is in use, so it is not a failover slot yet: stop cdc run and run cdc init again" in busy.stdout + busy.stderr
    assert failover_flag(fenv) is False
    bridge.terminate()
    assert bridge.wait(30) == 0
    fenv.wait_slot_inactive()

    done = fenv.cdc("init", check=True)
    assert f"made slot {fenv.slot} a failover slot" in done.stdout + done.stderr
    assert failover_flag(fenv) is True
    again = fenv.cdc("init", check=True)
    assert "failover slot" not in again.stdout + again.stderr
