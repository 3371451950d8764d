"""A backfill request reaches the bridge through the WAL (`REQUEST_PREFIX`), transactional with its
`cdc_backfills` row, so it is decoded only once that row is committed. Committed is not yet visible:
the commit's WAL is flushed (and decoded) before the committing backend makes its transaction visible
to other sessions, a short moment, or as long as a synchronous standby takes to answer. A bridge that
looks up the row on decoding the request can miss it; it must look again until it sees it, and, when
idle, still look on a slow timer so that no request is ever left pending."""

from __future__ import annotations

import signal
import threading

import psycopg
import pytest

from cdc.demo.local import wait_for
from conftest import read_stream
from test_backfill import RIDE, backfill_done, setup

pytestmark = pytest.mark.integration

NO_STANDBY = "cdc_test_no_such_standby"


def caught_up(env) -> None:
    target = env.current_wal()
    wait_for(lambda: env.confirmed_flush() >= target, 30, "the bridge to catch up")


def _sync_rep_waiter(env, pid: int) -> bool:
    return bool(env.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND wait_event = 'SyncRep'", (pid,))[0][0])


def _commit_in_thread(conn: psycopg.Connection, work) -> threading.Thread:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work(conn)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.errors = errors
    thread.start()
    return thread


def _hold_commits(env) -> tuple[psycopg.Connection, threading.Thread]:
    """Make commits wait for a synchronous standby that never comes; returns once one does (the server
    applies a reload asynchronously: a probe transaction tells when commits are held)."""
    with psycopg.connect(env.postgres.dsn, autocommit=True) as admin:
        admin.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{NO_STANDBY}'")
        admin.execute("SELECT pg_reload_conf()")

    def probe_held():
        probe = env.connect(options="-c synchronous_commit=on")
        pid = probe.info.backend_pid
        # a transaction that writes WAL: its commit waits for the standby
        thread = _commit_in_thread(probe, lambda c: c.execute("SELECT pg_logical_emit_message(true, 'cdc_test_probe', '')"))
        wait_for(lambda: not thread.is_alive() or _sync_rep_waiter(env, pid), 30, "the probe to commit or wait")
        if thread.is_alive():
            return probe, thread
        probe.close()  # committed before the reload took effect: try again
        return None

    return wait_for(probe_held, 60, "commits to wait for the standby")


def _release_commits(env) -> None:
    with psycopg.connect(env.postgres.dsn, autocommit=True) as admin:
        admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
        admin.execute("SELECT pg_reload_conf()")


def test_a_request_decoded_before_its_row_is_visible_is_still_served(env):
    from cdc.bridge.backfill import enqueue
    from cdc.mapping.model import parse_mapping
    from cdc.yamlsrc import load_yaml_documents

    setup(env, rows=50, chunk=20)
    env.cdc("init", check=True)
    # the bridge (and everything but the request below) commits without waiting for a standby
    env.execute(f'ALTER DATABASE "{env.dbname}" SET synchronous_commit = local')
    proc = env.start_bridge()
    wait_for(env.slot_active, 30, "the bridge to attach")
    ride = parse_mapping(load_yaml_documents(RIDE, "ride.yaml")[0], {})
    requester = env.connect(options="-c synchronous_commit=on")
    try:
        probe, probing = _hold_commits(env)
        pid = requester.info.backend_pid
        requesting = _commit_in_thread(requester, lambda c: enqueue(c, env.slot, ride))
        wait_for(lambda: _sync_rep_waiter(env, pid), 30, "the request's commit to wait for the standby")
        flushed = env.current_wal()  # past the request's commit record
        # the bridge decoded the request and passed its commit while the row was invisible to it
        wait_for(lambda: env.confirmed_flush() >= flushed, 30, "the bridge to pass the request")
        assert env.execute("SELECT count(*) FROM cdc_backfills")[0][0] == 0, "the row is not visible yet"
    finally:
        _release_commits(env)
    requesting.join(30)
    probing.join(30)
    probe.close()
    requester.close()
    assert not requesting.errors, requesting.errors
    wait_for(lambda: backfill_done(env), 30, "the backfill requested while its row was invisible to be read")
    caught_up(env)  # done is recorded with the last chunk's watermark, which reaches Redis when decoded
    reads = [e["key"]["id"] for e in read_stream(env.redis, "cdc:ride") if e["op"] == "r"]
    assert sorted(reads) == list(range(1, 51))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


@pytest.mark.slow
def test_backfills_queued_back_to_back_are_each_served(env):
    """Each `cdc backfill --wait`, queued while the bridge has just gone idle after the previous one."""
    setup(env, rows=30, chunk=50)
    env.cdc("init", check=True)
    proc = env.start_bridge()
    wait_for(env.slot_active, 30, "the bridge to attach")
    for n in range(1, 11):
        waited = env.cdc("backfill", "--entity", "ride", "--where", f"id <= {n}", "--wait", timeout=60)
        assert waited.returncode == 0, waited.stderr
        assert f"backfill {n}: done, {n} row(s) read" in waited.stdout
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def test_an_idle_bridge_finds_a_backfill_queued_without_a_request(env):
    """A row written without the request message (by hand, or by an older `cdc backfill`): the idle look
    at `cdc_backfills` finds it."""
    setup(env, rows=20, chunk=50)
    env.cdc("init", check=True)
    proc = env.start_bridge()
    wait_for(env.slot_active, 30, "the bridge to attach")
    env.execute("INSERT INTO cdc_backfills (slot, entity) VALUES (%s, 'ride')", (env.slot,))
    wait_for(lambda: backfill_done(env), 30, "the backfill queued without a request to be read")
    caught_up(env)
    assert sorted(e["key"]["id"] for e in read_stream(env.redis, "cdc:ride") if e["op"] == "r") == list(range(1, 21))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def test_a_bridge_started_before_cdc_backfills_existed_serves_the_first_backfill(env):
    """`cdc backfill` creates the table when it is missing: a running bridge that found none serves it."""
    setup(env, rows=20, chunk=50)
    env.cdc("init", check=True)
    env.execute("DROP TABLE cdc_backfills")
    proc = env.start_bridge()
    wait_for(env.slot_active, 30, "the bridge to attach")
    waited = env.cdc("backfill", "--entity", "ride", "--wait", timeout=60)
    assert waited.returncode == 0, waited.stderr
    assert "backfill 1: done, 20 row(s) read" in waited.stdout
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
