"""Failover readiness tells the truth: "yes" only when a failover now loses nothing (PostgreSQL 18).

Readiness is judged on each standby's own copy of the slot. The window it must never call
"yes" is the standby's temporary copy: the slot sync worker creates it temporary and persists
it only once the primary's slot has passed what the standby reserved; a promotion drops it.
A transaction left open on the primary keeps the window open for as long as the test needs:
the primary's slot cannot move its catalog xmin past it, while the copy reserved a newer one.
"""

from __future__ import annotations

import signal

import orjson
import psycopg
import pytest

from cdc.demo.local import free_port, wait_for
from conftest import Env, read_stream
from pg_pair import PrimaryStandby, env_on, running_pair
from test_failover import _new_primary_state, _setup, assert_streams_are_the_new_primary, failover_ready_metric
from workload import ResilientWorkload

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.pg18, pytest.mark.one_path]


@pytest.fixture
def pair(servers_root, tmp_path):
    with running_pair(servers_root, tmp_path, "truth", wait_for_standby=True) as p:
        yield p


@pytest.fixture
def ha_env(pair, redis_server, tmp_path):
    with env_on(pair, redis_server, tmp_path) as e:
        yield e


def _standby_copy(pair: PrimaryStandby, slot: str) -> tuple[bool, bool] | None:
    """(synced, temporary) of the standby's copy of the slot, None without one."""
    with psycopg.connect(pair.dsn_for(pair.standby), autocommit=True) as conn:
        row = conn.execute("SELECT synced, temporary FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    return None if row is None else (bool(row[0]), bool(row[1]))


def _set_slot_sync(pair: PrimaryStandby, on: bool) -> None:
    with psycopg.connect(pair.dsn_for(pair.standby), autocommit=True) as conn:
        conn.execute(f"ALTER SYSTEM SET sync_replication_slots = {'on' if on else 'off'}")
        conn.execute("SELECT pg_reload_conf()")


def _status_failover(env: Env) -> dict:
    return orjson.loads(env.cdc("status", "--json", check=True).stdout)["slot"]["failover"]


def test_readiness_says_no_through_the_temporary_copy_and_a_failover_then_stops_for_recovery(ha_env, pair):
    env = ha_env
    port = free_port()
    _set_slot_sync(pair, False)  # the copy is made only once the open transaction below has its xid
    _setup(env, pair, extra=f"http: {{host: 127.0.0.1, port: {port}}}\n")
    holder = psycopg.connect(pair.dsn_for(pair.primary))  # an open transaction with an xid, never committed
    holder.execute("INSERT INTO workload_ledger (n) VALUES (-1)")
    workload = ResilientWorkload(pair.dsn, transactions=100000, seed=5, rate=100, big_every=0, big_size=0)
    proc = env.start_bridge()
    workload.start()
    try:
        wait_for(lambda: env.redis.xlen("cdc:ledger") >= 50, 60, "the bridge to publish")
        _set_slot_sync(pair, True)
        wait_for(lambda: _standby_copy(pair, env.slot) is not None, 60, "the standby to copy the slot")
        assert _standby_copy(pair, env.slot) == (True, True), "the copy should be temporary while the transaction is open"

        # every reading while the copy is temporary says no, and why
        wait_for(lambda: failover_ready_metric(port) is not None, 30, "the readiness metric")
        for _ in range(3):
            status = _status_failover(env)
            check = env.cdc("check")
            metric = failover_ready_metric(port)
            assert _standby_copy(pair, env.slot) == (True, True)  # still temporary after the readings
            assert status["state"] == "no" and status["ready"] is False, status
            assert "holds only a temporary copy of slot" in status["reason"], status["reason"]
            assert metric == 0
            assert "holds only a temporary copy of slot" in check.stdout + check.stderr, check.stdout + check.stderr
            assert "failover-ready: yes" not in check.stdout
        wait_for(lambda: "failover-ready no: " in proc.log_path.read_text()
                 and "temporary copy" in proc.log_path.read_text(), 30, "the bridge to log why it is not ready")
        assert "failover-ready yes" not in proc.log_path.read_text()

        # a failover in the window: the promotion drops the copy; the bridge stops with the documented fix
        pair.primary.stop("immediate")
        pair.standby.promote()
        with psycopg.connect(pair.dsn_for(pair.standby), autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s",
                                (env.slot,)).fetchone()[0] == 0
        assert proc.wait(120) == 4, proc.log_path.read_text()[-3000:]
    finally:
        holder.close()
        workload.stopped.set()
        workload.done.wait(60)
        if proc.poll() is None:
            proc.kill()
    log = proc.log_path.read_text()
    (error,) = [line for line in log.splitlines() if line.startswith("cdc: error: ")]
    assert "does not exist" in error and "cdc init" in error and "cdc recover" in error, error

    # the documented recovery: cdc init on the new primary, cdc recover; the streams replay to its tables
    with psycopg.connect(pair.dsn_for(pair.standby), autocommit=True) as conn:
        conn.execute("INSERT INTO riders (id, name, email) VALUES (900001, 'after', 'x')")
    env.cdc("init", check=True)
    env.cdc("recover", check=True, timeout=300)
    env.cdc("run", "--until-caught-up", check=True, timeout=300)
    ledger, rides, riders = _new_primary_state(pair)
    streams = {s: read_stream(env.redis, f"cdc:{s}") for s in ("ledger", "ride", "rider")}
    assert set(_replay_recovered(streams["ledger"], "n")) == ledger
    assert _replay_recovered(streams["ride"], "distance") == rides
    assert _replay_recovered(streams["rider"], "name") == riders
    assert ledger and riders[900001] == "after"


def _replay_recovered(entries: list[dict], field: str) -> dict:
    """A stream applied as a consumer does: cdc recover's marker (x) and a truncate start the table afresh."""
    table: dict = {}
    for e in entries:
        if e["op"] in ("x", "t"):
            table.clear()
        elif e["op"] == "d":
            table.pop(next(iter(e["key"].values())), None)
        else:
            table[next(iter(e["key"].values()))] = e["data"][field]
    return table


def test_a_switchover_when_check_says_yes_loses_nothing(ha_env, pair):
    """The planned switchover of the PostgreSQL HA how-to: cdc check says failover-ready yes, then the primary
    is stopped (fast) and the standby promoted; every transaction is in the streams exactly once."""
    env = ha_env
    _setup(env, pair)
    workload = ResilientWorkload(pair.dsn, transactions=100000, seed=7, rate=100, big_every=40, big_size=100)
    proc = env.start_bridge()
    workload.start()
    try:
        wait_for(lambda: "failover-ready: yes" in env.cdc("check").stdout, 120, "cdc check to say failover-ready yes")
        synced, temporary = _standby_copy(pair, env.slot) or (False, True)
        assert synced and not temporary, "check said yes without a persisted copy on the standby"
        pair.primary.stop("fast")
        pair.standby.promote()
        committed = workload.committed
        wait_for(lambda: workload.committed >= committed + 30, 60, "the writers to commit on the new primary")
        assert proc.poll() is None, proc.log_path.read_text()[-3000:]
    finally:
        workload.stopped.set()
        workload.done.wait(60)
    assert workload.error is None, workload.error
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.log_path.read_text()[-3000:]
    env.cdc("run", "--until-caught-up", check=True, timeout=300)
    assert_streams_are_the_new_primary(env, pair)
    after = _status_failover(env)
    assert after["state"] == "no" and after["ready"] is False, after
    # the old primary, the DSN's other host, is down: its side is unknown, never counted as a good copy
    assert "cannot be read" in after["reason"] and "unknown" in after["reason"], after["reason"]

