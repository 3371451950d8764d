"""`cdc recover`: after Redis really lost a range of entries, the streams replay to the tables again,
rows deleted inside the lost range included, and consumers that reset at the marker end exact."""

from __future__ import annotations

import random
import signal
from decimal import Decimal

import orjson
import pytest
import redis

from cdc.demo.local import LocalRedis, free_port, wait_for
from conftest import read_stream
from replay import replay, ride_rows
from ride_consumers import state, truth

pytestmark = pytest.mark.integration


def mirror(env) -> dict:
    return {k["id"]: d for k, d in env.execute("SELECT key, data FROM ride_mirror WHERE NOT deleted")}


def consumers_exact(env) -> bool:
    expected = {k: v for k, v in truth(env).items() if v != 0}
    return state(env, "totals") == expected and mirror(env) == ride_rows(env)


@pytest.fixture
def volatile(env, servers_root):
    """A Redis that keeps only what an explicit SAVE wrote: a restart brings back that older RDB."""
    server = LocalRedis(servers_root / f"rdb-redis-{env.dbname}", appendonly=False)
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("accepted_first", [False, True], ids=["after-detection", "after-cdc-init-accepted-it"])
def test_recover_after_a_real_loss_replays_to_the_table_and_resets_consumers(env, volatile, accepted_first):
    env.apply_sql("10_rocket_rides.sql", "20_consumer_state.sql")
    env.copy_mappings("ride.yaml")
    env.write_config(redis_url=volatile.url)
    env.cdc("init", check=True)
    env.execute("INSERT INTO riders (id, name, email) SELECT g, 'r' || g, 'e' FROM generate_series(1, 5) g")
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1 + g % 5, g * 1.5 FROM generate_series(1, 300) g")
    env.cdc("run", "--until-caught-up", check=True)
    totals = env.start_consumer("totals")
    sink = env._start("mirror", "consume", "--entity", "ride", "--group", "mirror", "--start", "0",
                      "--sink", "public.ride_mirror", env=None)
    wait_for(lambda: consumers_exact(env), 60, "the consumers to reach the table")
    client = redis.Redis.from_url(volatile.url)
    assert client.save()  # the RDB Redis will come back with

    # the range Redis will lose: deletes, updates and inserts (some inserted and deleted inside it)
    env.execute("DELETE FROM rides WHERE id % 10 = 3")  # 30 rows the restored stream still holds
    env.execute("UPDATE rides SET distance_m = distance_m + 1000, rider_id = 1 + (rider_id % 5) WHERE id % 10 = 5")
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1 + g % 5, g FROM generate_series(1, 50) g")
    env.execute("DELETE FROM rides WHERE id > 340")  # 10 rows born and gone inside the range
    env.cdc("run", "--until-caught-up", check=True)
    wait_for(lambda: consumers_exact(env), 60, "the consumers to apply the range before it is lost")
    lost_len = client.xlen("cdc:ride")
    client.close()

    volatile.restart()  # back from the older RDB: the range is gone from the streams
    client = redis.Redis.from_url(volatile.url)
    assert client.xlen("cdc:ride") == 300 < lost_len
    result = env.cdc("run", "--until-caught-up")
    assert result.returncode == 6 and "redis lost entries" in result.stderr
    # committed after the loss, before the recovery: streamed by the bridge, or held by the snapshot
    # (301 was inserted inside the lost range: its delete is held by the snapshot, no stream entry names it)
    env.execute("DELETE FROM rides WHERE id IN (1, 2, 301)")
    env.execute("UPDATE rides SET distance_m = 7 WHERE id = 4")
    if accepted_first:
        assert "accepted the loss" in env.cdc("init", check=True).stdout

    result = env.cdc("recover")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    if not accepted_first:
        assert "redis lost the entries of transactions committed in (" in out
    gone = {i for (i,) in env.execute("SELECT g FROM generate_series(1, 300) g WHERE g NOT IN (SELECT id FROM rides)")}
    assert len(gone) == 32
    rows_now = env.execute("SELECT count(*) FROM rides")[0][0]
    assert f"ride: rebuilt 1 stream(s): 32 deleted keys (d), the marker (x), {rows_now} rows (r)" in out
    assert out.strip().endswith("start the bridge (cdc run)")
    assert orjson.loads(env.cdc("status", "--json", check=True).stdout)["bridge"]["data_loss"] is None

    # after the recovery: the bridge resumes, and new changes follow the rebuilt stream
    env.execute("DELETE FROM rides WHERE id IN (5, 6)")
    env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (2, 12.5)")
    env.cdc("run", "--until-caught-up", check=True)
    entries = read_stream(client, "cdc:ride")
    rebuilt = entries[300:]
    deletes = [e for e in rebuilt if e["op"] == "d"][:32]
    assert {e["key"]["id"] for e in deletes} == gone
    assert all(e["before"]["id"] == e["key"]["id"] for e in deletes)  # the record the stream last told
    assert [e["op"] for e in rebuilt[32:33 + rows_now]] == ["x"] + ["r"] * rows_now
    # every change exactly once: positions strictly increase along the stream
    positions = [(int(e["lsn"]), int(e["seq"])) for e in entries]
    assert positions == sorted(set(positions))
    assert replay(entries, reset_at_marker=False) == ride_rows(env)
    assert replay(entries, reset_at_marker=True) == ride_rows(env)

    # the consumers kept state from the lost range; the marker resets it exactly
    wait_for(lambda: consumers_exact(env), 60, "the consumers to be exact after the recovery")
    for proc in (totals, sink):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    client.close()
    assert sum(truth(env).values()) > Decimal(0)


def test_recover_refuses_while_a_bridge_is_attached(env):
    env.init_rides("ride.yaml", riders=1)
    env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, 1), (1, 2)")
    bridge = env.start_bridge()
    wait_for(lambda: env.redis.xlen("cdc:ride") == 2 and env.slot_active(), 30, "the bridge to stream")
    flushed = env.redis.get(f"cdc:bridge:{env.slot}:flushed")
    ids = [entry_id for entry_id, _ in env.redis.xrange("cdc:ride")]
    walsender = env.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (env.slot,))[0][0]
    result = env.cdc("recover")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"cdc: error: a bridge is attached to slot '{env.slot}' (walsender pid {walsender}); "
        "stop it (cdc run), then run cdc recover again")
    # recover refused before touching Redis: the streams are as they were and the flushed record was not reset
    # (the running bridge itself may move it forward, e.g. past a WAL record it acknowledges while idle)
    assert [entry_id for entry_id, _ in env.redis.xrange("cdc:ride")] == ids
    assert int(env.redis.get(f"cdc:bridge:{env.slot}:flushed")) >= int(flushed) > 0
    bridge.send_signal(signal.SIGTERM)
    assert bridge.wait(30) == 0


def test_recover_without_a_slot_says_to_run_init(env):
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml")
    result = env.cdc("recover")
    assert result.returncode == 4
    assert result.stderr.strip() == (f"cdc: error: replication slot '{env.slot}' does not exist; "
                                     "run: cdc init --config <file>, then cdc recover")


def test_recover_after_the_slot_was_dropped_and_created_again(env):
    """Changes committed while no slot existed never reach a stream; init, then recover, repairs them."""
    env.init_rides("ride.yaml", riders=2)
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1 + g % 2, g FROM generate_series(1, 100) g")
    env.cdc("run", "--until-caught-up", check=True)
    env.execute("SELECT pg_drop_replication_slot(%s)", (env.slot,))  # as after an invalidated slot
    env.execute("DELETE FROM rides WHERE id % 10 = 0")
    env.execute("UPDATE rides SET distance_m = 0.5 WHERE id % 10 = 1")
    env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, 3), (2, 4)")
    env.cdc("init", check=True)
    result = env.cdc("recover")
    assert result.returncode == 0, result.stderr
    assert "ride: rebuilt 1 stream(s): 10 deleted keys (d), the marker (x), 92 rows (r)" in result.stdout
    env.execute("DELETE FROM rides WHERE id = 2")
    env.cdc("run", "--until-caught-up", check=True)
    entries = read_stream(env.redis, "cdc:ride")
    assert replay(entries, reset_at_marker=False) == replay(entries, reset_at_marker=True) == ride_rows(env)


def test_a_partitioned_entity_is_rebuilt_at_one_position_and_a_table_sink_ends_exact_in_any_order(env):
    env.apply_sql("10_rocket_rides.sql")
    env.write_mapping("ride.yaml", "entity: ride\ntable: public.rides\nkey: [id]\npartitions: {count: 2, by: [id]}\n"
                                   "fields: {id: id, distance: distance_m, rider: rider_id}\n")
    env.cdc("init", check=True)
    env.execute("INSERT INTO riders (id, name, email) VALUES (1, 'a', 'b')")
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1, g FROM generate_series(1, 200) g")
    env.cdc("run", "--until-caught-up", check=True)
    env.execute("SELECT pg_drop_replication_slot(%s)", (env.slot,))
    env.execute("DELETE FROM rides WHERE id % 7 = 0")
    env.execute("UPDATE rides SET distance_m = 1.25 WHERE id % 7 = 1")
    env.cdc("init", check=True)
    result = env.cdc("recover")
    assert result.returncode == 0, result.stderr
    assert "ride: rebuilt 2 stream(s): 28 deleted keys (d), the marker (x), 172 rows (r)" in result.stdout
    streams = [read_stream(env.redis, f"cdc:ride:{p}") for p in (0, 1)]
    markers = [[(e["lsn"], e["seq"]) for e in s if e["op"] == "x"] for s in streams]
    assert len(markers[0]) == 1 and markers[0] == markers[1]

    from cdc.consume.replay import read_range
    from cdc.consume.table_sink import TableSink

    entries = [e for p in (0, 1) for e in read_range(env.redis, f"cdc:ride:{p}")]
    rng = random.Random(5)
    sink = TableSink(env.dsn, "public.ride_mirror")
    try:
        for _ in range(3):  # redelivered, in any order, in batches of any size
            rng.shuffle(entries)
            for start in range(0, len(entries), 37):
                sink(entries[start:start + 37])
    finally:
        sink.close()
    assert mirror(env) == ride_rows(env)


@pytest.mark.slow
def test_a_recovery_killed_midway_keeps_the_bridge_out_and_completes_when_run_again(env):
    env.init_rides("ride.yaml", riders=1)
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1, g FROM generate_series(1, 60000) g")
    env.cdc("run", "--until-caught-up", check=True)
    env.execute("SELECT pg_drop_replication_slot(%s)", (env.slot,))
    env.execute("DELETE FROM rides WHERE id % 10 = 0")  # 6000 rows the stream still holds
    env.cdc("init", check=True)
    client = env.redis
    recovering = env._start("recover", "recover", env=None)
    # the 6000 deletes and the marker are in, and some of the rows
    wait_for(lambda: client.xlen("cdc:ride") > 60000 + 6001 + 4000, 120, "the rebuild to be under way", interval=0.01)
    assert recovering.poll() is None, "the rebuild ended before it could be killed: give the table more rows"
    recovering.send_signal(signal.SIGKILL)
    recovering.wait(30)
    partial = client.xlen("cdc:ride")
    assert partial < 60000 + 6001 + 54000

    result = env.cdc("run", "--until-caught-up")  # a bridge cannot write into a half-rebuilt stream
    assert result.returncode == 6 and "redis lost entries: it holds changes up to 0/0" in result.stderr
    assert client.xlen("cdc:ride") == partial

    result = env.cdc("recover")
    assert result.returncode == 0, result.stderr
    assert "ride: rebuilt 1 stream(s): 0 deleted keys (d), the marker (x), 54000 rows (r)" in result.stdout
    env.execute("DELETE FROM rides WHERE id = 1")
    env.cdc("run", "--until-caught-up", check=True)
    entries = read_stream(client, "cdc:ride")
    positions = [(int(e["lsn"]), int(e["seq"])) for e in entries]
    assert positions == sorted(set(positions))
    assert replay(entries, reset_at_marker=False) == replay(entries, reset_at_marker=True) == ride_rows(env)


def test_recover_with_redis_away_is_one_line_without_the_password(env):
    env.init_rides("ride.yaml")
    secret = "s3cret-Redis-pw"
    env.write_config(redis_url=f"redis://cdc:{secret}@127.0.0.1:{free_port()}/0")
    result = env.cdc("recover")
    assert result.returncode == 75
    assert result.stderr.startswith("cdc: error: redis unavailable") and result.stderr.count("\n") == 1
    assert secret not in result.stdout + result.stderr and "Traceback" not in result.stderr


def test_a_bridge_writing_during_the_rebuild_fails_it_and_a_second_run_completes_it(env):
    from cdc.cli.common import load_config
    from cdc.errors import CdcError
    from cdc.ops.recover import recover

    env.init_rides("ride.yaml", riders=1)
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1, g FROM generate_series(1, 50) g")
    env.cdc("run", "--until-caught-up", check=True)
    env.execute("SELECT pg_drop_replication_slot(%s)", (env.slot,))
    env.execute("DELETE FROM rides WHERE id <= 5")
    env.cdc("init", check=True)
    settings, mappings = load_config(type("Args", (), {"config": str(env.config_path)})())
    flushed = f"cdc:bridge:{env.slot}:flushed"

    def say(line: str) -> None:  # what a bridge's first append does to the record, mid-rebuild
        if line.startswith("cdc:ride: read"):
            env.redis.set(flushed, 12345)

    with pytest.raises(CdcError, match="a bridge wrote to redis during the rebuild; stop every bridge"):
        recover(settings, mappings, say)
    assert env.redis.get(flushed) == b"12345"  # the record is left for the bridge's own check
    result = env.cdc("recover")
    assert result.returncode == 0, result.stderr
    assert "ride: rebuilt 1 stream(s): 0 deleted keys (d), the marker (x), 45 rows (r)" in result.stdout
    env.cdc("run", "--until-caught-up", check=True)
    entries = read_stream(env.redis, "cdc:ride")
    assert replay(entries, reset_at_marker=False) == replay(entries, reset_at_marker=True) == ride_rows(env)
