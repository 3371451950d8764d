"""A second `cdc run` on a slot another bridge holds: it says so at once, before it binds the
metrics port (exit 75, the slot and who holds it), or, with --standby, waits and takes over
when the slot is free, with every change in the stream once."""

from __future__ import annotations

import signal
import socket

import pytest

from cdc.bridge.slot_holder import SlotHolder, gone
from cdc.demo.local import free_port, wait_for

from conftest import read_stream

pytestmark = [pytest.mark.integration, pytest.mark.one_path]


@pytest.fixture
def rides(env):
    env.init_rides("ride.yaml", riders=2)
    env.write_config(f"http: {{host: 127.0.0.1, port: {free_port()}}}\n")
    return env


def holder(env) -> tuple[int, str]:
    return env.execute("SELECT s.active_pid, r.application_name FROM pg_replication_slots s "
                       "JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE s.slot_name = %s", (env.slot,))[0]


def insert_rides(env, first: int, last: int) -> None:
    env.execute("INSERT INTO rides (id, rider_id, distance_m) SELECT g, 1 + g %% 2, g FROM generate_series(%s::int, %s::int) g",
                (first, last))


def test_a_second_bridge_on_the_slot_says_who_holds_it_before_binding_the_port(rides):
    env = rides
    first = env.start_bridge()
    try:
        wait_for(env.slot_active, 60, "the first bridge to hold the slot")
        walsender, name = holder(env)
        assert name == f"cdc run on {socket.gethostname()} pid {first.pid}"
        second = env.cdc("run", timeout=60)
        assert second.returncode == 75, second.stderr
        assert second.stderr.splitlines()[-1] == (
            f"cdc: error: a bridge is already running on slot {env.slot}, walsender pid {walsender} "
            f"(cdc run on {socket.gethostname()} pid {first.pid}, from 127.0.0.1); stop it first, or start this one "
            "with cdc run --standby to take over when the slot is free; if that bridge is gone, PostgreSQL ends its "
            f"walsender within wal_sender_timeout (or now: SELECT pg_terminate_backend({walsender}))")
        assert "Address already in use" not in second.stderr and "cannot serve metrics" not in second.stderr
        assert holder(env)[0] == walsender and first.poll() is None, "the first bridge streams on"
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0, first.log_path.read_text()


@pytest.mark.slow
def test_a_standby_takes_over_when_the_first_bridge_stops_and_every_change_is_streamed_once(rides):
    env = rides
    first = env.start_bridge()
    wait_for(env.slot_active, 60, "the first bridge to hold the slot")
    walsender, _ = holder(env)
    standby = env.start_bridge("--standby")
    try:
        held = (f"standby: slot {env.slot} is held by walsender pid {walsender} "
                f"(cdc run on {socket.gethostname()} pid {first.pid}, from 127.0.0.1); taking over when it is free")
        wait_for(lambda: held in standby.log_path.read_text(), 60, "the standby to say who holds the slot")
        insert_rides(env, 1, 50)
        wait_for(lambda: env.redis.xlen("cdc:ride") == 50, 60, "the first bridge to stream 50 rides")
        assert standby.poll() is None
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0, first.log_path.read_text()
        insert_rides(env, 51, 120)
        wait_for(lambda: env.redis.xlen("cdc:ride") == 120, 60, "the standby to stream the rest")
        assert holder(env)[1] == f"cdc run on {socket.gethostname()} pid {standby.pid}"
        log = standby.log_path.read_text()
        assert log.count("standby: slot") == 1, "said once"
        assert f"slot {env.slot} is free: the standby takes over" in log
        entries = read_stream(env.redis, "cdc:ride")
        assert [e["key"]["id"] for e in entries] == list(range(1, 121)), "every ride once, in commit order"
        assert {e["op"] for e in entries} == {"c"}
    finally:
        standby.send_signal(signal.SIGTERM)
        assert standby.wait(30) == 0, standby.log_path.read_text()


def test_a_standby_stopped_while_waiting_exits_0(rides):
    env = rides
    first = env.start_bridge()
    try:
        wait_for(env.slot_active, 60, "the first bridge to hold the slot")
        standby = env.start_bridge("--standby")
        wait_for(lambda: "standby: slot" in standby.log_path.read_text(), 60, "the standby to wait")
        standby.send_signal(signal.SIGTERM)
        assert standby.wait(30) == 0, standby.log_path.read_text()
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0


def test_only_a_bridge_of_this_host_whose_process_is_gone_counts_as_gone():
    host = socket.gethostname()
    dead = 2 ** 22 + 12345  # above any pid this machine hands out (pid_max <= 2**22)
    assert gone(SlotHolder(1, f"cdc run on {host} pid {dead}", None), host, 99)
    assert gone(SlotHolder(1, f"cdc run on {host} pid 99", None), host, 99), "an earlier life of this very pid"
    assert not gone(SlotHolder(1, f"cdc run on {host} pid 1", None), host, 99), "pid 1 runs"
    assert not gone(SlotHolder(1, f"cdc run on other-host pid {dead}", None), host, 99)
    assert not gone(SlotHolder(1, "pg_recvlogical", None), host, 99)
    assert not gone(SlotHolder(1, None, None), host, 99)


def test_a_metrics_port_still_held_by_a_closing_bridge_is_bound_once_free(monkeypatch):
    """The standby takes over as soon as the first bridge released the slot, which closes its metrics
    server only after: the standby tries the port again rather than exiting (for up to PORT_WAIT_S)."""
    import threading

    from cdc.bridge import loop
    from cdc.config import Settings
    from cdc.errors import ConfigError

    def blocked_port() -> socket.socket:
        blocker = socket.socket()
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        return blocker

    blocker = blocked_port()
    port = blocker.getsockname()[1]
    bridge = loop.Bridge(Settings.from_dict({"http": {"host": "127.0.0.1", "port": port}}), [])
    closing = threading.Timer(0.5, blocker.close)  # the first bridge's server shutting down
    closing.start()
    server = bridge._serve_metrics()
    closing.join()
    assert server.server_address[1] == port
    server.shutdown()
    server.server_close()

    blocker = blocked_port()  # a port that stays taken: the error, after the wait
    monkeypatch.setattr(loop, "PORT_WAIT_S", 0.3)
    bridge = loop.Bridge(Settings.from_dict({"http": {"host": "127.0.0.1", "port": blocker.getsockname()[1]}}), [])
    with pytest.raises(ConfigError, match="cannot serve metrics on 127.0.0.1:.*Address already in use"):
        bridge._serve_metrics()
    blocker.close()


def test_a_bridge_that_loses_the_race_to_the_slot_exits_75_instead_of_retrying(rides):
    """Two `cdc run` started together both find the slot free; the one whose START_REPLICATION comes
    second is told the slot is active. It never streamed: it stops (exit 75) rather than looping as a
    standby nobody asked for. Here the winner is a plain replication connection taken in that window."""
    import argparse
    import threading

    import psycopg

    from cdc.bridge.loop import Bridge
    from cdc.cli.common import load_config
    from cdc.errors import SlotTaken

    env = rides
    settings, mappings = load_config(argparse.Namespace(config=env.config_path))
    winner = psycopg.connect(env.dsn, replication="database", autocommit=True, application_name="winner")
    try:
        winner.execute(f"START_REPLICATION SLOT {env.slot} LOGICAL 0/0 "
                       f"(proto_version '1', publication_names '{env.publication}')")
        wait_for(env.slot_active, 30, "the winner to hold the slot")
        bridge = Bridge(settings, mappings)
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                bridge.run()
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - what the run ended with is the test's subject
                outcome.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(120)
        if thread.is_alive():
            bridge.stop()
            thread.join(60)
        assert outcome and isinstance(outcome[0], SlotTaken), f"retried instead of stopping: {outcome}"
        assert outcome[0].exit_code == 75 and bridge.failures["postgres"] == 0, "not one retry"
        assert f"another bridge started streaming slot {env.slot} first" in str(outcome[0])
        assert "cdc run --standby" in str(outcome[0])
    finally:
        winner.close()


@pytest.mark.slow
def test_two_bridges_started_together_one_streams_and_the_other_exits_75(rides):
    env = rides
    for round_ in range(5):
        a, b = env.start_bridge(), env.start_bridge()
        try:
            wait_for(lambda: a.poll() is not None or b.poll() is not None, 120, "one of the two to exit")
            loser, winner = (a, b) if a.poll() is not None else (b, a)
            assert loser.wait() == 75, loser.log_path.read_text()
            assert "cdc: error:" in loser.log_path.read_text().splitlines()[-1]
            insert_rides(env, 100 * round_ + 1, 100 * round_ + 10)
            wait_for(lambda: env.redis.xlen("cdc:ride") == 10 * (round_ + 1), 60, "the winner to stream")
            assert winner.poll() is None
        finally:
            for proc in (a, b):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    assert proc.wait(30) == 0, proc.log_path.read_text()


def test_sighup_stops_the_bridge_cleanly_saying_why(rides):
    env = rides
    bridge = env.start_bridge()
    wait_for(env.slot_active, 60, "the bridge to hold the slot")
    insert_rides(env, 1, 5)
    wait_for(lambda: env.redis.xlen("cdc:ride") == 5, 60, "the bridge to stream")
    bridge.send_signal(signal.SIGHUP)
    assert bridge.wait(30) == 0, bridge.log_path.read_text()
    log = bridge.log_path.read_text()
    assert "received SIGHUP" in log and "start cdc run again to apply changes" in log
    assert "bridge stopped entries_published=5" in log
