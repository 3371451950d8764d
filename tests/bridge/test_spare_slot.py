"""The spare slot (postgres.spare_slot_dsn): losing the standby that decodes loses nothing.

A primary and a physical standby (PostgreSQL 18); the slot lives on the standby
(postgres.slot_dsn) and `cdc init` creates a spare of the same name on the primary first. The
running bridge keeps the spare no further than what Redis holds. When the standby dies under
writes (or its slot is dropped), the bridge carries on from the spare: the changes between the
spare's position and Redis' record are decoded again and skipped by position, so every
transaction is in the streams exactly once, in order, and the streams replay to the tables.
"""

from __future__ import annotations

import signal

import orjson
import psycopg
import pytest

from cdc import keys
from cdc.config import Settings
from cdc.demo.local import wait_for
from cdc.errors import ConfigError
from cdc.source.lsn import Lsn
from cdc.source.spare_slot import SpareReading, judge
from conftest import SQL, Env, read_stream
from replay import replay
from pg_pair import PrimaryStandby, env_on, running_pair
from workload import ResilientWorkload

RIDER = "entity: rider\ntable: public.riders\nkey: [id]\nfields: {id: id, name: name}\n"
RIDE = "entity: ride\ntable: public.rides\nkey: [id]\nfields: {id: id, distance: distance_m, rider: rider_id}\n"
LEDGER = "entity: ledger\ntable: public.workload_ledger\nkey: [n]\nfields: {n: n}\n"


def test_a_spare_stands_in_only_when_no_further_than_what_redis_holds():
    assert judge(SpareReading(True, Lsn(100), "reserved"), Lsn(100)) is None
    assert judge(SpareReading(True, Lsn(50), "extended"), Lsn(100)) is None
    assert "past what Redis holds" in judge(SpareReading(True, Lsn(101), "reserved"), Lsn(100))
    assert "does not exist" in judge(SpareReading(False), Lsn(100))
    assert "invalidated" in judge(SpareReading(True, Lsn(10), "lost"), Lsn(100))
    assert "invalidated" in judge(SpareReading(True, Lsn(10), "reserved", conflicting=True), Lsn(100))
    assert "no record" in judge(SpareReading(True, Lsn(10), "reserved"), None)


@pytest.mark.parametrize("postgres, wrong", [
    ('spare_slot_dsn: "host=a"', "needs postgres.slot_dsn"),
    ('slot_dsn: "host=b", spare_slot_dsn: "host=b"', "names the server of postgres.slot_dsn"),
])
def test_a_spare_without_a_standby_slot_or_on_its_server_is_refused(tmp_path, postgres, wrong):
    config = tmp_path / "cdc.yaml"
    config.write_text(f"postgres: {{dsn: 'host=p', {postgres}}}\nredis: {{url: 'redis://localhost'}}\n")
    with pytest.raises(ConfigError) as caught:
        Settings.from_file(config, env={})
    assert wrong in str(caught.value) and "cdc.yaml:1" in str(caught.value)


@pytest.fixture
def pair(servers_root, tmp_path):
    with running_pair(servers_root, tmp_path, "spare", wait_for_standby=False) as p:
        yield p


@pytest.fixture
def senv(pair, redis_server, tmp_path):
    with env_on(pair, redis_server, tmp_path) as e:
        yield e


def _slot(pair: PrimaryStandby, server, slot: str) -> tuple[int, bool] | None:
    """The slot's confirmed position (bytes) and whether it is streamed, on `server`."""
    with psycopg.connect(pair.dsn_for(server), autocommit=True) as conn:
        row = conn.execute("SELECT confirmed_flush_lsn - '0/0'::pg_lsn, active FROM pg_replication_slots "
                           "WHERE slot_name = %s", (slot,)).fetchone()
    return None if row is None else (int(row[0]), bool(row[1]))


def _setup(env: Env, pair: PrimaryStandby) -> None:
    env.apply_sql("10_rocket_rides.sql")
    env.execute("CREATE TABLE workload_ledger (n int PRIMARY KEY)")
    env.write_mapping("ride.yaml", RIDE)
    env.write_mapping("rider.yaml", RIDER)
    env.write_mapping("ledger.yaml", LEDGER)
    env.write_config("batch: {max_entries: 40, max_delay_ms: 5}\n", dsn=pair.dsn,
                     postgres=f', receive_timeout_s: 5, slot_check_interval_s: 0.5, heartbeat_interval_s: 1, '
                              f'slot_dsn: "{pair.dsn_for(pair.standby)}", spare_slot_dsn: "{pair.dsn_for(pair.primary)}", '
                              'spare_after_s: 3')


def _replay(entries: list[dict], field: str) -> dict:
    """The stream applied by its `id` key, as `field` per row."""
    return {key: row[field] for key, row in replay(entries).items()}


def _assert_exact(env: Env, pair: PrimaryStandby) -> None:
    streams = {s: read_stream(env.redis, f"cdc:{s}") for s in ("ledger", "ride", "rider")}
    for name, entries in streams.items():
        positions = [(int(e["lsn"]), int(e["seq"])) for e in entries]
        assert len(set(positions)) == len(positions), f"cdc:{name}: duplicate source positions"
        assert positions == sorted(positions), f"cdc:{name}: entries out of source order"
    with psycopg.connect(pair.dsn_for(pair.primary), autocommit=True) as conn:
        ledger = {r[0] for r in conn.execute("SELECT n FROM workload_ledger")}
        rides = {r[0]: f"{r[1]:.3f}" for r in conn.execute("SELECT id, distance_m FROM rides")}
        riders = {r[0]: r[1] for r in conn.execute("SELECT id, name FROM riders")}
    published = [e["key"]["n"] for e in streams["ledger"]]
    assert len(published) == len(set(published)), "a transaction was published twice"
    assert set(published) == ledger
    assert _replay(streams["ride"], "distance") == rides
    assert _replay(streams["rider"], "name") == riders


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.pg18
@pytest.mark.one_path
def test_the_standby_dying_under_writes_the_bridge_carries_on_from_the_spare_exactly(senv, pair):
    env = senv
    _setup(env, pair)
    init = env.cdc("init", check=True)
    assert "created the spare slot" in init.stdout + init.stderr, init.stdout + init.stderr
    created = _slot(pair, pair.primary, env.slot)
    assert created is not None and _slot(pair, pair.standby, env.slot) is not None
    check = env.cdc("check")
    assert check.returncode == 0 and "could stand in for the slot" in check.stdout, check.stdout + check.stderr

    workload = ResilientWorkload(pair.dsn, transactions=100000, seed=5, rate=150, big_every=40, big_size=100)
    workload.start()
    try:
        proc = env.start_bridge()
        # the spare follows what Redis holds, never past it
        for _ in range(3):
            wait_for(lambda: (_slot(pair, pair.primary, env.slot) or (0,))[0] > created[0] or proc.poll() is not None,
                     60, "the bridge to move the spare on")
            assert proc.poll() is None, proc.log_path.read_text()[-3000:]
            spare = _slot(pair, pair.primary, env.slot)
            assert spare is not None and not spare[1], "the spare is not streamed"
            assert spare[0] <= int(env.redis.get(keys.flushed_key(env.slot))), "the spare went past what Redis holds"
            created = spare
        status = orjson.loads(env.cdc("status", "--json", check=True).stdout)
        assert status["spare"]["ready"] and status["spare"]["on"] == "primary", status["spare"]

        pair.standby.stop("immediate")  # the standby and its slot are gone
        committed = workload.committed
        wait_for(lambda: workload.committed >= committed + 40, 90, "the writers to commit more")
        before = env.redis.xlen("cdc:ledger")
        wait_for(lambda: env.redis.xlen("cdc:ledger") > before + 20 or proc.poll() is not None, 120,
                 "the bridge to publish from the spare")
        assert proc.poll() is None, proc.log_path.read_text()[-3000:]
        assert "carrying on from the spare slot on the primary" in proc.log_path.read_text()
        assert _slot(pair, pair.primary, env.slot)[1], "the bridge streams the spare"
    finally:
        workload.stopped.set()
        workload.done.wait(60)
    assert workload.error is None, workload.error
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.log_path.read_text()[-3000:]
    # a restart with the same settings waits spare_after_s for the standby, then carries on from the spare again
    caught_up = env.cdc("run", "--until-caught-up", check=True, timeout=300)
    assert "carrying on from the spare slot" in caught_up.stderr + caught_up.stdout
    _assert_exact(env, pair)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.pg18
@pytest.mark.one_path
def test_the_standby_losing_its_slot_the_bridge_carries_on_from_the_spare_and_without_one_stops(senv, pair):
    env = senv
    _setup(env, pair)
    env.cdc("init", check=True)
    workload = ResilientWorkload(pair.dsn, transactions=100000, seed=6, rate=150)
    workload.start()
    try:
        proc = env.start_bridge()
        wait_for(lambda: (_slot(pair, pair.standby, env.slot) or (0, False))[1] or proc.poll() is not None, 60,
                 "the bridge to stream the standby's slot")
        wait_for(lambda: env.redis.xlen("cdc:ledger") > 20, 60, "entries")
        with psycopg.connect(pair.dsn_for(pair.standby), autocommit=True) as standby:
            def drop() -> bool:
                pid = standby.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                                      (env.slot,)).fetchone()[0]
                if pid:
                    standby.execute("SELECT pg_terminate_backend(%s)", (pid,))
                    return False
                standby.execute("SELECT pg_drop_replication_slot(%s)", (env.slot,))
                return True
            wait_for(lambda: _try(drop), 30, "the standby's slot to be dropped")
        before = env.redis.xlen("cdc:ledger")
        wait_for(lambda: env.redis.xlen("cdc:ledger") > before + 20 or proc.poll() is not None, 120,
                 "the bridge to publish from the spare")
        assert proc.poll() is None, proc.log_path.read_text()[-3000:]
        assert "lost the slot: carrying on from the spare slot" in proc.log_path.read_text()
    finally:
        workload.stopped.set()
        workload.done.wait(60)
    assert workload.error is None, workload.error
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.log_path.read_text()[-3000:]
    env.cdc("run", "--until-caught-up", check=True, timeout=300)  # the standby is up: its slot is gone, the spare's on
    _assert_exact(env, pair)

    # with the spare lost too, the missing slot stops the bridge and says why the spare cannot stand in
    with psycopg.connect(pair.dsn_for(pair.primary), autocommit=True) as primary:
        primary.execute("SELECT pg_drop_replication_slot(%s)", (env.slot,))
    stopped = env.cdc("run", "--until-caught-up", timeout=300)
    assert stopped.returncode == 4, stopped.stdout + stopped.stderr
    assert "does not exist" in stopped.stderr and "cannot stand in" in stopped.stderr, stopped.stderr


def _try(step) -> bool:
    try:
        return step()
    except psycopg.Error:
        return False


def _as(pair: PrimaryStandby, user: str, server=None) -> str:
    """A DSN of `user`: on `server`, or on both servers asking for the writable one."""
    if server is not None:
        return f"host=127.0.0.1 port={server.port} user={user} dbname={pair.dbname}"
    return pair.dsn.replace("user=postgres", f"user={user}")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.pg18
@pytest.mark.one_path
def test_least_privilege_with_the_slot_on_a_standby_and_the_spare_on_the_primary(senv, pair):
    """The least-privilege how-to with the slot on a standby: a superuser applies what `cdc sql` prints, the
    tables' owner (LOGIN REPLICATION, no superuser, not allowed pg_log_standby_snapshot()) runs `cdc init`, which
    creates the slot on the standby through its heartbeat fallback and the spare on the primary; cdc_bridge runs
    `cdc check` and `cdc run`, keeps the spare moving and carries on from it when the standby dies: exact."""
    env = senv
    env.execute("CREATE ROLE app_owner LOGIN REPLICATION")
    env.execute(f'GRANT CREATE ON DATABASE "{pair.dbname}" TO app_owner')
    env.execute("GRANT CREATE ON SCHEMA public TO app_owner")
    with psycopg.connect(_as(pair, "app_owner", pair.primary), autocommit=True) as owner:
        owner.execute((SQL / "10_rocket_rides.sql").read_text())
        owner.execute("CREATE TABLE workload_ledger (n int PRIMARY KEY)")
        assert not owner.execute("SELECT has_function_privilege('pg_log_standby_snapshot()', 'EXECUTE')").fetchone()[0]
    env.write_mapping("ride.yaml", RIDE)
    env.write_mapping("rider.yaml", RIDER)
    env.write_mapping("ledger.yaml", LEDGER)
    bridge = {"CDC_POSTGRES_DSN": _as(pair, "cdc_bridge"),
              "CDC_POSTGRES_SLOT_DSN": _as(pair, "cdc_bridge", pair.standby),
              "CDC_POSTGRES_SPARE_SLOT_DSN": _as(pair, "cdc_bridge", pair.primary)}
    owner_env = {"CDC_POSTGRES_DSN": _as(pair, "app_owner"),
                 "CDC_POSTGRES_SLOT_DSN": _as(pair, "app_owner", pair.standby),
                 "CDC_POSTGRES_SPARE_SLOT_DSN": _as(pair, "app_owner", pair.primary)}
    env.write_config("batch: {max_entries: 40, max_delay_ms: 5}\n", dsn=pair.dsn,
                     postgres=', receive_timeout_s: 5, slot_check_interval_s: 0.5, heartbeat_interval_s: 1, '
                              'spare_after_s: 3')
    env.execute(env.cdc("sql", check=True).stdout)  # as a superuser, what the how-to says
    init = env.cdc("init", env=owner_env, timeout=240)
    assert init.returncode == 0, init.stdout + init.stderr
    assert "created the spare slot" in init.stdout + init.stderr, init.stdout + init.stderr
    assert _slot(pair, pair.standby, env.slot) is not None and _slot(pair, pair.primary, env.slot) is not None
    check = env.cdc("check", env=bridge)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "could stand in for the slot" in check.stdout and "the standby can decode" in check.stdout, check.stdout

    workload = ResilientWorkload(pair.dsn, transactions=100000, seed=7, rate=150, big_every=40, big_size=100)
    workload.start()
    try:
        proc = env.start_bridge(env=bridge)
        created = _slot(pair, pair.primary, env.slot)
        wait_for(lambda: (_slot(pair, pair.primary, env.slot) or (0,))[0] > created[0] or proc.poll() is not None,
                 60, "cdc_bridge to move the spare on")
        assert proc.poll() is None, proc.log_path.read_text()[-3000:]
        pair.standby.stop("immediate")
        before = env.redis.xlen("cdc:ledger")
        wait_for(lambda: env.redis.xlen("cdc:ledger") > before + 20 or proc.poll() is not None, 120,
                 "cdc_bridge to publish from the spare")
        assert proc.poll() is None, proc.log_path.read_text()[-3000:]
        assert "carrying on from the spare slot on the primary" in proc.log_path.read_text()
    finally:
        workload.stopped.set()
        workload.done.wait(60)
    assert workload.error is None, workload.error
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.log_path.read_text()[-3000:]
    env.cdc("run", "--until-caught-up", check=True, timeout=300, env=bridge)
    _assert_exact(env, pair)
