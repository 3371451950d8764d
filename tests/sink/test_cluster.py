"""Redis Cluster: each stream and its high-water mark share a hash slot, batches go to the
owning node, and a replay after a crash still appends nothing twice."""

from __future__ import annotations

import signal
import socket
import time

import pytest
from redis.cluster import RedisCluster

from cdc import keys
from cdc.demo.local import wait_for
from redis_cluster import three_node_cluster

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(servers_root):
    with three_node_cluster(servers_root) as nodes:
        yield nodes


def test_a_node_whose_port_was_taken_meanwhile_starts_on_another(servers_root, monkeypatch):
    """Between the check that a port is free and the server's start, another process can take it: the
    server exits at once (not after the 30 s wait for it), its log says why, and the cluster's helper
    starts the node on another port."""
    import redis_cluster

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", redis_cluster.cluster_port()))
        taken.listen()
        port = taken.getsockname()[1]
        ports = iter([port, redis_cluster.cluster_port()])
        monkeypatch.setattr(redis_cluster, "cluster_port", lambda: next(ports))
        started = time.monotonic()
        node = redis_cluster._start_node(servers_root, "taken")
        try:
            assert node.port != port and node.ready()
            assert time.monotonic() - started < 20
        finally:
            node.stop()


def test_bridge_publishes_exactly_once_across_a_three_node_cluster(env, cluster):
    env.write_mapping("ride.yaml", "entity: ride\ntable: public.rides\nkey: [id]\npartitions: {count: 6}\n"
                                   "fields: {id: id, distance: distance_m, rider: rider_id}\n")
    env.write_config(redis_url=f"redis://127.0.0.1:{cluster[0].port}/0", redis=", cluster: true")
    env.init_rides(riders=1)
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1, g FROM generate_series(1, 3000) g")
    proc = env.start_bridge()
    time.sleep(0.3)  # a crash instant during the first batches, not a wait for a condition
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    env.wait_slot_inactive()
    env.cdc("run", "--until-caught-up", check=True)
    env.cdc("run", "--until-caught-up", check=True)

    client = RedisCluster(host="127.0.0.1", port=cluster[0].port)
    streams = [f"cdc:ride:{p}" for p in range(6)]
    owners = {client.get_node_from_key(s).name for s in streams}
    assert len(owners) >= 2, "the partitions should spread over several nodes"
    ids = []
    for s in streams:
        assert client.keyslot(keys.mark_key(s)) == client.keyslot(s)
        entries = client.xrange(s)
        positions = [(int(f[b"lsn"]), int(f[b"seq"])) for _, f in entries]
        assert positions == sorted(positions) and len(set(positions)) == len(positions)
        ids += [int(f[b"key"][6:-1]) for _, f in entries]
    assert sorted(ids) == list(range(1, 3001)), "every ride exactly once"
    status = env.cdc("status", "--json", check=True)
    assert '"length": ' in status.stdout
    env.cdc("trim", check=True)

    # a consumer of every partition, on the cluster, totals the rides exactly
    env.apply_sql("20_consumer_state.sql")
    consumer = env.start_consumer("totals")
    try:
        wait_for(lambda: env.execute("SELECT total_distance FROM consumer_states WHERE rider_id = 0") == [(4501500,)],
                 60, "the consumer to total every ride")
    finally:
        consumer.terminate()
        assert consumer.wait(30) == 0, consumer.log_path.read_text()
    client.close()


@pytest.mark.parametrize("mode", ["transaction", "script"])
def test_a_failed_stream_moves_neither_its_mark_nor_the_flushed_record_on_a_cluster(cluster, mode):
    """One lane per stream: a refused stream appends nothing and keeps its mark; the flushed record, written after
    every lane confirmed, stays where it was; the other streams' marks move only with their entries."""
    from cdc.errors import DataLossError, PublishError
    from cdc.sink.publisher import Publisher, StreamBatch, position

    def batch(stream, positions):
        b = StreamBatch(stream)
        for lsn, seq in positions:
            b.add(position(lsn, seq), [b"op", b"c", b"lsn", str(lsn), b"seq", seq])
        return b

    client = RedisCluster(host="127.0.0.1", port=cluster[0].port)
    owners: dict[str, str] = {}
    for i in range(50):  # three streams on three nodes
        stream = f"cdc:s{i}"
        owners.setdefault(client.get_node_from_key(stream).name, stream)
    a, b, c = sorted(owners.values())[:3]
    flushed = "cdc:bridge:slot:flushed"
    url = f"redis://127.0.0.1:{cluster[0].port}/0"
    pub = Publisher(url, cluster=True, append=mode, flushed_key=flushed, entities={c: "ride"})

    def held(stream):
        return [(int(f[b"lsn"]), int(f[b"seq"])) for _, f in client.xrange(stream)] if client.type(stream) == b"stream" \
            else client.type(stream)

    try:
        pub.send([batch(a, [(100, 0)]), batch(b, [(100, 1)])], flushed=150)
        pub.confirm()
        client.set(c, "not a stream")
        with pytest.raises(PublishError) as caught:
            pub.send([batch(a, [(200, 0)]), batch(b, [(200, 1)]), batch(c, [(200, 2)])], flushed=250)
            pub.confirm()
        assert type(caught.value) is PublishError and f"redis key {c} holds a string, not a stream, stream of entity ride" \
            in str(caught.value)
        assert client.get(flushed) == b"150" and client.get(keys.mark_key(c)) is None
        for stream in (a, b):  # each mark is the position of its stream's last entry
            assert client.get(keys.mark_key(stream)) == position(*held(stream)[-1]).encode()
        client.delete(c)
        assert pub.publish([batch(a, [(200, 0)]), batch(b, [(200, 1)]), batch(c, [(200, 2)])]) >= 1
        client.delete(b)  # a vanished stream, on its own node
        with pytest.raises(DataLossError, match=f"stream {b} .* is gone from redis"):
            pub.send([batch(a, [(300, 0)]), batch(b, [(300, 1)])], flushed=350)
            pub.confirm()
        assert not client.exists(b) and int(client.get(flushed)) < 350
    finally:
        pub.close()
        client.close()


@pytest.mark.one_path  # the claims of several bridges; kill -9 recovery runs on both paths in the first test
@pytest.mark.slow
def test_two_bridges_on_disjoint_tables_stay_exact_through_kill_9_on_a_cluster(env, cluster, tmp_path):
    from several_bridges import assert_exact, ride_and_rider_bridges, run_two_bridges

    url = f"redis://127.0.0.1:{cluster[0].port}/0"
    a, b = ride_and_rider_bridges(env, tmp_path / "b", redis_url=url, redis=", cluster: true")
    try:
        workload = run_two_bridges(a, b, rounds=10, seed=5, transactions=1000)
    finally:
        b.close()
    client = RedisCluster(host="127.0.0.1", port=cluster[0].port)
    try:
        assert client.keyslot(keys.BRIDGE_SLOTS) == client.keyslot(keys.STREAM_OWNERS), "one script claims both"
        assert {k.decode(): v.decode() for k, v in client.hgetall(keys.STREAM_OWNERS).items()} == {
            "cdc:ride": a.slot, "cdc:rider": b.slot}
        assert_exact(client, workload)
    finally:
        client.close()


@pytest.mark.parametrize("mode", ["transaction", "script"])
def test_the_transactions_stream_is_appended_only_after_every_other_lane_on_a_cluster(cluster, mode):
    """A transaction's END record (in a stream of its own lane) goes to Redis only once every other stream of the
    send confirmed its entries: a refused stream leaves no END naming its entries."""
    from cdc.errors import PublishError
    from cdc.sink.publisher import Publisher, StreamBatch, position

    def batch(stream, positions):
        b = StreamBatch(stream)
        for lsn, seq in positions:
            b.add(position(lsn, seq), [b"op", b"c", b"lsn", str(lsn), b"seq", seq])
        return b

    client = RedisCluster(host="127.0.0.1", port=cluster[0].port)
    owners: dict[str, str] = {}
    for i in range(50):
        stream = f"cdc:s{i}"
        owners.setdefault(client.get_node_from_key(stream).name, stream)
    a, c, t = sorted(owners.values())[:3]  # an entity stream, one that will be refused, the transactions stream
    pub = Publisher(f"redis://127.0.0.1:{cluster[0].port}/0", cluster=True, append=mode,
                    flushed_key="cdc:bridge:slot:flushed", after_others=t)
    try:
        assert pub.publish([batch(t, [(100, 2)]), batch(a, [(100, 0)]), batch(c, [(100, 1)])]) == 3
        client.delete(c)
        client.delete(keys.mark_key(c))
        client.set(c, "not a stream")
        with pytest.raises(PublishError):  # the END first in the send, as a lane of its own could go first
            pub.send([batch(t, [(200, 2)]), batch(a, [(200, 0)]), batch(c, [(200, 1)])], flushed=250)
            pub.confirm()
        assert [int(f[b"lsn"]) for _, f in client.xrange(t)] == [100], "no END before its entries are all in"
        client.delete(c)
        assert pub.publish([batch(t, [(200, 2)]), batch(a, [(200, 0)]), batch(c, [(200, 1)])]) == 2  # a's is there
        assert [int(f[b"lsn"]) for _, f in client.xrange(t)] == [100, 200]
    finally:
        pub.close()
        client.close()
