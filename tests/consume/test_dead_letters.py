"""Dead letters hold exactly the entries the handler failed on, `max_deliveries` times each,
even when a consumer is killed mid-way; entries re-delivered behind a failing one never count;
in exclusive mode nothing overtakes a failing entry."""

from __future__ import annotations

import os
import signal
import threading
from decimal import Decimal
from pathlib import Path

import orjson
import pytest

from cdc import keys
from cdc.consume.consumer import Consumer
from cdc.consume.table_sink import TableSink
from cdc.demo.local import wait_for

from failing_handlers import fails

pytestmark = pytest.mark.integration

RIDES = 1200  # rides 1..1200; the handler fails on the 240 whose id is divisible by 5
FAILING = {i for i in range(1, RIDES + 1) if i % 5 == 0}


@pytest.fixture
def rides(env):
    env.init_rides("ride.yaml", sql=("10_rocket_rides.sql", "20_consumer_state.sql"), config="trim: {interval_s: 0}\n",
                   riders=7)
    env.execute("INSERT INTO rides (id, rider_id, distance_m) SELECT g, 1 + g %% 7, g * 1.125 FROM generate_series(1, %s) g",
                (RIDES,))
    env.cdc("run", "--until-caught-up", check=True)
    assert env.redis.xlen("cdc:ride") == RIDES
    return env


def dead_letters(env, group: str) -> list[dict]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in env.redis.xrange(f"cdc:dlq:{group}")]


def dead_ride_ids(letters: list[dict]) -> list[int]:
    return sorted(orjson.loads(orjson.loads(d["entry"])["key"])["id"] for d in letters)


def settled(env, group: str) -> bool:
    """Every entry delivered to the group, none pending."""
    info = next(g for g in env.redis.xinfo_groups("cdc:ride") if g["name"].decode() == group)
    return info["lag"] == 0 and info["pending"] == 0


def check_dead_letters(env, group: str, max_deliveries: int) -> None:
    letters = dead_letters(env, group)
    assert dead_ride_ids(letters) == sorted(FAILING), "the dead letters are exactly the failing rides, once each"
    assert {d["deliveries"] for d in letters} == {str(max_deliveries)}
    assert all(d["error"].startswith("ValueError: ride ") for d in letters)


@pytest.mark.slow
@pytest.mark.parametrize("max_deliveries", [2, 5])
def test_exclusive_consumer_dead_letters_only_what_the_handler_failed_on(rides, max_deliveries):
    env = rides
    handlers = str(Path(__file__).parent)
    extra = {"PYTHONPATH": os.pathsep.join(filter(None, [handlers, os.environ.get("PYTHONPATH")]))}
    env.execute("CREATE TABLE applied_rides (n bigserial PRIMARY KEY, ride bigint NOT NULL)")
    args = ("--handler", "failing_handlers:logged_totals_except_fives", "--count", "100",
            "--max-deliveries", str(max_deliveries), "--lease-ttl-ms", "1500")
    first = env._start("consumer-first", "consume", "--entity", "ride", "--group", "g", "--start", "0", *args, env=extra)
    wait_for(lambda: env.redis.xlen("cdc:dlq:g") >= 30, 120, "the first consumer to dead-letter some rides")
    first.send_signal(signal.SIGKILL)  # mid-way, with a batch in hand
    first.wait(10)
    second = env._start("consumer-second", "consume", "--entity", "ride", "--group", "g", *args, env=extra)
    try:
        wait_for(lambda: settled(env, "g") and env.redis.xlen("cdc:dlq:g") >= len(FAILING), 180,
                 "the second consumer to finish")
    finally:
        second.terminate()
        assert second.wait(30) == 0, second.log_path.read_text()
    check_dead_letters(env, "g", max_deliveries)
    expected = dict(env.execute(
        "SELECT rider_id, sum(distance_m) FROM rides WHERE id % 5 <> 0 GROUP BY rider_id"))
    expected[0] = sum(expected.values(), Decimal(0))
    state = dict(env.execute("SELECT rider_id, total_distance FROM consumer_states WHERE consumer = 'g'"))
    assert state == expected
    # in stream order (nothing overtook a failing entry), each once, across the kill
    applied = [ride for (ride,) in env.execute("SELECT ride FROM applied_rides ORDER BY n")]
    assert applied == sorted(set(range(1, RIDES + 1)) - FAILING)


@pytest.mark.parametrize("max_deliveries", [2, 5])
def test_shared_consumers_dead_letter_only_what_the_handler_failed_on(rides, max_deliveries):
    env = rides
    client = env.redis
    sinks: list[TableSink] = []

    def failing_sink():
        sink = TableSink(env.dsn, "public.ride_mirror")  # one connection per consumer thread
        sinks.append(sink)

        def handle(entries):
            for e in entries:
                if fails(e):
                    raise ValueError(f"ride {e.key['id']} is divisible by 5")
            sink(entries)
        return handle

    def member(name: str) -> Consumer:
        return Consumer(client, ["cdc:ride"], "m", name, exclusive=False, count=100, claim_idle_ms=300,
                        block_ms=100, max_deliveries=max_deliveries)

    # a consumer that dies mid-way: two batches handled (their failures counted), the next left pending
    dead, handle = member("dead"), failing_sink()
    dead.create_group("0")
    dead.process(dead.read(), handle)
    dead.process(dead.read(), handle)
    in_hand = dead.read()
    assert in_hand and client.xpending("cdc:ride", "m")["pending"] >= len(in_hand)
    stop = threading.Event()
    live = [member("a"), member("b")]
    threads = [threading.Thread(target=c.run, args=(failing_sink(), stop)) for c in live]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: settled(env, "m") and client.xlen("cdc:dlq:m") >= len(FAILING), 120,
                 "the live consumers to finish, the dead one's entries included")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        for sink in sinks:
            sink.close()
    assert sum(c.claimed for c in live) >= len(in_hand), "the dead consumer's entries were taken over"
    check_dead_letters(env, "m", max_deliveries)
    mirrored = {row[0]["id"] for row in env.execute("SELECT key FROM ride_mirror")}
    assert mirrored == set(range(1, RIDES + 1)) - FAILING
    assert client.hlen("{cdc:ride}:failures:m") == 0, "no failure record outlives its entry"


def test_a_server_away_is_no_failure_of_the_entry_but_a_cancelled_query_is(env):
    import psycopg

    client = env.redis
    client.xadd("s", {"op": "c", "key": '{"id": 1}', "lsn": "1", "seq": "0"})
    consumer = Consumer(client, ["s"], "g", "c1", max_deliveries=2, block_ms=10)
    consumer.create_group("0")
    batch = consumer.read()

    def connection_lost(entries):
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    for _ in range(3):  # however often: propagated to the retry loop, never counted
        with pytest.raises(psycopg.OperationalError):
            consumer.process(batch, connection_lost)
        batch = consumer.read()
        assert [e.id for e in batch] == [batch[0].id]
    assert consumer.failed == 0 and client.xlen("cdc:dlq:g") == 0 and client.hlen("{s}:failures:g") == 0

    def cancelled(entries):
        raise psycopg.errors.QueryCanceled("canceling statement due to statement timeout")

    consumer.process(batch, cancelled)
    consumer.process(consumer.read(), cancelled)
    [letter] = dead_letters(env, "g")
    assert letter["deliveries"] == "2" and letter["error"].startswith("QueryCanceled: canceling statement")
    assert client.xpending("s", "g")["pending"] == 0 and client.hlen("{s}:failures:g") == 0


@pytest.mark.parametrize("exclusive", [True, False])
def test_a_consumer_stopped_between_the_last_failure_and_the_dead_letter_is_finished_by_the_next(env, exclusive):
    """The last failure is counted, then the consumer dies before moving the entry to the dead
    letters: whoever reads it next dead-letters it with the recorded count and error, without
    handing it to the handler a time more."""
    client = env.redis
    ids = [client.xadd("s", {"op": "c", "key": f'{{"id": {i}}}', "lsn": "1", "seq": str(i)}) for i in range(3)]
    first = Consumer(client, ["s"], "g", "c1", exclusive=exclusive, max_deliveries=3, block_ms=10)
    first.create_group("0")
    assert [e.id for e in first.read()] == [i.decode() for i in ids]
    for i in ids[:2]:  # as `fail` leaves them when the process dies right after counting
        client.hset("{s}:failures:g", mapping={i: 3, i + b":error": f"ValueError: bad {i.decode()}"})
    later = client.xadd("s", {"op": "c", "key": '{"id": 3}', "lsn": "1", "seq": "3"})
    restarted = Consumer(client, ["s"], "g", "c1", exclusive=exclusive, max_deliveries=3, block_ms=10)
    batch = restarted.read()
    assert [e.id for e in batch] == [ids[2].decode()], "only the entry behind them goes to the handler"
    letters = dead_letters(env, "g")
    assert [(d["source_id"], d["deliveries"], d["error"]) for d in letters] == [
        (i.decode(), "3", f"ValueError: bad {i.decode()}") for i in ids[:2]]
    assert [orjson.loads(d["entry"])["seq"] for d in letters] == ["0", "1"]
    restarted.ack(batch)
    assert [e.id for e in restarted.read()] == [later.decode()]
    assert client.hlen("{s}:failures:g") == 0 and client.xpending("s", "g")["pending"] == 1


def test_a_pending_batch_wholly_dead_lettered_on_reading_lets_the_entries_behind_it_come_next(env):
    client = env.redis
    ids = [client.xadd("s", {"op": "c", "key": f'{{"id": {i}}}', "lsn": "1", "seq": str(i)}) for i in range(3)]
    first = Consumer(client, ["s"], "g", "c1", exclusive=False, count=2, max_deliveries=2, block_ms=10)
    first.create_group("0")
    assert len(first.read()) == 2 and len(first.read()) == 1  # all three pending with c1
    client.hset("{s}:failures:g", mapping={ids[0]: 2, ids[1]: 2})
    restarted = Consumer(client, ["s"], "g", "c1", exclusive=False, count=2, max_deliveries=2, block_ms=10)
    assert restarted.read() == [] and client.xlen("cdc:dlq:g") == 2
    assert [e.id for e in restarted.read()] == [ids[2].decode()], "the pending entry behind, before anything new"


def test_a_shared_consumer_never_counts_or_dead_letters_an_entry_another_one_claimed(env):
    """The race of shared consumers: A is handed an entry, B claims it while A works on it; whatever A does
    with it then (fail it, dead-letter it, finish it) must leave no failure record behind B's outcome."""
    client = env.redis
    for n in range(1, 4):
        client.xadd("s", {"op": "c", "key": f'{{"id": {n}}}', "data": f'{{"id": {n}}}', "lsn": "1", "seq": str(n)})
    a = Consumer(client, ["s"], "g", "a", exclusive=False, max_deliveries=2, block_ms=10, claim_idle_ms=60_000)
    b = Consumer(client, ["s"], "g", "b", exclusive=False, max_deliveries=2, block_ms=10, claim_idle_ms=60_000)
    a.create_group("0")
    first, second, third = a.read()
    failures = keys.failures_key("s", "g")

    # 1. B claims the first entry and finishes it; A's late failure on it is not counted
    client.xclaim("s", "g", "b", 0, [first.id])
    b.ack([first])
    a.fail(first, ValueError("late"))
    assert client.hlen(failures) == 0 and a.failed == 0

    # 2. A fails the second once, B claims it and fails it: B's count reaches the limit and B dead-letters it;
    #    A's late failure (which would reach the limit too) neither counts nor dead-letters it again
    a.fail(second, ValueError("one"))
    client.xclaim("s", "g", "b", 0, [second.id])
    b.fail(second, ValueError("two"))
    assert b.dead_lettered == 1 and client.xlen("cdc:dlq:g") == 1
    assert not a.dead_letter("s", second.id, second, 2, "ValueError: late")
    a.fail(second, ValueError("late"))
    assert client.hlen(failures) == 0 and client.xlen("cdc:dlq:g") == 1 and a.dead_lettered == 0

    # 3. B claims the third and fails it once; A then finishes it: the entry is done, its record goes with it
    client.xclaim("s", "g", "b", 0, [third.id])
    b.fail(third, ValueError("once"))
    assert client.hlen(failures) == 2  # the count and the error
    a.ack([third])
    assert client.hlen(failures) == 0
    assert client.xpending("s", "g")["pending"] == 0


@pytest.fixture
def cluster_client(servers_root):
    from redis.cluster import RedisCluster

    from redis_cluster import three_node_cluster

    with three_node_cluster(servers_root, "dlq") as nodes:
        client = RedisCluster(host="127.0.0.1", port=nodes[0].port)
        letters = client.get_node_from_key("cdc:dlq:g").name
        stream = next(f"s{n}" for n in range(100) if client.get_node_from_key(f"s{n}").name != letters)
        yield client, stream
        client.close()


def test_on_a_cluster_a_crash_between_the_dead_letter_and_the_acknowledgement_leaves_one_letter(cluster_client):
    """The dead-letter stream and the entry's stream are on two nodes: the letter is written, then the entry
    acknowledged. A consumer stopped between the two moves the entry again when it restarts: the letter it wrote
    is reused, never written twice; a letter whose entry another consumer claimed meanwhile is taken back,
    unless that consumer reused it."""
    client, s = cluster_client
    ids = [client.xadd(s, {"op": "c", "key": f'{{"id": {n}}}', "data": "{}", "lsn": "1", "seq": str(n)}).decode()
           for n in range(3)]
    first = Consumer(client, [s], "g", "c1", exclusive=False, max_deliveries=1, block_ms=10)
    first.create_group("0")
    entries = first.read()

    class Stopped(Exception):
        pass

    def stop_here(**kwargs):
        raise Stopped()  # the process dies after the letter, before the acknowledgement

    first._ack_owned_script = stop_here
    with pytest.raises(Stopped):
        first.dead_letter(s, ids[0], entries[0], 1, "ValueError: boom")
    assert client.xlen("cdc:dlq:g") == 1 and client.xpending(s, "g")["pending"] == 3

    restarted = Consumer(client, [s], "g", "c1", exclusive=False, max_deliveries=1, block_ms=10)
    assert restarted.dead_letter(s, ids[0], entries[0], 1, "ValueError: boom")
    assert client.xlen("cdc:dlq:g") == 1, "the letter was written twice"
    assert client.xpending(s, "g")["pending"] == 2
    assert not client.exists(keys.dead_letter_index_key("g")), "the index keeps only moves under way"

    # another consumer claims the second entry between A's letter and A's acknowledgement, and finishes it:
    # A takes its letter back
    other = Consumer(client, [s], "g", "c2", exclusive=False, max_deliveries=1, block_ms=10)
    original = restarted._ack_owned_script

    def claimed_meanwhile(**kwargs):
        client.xclaim(s, "g", "c2", 0, [ids[1]])
        return original(**kwargs)

    restarted._ack_owned_script = claimed_meanwhile
    assert not restarted.dead_letter(s, ids[1], entries[1], 1, "ValueError: late")
    assert client.xlen("cdc:dlq:g") == 1
    other.ack([entries[1]])

    # ... or dead-letters it too, reusing A's letter: A leaves it
    def claimed_and_moved(**kwargs):
        client.xclaim(s, "g", "c2", 0, [ids[2]])
        assert other.dead_letter(s, ids[2], entries[2], 1, "ValueError: both")
        return original(**kwargs)

    restarted._ack_owned_script = claimed_and_moved
    assert not restarted.dead_letter(s, ids[2], entries[2], 1, "ValueError: both")
    letters = client.xrange("cdc:dlq:g")
    assert len(letters) == 2 and [f[b"source_id"].decode() for _, f in letters] == [ids[0], ids[2]]
    assert client.xpending(s, "g")["pending"] == 0
