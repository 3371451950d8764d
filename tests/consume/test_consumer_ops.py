"""Dead letters, replay and time travel, leases, idempotent sinks, the consumer status view."""

from __future__ import annotations

import threading
import time
from decimal import Decimal

import orjson
import pytest

from cdc.consume.checkpoint import TransactionalHandler
from cdc.consume.consumer import Consumer
from cdc.demo.local import wait_for
from cdc.demo.rocketrides import ride_totals
from cdc.consume.table_sink import TableSink
from cdc.config import Settings
from cdc.mapping.model import load_mappings
from cdc.ops.status import collect

pytestmark = pytest.mark.integration


@pytest.fixture
def rides(env):
    return env.init_rides("ride.yaml", sql=("10_rocket_rides.sql", "20_consumer_state.sql"), config="trim: {interval_s: 0}\n", riders=3)


def publish(env, rows: list[tuple[int, str]]) -> None:
    with env.connect() as conn:
        for rider, distance in rows:
            conn.execute("INSERT INTO rides (rider_id, distance_m) VALUES (%s, %s)", (rider, Decimal(distance)))
    env.cdc("run", "--until-caught-up", check=True)


def drain(consumer: Consumer, handle, until, timeout: float = 30) -> None:
    def step():
        entries = consumer.read()
        if entries:
            consumer.process(entries, handle)
        return until()
    wait_for(step, timeout, "the consumer to drain", interval=0)


def totals(env, consumer: str) -> dict:
    return dict(env.execute("SELECT rider_id, total_distance FROM consumer_states WHERE consumer = %s", (consumer,)))


def test_poison_entry_goes_to_dead_letters_and_replays_exactly_once(rides):
    publish(rides, [(1, "1.5"), (2, "2.5"), (1, "4")])
    client = rides.redis
    consumer = Consumer(client, ["cdc:ride"], "audit", "c1", max_deliveries=3, lease_ttl_ms=2000)
    consumer.create_group("0")
    poison = {"on": True}

    def apply(conn, entries, name):
        for e in entries:
            if poison["on"] and e.data["distance"] == "2.500":
                raise ValueError("cannot handle 2.5")
        ride_totals(conn, entries, name)

    handler = TransactionalHandler(rides.dsn, "audit", apply, epoch_of=consumer.epoch)
    other_handler = None
    try:
        check_dead_letters(rides, client, consumer, handler, poison)
        # another group never applies a replay meant for audit
        other = Consumer(client, ["cdc:ride"], "other", "o1")
        other.create_group("0")
        other_handler = TransactionalHandler(rides.dsn, "other", ride_totals, epoch_of=other.epoch)
        drain(other, other_handler, lambda: other.acked == 4)
        assert totals(rides, "other")[0] == Decimal("8.0")
    finally:
        handler.close()
        if other_handler is not None:
            other_handler.close()


def check_dead_letters(rides, client, consumer, handler, poison) -> None:
    drain(consumer, handler, lambda: consumer.dead_lettered == 1)
    drain(consumer, handler, lambda: totals(rides, "audit").get(0) == Decimal("5.5"))
    assert totals(rides, "audit") == {0: Decimal("5.5"), 1: Decimal("5.5")}
    assert client.xpending("cdc:ride", "audit")["pending"] == 0

    listed = rides.cdc("dlq", "list", "--group", "audit", check=True).stdout
    assert "deliveries=3" in listed and "ValueError: cannot handle 2.5" in listed
    dlq_id = listed.split()[0]
    shown = orjson.loads(rides.cdc("dlq", "show", dlq_id, "--group", "audit", check=True).stdout)
    assert orjson.loads(shown["entry"]["data"]) == {"id": 2, "distance": "2.500", "rider": 2}

    # fixed: replay it; it is applied once, even when delivered again
    poison["on"] = False
    assert "replayed into cdc:ride" in rides.cdc("dlq", "replay", "--group", "audit", check=True).stdout
    drain(consumer, handler, lambda: totals(rides, "audit").get(0) == Decimal("8.0"))
    rides.redis.xgroup_setid("cdc:ride", "audit", "0")  # everything delivered once more
    drain(consumer, handler, lambda: handler.skipped >= 4)
    assert totals(rides, "audit") == {0: Decimal("8.0"), 1: Decimal("5.5"), 2: Decimal("2.5")}
    assert "0 dead letter(s)" in rides.cdc("dlq", "list", "--group", "audit", check=True).stdout


def test_replay_from_a_time_and_read_a_time_range(rides):
    publish(rides, [(1, "1")])
    time.sleep(0.01)  # stream IDs are milliseconds: make the boundary fall between entries
    middle = int(time.time() * 1000)
    time.sleep(0.01)
    publish(rides, [(2, "2"), (3, "3")])
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(middle / 1000)) + f".{middle % 1000:03d}Z"
    out = rides.cdc("replay", "--entity", "ride", "--group", "late", "--from", iso, check=True).stdout
    assert f"group late on cdc:ride: created at {middle}-0" in out
    client = rides.redis
    got = client.xreadgroup("late", "x", {"cdc:ride": ">"})[0][1]
    assert [orjson.loads(f[b"data"])["rider"] for _, f in got] == [2, 3]
    assert "reset to 0" in rides.cdc("replay", "--entity", "ride", "--group", "late", "--from", "0", check=True).stdout
    assert len(client.xreadgroup("late", "x", {"cdc:ride": ">"})[0][1]) == 3

    lines = rides.cdc("read", "--entity", "ride", "--to", iso, check=True).stdout.splitlines()
    assert [orjson.loads(line)["data"]["rider"] for line in lines] == [1]
    lines = rides.cdc("read", "--entity", "ride", "--from", iso, check=True).stdout.splitlines()
    assert [orjson.loads(line)["data"]["rider"] for line in lines] == [2, 3]
    assert "not '$', '0', a stream ID or an ISO-8601 time" in rides.cdc("read", "--entity", "ride", "--from", "yesterday").stderr


def test_leases_give_each_partition_to_one_consumer_and_fail_over(env):
    client = env.redis
    streams = [f"p{i}" for i in range(4)]
    for s in streams:
        client.xadd(s, {"op": "c", "key": "{}", "lsn": "1", "seq": "0"})
    a = Consumer(client, streams, "g", "a", lease_ttl_ms=600, block_ms=50)
    b = Consumer(client, streams, "g", "b", lease_ttl_ms=600, block_ms=50)
    a.create_group("0")
    stop_a, stop_b = threading.Event(), threading.Event()
    overlaps = []

    def watch():
        while not stop_b.is_set():
            both = set(a.active_streams) & set(b.active_streams)
            if both:
                overlaps.append(both)
            time.sleep(0.01)

    threads = [threading.Thread(target=a.run, args=(lambda e: None, stop_a)),
               threading.Thread(target=b.run, args=(lambda e: None, stop_b)),
               threading.Thread(target=watch)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: sorted(a.active_streams + b.active_streams) == streams, 10, "all partitions owned")
        stop_a.set()  # a stops (its leases are released) : b takes everything
        wait_for(lambda: b.active_streams == streams, 10, "b to take over every partition")
        wait_for(lambda: a.acked + b.acked == 4, 10, "every entry handled once")
    finally:
        stop_a.set()
        stop_b.set()
        for t in threads:
            t.join(10)
    assert not overlaps, f"two consumers owned {overlaps[0]} at once"


def test_idempotent_sink_is_safe_to_reapply_in_any_order(rides):
    rides.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (1, 1, 1), (2, 2, 2)")
    rides.execute("UPDATE rides SET distance_m = 10 WHERE id = 1")
    rides.execute("DELETE FROM rides WHERE id = 2")
    rides.cdc("run", "--until-caught-up", check=True)
    client = rides.redis
    from cdc.consume.replay import read_range

    entries = list(read_range(client, "cdc:ride"))
    sink = TableSink(rides.dsn, "public.ride_mirror")
    try:
        sink(entries)
        sink(list(reversed(entries)))  # redelivered, and out of order
        sink(entries[:2])              # an old insert again
    finally:
        sink.close()
    rows = rides.execute("SELECT key, data, deleted FROM ride_mirror ORDER BY key->>'id'")
    assert rows == [({"id": 1}, {"id": 1, "distance": "10.000", "rider": 1}, False), ({"id": 2}, None, True)]


def test_status_shows_the_consumer_view(rides):
    publish(rides, [(1, "1"), (2, "2"), (3, "3")])
    client = rides.redis
    client.xgroup_create("cdc:ride", "slow", id="0")
    client.xreadgroup("slow", "s1", {"cdc:ride": ">"}, count=1)
    status = orjson.loads(rides.cdc("status", "--json", check=True).stdout)
    (stream,) = status["streams"]
    (group,) = stream["groups"]
    assert group["group"] == "slow" and group["lag"] == 2 and group["pending"] == 1
    assert group["consumers"][0]["name"] == "s1" and group["oldest_pending_idle_ms"] >= 0
    assert stream["first_time"].endswith("Z") and stream["length"] == 3
    text = rides.cdc("status", check=True).stdout
    rows = [line.split() for line in text.splitlines()]
    assert ["cdc:ride", "slow", "2", "1"] in [r[:4] for r in rows]  # stream, group, lag, pending
    assert ["cdc:ride", "slow", "s1", "1"] in [r[:4] for r in rows]  # stream, group, consumer, pending
    assert status["stale_consumers"] == [] and "STALE" not in text
    # a consumer that stopped reading long ago is listed as stale; one that reads is not
    wait_for(lambda: client.xinfo_consumers("cdc:ride", "slow")[0]["idle"] >= 1500, 10, "s1 to be idle 1.5s")
    client.xreadgroup("slow", "s2", {"cdc:ride": ">"}, count=1)
    settings = Settings.from_file(rides.config_path)
    status = collect(settings, load_mappings(settings.mappings), stale_after_s=1)  # in-process: s2 read just now
    assert [(c["consumer"], c["pending"]) for c in status["stale_consumers"]] == [("s1", 1)]
    assert status["stale_consumers"][0]["idle_ms"] >= 1500
    text = rides.cdc("status", "--stale-after-s", "1", check=True).stdout
    (s1_row,) = [line for line in text.splitlines() if line.split()[:3] == ["cdc:ride", "slow", "s1"]]
    assert "STALE" in s1_row
    assert orjson.loads(rides.cdc("status", "--json", "--stale-after-s", "1", check=True).stdout)["stale_consumers"][0]["consumer"] == "s1"
    # trimming keeps what the slow group still needs
    out = rides.cdc("trim", check=True).stdout
    assert "cdc:ride: trimmed 0" in out
    client.xack("cdc:ride", "slow", *[i for i, _ in client.xrange("cdc:ride", count=2)])
    assert "cdc:ride: trimmed 2" in rides.cdc("trim", check=True).stdout


def test_the_running_bridge_trims_what_every_group_consumed(rides):
    rides.write_config("trim: {interval_s: 0.3}\n")
    client = rides.redis
    client.xgroup_create("cdc:ride", "g", id="0", mkstream=True)
    proc = rides.start_bridge()
    with rides.connect() as conn:
        for i in range(5):
            conn.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, %s)", (i,))
    wait_for(lambda: client.xlen("cdc:ride") == 5, 30, "five entries")
    got = client.xreadgroup("g", "c", {"cdc:ride": ">"}, count=3)[0][1]
    client.xack("cdc:ride", "g", *[i for i, _ in got])
    wait_for(lambda: client.xlen("cdc:ride") == 2, 30, "the bridge to trim the three consumed entries")
    assert client.hget("cdc:stats:trim", "cdc:ride:trimmed") == b"3"
    proc.terminate()
    assert proc.wait(30) == 0


def test_cdc_consume_rides_out_a_redis_restart(rides):
    publish(rides, [(1, "1"), (2, "2")])
    proc = rides.start_consumer("totals")
    try:
        wait_for(lambda: totals(rides, "totals").get(0) == Decimal("3.000"), 30, "the first total")
        rides.redis_server.restart()
        publish(rides, [(3, "4")])
        wait_for(lambda: totals(rides, "totals").get(0) == Decimal("7.000"), 60, "the total after redis restarted")
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, proc.log_path.read_text()
    assert "transient failure, retrying" in proc.log_path.read_text()


def test_a_group_named_like_another_groups_lease_epoch_is_refused(env):
    """Group g:epoch's lease key would be group g's epoch counter: refused, one line, exit 2, before any key."""
    env.init_rides("ride.yaml")
    result = env.cdc("consume", "--entity", "ride", "--group", "totals:epoch", "--start", "0",
                     "--handler", "cdc.demo.rocketrides:ride_totals")
    assert result.returncode == 2, result.stderr
    assert "ends with :epoch" in result.stderr and "Traceback" not in result.stderr
    assert not env.redis.keys("*totals*")
    with pytest.raises(ValueError, match="lease epoch counter of group 'totals'"):
        Consumer(env.redis, ["cdc:ride"], "totals:epoch", "c1")
